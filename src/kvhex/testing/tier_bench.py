"""One tier under the kit's audits: what its events said so far, and the checks of what it
says against what it does (probes, byte-exact gets, re-puts, deletes, a refill to capacity).
The parts that delete run only for a tier that ``Deletes``; for another one the keys a
scenario used stay in the tier (the next scenario uses new ones).
"""

from __future__ import annotations

import time
from collections import Counter

import attrs

from kvhex.domain.events import Removed, Stored
from kvhex.domain.keys import OffloadKey
from kvhex.ports.host_buffer import HostBuffer
from kvhex.ports.tier_store import Deletes, TierStore
from kvhex.testing.tier_kit import TierKit, describe_keys, replay, tier_key

SAID = "replaying take_events()"


@attrs.define
class Bench:
    """A tier, its host buffer, its capacity in blocks when known, the keys its events made
    resident so far, and the base of the key numbers the current scenario uses."""

    kit: TierKit
    store: TierStore
    host: HostBuffer
    capacity: int | None
    resident: set[OffloadKey] = attrs.Factory(set)
    base: int = 0

    def replay(self) -> list[str]:
        """Take the tier's events into :attr:`resident`; what in them breaks the port."""
        return replay(self.store.take_events(), self.resident, self.store.identity)

    def audit(self, keys: list[OffloadKey], decided: dict[OffloadKey, bool]) -> list[str]:
        """What the tier says against what it does, on ``keys`` (and ``decided``: keys whose
        state the order of a scenario decides); then put the resident ones again (nothing is
        announced) and, where the tier ``Deletes``, delete them all (each announced once, none
        readable after)."""
        problems = self.replay()
        for key, want in decided.items():
            if (key in self.resident) != want:
                have = "resident" if key in self.resident else "absent"
                state = "resident" if want else "absent"
                name = describe_keys([key])
                problems.append(f"the order leaves key {name} {state}; {SAID} says {have}")
        problems += self.compare(keys)
        if problems:
            return problems
        held = [k for k in keys if k in self.resident]
        for result in self.kit.put_all(self.store, self.host, held):
            if not result.success:
                problems.append(f"a put of resident keys failed: {result.error}")
        events = self.store.take_events()
        again = [k for e in events if isinstance(e, Stored) for k in e.keys]
        if again:
            problems.append(f"a put of resident keys announced Stored: {describe_keys(again)}")
        problems += replay(events, self.resident, self.store.identity)
        if not isinstance(self.store, Deletes):
            return problems
        return problems + self.delete(keys)

    def delete(self, keys: list[OffloadKey]) -> list[str]:
        """Delete ``keys`` (the tier must be one that ``Deletes``): exactly the resident ones
        are announced, each once, and none of them is found or loads afterwards."""
        store = self.store
        assert isinstance(store, Deletes), f"{type(store).__name__} has no delete"
        held = [k for k in dict.fromkeys(keys) if k in self.resident]
        store.delete(keys)
        events = self.store.take_events()
        removed = Counter(k for e in events if isinstance(e, Removed) for k in e.keys)
        others = [type(e).__name__ for e in events if not isinstance(e, Removed)]
        problems = []
        if removed != Counter(held) or others:
            problems.append(
                f"delete of the resident keys {describe_keys(held)} announced removed "
                f"{describe_keys(removed.elements())}" + (f", and {others}" if others else "")
            )
        self.resident.difference_update(keys)
        return problems + self.compare(keys, f"after deleting them, {SAID}")

    def compare(self, keys: list[OffloadKey], said: str = SAID) -> list[str]:
        """Probes and gets of ``keys`` against :attr:`resident`: every resident key is found
        and loads with exactly its bytes (wrong bytes raise), no other key does, but those a
        tier on shared storage left in place at start-up (its ``left_at_start``: blocks
        beyond its capacity, other instances' maybe, which it neither deletes nor
        announces)."""
        wanted = {k for k in keys if k in self.resident}
        left = set(getattr(self.store, "left_at_start", ())) - self.resident
        found = self.kit.probe(self.store, keys) - left
        problems = []
        if found != wanted:
            problems.append(
                f"{said} gives {describe_keys(wanted)} but probes find {describe_keys(found)}"
            )
        loaded, errors = self.kit.get_all(self.store, self.host, keys)
        loaded -= left
        if wanted - loaded:
            lost = ", ".join(f"{describe_keys([k])} ({errors[k]})" for k in wanted - loaded)
            problems.append(f"{said} gives keys that cannot be read: {lost}")
        if loaded - wanted:
            problems.append(
                f"{said} gives absent keys that load anyway: {describe_keys(loaded - wanted)}"
            )
        return problems

    def refill(self) -> None:
        """No slot leaked: the emptied tier takes its whole capacity again, evicting
        nothing; then it is emptied again (the next opening of its storage finds nothing).
        Only where the capacity is known and the tier ``Deletes`` (else it was not emptied)."""
        store = self.store
        if self.capacity is None or not isinstance(store, Deletes):
            return
        time.sleep(0.05)  # lets deletions still in flight finish (a put may not wait for them)
        store.poll()
        self.base += 1000
        keys = [tier_key(self.base + i) for i in range(self.capacity)]
        for result in self.kit.put_all(store, self.host, keys):
            assert result.success, (
                f"after every scenario deleted its keys, putting {self.capacity} new blocks "
                f"(the capacity) failed: {result.error}"
            )
        events = store.take_events()
        evicted = [k for e in events if isinstance(e, Removed) for k in e.keys]
        assert not evicted, f"refilling the emptied tier evicted {describe_keys(evicted)}"
        store.delete(keys)
