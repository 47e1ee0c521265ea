"""``TorchHostBuffer``: the primary tier's slots as one uint8 torch tensor and as memoryviews.

The bytes live in one ``mmap``: anonymous for a buffer private to this process, or a named
file (under ``/dev/shm`` by default) that one process creates and others attach to, because in
vLLM the scheduler process (which runs the tiers) and the worker processes (which run the
device copies) must see the same host bytes. ``.tensor`` (for device copies) and every
``slot_view`` (for tiers) point at that same memory: nothing is copied between them.

When CUDA is available the memory is page-locked with ``cudaHostRegister`` so device copies
are asynchronous DMA; a failed registration is logged and the buffer works unpinned (copies
then block the calling thread). Registration is per process: each process that attaches
pins its own mapping.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import stat
import tempfile
import weakref
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any, cast

import structlog
import torch

log = structlog.get_logger(__name__)


def shm_path(shm_name: str) -> Path:
    """Where a named buffer lives: ``shm_name`` itself when it holds a path separator,
    otherwise ``/dev/shm/<shm_name>`` (the system's temporary directory where there is no
    ``/dev/shm``)."""
    if os.sep in shm_name:
        return Path(shm_name)
    if not shm_name or shm_name in {".", ".."}:
        raise ValueError(f"invalid shared-memory name {shm_name!r}")
    base = Path("/dev/shm")
    return (base if base.is_dir() else Path(tempfile.gettempdir())) / shm_name


def _unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def _cudart() -> Any:
    # untyped in torch; the runtime module binds cudaHostRegister / cudaHostUnregister
    return cast(Any, torch.cuda).cudart()


class TorchHostBuffer:
    """``num_slots`` x ``slot_bytes`` of host memory, pinned when CUDA is available.

    Args:
        num_slots: slots in the buffer.
        slot_bytes: bytes per slot (one chunk of every registered KV tensor, see
            ``kvhex.domain.SlotLayout``).
        pin: page-lock the memory with ``cudaHostRegister``; ``None`` pins when CUDA is
            available. ``True`` without CUDA raises ``ValueError``.
        shm_name: back the buffer by this named shared-memory file instead of private memory
            (see :func:`shm_path`); ``None`` keeps it private to this process.
        create: with ``shm_name``, create the file (owner-only, mode 0600; an existing file
            is refused) or, with ``False``, attach to one another process created (it must
            belong to this user, be owner-only and have exactly ``num_slots * slot_bytes``
            bytes).

    The creator removes the file when it closes (or at interpreter exit); processes attached
    to it keep their mapping until they close. Close the ``BlockTransfer`` using this buffer
    before the buffer: closing unpins the memory.

    Raises:
        ValueError: non-positive sizes, ``create=False`` without a name, a size mismatch
            with an existing file (naming both sizes), ``pin=True`` without CUDA.
        FileExistsError: ``create=True`` and the file exists.
        FileNotFoundError: ``create=False`` and the file does not exist.
        PermissionError: the file to attach belongs to another user or is not owner-only.
        OSError: the shared-memory file system has no room for the buffer.
    """

    def __init__(
        self,
        num_slots: int,
        slot_bytes: int,
        *,
        pin: bool | None = None,
        shm_name: str | None = None,
        create: bool = True,
    ) -> None:
        if num_slots <= 0 or slot_bytes <= 0:
            raise ValueError(
                f"need num_slots > 0 and slot_bytes > 0, got {num_slots} and {slot_bytes}"
            )
        cuda = torch.cuda.is_available()
        if pin and not cuda:
            raise ValueError("pin=True needs a CUDA device; pass pin=None to pin only on CUDA")
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.nbytes = num_slots * slot_bytes
        self.path: Path | None = None
        self._finalizer: Callable[[], object] | None = None
        if shm_name is None:
            if not create:
                raise ValueError("create=False attaches to a named buffer: pass shm_name")
            memory = mmap.mmap(-1, self.nbytes)
        else:
            self.path = shm_path(shm_name)
            memory = self._create(self.path) if create else self._attach(self.path)
        self.owner = self.path is not None and create
        self._mmap: mmap.mmap | None = memory
        self._view: memoryview | None = memoryview(memory)
        self._tensor: torch.Tensor | None = torch.frombuffer(memory, dtype=torch.uint8).view(
            num_slots, slot_bytes
        )
        self.pinned = False
        if pin is None:
            pin = cuda
        if pin:
            self._register()

    # -- construction ----------------------------------------------------------------------
    def _create(self, path: Path) -> mmap.mmap:
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
        try:
            fd = os.open(path, flags, 0o600)
        except FileExistsError as exc:
            raise FileExistsError(
                f"shared host buffer {path} already exists: another instance uses the name, "
                "or a crashed one left it behind (remove it, or attach with create=False)"
            ) from exc
        self._finalizer = weakref.finalize(self, _unlink, path)
        try:
            os.fchmod(fd, 0o600)  # umask cannot widen it, but be explicit
            if hasattr(os, "posix_fallocate"):
                # reserve the pages now: a full tmpfs then fails here, not with SIGBUS later
                os.posix_fallocate(fd, 0, self.nbytes)
            else:  # pragma: no cover - not Linux
                os.ftruncate(fd, self.nbytes)
            return mmap.mmap(fd, self.nbytes)
        except BaseException:
            self._finalizer()
            raise
        finally:
            os.close(fd)

    def _attach(self, path: Path) -> mmap.mmap:
        fd = os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
        try:
            info = os.fstat(fd)
            if info.st_uid != os.getuid():
                raise PermissionError(
                    f"shared host buffer {path} belongs to uid {info.st_uid}, not to this "
                    f"process's uid {os.getuid()}"
                )
            if stat.S_IMODE(info.st_mode) & 0o077:
                raise PermissionError(
                    f"shared host buffer {path} has mode {stat.S_IMODE(info.st_mode):o}; "
                    "kvhex only attaches to owner-only (0600) files"
                )
            if info.st_size != self.nbytes:
                raise ValueError(
                    f"shared host buffer {path} holds {info.st_size} bytes, but "
                    f"num_slots * slot_bytes = {self.num_slots} * {self.slot_bytes} = "
                    f"{self.nbytes}"
                )
            return mmap.mmap(fd, self.nbytes)
        finally:
            os.close(fd)

    def _register(self) -> None:
        assert self._tensor is not None
        try:
            torch.cuda.check_error(
                _cudart().cudaHostRegister(self._tensor.data_ptr(), self.nbytes, 0)
            )
        except RuntimeError as exc:  # torch.cuda.CudaError is a RuntimeError
            log.warning(
                "host_buffer_pin_failed",
                nbytes=self.nbytes,
                path=str(self.path) if self.path else None,
                error=str(exc),
                consequence="device copies will be synchronous",
            )
            return
        self.pinned = True

    # -- HostBuffer ------------------------------------------------------------------------
    @property
    def tensor(self) -> torch.Tensor:
        """The whole buffer as a uint8 ``[num_slots, slot_bytes]`` CPU tensor (zero-copy).

        Raises ``ValueError`` after :meth:`close`."""
        if self._tensor is None:
            raise ValueError("host buffer is closed")
        return self._tensor

    def slot_view(self, slot: int) -> memoryview:
        """A writable, zero-copy view of one slot. ``IndexError`` outside the buffer or after
        close. A view keeps the mapping alive until it is dropped."""
        if self._view is None:
            raise IndexError("host buffer is closed")
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} outside 0..{self.num_slots - 1}")
        start = slot * self.slot_bytes
        return self._view[start : start + self.slot_bytes]

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._view is None

    def close(self) -> None:
        """Unpin, drop this object's references to the memory and, as the creator, remove the
        shared-memory file. Idempotent. Views and tensors handed out earlier keep the mapping
        alive until they are dropped."""
        if self._view is None:
            return
        if self.pinned and self._tensor is not None:
            try:
                torch.cuda.check_error(_cudart().cudaHostUnregister(self._tensor.data_ptr()))
            except RuntimeError as exc:
                log.warning("host_buffer_unpin_failed", error=str(exc))
            self.pinned = False
        # never mmap.close(): tensors made from the mapping do not hold a buffer export, so
        # closing would unmap memory they still point at. The mapping goes with its last user.
        self._view = None
        self._tensor = None
        self._mmap = None
        if self._finalizer is not None:
            self._finalizer()

    def __enter__(self) -> TorchHostBuffer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        where = f", shm={str(self.path)!r}" if self.path else ""
        return (
            f"TorchHostBuffer(num_slots={self.num_slots}, slot_bytes={self.slot_bytes}, "
            f"pinned={self.pinned}{where})"
        )
