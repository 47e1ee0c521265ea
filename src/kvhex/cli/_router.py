"""What one KV-aware router would drop or miscredit of a stream: ``kvhex events --router``.

Every event a ``kvhex events`` watch takes in (live, replayed or read from a file) also goes
through :class:`RouterCheck`, which applies the router's profile
(:mod:`kvhex.domain.routers`) to it: the ZMQ topic of the live message it came in, the hash
form of its batch, its medium, locality and ownership, its block size, whether it is a
placeholder or holds partial blocks, its KV group, and whether the router holds its parent
where it keeps blocks strictly parent first. Findings are counted per line (one line per rule
and value), in events; what the router credits is counted too, at its weight, so the report
says where every event went.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from kvhex.adapters.events.wire import AllBlocksCleared, BlockRemoved, BlockStored
from kvhex.domain.routers import (
    Effect,
    Finding,
    RouterProfile,
    Rule,
    check_block_size,
    check_group,
    check_hash_form,
    check_parent_first,
    check_residency,
    check_store,
    check_topic,
)

STREAM_KEYS = {
    "medium": "the publishing tier's medium ([[tiers]] options.medium; vLLM: "
    "secondary_tiers[i].kvhex.medium)",
    "locality": "the publishing tier's locality ([[tiers]] options.locality; vLLM: "
    "secondary_tiers[i].locality)",
    "ownership": "the publishing tier's announce_ownership ([[tiers]] announce_ownership; "
    "vLLM: secondary_tiers[i].kvhex.announce_ownership)",
    "int_hashes": "[events] int_block_hashes (vLLM: VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1)",
    "topic": "the publisher's topic (vLLM: kv_events_config.topic; kvhex: [[sinks]] options.topic)",
    "block_size": "--router-block-size (kvhex: [events] router_block_size; vLLM: "
    "kvhex.router_block_size)",
}
"""Where each fix goes, as a stream's reader is told: the stream does not say which tier or
configuration published an event, so both of kvhex's configurations are named."""


class RouterCheck:
    """The findings of one router over one stream, in the order events arrive.

    Args:
        profile: the router.
        block_size: the block size it reads (``--router-block-size``); ``None``: its
            default, else the block size of the stream's first full store (assumed, and said).
    """

    def __init__(self, profile: RouterProfile, block_size: int | None) -> None:
        self.profile = profile
        self.block_size = block_size or profile.default_block_size
        self.block_size_from = (
            "--router-block-size"
            if block_size is not None
            else f"its {profile.block_size_setting} default"
            if profile.default_block_size is not None
            else None
        )
        self.events = 0
        self.mismatched = 0
        """Events the router drops or miscredits (for at least one reason)."""
        self.mismatched_known = 0
        """Those of them for a reason other than a parent not seen (which a stream joined
        late cannot tell)."""
        self.counts: Counter[str] = Counter()
        self.findings: dict[str, Finding] = {}
        self.topics: Counter[str] = Counter()
        """Events per ZMQ topic of the live messages they came in."""
        self._residencies: dict[tuple[Any, ...], list[Finding]] = {}
        # what the router holds, per tree (each residency, or Dynamo's device tree), as a set:
        # neither router counts references (one removal drops a block announced twice)
        self._held: dict[tuple[str | None, str | None], set[bytes | int]] = {}

    def batch(self, events: list[Any], topic: bytes | None) -> None:
        """The events taken in of one batch; ``topic``: its live message's ZMQ topic
        (``None`` when unknown: a replayed batch, a file)."""
        shared: list[Finding] = []
        if topic is not None:
            text = topic.decode("utf-8", "replace")
            self.topics[text] += len(events)
            dropped = check_topic(self.profile, text, key=STREAM_KEYS["topic"])
            shared += [dropped] if dropped is not None else []
        if any(_holds_bytes(event) for event in events):
            undecoded = check_hash_form(self.profile, key=STREAM_KEYS["int_hashes"])
            shared += [undecoded] if undecoded is not None else []
        for event in events:
            self.events += 1
            found = shared + self._event(event)
            mismatches = [f for f in found if f.mismatch]
            if mismatches:  # not also credited
                found = mismatches
                self.mismatched += 1
                if any(f.rule is not Rule.PARENT_FIRST for f in mismatches):
                    self.mismatched_known += 1
            for finding in found:
                line = finding.line()
                self.counts[line] += 1
                self.findings.setdefault(line, finding)

    def _event(self, event: Any) -> list[Finding]:
        if isinstance(event, AllBlocksCleared):
            self._held.clear()
            return []
        if not isinstance(event, BlockStored | BlockRemoved):
            return []
        found = list(
            self._residency(event.medium, event.locality, event.ownership, event.group_idx)
        )
        tree = self._tree(event.medium, event.ownership)
        if isinstance(event, BlockRemoved):
            if tree is not None and tree in self._held:
                self._held[tree].difference_update(event.block_hashes)
            return found
        shape = check_store(
            self.profile,
            hashes=len(event.block_hashes),
            tokens=len(event.token_ids),
            block_size=event.block_size,
        )
        if shape is not None:
            found.append(shape)
        if event.block_size:
            if self.block_size is None:  # assumed from the first full store
                self.block_size = event.block_size
                self.block_size_from = "the stream's first store: give --router-block-size"
            size = check_block_size(
                self.profile,
                event.block_size,
                self.block_size,
                key=STREAM_KEYS["block_size"],
                told=self.block_size_from or "",
            )
            found += [size] if size is not None else []
        dropped = any(f.effect is Effect.DROPS and f.rule is not Rule.PARTIAL_BLOCK for f in found)
        if tree is not None and not dropped:  # a miscredited block is held all the same
            parent = event.parent_block_hash
            if parent is not None and not self._holds(parent, tree):
                orphan = check_parent_first(self.profile, event.medium)
                found += [orphan] if orphan is not None else []
            else:
                self._held.setdefault(tree, set()).update(event.block_hashes)
        return found

    def _tree(
        self, medium: str | None, ownership: str | None
    ) -> tuple[str | None, str | None] | None:
        """Where the router keeps ``medium`` blocks for the parent-first rule: each residency
        where a parent in any medium counts, else one strict tree; ``None``: not kept strictly."""
        if not self.profile.strict_parent(medium):
            return None
        return (medium, ownership) if self.profile.parent_anywhere else (None, None)

    def _holds(self, parent: bytes | int, tree: tuple[str | None, str | None]) -> bool:
        if self.profile.parent_anywhere:
            return any(parent in held for held in self._held.values())
        return parent in self._held.get(tree, ())

    def _residency(
        self, medium: str | None, locality: str | None, ownership: str | None, group: int | None
    ) -> list[Finding]:
        key = (medium, locality, ownership, group)
        found = self._residencies.get(key)
        if found is None:
            found = check_residency(
                self.profile,
                medium,
                locality,
                ownership,
                medium_key=STREAM_KEYS["medium"],
                locality_key=STREAM_KEYS["locality"],
                ownership_key=STREAM_KEYS["ownership"],
            )
            other_group = check_group(self.profile, group)
            if other_group is not None:
                found = [f for f in found if f.mismatch] + [other_group]
            self._residencies[key] = found
        return found

    def summary(self, *, joined_late: bool = False) -> dict[str, Any]:
        """The findings as JSON-ready builtins. ``joined_late``: the stream was not seen
        from its start, so a store before its parent may be one whose parent came before:
        such findings are listed, not counted."""
        rows = []
        mismatched = self.mismatched_known if joined_late else self.mismatched
        for line, count in sorted(
            self.counts.items(),
            key=lambda item: (not self.findings[item[0]].mismatch, -item[1], item[0]),
        ):
            finding = self.findings[line]
            counted = not (joined_late and finding.rule is Rule.PARENT_FIRST)
            rows.append(
                {
                    "line": line,
                    "count": count,
                    "rule": finding.rule.value,
                    "effect": finding.effect.value,
                    "field": finding.field,
                    "value": finding.value,
                    "key": finding.key,
                    "fix": finding.fix,
                    "counted": counted,
                }
            )
        return {
            "router": self.profile.name,
            "version": self.profile.version,
            "block_size": self.block_size,
            "block_size_from": self.block_size_from,
            "topics": dict(sorted(self.topics.items())),
            "events": self.events,
            "mismatched_events": mismatched,
            "findings": rows,
            "verdict": "mismatch" if mismatched else "reads all",
        }


def _holds_bytes(event: Any) -> bool:
    """The event holds a block hash as bytes (a hash, or its parent's)."""
    hashes = getattr(event, "block_hashes", None)
    if hashes is None:
        return False
    parent = getattr(event, "parent_block_hash", None)
    return isinstance(parent, bytes) or any(isinstance(h, bytes) for h in hashes)
