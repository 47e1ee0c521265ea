"""Types of the native data path (``_slotio.c``, loaded and checked by ``_native.py``)."""

from collections.abc import Sequence

_Buffer = bytes | bytearray | memoryview
_Block = tuple[int, int, bytearray | memoryview, _Buffer]

API_VERSION: int

def write_blocks(blocks: Sequence[_Block], digest_offset: int, max_run_bytes: int) -> list[int]: ...
def read_blocks(
    blocks: Sequence[tuple[int, int, bytearray | memoryview, memoryview]], max_run_bytes: int
) -> list[int | None]: ...
def checksum(data: _Buffer) -> int: ...
def bind_hasher(path: str, symbol: str) -> None: ...
