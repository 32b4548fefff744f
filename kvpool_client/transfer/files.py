"""Reading SSD segments of this host straight from their files.

Rules of this file:
- A segment is read here when it is on this host, names a file, and this process may open it
  (the owner's files are 0600: the same user). Anything else reads through the owner's data
  server, as from another host.
- Before the first read of a file its header must carry the ownership proof the master handed
  out with the descriptor (as for shared memory, ``shm.py``): a descriptor that names another
  client's file is never read as this one. This client's own segments use their own
  descriptors.
- Reads are positioned and direct where the filesystem allows (``ssd.read_range``); the items
  of one batch run on a few threads, so several reads are in flight at once.
- A file is cached by segment id and opened again when the descriptor names another path (the
  owner came back), and dropped once it has no name left (its owner removed it), as shared
  memory is, or is shorter than its segment (cut by something else: its holes would read as
  zeros); both are checked before every read (one ``fstat``), and a file opened again must
  carry the proof again.
- A read of an object with a checksum is checked by the plan (``ReadPlan``), as every read is.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hmac
import logging
import os
import threading
from collections.abc import Mapping, Sequence

from kvpool_client.core.read_plan import ReadItem
from kvpool_client.core.regions import by_address
from kvpool_client.segments import HEADER_BYTES, read_owner_proof
from kvpool_client.ssd import SsdSegment, open_direct, read_range
from kvpool_wire.status import KVPoolError, Status
from kvpool_wire.types import SegmentInfo, Tier

logger = logging.getLogger(__name__)

#: Reads of one batch in flight at once.
READ_THREADS = 4


class FileTransport:
    """Reads of same-host SSD segments; see the module rules."""

    def __init__(self, own: Mapping[str, SsdSegment], local_host_id: str) -> None:
        self._own = own
        self._local_host_id = local_host_id
        # segment id -> (fd, direct, path)
        self._files: dict[str, tuple[int, bool, str]] = {}
        self._unreachable: set[str] = set()
        self._lock = threading.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def reaches(self, info: SegmentInfo) -> bool:
        """Whether ``info`` is read from its file here."""
        if info.tier != Tier.SSD or info.host_id != self._local_host_id or not info.file_path:
            return False
        if info.segment_id in self._own:
            return True
        return info.segment_id not in self._unreachable

    def read_batch(self, items: Sequence[ReadItem]) -> list[Status]:
        """Read every item; one Status each."""
        if len(items) == 1:
            return [self._read(items[0])]
        if self._pool is None:
            with self._lock:
                if self._pool is None:
                    self._pool = concurrent.futures.ThreadPoolExecutor(
                        READ_THREADS, thread_name_prefix="kvpool-ssd-read")
        return list(self._pool.map(self._read, items))

    def write_batch(self, items: Sequence[ReadItem]) -> list[Status]:
        """Nothing writes into an SSD segment but its owner's tier copies."""
        return [Status.PERMISSION_DENIED] * len(items)

    def _read(self, item: ReadItem) -> Status:
        info, placement, regions = item
        if by_address(regions):
            return Status.INVALID_ARGUMENT
        try:
            own = self._own.get(info.segment_id)
            if own is not None:
                own.read_into(placement.offset, placement.length, regions)
                return Status.OK
            fd, direct = self._open(info)
            read_range(fd, direct, placement.offset, placement.length, regions)
            return Status.OK
        except KVPoolError as exc:
            logger.warning("reading %s from its file failed: %s", info.segment_id, exc)
            return exc.status
        except OSError as exc:
            logger.warning("reading %s from its file failed: %s", info.segment_id, exc)
            self.forget(info.segment_id)
            return Status.TRANSFER_FAILED

    def _open(self, info: SegmentInfo) -> tuple[int, bool]:
        opened = self._files.get(info.segment_id)
        if opened is not None and opened[2] == info.file_path and _whole(opened[0], info):
            return opened[0], opened[1]
        if opened is not None:
            self.forget(info.segment_id)
        try:
            plain = os.open(info.file_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            self._unreachable.add(info.segment_id)  # read through its data server from now on
            raise KVPoolError(Status.SEGMENT_NOT_FOUND, f"{info.file_path}: {exc}") from exc
        try:
            proof = read_owner_proof(plain, info.size_bytes) if _whole(plain, info) else None
        finally:
            os.close(plain)
        if proof is None or not info.ownership_proof or not hmac.compare_digest(
                proof[:len(info.ownership_proof)], info.ownership_proof):
            raise KVPoolError(Status.PERMISSION_DENIED,
                              f"{info.file_path} does not carry the proof of {info.segment_id}")
        fd, direct = open_direct(info.file_path, os.O_RDONLY)
        with self._lock:
            raced = self._files.get(info.segment_id)
            if raced is not None:
                os.close(fd)
                return raced[0], raced[1]
            self._files[info.segment_id] = (fd, direct, info.file_path)
        return fd, direct

    def forget(self, segment_id: str) -> None:
        """Close the file of ``segment_id`` (the next read opens and checks it again)."""
        with self._lock:
            opened = self._files.pop(segment_id, None)
        if opened is not None:
            with contextlib.suppress(OSError):
                os.close(opened[0])

    def close(self) -> None:
        """Close every file and the read threads (idempotent)."""
        with self._lock:
            files, self._files = self._files, {}
            pool, self._pool = self._pool, None
        for fd, *_ in files.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        if pool is not None:
            pool.shutdown(wait=False)


def _whole(fd: int, info: SegmentInfo) -> bool:
    """Whether the file of ``fd`` still has a name and the whole length of its segment."""
    st = os.fstat(fd)
    return bool(st.st_nlink) and st.st_size >= info.size_bytes + HEADER_BYTES
