"""Scenarios of jobs and deletes on a few keys, and what the port's order alone decides
about each key (pure: no tier, no IO).

A scenario is a sequence of steps: submit a job, delete keys, poll once, wait for a job (or
for all). :func:`interleavings` gives every order the port allows for two actions on one
key. :class:`KeyModel` follows a scenario as it runs and knows, for each key at each moment,
whether the tier must hold it (``True``), must not (``False``) or may do either (``None``,
e.g. while a put of it is in flight): a get or probe whose key stayed decided from its
submission to its result must answer accordingly, and so must the tier at the end.
"""

from __future__ import annotations

import attrs

from kvhex.domain.jobs import JobKind


@attrs.frozen
class Job:
    """Submit a job of ``kind`` on the scenario's keys ``ids``."""

    label: str
    kind: JobKind
    ids: tuple[int, ...]

    def __str__(self) -> str:
        return f"{self.kind.value} {self.label}({_ids(self.ids)})"


@attrs.frozen
class Delete:
    """Call ``delete`` on the scenario's keys ``ids`` (duplicates kept)."""

    ids: tuple[int, ...]

    def __str__(self) -> str:
        return f"delete({_ids(self.ids)})"


@attrs.frozen
class Poll:
    """Poll once, whatever it returns."""

    def __str__(self) -> str:
        return "poll"


@attrs.frozen
class Wait:
    """Poll until job ``label`` (``None``: every job submitted) has been reported."""

    label: str | None = None

    def __str__(self) -> str:
        return f"wait {self.label or 'all'}"


Step = Job | Delete | Poll | Wait


def _ids(ids: tuple[int, ...] | list[int]) -> str:
    """``"0, 1..7"``: runs of consecutive numbers shortened."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}..{r[-1]}" for r in runs)


def describe_ids(ids: tuple[int, ...] | list[int]) -> str:
    """Scenario key numbers for messages, runs shortened (``"nothing"`` for none)."""
    return _ids(ids) or "nothing"


def describe(steps: tuple[Step, ...]) -> str:
    """``"put A(0, 1..7) ; poll ; put B(0) ; wait all"``."""
    return " ; ".join(map(str, steps))


def interleavings(a: Job | Delete, b: Job | Delete) -> list[tuple[Step, ...]]:
    """Every order of submissions and polls the port allows for ``a`` and ``b``: each one
    first, and the second submitted after the first was reported, after one poll, or at
    once; then every result is polled, in whatever order the tier finishes."""
    out: list[tuple[Step, ...]] = []
    for first, second in ((a, b), (b, a)):
        done: tuple[Step, ...] = (Wait(first.label),) if isinstance(first, Job) else ()
        for gap in (done, (Poll(),), ()):
            steps = (first, *gap, second, Wait())
            if steps not in out:
                out.append(steps)
    return out


class KeyModel:
    """What the order of a scenario's steps decides about each key (see the module
    docstring). Fed each step as it runs and each result as it is polled; returns the
    problems it sees."""

    def __init__(self, present: set[int]) -> None:
        self.state: dict[int, bool | None] = {}
        self._present = present
        self._version: dict[int, int] = {}
        self._puts: dict[int, set[str]] = {}  # key -> puts of it in flight
        self._deleted_during: dict[str, set[int]] = {}
        self._seen: dict[str, dict[int, tuple[int, bool | None]]] = {}

    def _get(self, i: int) -> bool | None:
        return self.state.get(i, i in self._present)

    def _set(self, i: int, value: bool | None) -> None:
        if self._get(i) != value or value is None:
            self._version[i] = self._version.get(i, 0) + 1
        self.state[i] = value

    def submitted(self, job: Job) -> None:
        if job.kind is JobKind.PUT:
            self._deleted_during[job.label] = set()
            for i in job.ids:
                self._puts.setdefault(i, set()).add(job.label)
                if self._get(i) is not True:
                    self._set(i, None)
        else:
            self._seen[job.label] = {i: (self._version.get(i, 0), self._get(i)) for i in job.ids}

    def deleted(self, ids: tuple[int, ...]) -> None:
        for i in set(ids):
            writing = self._puts.get(i)
            if writing:
                for label in writing:
                    self._deleted_during[label].add(i)
                self._set(i, None)
            else:
                self._set(i, False)

    def put_finished(self, job: Job, success: bool) -> None:
        deleted = self._deleted_during.pop(job.label)
        for i in job.ids:
            self._puts[i].discard(job.label)
            if success and i not in deleted:
                self._set(i, True)

    def answered(self, job: Job, has: set[int]) -> list[str]:
        """A get's loaded keys or a probe's found keys, against what was decided."""
        problems = []
        verb = "loaded" if job.kind is JobKind.GET else "found"
        for i, (version, state) in self._seen.pop(job.label).items():
            if state is None or self._version.get(i, 0) != version:
                continue
            if state and i not in has:
                problems.append(f"{job} had not {verb} key {i}, resident all along")
            elif not state and i in has:
                problems.append(f"{job} {verb} key {i}, absent all along")
        return problems

    def decided(self) -> dict[int, bool]:
        """Keys whose end state the order decides, with that state."""
        return {i: s for i, s in self.state.items() if s is not None} | {
            i: True for i in self._present if i not in self.state
        }
