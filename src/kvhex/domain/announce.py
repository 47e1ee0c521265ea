"""``Announcer``: the tiers' raw events as they are announced, in an order routers can index.

Routers (Dynamo's indexer, llm-d) keep a radix tree over block hashes: a block is usable only
under a parent they hold, and a block announced before its parent may be dropped for good.
Tiers append their raw events as their state changes, in no order a tree needs (a job's keys in
any order, an IO thread's job finishing before an earlier one). Once per step the announcer
turns them into the stream that is announced:

* **What is announced where.** Each tier is announced under a public identity (medium,
  locality, ownership; by default its own), and one public identity is one residency: a key
  is announced ``Stored`` there when the first tier announcing under it holds the key, and
  ``Removed`` when the last one lets it go. Consumers that do not reference-count
  (Dynamo's indexer drops a block at its first removal) read the stream right.
* **Parent first.** A stored key is announced only once its parent (the chunk before it in
  its request, the same KV group) is announced in some residency and not removed since, or
  when it has none (a request's first chunk), or when nothing is known of it (a
  placeholder). A key whose parent is not announced waits, across steps if need be, and goes
  out right after its parent; a key a tier removes while it waits is never announced. With
  :attr:`Provenance.device_events` the engine announces the request's blocks on its device
  itself, first: a chunk whose parent no tier announced goes out at the end of its step,
  where the device holds that parent (:meth:`Announcer.see_device`: a store of a running
  request's blocks; not a cascade or promotion finishing after the device evicted the
  parent, which waits, across steps, until the device or a tier holds the parent again).
* **Runs.** A raw ``Stored``'s keys leave as runs, each a chain of chunks in order (each
  key's parent the key before it): the translator announces each run as one ``BlockStored``
  (hashes in order, the parent of the first), as vLLM announces a request's GPU blocks.

``Cleared`` leaves as the ``Removed`` of the keys its tier announced. Removal order carries no
meaning: a removal never implies the removal of the removed block's descendants, and each
removed block is named.

Scheduler thread only; no IO, no clock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping
from itertools import pairwise
from typing import cast

from kvhex.domain.events import Cleared, Removed, Stored, TierEvent
from kvhex.domain.keys import OffloadKey
from kvhex.domain.locator import ChunkRecord, Span, record_parent, span_parent, spans
from kvhex.domain.request import ReqContext
from kvhex.domain.tiers import TierIdentity

_Parent = OffloadKey | None | bool
"""A key's parent: a key, ``None`` (the request's first chunk), ``False`` (unknown)."""
_Solo = tuple[set[OffloadKey], TierIdentity, bool]
"""A tier announced alone: the keys it announced, its public identity, and whether it is
exact and announced as itself (its events then go out as they are)."""


class _Run:
    """Keys of one tier forming a chain (each key's parent the key before it)."""

    __slots__ = ("ctx", "keys", "records", "tier")

    def __init__(
        self,
        tier: TierIdentity,
        keys: list[OffloadKey],
        ctx: ReqContext | None,
        records: list[ChunkRecord | None],
    ) -> None:
        self.tier = tier
        self.keys = keys
        self.ctx = ctx
        self.records = records  # one per key (None: a placeholder)


class _Held:
    """A stored key of one tier waiting for its parent to be announced."""

    __slots__ = ("ctx", "device", "key", "parent", "record", "tier")

    def __init__(
        self,
        *,
        tier: TierIdentity,
        key: OffloadKey,
        parent: OffloadKey,
        ctx: ReqContext | None,
        record: ChunkRecord | None,
        device: bool,
    ) -> None:
        self.tier = tier
        self.key = key
        self.parent = parent
        self.ctx = ctx
        self.record = record
        self.device = device


class Announcer:
    """Orders, deduplicates and relabels raw tier events (see the module docstring).

    Args:
        publish_as: the public identity of each tier that is announced under another one
            than its own (a tier absent from it is announced as itself).
        exact: tiers whose raw events are exact: a ``Stored`` names only keys the tier does
            not hold readable, each once, and a ``Removed`` only keys it does, each once (the
            host primary tier's, by construction). Where such a tier is announced alone under
            its own identity and nothing waits, its events go out as they are, each key
            recorded with one set operation instead of a test and an update.
    """

    __slots__ = (
        "_announced",
        "_device",
        "_device_holds",
        "_exact",
        "_held",
        "_holders",
        "_publish_as",
        "_sharing",
        "_solo",
        "_waiting",
    )

    def __init__(
        self,
        publish_as: Mapping[TierIdentity, TierIdentity] | None = None,
        exact: Iterable[TierIdentity] = (),
    ) -> None:
        self._publish_as = dict(publish_as or {})
        self._exact = frozenset(exact)
        self._announced: dict[TierIdentity, set[OffloadKey]] = {}  # per tier: keys announced
        self._holders: dict[TierIdentity, dict[OffloadKey, int]] = {}  # public -> key -> tiers
        self._waiting: dict[OffloadKey, list[_Held]] = {}  # parent -> keys waiting for it
        self._held: dict[TierIdentity, dict[OffloadKey, _Held]] = {}  # per tier: waiting keys
        self._device: list[_Held] = []  # keys waiting whose parent is the device's
        self._device_holds: Callable[[OffloadKey], bool] | None = None
        self._sharing: dict[TierIdentity, set[TierIdentity]] = {}  # public -> tiers seen
        # tiers seen alone under their public identity: the keys each announced, that
        # identity, and whether the tier is exact and announced as itself (one dict lookup on
        # the common paths instead of three)
        self._solo: dict[TierIdentity, _Solo] = {}
        for tier, public in self._publish_as.items():
            self._sharing.setdefault(public, set()).add(tier)

    def see_device(self, holds: Callable[[OffloadKey], bool] | None) -> None:
        """Ask ``holds(parent)`` whether the engine's device holds a parent before a key
        waiting for it goes out as the device's child (``None``: assume it does, as when
        nothing can tell). The engine's scheduler thread calls it, at the end of each step
        with keys waiting; it must be a dict read."""
        self._device_holds = holds

    # -- queries -------------------------------------------------------------------------
    def public(self, tier: TierIdentity) -> TierIdentity:
        """The identity ``tier`` is announced under."""
        return self._publish_as.get(tier, tier)

    def waiting(self, tier: TierIdentity) -> frozenset[OffloadKey]:
        """The keys ``tier`` stored that wait for their parent to be announced."""
        return frozenset(self._held.get(tier, ()))

    def is_announced(self, key: OffloadKey) -> bool:
        """Whether ``key`` is announced in some residency (and not removed since): some tier
        announced it and did not take it back (a check per chain head, over the few tiers,
        instead of a count per announced key)."""
        return any(key in mine for mine in self._announced.values())

    # -- the step's events ---------------------------------------------------------------
    def order(self, raw: Iterable[TierEvent]) -> list[TierEvent]:
        """The events to announce for ``raw`` (one step's, in the tiers' order): public
        identities, each residency's keys once, stores parent-first in runs."""
        out: list[TierEvent] = []
        solo_of = self._solo
        for event in raw:
            if type(event) is Stored:
                ctx = event.ctx
                if (
                    not self._waiting  # then no key is held either
                    and not event.records
                    and (ctx is None or ctx.provenance is None)
                    and (solo := solo_of.get(event.tier)) is not None
                ):  # placeholders of a tier announced alone, nothing waiting: each new key goes
                    if solo[2]:  # an exact tier's event, as it is
                        solo[0].update(event.keys)
                        out.append(event)
                    else:
                        self._placeholders(event, solo, out)
                else:
                    self._stored(event, out)
            elif type(event) is Removed:
                if not self._held and (solo := solo_of.get(event.tier)) is not None and solo[2]:
                    solo[0].difference_update(event.keys)  # an exact tier's event, as it is
                    out.append(event)
                else:
                    self._removed(event.keys, event.tier, out, event)
            elif isinstance(event, Cleared):
                self._removed(tuple(self._announced.get(event.tier, ())), event.tier, out)
                for held in list(self._held.get(event.tier, {}).values()):
                    self._unhold(held)
        if self._device:
            self._release_device_children(out)
        return out

    def _release_device_children(self, out: list[TierEvent]) -> None:
        """The keys waiting for a parent of the device's go out where the device holds it
        (its events, published before this step's, announced it); the others wait on. A key
        whose parent waits too goes out with it."""
        device, self._device = self._device, []
        holds = self._device_holds
        waiting = {(h.tier, h.key): h for h in device if self._is_held(h)}
        for held in waiting.values():
            if (held.tier, held.parent) in waiting or not self._is_held(held):
                continue
            if holds is not None and not holds(held.parent):
                self._device.append(held)  # gone from the device: wait for a holder
                continue
            self._unhold(held)
            self._emit(self._chain_from(held), out)

    # -- stores --------------------------------------------------------------------------
    def _stored(self, event: Stored, out: list[TierEvent]) -> None:
        """``order`` of a ``Stored`` its fast paths do not take."""
        tier, ctx = event.tier, event.ctx
        mine = self._announced.get(tier, ())
        held = self._held.get(tier, {})
        keys = [k for k in dict.fromkeys(event.keys) if k not in mine and k not in held]
        if not keys:
            return
        records: dict[OffloadKey, ChunkRecord | None]
        parents: dict[OffloadKey, _Parent] = {}
        if event.records:  # keys stored with no request at hand: their records say
            given = dict(zip(event.keys, event.records, strict=True))
            records = {k: given[k] for k in keys}
            for k, r in records.items():
                parents[k] = False if r is None else record_parent(r)
        else:  # where each key lies in its request (the translator describes it there)
            if ctx is None or ctx.provenance is None:  # nothing known of any key: all go
                self._emit(_Run(tier, keys, ctx, [None] * len(keys)), out)
                return
            found = spans(ctx, keys)
            if not any(found):  # no key found in its request: all go, in order
                self._emit(_Run(tier, keys, ctx, [None] * len(keys)), out)
                return
            if ctx is not None and _one_chain(found):  # the common case: a job's chunks
                head = span_parent(ctx, keys[0], found[0])  # type: ignore[arg-type]
                if head is None or self.is_announced(head):
                    self._emit(_Run(tier, keys, ctx, [None] * len(keys)), out)
                    return
            records = dict.fromkeys(keys)
            for k, span in zip(keys, found, strict=True):
                parents[k] = False if span is None or ctx is None else span_parent(ctx, k, span)
        live = self.is_announced
        device = ctx is not None and ctx.provenance is not None and ctx.provenance.device_events
        going: list[OffloadKey] = []  # what goes now, chain after chain, parents first
        ready: set[OffloadKey] = set()
        for chain in _chains(keys, parents):
            # every key from the first whose parent is announced (or none) on can go: each
            # announces the next one's parent; the keys before it wait for theirs
            go = 0
            for key in chain:
                parent = parents[key] if go == 0 else chain[go - 1]
                if parent is None or isinstance(parent, bool) or parent in ready or live(parent):
                    break
                go += 1
            for i in range(go):
                key = chain[i]
                parent = parents[key] if i == 0 else chain[i - 1]
                self._hold(
                    _Held(
                        tier=tier,
                        key=key,
                        parent=cast("OffloadKey", parent),  # a key: the loop above said so
                        ctx=ctx,
                        record=records[key],
                        device=device,
                    )
                )
            if go:
                going += chain[go:]
                ready.update(chain[go:])
            else:
                going += chain
                ready.update(chain)
        if going:
            self._emit(_Run(tier, going, ctx, [records[k] for k in going]), out)

    def _placeholders(self, event: Stored, solo: _Solo, out: list[TierEvent]) -> None:
        """``_emit`` of the keys of ``event`` its tier did not announce yet, in order, for
        the common case ``order`` tests: nothing waits, nothing is known of the keys, and
        no other tier is announced as this one's public identity (``solo``: the keys the
        tier announced, and that identity)."""
        mine, public, _ = solo
        given = event.keys
        before = len(mine)
        keys = given if mine.isdisjoint(given) else [key for key in given if key not in mine]
        mine.update(keys)
        if len(mine) - before != len(keys):  # a key listed twice: announced once, in order
            keys = list(dict.fromkeys(keys))
        if not keys:
            return
        if keys is given and public is event.tier:  # (commonly: the tier's event as it is)
            out.append(event)
        else:
            out.append(Stored(tuple(keys), public, event.ctx))

    def _emit(self, first: _Run, out: list[TierEvent]) -> None:
        """Announce ``first``, then every key that waited for a key announced meanwhile."""
        work = deque(((first, False),))
        waiting = self._waiting
        while work:
            run, released = work.popleft()
            tier = run.tier
            public = self._publish_as.get(tier, tier)
            mine = self._announced.setdefault(tier, set())
            records: list[ChunkRecord | None]
            if self._shares(public, tier):
                holders = self._holders.setdefault(public, {})
                new: list[OffloadKey] = []
                records = []
                for key, record in zip(run.keys, run.records, strict=True):
                    mine.add(key)
                    count = holders.get(key, 0)
                    holders[key] = count + 1
                    if not count:  # else another tier announced it under the same identity
                        new.append(key)
                        records.append(record)
            else:  # the only tier announced so: a key it did not announce is new
                mine.update(run.keys)
                new, records = run.keys, run.records
            if waiting:  # keys wait for a parent: those of the keys announced now go next
                for key in new:
                    if key in waiting:  # (a key waits only for a parent not announced)
                        while (waiters := waiting.get(key)) is not None:
                            held = waiters[0]
                            self._unhold(held)
                            work.append((self._chain_from(held), True))
            if not new:
                continue
            last = out[-1] if out and released else None
            if type(last) is Stored and last.tier == public and last.ctx is run.ctx:
                # a key released by the one before it, of the same tier and request: one run
                before_records = last.records or (None,) * len(last.keys)
                merged = _records([*before_records, *records])
                out[-1] = Stored(last.keys + tuple(new), public, run.ctx, merged)
            else:
                out.append(Stored(tuple(new), public, run.ctx, _records(records)))

    def _shares(self, public: TierIdentity, tier: TierIdentity) -> bool:
        """Whether another tier than ``tier`` is announced as ``public`` too (then keys are
        counted per tier holding them under it)."""
        tiers = self._sharing.get(public)
        if tiers is None:
            tiers = self._sharing[public] = set()
        if tier not in tiers:
            tiers.add(tier)
            if len(tiers) == 2 and public not in self._holders:
                # shared from now on: count what the first tier announced alone so far
                (first,) = tiers - {tier}
                self._holders[public] = dict.fromkeys(self._announced.get(first, ()), 1)
        if len(tiers) > 1:
            for shared in tiers:
                self._solo.pop(shared, None)
            return True
        if tier not in self._solo:
            exact = tier in self._exact and public == tier
            self._solo[tier] = (self._announced.setdefault(tier, set()), public, exact)
        return False

    def _chain_from(self, first: _Held) -> _Run:
        """``first`` (no longer held) and the keys of its tier and request that waited for it,
        and for them, in order: one run."""
        keys, records = [first.key], [first.record]
        held = first
        while (waiters := self._waiting.get(held.key)) is not None:
            nxt = next((w for w in waiters if w.tier == held.tier and w.ctx is held.ctx), None)
            if nxt is None:
                break
            self._unhold(nxt)
            keys.append(nxt.key)
            records.append(nxt.record)
            held = nxt
        return _Run(first.tier, keys, first.ctx, records)

    def _hold(self, held: _Held) -> None:
        self._waiting.setdefault(held.parent, []).append(held)
        self._held.setdefault(held.tier, {})[held.key] = held
        if held.device:
            self._device.append(held)

    def _is_held(self, held: _Held) -> bool:
        return self._held.get(held.tier, {}).get(held.key) is held

    def _unhold(self, held: _Held) -> None:
        mine = self._held.get(held.tier)
        if mine is not None and mine.get(held.key) is held:
            del mine[held.key]
            if not mine:
                del self._held[held.tier]
        waiters = self._waiting.get(held.parent)
        if waiters is not None:
            waiters[:] = [w for w in waiters if w is not held]
            if not waiters:
                del self._waiting[held.parent]

    # -- removals ------------------------------------------------------------------------
    def _removed(
        self,
        keys: tuple[OffloadKey, ...],
        tier: TierIdentity,
        out: list[TierEvent],
        event: Removed | None = None,
    ) -> None:
        """Announce the removal of those of ``keys`` ``tier`` announced (``event``: the raw
        event they come from, announced as it is where nothing changes)."""
        held = self._held.get(tier) if self._held else None
        solo = self._solo.get(tier)
        mine: set[OffloadKey] | None
        if solo is not None and held is None:  # the common case: one residency, none held
            mine, public, _ = solo
            holders = None
        else:
            public = self._publish_as.get(tier, tier)
            mine = self._announced.get(tier)
            shared = solo is None and self._shares(public, tier)
            holders = self._holders.get(public, {}) if shared else None
        if held is None and holders is None and mine is not None:  # the common case
            gone = keys if mine.issuperset(keys) else tuple(k for k in keys if k in mine)
            if not gone:
                return
            before = len(mine)
            mine.difference_update(gone)
            if before - len(mine) != len(gone):  # a key listed twice: named once
                gone = tuple(dict.fromkeys(gone))
            elif gone is keys and event is not None and public is tier:
                out.append(event)
                return
            out.append(Removed(gone, public))
            return
        dropped: list[OffloadKey] = []
        for key in dict.fromkeys(keys):
            if held is not None and (waiting := held.get(key)) is not None:
                self._unhold(waiting)  # never announced; its children keep waiting for it
                continue
            if mine is None or key not in mine:
                continue  # never announced: nothing to take back
            mine.discard(key)
            if holders is not None:
                count = holders.pop(key, 1) - 1
                if count > 0:
                    holders[key] = count  # another tier still holds it under this identity
                    continue
            dropped.append(key)
        if dropped:
            out.append(Removed(tuple(dropped), public))


def _one_chain(found: list[Span | None]) -> bool:
    """Whether every key lies right after the one before it, in one request and group."""
    previous = found[0]
    if previous is None:
        return False
    for span in found[1:]:
        if span is None or span[0] != previous[1] or span[2] is not previous[2]:
            return False
        previous = span
    return True


def _chains(
    keys: list[OffloadKey], parents: Mapping[OffloadKey, _Parent]
) -> list[list[OffloadKey]]:
    """``keys`` as chains, parents' chains first: each chain a key, then its only child among
    ``keys``, and so on; a key with several children ends its chain, each child starts one."""
    if all(parents[b] == a for a, b in pairwise(keys)):
        return [keys]  # the common case: a job's keys, one chain in order
    inside = set(keys)
    children: dict[OffloadKey, list[OffloadKey]] = {}
    roots: deque[OffloadKey] = deque()
    for key in keys:
        parent = parents[key]
        if isinstance(parent, bytes) and parent in inside and parent != key:
            children.setdefault(OffloadKey(parent), []).append(key)
        else:
            roots.append(key)
    chains: list[list[OffloadKey]] = []
    seen: set[OffloadKey] = set()
    while roots or len(seen) < len(inside):
        if not roots:  # only a cycle is left (hashes never make one): break it anywhere
            roots.append(next(k for k in keys if k not in seen))
        key = roots.popleft()
        if key in seen:
            continue
        chain = [key]
        seen.add(key)
        while (kids := children.get(key)) is not None:
            kids = [k for k in kids if k not in seen]
            if len(kids) != 1:
                roots.extend(kids)
                break
            key = kids[0]
            chain.append(key)
            seen.add(key)
        chains.append(chain)
    return chains


def _records(records: list[ChunkRecord | None]) -> tuple[ChunkRecord | None, ...] | None:
    return tuple(records) if records.count(None) != len(records) else None
