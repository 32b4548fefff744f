"""Local DRAM segments: POSIX shared memory that peers on this host map, and peers elsewhere
reach through this client's data server.

Rules of this file:
- A segment lives in ``/dev/shm/kvpool.<cluster>.<client>.<index>.<pid>.<start>``: cluster and
  client are sanitised (``[A-Za-z0-9_-]``, a short hash appended when anything had to change),
  ``pid`` and ``start`` (the owner's start time in clock ticks since boot) identify the owning
  process, so that shared memory left by a crashed process can be recognised even after its pid
  was reused.
- Files are created ``O_EXCL`` with mode 0600 and are owned by the user; every page is allocated
  (``posix_fallocate``: a full ``/dev/shm`` fails here with NO_SPACE instead of a SIGBUS on
  some later put) and write-faulted into this process before ``create`` returns, so no put pays
  a page fault.
- With ``huge_pages`` the mapping is marked ``MADV_HUGEPAGE`` before any page exists and filled
  with ``MADV_POPULATE_WRITE`` (which reports a full tmpfs as an error, as the fallocate does;
  the fallocate itself would allocate 4 KiB pages). Whether the kernel gave 2 MiB pages is read
  back (``huge_bytes``); without them the segment works the same on 4 KiB pages, and says so in
  the log (``pages.py``).
- ``close`` unlinks the name first and unmaps when no view is left; it is idempotent.
- The file holds the segment's ``size_bytes`` and, after them, one page of header: a magic and
  the ownership proof (``capability.ownership_proof``) the owner stamps with its capability key
  before every mount. Mappers check it against the proof the master hands out (``shm.py``).
- The owner holds a shared ``flock`` on its file for as long as the segment lives. The kernel
  drops it when the process dies, whatever pid namespace it runs in, so start-up cleanup
  removes a left-over file only when it can take the lock (and the pid in the name, where it
  can be checked, is gone too).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import logging
import mmap
import os
import re
import socket
import stat
import threading
from collections.abc import Callable

import numpy as np

from kvpool_client import pages
from kvpool_wire.capability import PROOF_BYTES, ownership_proof
from kvpool_wire.status import KVPoolError, Status
from kvpool_wire.types import ClientId, SegmentId, SegmentInfo, Tier

SHM_DIR = "/dev/shm"
_PREFIX = "kvpool"
_SAFE = re.compile(r"[A-Za-z0-9_-]+")
_MAX_PART_CHARS = 48
_PARALLEL_PREFAULT_BYTES = 64 << 20
_HUGE_PAGE_BYTES = 2 << 20  # where two threads split a range: a 2 MiB (and page) boundary
_STALE_NAME = re.compile(r"kvpool\.([A-Za-z0-9_-]+)\.[A-Za-z0-9_-]+\.\d+\.(\d+)\.(\d+)")
#: The header page after a segment's bytes: magic, then the owner's proof.
HEADER_BYTES = mmap.PAGESIZE
HEADER_MAGIC = b"KVPOWNR1"
_PROOF_AT = len(HEADER_MAGIC)

log = logging.getLogger(__name__)


def host_id() -> str:
    """Return the identity of this machine: ``<boot id>:<hostname>``.

    Two processes see the same id exactly when they can map each other's shared memory. The
    environment variable ``KVPOOL_HOST_ID`` overrides it (tests use it to force the tcp path).
    """
    override = os.environ.get("KVPOOL_HOST_ID")
    if override:
        return override
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot_id = f.read().strip()
    except OSError:
        boot_id = "no-boot-id"
    return f"{boot_id}:{socket.gethostname()}"


def _name_part(text: str) -> str:
    """A file-name-safe, collision-free rendering of ``text`` (no dots, bounded length)."""
    if _SAFE.fullmatch(text) and len(text) <= _MAX_PART_CHARS:
        return text
    safe = re.sub(r"[^A-Za-z0-9_-]", "_", text)[: _MAX_PART_CHARS - 17]
    return f"{safe}-{hashlib.blake2b(text.encode(), digest_size=8).hexdigest()}"


def _process_start_ticks(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot; None when it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            text = f.read()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    fields = text[text.rfind(")") + 2:].split()
    if len(fields) < 20 or fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def _allocate(fd: int, total_bytes: int, huge_pages: bool) -> mmap.mmap:
    """Size the file, map it and fault every page in (see the module rules). Raises OSError
    (ENOSPC, ENOMEM or EFAULT when the file system cannot hold it)."""
    if not huge_pages:
        os.posix_fallocate(fd, 0, total_bytes)
        mapping = mmap.mmap(fd, total_bytes, flags=mmap.MAP_SHARED,
                            prot=mmap.PROT_READ | mmap.PROT_WRITE)
        _prefault(mapping, total_bytes)
        return mapping
    os.ftruncate(fd, total_bytes)
    mapping = mmap.mmap(fd, total_bytes, flags=mmap.MAP_SHARED,
                        prot=mmap.PROT_READ | mmap.PROT_WRITE)
    address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    pages.advise_huge(address, total_bytes)
    code = _in_two_halves(total_bytes, lambda start, stop: pages.populate(
        address + start, stop - start))
    if code == errno.EINVAL:  # a kernel without MADV_POPULATE_WRITE: allocate as without
        log.warning("this kernel cannot populate a mapping (MADV_POPULATE_WRITE); the segment "
                    "is allocated on 4 KiB pages")
        os.posix_fallocate(fd, 0, total_bytes)
        _prefault(mapping, total_bytes)
    elif code:
        mapping.close()
        raise OSError(code, os.strerror(code))
    return mapping


def _in_two_halves(total_bytes: int, work: Callable[[int, int], int | None]) -> int:
    """Run ``work(start, stop)`` over ``[0, total_bytes)``, split across two threads when the
    range is large (page work in the kernel, the GIL let go). Returns 0 or the first nonzero
    result."""
    if total_bytes < _PARALLEL_PREFAULT_BYTES:
        return work(0, total_bytes) or 0
    half = (total_bytes // 2) // _HUGE_PAGE_BYTES * _HUGE_PAGE_BYTES
    results: list[int | None] = []
    worker = threading.Thread(target=lambda: results.append(work(half, total_bytes)),
                              name="kvpool-prefault")
    worker.start()
    first = work(0, half)
    worker.join()
    return first or next(iter(results), 0) or 0


def _prefault(mapping: mmap.mmap, size_bytes: int) -> None:
    """Write-fault every page of ``mapping`` (the pages are fresh zeros; a zero is written).

    Faulting is per-page kernel work, so large segments are split across two threads (numpy
    releases the GIL): measured here about 0.4 s per GiB with the fallocate, against 0.6 s with
    MAP_POPULATE, which faults on one thread.
    """
    _in_two_halves(size_bytes, lambda start, stop: _touch_pages(mapping, start, stop))


def _touch_pages(mapping: mmap.mmap, start: int, stop: int) -> None:
    """Write a zero into every page of ``[start, stop)`` (the array, and its export, die here)."""
    pages = np.frombuffer(mapping, dtype=np.uint8, count=stop - start, offset=start)
    pages[::mmap.PAGESIZE] = 0


def shm_name_for(cluster: str, client_id: str, index: int, pid: int | None = None) -> str:
    """Return the shared-memory file name of segment ``index`` of ``client_id`` owned by ``pid``
    (default: this process)."""
    pid = os.getpid() if pid is None else pid
    start = _process_start_ticks(pid)
    if start is None:
        raise KVPoolError(Status.INVALID_ARGUMENT, f"process {pid} is not running")
    return f"{_PREFIX}.{_name_part(cluster)}.{_name_part(client_id)}.{index}.{pid}.{start}"


class LocalSegment:
    """One segment of this process: a 0600 POSIX shared-memory file, mapped and pre-faulted."""

    def __init__(self, segment_id: str, shm_name: str, size_bytes: int, mapping: mmap.mmap,
                 client_id: str, lock_fd: int = -1) -> None:
        self.segment_id = SegmentId(segment_id)
        self.huge_bytes = 0  # bytes the kernel backs with 2 MiB pages (create() sets it)
        self.shm_name = shm_name
        self.size_bytes = size_bytes
        self.client_id = ClientId(client_id)
        self._mmap: mmap.mmap | None = mapping
        self._lock_fd = lock_fd  # holds the shared flock: this segment's owner is alive
        full = memoryview(mapping)
        self._view: memoryview | None = full[:size_bytes]  # the header page stays out of reach
        full.release()
        # The ctypes object exports the buffer only while it exists; it is dropped at once.
        self._address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))

    @classmethod
    def create(cls, cluster: str, client_id: str, index: int, size_bytes: int, *,
               huge_pages: bool = False) -> LocalSegment:
        """Create, size, pre-fault and map a new segment (on huge pages where asked and the
        host gives them; see the module rules).

        Returns the segment. Raises KVPoolError INVALID_ARGUMENT (size <= 0 or index < 0),
        SEGMENT_ALREADY_EXISTS (this process already has that segment), NO_SPACE (``/dev/shm``
        cannot hold it) or INTERNAL_ERROR (any other OS failure).
        """
        if size_bytes <= 0 or index < 0:
            raise KVPoolError(Status.INVALID_ARGUMENT,
                              f"segment size must be > 0 and index >= 0, got {size_bytes}, {index}")
        name = shm_name_for(cluster, client_id, index)
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o600)
        except FileExistsError:
            raise KVPoolError(Status.SEGMENT_ALREADY_EXISTS, f"{path} exists") from None
        except OSError as exc:
            raise KVPoolError(Status.INTERNAL_ERROR, f"cannot create {path}: {exc}") from exc
        total_bytes = size_bytes + HEADER_BYTES
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # before anyone can see it unlocked
            os.fchmod(fd, 0o600)  # the umask can only remove bits; make the mode exact anyway
            mapping = _allocate(fd, total_bytes, huge_pages)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(path)
            os.close(fd)
            status = Status.NO_SPACE if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFAULT) \
                else Status.INTERNAL_ERROR
            raise KVPoolError(status, f"cannot allocate {size_bytes} bytes in {path}: {exc}") \
                from exc
        mapping[size_bytes:size_bytes + _PROOF_AT] = HEADER_MAGIC
        segment = cls(f"{client_id}-seg{index}", name, size_bytes, mapping, client_id, fd)
        if huge_pages:
            segment.huge_bytes = min(size_bytes, pages.huge_bytes(segment.address))
            if segment.huge_bytes:
                log.info("segment %s: %d of %d bytes on 2 MiB pages", segment.segment_id,
                         segment.huge_bytes, size_bytes)
            else:
                log.warning("segment %s: huge pages asked for, but %s gave 4 KiB pages (mount "
                            "it with huge=advise, or set /sys/kernel/mm/transparent_hugepage/"
                            "shmem_enabled to force); continuing on 4 KiB pages",
                            segment.segment_id, SHM_DIR)
        return segment

    def stamp_owner(self, capability_key: bytes) -> None:
        """Write the ownership proof of ``capability_key`` into the header (before mounting)."""
        mapping = self._mmap
        if mapping is None:
            raise KVPoolError(Status.SEGMENT_NOT_FOUND, f"segment {self.segment_id} is closed")
        proof = ownership_proof(capability_key, self.segment_id, self.shm_name, self.size_bytes)
        at = self.size_bytes + _PROOF_AT
        mapping[at:at + len(proof)] = proof

    @property
    def buffer(self) -> memoryview:
        """Writable view of the whole segment. Raises KVPoolError SEGMENT_NOT_FOUND once closed."""
        if self._view is None:
            raise KVPoolError(Status.SEGMENT_NOT_FOUND, f"segment {self.segment_id} is closed")
        return self._view

    @property
    def address(self) -> int:
        """Base address of the mapping in this process (valid until close)."""
        return self._address

    @property
    def closed(self) -> bool:
        """True after close()."""
        return self._view is None

    def describe(self, host_id: str, tcp_endpoint: str = "",
                 engine_endpoint: str = "") -> SegmentInfo:
        """Return the SegmentInfo a peer needs to reach this segment (what gets mounted); with
        ``engine_endpoint``, the segment is registered with that transfer engine at its
        address."""
        return SegmentInfo(segment_id=self.segment_id, client_id=self.client_id,
                           size_bytes=self.size_bytes, tier=Tier.DRAM, host_id=host_id,
                           shm_name=self.shm_name, tcp_endpoint=tcp_endpoint,
                           engine_endpoint=engine_endpoint,
                           engine_base_address=self.address if engine_endpoint else 0)

    def close(self) -> None:
        """Unlink the name and unmap (idempotent).

        The name goes first so that no peer can map it again. If views of the buffer are still
        alive the mapping stays until they are released (unmapping under them would crash);
        the memory is freed when the last mapping on the host goes.
        """
        if self._view is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(SHM_DIR, self.shm_name))
        view, self._view = self._view, None
        mapping, self._mmap = self._mmap, None
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # the lock goes with it
            self._lock_fd = -1
        try:
            view.release()
            if mapping is not None:
                mapping.close()
        except BufferError:
            log.warning("segment %s closed while views of it are alive; unmapped when they go",
                        self.segment_id)

    def __enter__(self) -> LocalSegment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"LocalSegment({self.segment_id!r}, {self.shm_name!r}, {self.size_bytes})"


def cleanup_stale_segments(cluster: str, directory: str = SHM_DIR, suffix: str = "") -> list[str]:
    """Unlink the shared memory of ``cluster`` left on this host by processes that are gone
    (or, with ``directory`` and ``suffix``, the SSD segment files there, see ``ssd.py``).

    Only files that match kvpool's naming pattern for this cluster, are regular files owned by
    this user, are not locked by a live owner (see the module rules; this holds across pid
    namespaces) and whose named owner (pid *and* start time) no longer runs here are removed;
    a zombie counts as gone. Returns the removed names, sorted.
    """
    part = _name_part(cluster)
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    uid = os.getuid()
    for name in names:
        if not name.endswith(suffix):
            continue
        match = _STALE_NAME.fullmatch(name[:len(name) - len(suffix)])
        if match is None or match.group(1) != part:
            continue
        pid, start = int(match.group(2)), int(match.group(3))
        if _process_start_ticks(pid) == start:
            continue  # the owner still runs
        path = os.path.join(directory, name)
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(info.st_mode) or info.st_uid != uid or _owner_alive(path):
            continue
        try:
            os.unlink(path)
        except FileNotFoundError:
            continue
        removed.append(name)
        log.info("removed stale segment %s (owner pid %d is gone)", name, pid)
    return sorted(removed)


def _owner_alive(path: str) -> bool:
    """True while some process holds the owner's lock on ``path`` (or it cannot be checked)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return True
    finally:
        os.close(fd)  # also drops the lock this call took
    return False


def read_owner_proof(fd: int, size_bytes: int) -> bytes | None:
    """The ownership proof in the header after ``size_bytes`` bytes of an open segment file,
    or None when the file has no kvpool header there."""
    try:
        header = os.pread(fd, _PROOF_AT + PROOF_BYTES, size_bytes)
    except OSError:
        return None
    if len(header) != _PROOF_AT + PROOF_BYTES or header[:_PROOF_AT] != HEADER_MAGIC:
        return None
    return header[_PROOF_AT:]


def split_sizes(total_bytes: int, max_bytes: int) -> list[int]:
    """Sizes of the segments that make up ``total_bytes`` (none for 0)."""
    if total_bytes <= 0:
        return []
    if max_bytes <= 0 or max_bytes >= total_bytes:
        return [total_bytes]
    full, rest = divmod(total_bytes, max_bytes)
    return [max_bytes] * full + ([rest] if rest else [])
