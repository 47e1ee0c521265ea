"""The slab mover's native data path, where it was built.

``_slotio`` (``_slotio.c``, compiled at install by ``hatch_build.py`` when a C compiler and
Python's headers are there) checksums and writes a job's blocks, or reads and checksums them,
with the GIL released once per call: the Python path releases it for every block's checksum
and every run's write, and each time takes it back from the scheduler thread and the other IO
threads. Both paths write the same bytes (tested byte for byte), and a tier may use either.

The checksum is the xxhash package's own XXH3-64 (bound from its extension), checked here
against :func:`xxhash.xxh3_64_intdigest` before first use: a library that disagrees, or
exports none, leaves the Python path in place. Bound first is ``XXH3_64bits_dispatch``, the
entry that picks the CPU's widest vector unit at run time and that xxhash's own functions
call; the plain ``XXH3_64bits`` the package builds for the baseline CPU (SSE2 on x86-64) is
four times slower on a 256 KiB block where AVX-512 is there, and is the fallback.
"""

from __future__ import annotations

import functools
import random
from types import ModuleType

import xxhash

_API_VERSION = 2
_CHECK_LENGTHS = (0, 1, 3, 16, 17, 128, 129, 240, 241, 1024, 4096 + 13, 1 << 20)
"""Lengths the bound checksum is compared at: each of XXH3's code paths."""
_SYMBOLS = ("XXH3_64bits_dispatch", "XXH3_64bits")
"""The xxhash extension's XXH3-64 entries, the fastest first (see the module docstring)."""


class NativeUnavailable(Exception):
    """The native data path cannot run here; the message says why and what to do."""


def forget() -> None:
    """Drop the cached load, so the next :func:`load` binds the library again (a test that
    changes what it may bind; a process that rebuilt the extension)."""
    _load.cache_clear()


@functools.cache
def _load() -> tuple[ModuleType | None, str]:
    """The module with its checksum bound and the entry bound, or None and why not."""
    try:
        from kvhex.adapters.storage.files import _slotio
    except ImportError as exc:
        return None, (
            f"not built ({exc}); reinstall kvhex where a C compiler and Python's headers are "
            "found (KVHEX_NATIVE=required makes a failed build an error)"
        )
    if _slotio.API_VERSION != _API_VERSION:
        return None, (
            f"the built module is version {_slotio.API_VERSION}, this code expects "
            f"{_API_VERSION}: reinstall kvhex to rebuild it"
        )
    library = getattr(getattr(xxhash, "_xxhash", None), "__file__", None)
    if library is None:
        return None, "the xxhash package has no compiled extension to take XXH3-64 from"
    sample = random.Random(0).randbytes(max(_CHECK_LENGTHS))
    why: list[str] = []
    for symbol in _SYMBOLS:
        try:
            _slotio.bind_hasher(library, symbol)
        except OSError as exc:
            why.append(str(exc))
            continue
        wrong = next(
            (
                n
                for n in _CHECK_LENGTHS
                if _slotio.checksum(sample[:n]) != xxhash.xxh3_64_intdigest(sample[:n])
            ),
            None,
        )
        if wrong is None:
            return _slotio, symbol
        why.append(f"the xxhash package's {symbol} disagrees with xxhash at {wrong} bytes")
    return None, "; ".join(why)


def load() -> ModuleType:
    """The native data path, its checksum bound and checked.

    Raises:
        NativeUnavailable: it was not built, is stale, or its checksum cannot be bound.
    """
    module, why = _load()
    if module is None:
        raise NativeUnavailable(f"the native data path is unavailable: {why}")
    return module


def checksum_entry() -> str:
    """The xxhash extension's function the native data path checksums with.

    Raises:
        NativeUnavailable: as :func:`load`.
    """
    load()
    return _load()[1]
