"""Page-level care of mapped segments: huge pages for a segment's own memory, and page tables
filled ahead of the first copy into a peer's segment.

Rules of this file:
- A first copy into a freshly mapped page pays a page fault per 4 KiB (measured here: a first
  pass over a peer's 1 GiB segment at about a sixth of the second pass). Two remedies, both
  best effort, both falling back to plain 4 KiB faulting without an error:
  - a segment owner asking for huge pages marks its mapping ``MADV_HUGEPAGE`` before the first
    touch; tmpfs then backs the file with 2 MiB folios where its mount allows it (``huge=advise``,
    ``within_size`` or ``always``, or ``shmem_enabled`` set to ``force``), and every process
    that maps the file maps them 2 MiB at a time;
  - a process writing into a peer's segment fills its page tables with
    ``MADV_POPULATE_WRITE`` (Linux 5.14) on a background thread, in chunks, far cheaper per
    page than faults.
- ``madvise`` is called through ctypes, which lets go of the GIL while the kernel works.
- Nothing here raises for an old kernel or a mount without huge pages: callers learn what they
  got from :func:`huge_bytes` (the kernel's own account, from ``/proc/self/smaps``).
"""

from __future__ import annotations

import collections
import ctypes
import errno
import logging
import os
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

logger = logging.getLogger(__name__)
T = TypeVar("T")

MADV_HUGEPAGE = 14
MADV_POPULATE_WRITE = 23  # Linux 5.14; EINVAL before
#: A chunk of one populate call: small enough that a retiring mapping waits little for it.
POPULATE_CHUNK_BYTES = 64 << 20

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int


def madvise(address: int, length_bytes: int, advice: int) -> int:
    """``madvise(2)`` on ``[address, address + length_bytes)``: 0, or the errno it failed with."""
    if _libc.madvise(address, length_bytes, advice) == 0:
        return 0
    return ctypes.get_errno() or errno.EINVAL


def advise_huge(address: int, length_bytes: int) -> bool:
    """Ask for huge pages on a mapping not yet touched. False when the kernel refused."""
    code = madvise(address, length_bytes, MADV_HUGEPAGE)
    if code:
        logger.debug("MADV_HUGEPAGE refused: %s", os.strerror(code))
    return code == 0


def populate(address: int, length_bytes: int) -> int:
    """Write-fault ``[address, address + length_bytes)`` into this process's page tables.

    Returns 0, or the errno: ``EINVAL`` (kernel before 5.14), ``ENOMEM`` / ``EFAULT`` (the file
    cannot back a page: a full tmpfs, where a plain write would have raised SIGBUS).
    """
    return madvise(address, length_bytes, MADV_POPULATE_WRITE)


def huge_bytes(address: int) -> int:
    """Bytes of the mapping that starts at ``address`` mapped through 2 MiB entries (0 when
    none, or when ``/proc/self/smaps`` cannot be read)."""
    start = f"{address:x}-"
    try:
        with open("/proc/self/smaps", encoding="ascii", errors="replace") as smaps:
            inside = False
            for line in smaps:
                if not inside:
                    inside = line.startswith(start)
                    continue
                name, _, value = line.partition(":")
                if name in ("ShmemPmdMapped", "FilePmdMapped") and value.split()[0] != "0":
                    return int(value.split()[0]) * 1024
                if name == "VmFlags":  # the mapping's last line
                    return 0
    except (OSError, ValueError, IndexError):
        return 0
    return 0


class Populator(Generic[T]):
    """One daemon thread that populates queued mappings, :data:`POPULATE_CHUNK_BYTES` at a time.

    ``hold(item)`` is called before each chunk under the caller's own locking: it returns the
    item's ``(address, length_bytes)`` and keeps it mapped until ``release(item)``, or None
    when the item has gone (then it is dropped). A kernel without ``MADV_POPULATE_WRITE``
    stops the populator for good; any other refusal drops that item only.
    """

    def __init__(self, hold: Callable[[T], tuple[int, int] | None],
                 release: Callable[[T], None]) -> None:
        self._hold = hold
        self._release = release
        self._queue: collections.deque[tuple[T, int]] = collections.deque()
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopped = False

    def add(self, item: T) -> None:
        """Populate ``item`` from its start, after the items queued before it."""
        with self._wake:
            if self._stopped:
                return
            self._queue.append((item, 0))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvpool-populate",
                                                daemon=True)
                self._thread.start()
            self._wake.notify()

    def stop(self) -> None:
        """Stop after the chunk in flight (idempotent); queued items are dropped."""
        with self._wake:
            self._stopped = True
            self._queue.clear()
            self._wake.notify()

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._queue and not self._stopped:
                    self._wake.wait()
                if self._stopped:
                    return
                item, done_bytes = self._queue.popleft()
            held = self._hold(item)
            if held is None:
                continue
            try:
                address, length_bytes = held
                chunk = min(POPULATE_CHUNK_BYTES, length_bytes - done_bytes)
                code = populate(address + done_bytes, chunk) if chunk > 0 else 0
            finally:
                self._release(item)
            if code == errno.EINVAL:
                logger.info("this kernel cannot populate mappings (MADV_POPULATE_WRITE); peer "
                            "segments fault page by page on first use")
                self.stop()
                return
            if code:
                logger.debug("populating a mapping stopped: %s", os.strerror(code))
            elif done_bytes + chunk < length_bytes:
                with self._wake:
                    if not self._stopped:
                        self._queue.appendleft((item, done_bytes + chunk))
