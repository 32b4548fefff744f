"""Writes and reads where the caller moves the bytes itself (``DataPath.write_with`` /
``read_with``), e.g. by device DMA straight into or out of a segment.

Rules of this file:
- Same engines as ``_datapath``: ``put_start`` -> the caller's ``fill(index, view)`` per
  placement -> ``put_end`` (``put_revoke`` for keys whose fill failed); ``get_replicas`` -> the
  caller's ``consume(index, view)`` on one replica (same host first) -> the lease must still
  hold when ``consume`` returns, or the key reads LEASE_EXPIRED and what was taken is void.
- On this host the view is the placement's own bytes in the mapped segment (kept mapped while
  the caller holds it); for another host it is a host buffer, sent after ``fill`` or filled
  over tcp before ``consume``. The caller is done with every view when ``done()`` returns (or,
  without ``done``, when each ``fill`` / ``consume`` returns).
- With checksums on, a write's checksum is taken from the bytes as they landed (after
  ``done``, from the view itself, never read back) and a read is checked before ``consume``
  sees the bytes.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvpool_client.buffers import checksum
from kvpool_client.transfer.base import Item
from kvpool_wire.status import KVPoolError, Status
from kvpool_wire.types import PutOptions

if TYPE_CHECKING:
    from kvpool_client._datapath import DataPath

logger = logging.getLogger(__name__)

#: fill(index, view): write the whole object ``index`` into ``view``; consume(index, view):
#: take the whole object ``index`` from ``view``. Both are done with the view when they return.
Filler = Callable[[int, memoryview], None]
Consumer = Callable[[int, memoryview], None]
#: done(): called once every fill / consume of a call has run and before the writes are
#: committed / the reads judged; fill and consume may leave their copies in flight until it
#: returns (e.g. queue asynchronous device copies, then synchronize once).
Done = Callable[[], None]


#: Reads must finish this much before the lease runs out (clock-rate differences, scheduling).
LEASE_MARGIN_RATIO = 0.02
LEASE_MARGIN_MIN_S = 0.001


def lease_deadline(sent_s: float, lease_ttl_s: float) -> float:
    """The monotonic time by which a read granted a lease of ``lease_ttl_s``, asked for at
    ``sent_s``, must have finished with the bytes."""
    return sent_s + lease_ttl_s - max(lease_ttl_s * LEASE_MARGIN_RATIO, LEASE_MARGIN_MIN_S)


def check_answers(call: str, answers: Sequence[object], keys: Sequence[bytes]) -> None:
    """A batch answer must have one item per key: a short one would leave keys unanswered,
    and an unanswered key must never pass for a success. Raises INTERNAL_ERROR."""
    if len(answers) != len(keys):
        raise KVPoolError(Status.INTERNAL_ERROR,
                          f"{call} answered {len(answers)} items for {len(keys)} keys")


async def write_with(path: DataPath, keys: list[bytes], sizes: list[int], options: PutOptions,
                     fill: Filler, done: Done | None = None) -> list[Status]:
    """Like ``write``, but ``fill`` writes every placement (see the module docstring); a
    key whose ``fill`` raised is revoked with TRANSFER_FAILED, and so is every filled key
    when ``done`` raised."""
    epoch, statuses, jobs = await path._put_start(keys, sizes, options)
    if not jobs:
        return statuses
    infos = await path.resolve(p.segment_id for _, p in jobs)
    remote: list[tuple[int, Item]] = []  # (key index, item) for placements on other hosts
    checksums = [0] * len(keys) if path.checksum_max_bytes else None
    with contextlib.ExitStack() as borrowed:  # same-host placements stay mapped until done
        filled: dict[int, memoryview] = {}  # key index -> its first placement's bytes
        attempted = False  # a fill ran: done() must end its copies before the views go
        for index, placement in jobs:
            if statuses[index] != Status.OK:
                continue
            info = infos.get(placement.segment_id)
            status = Status.SEGMENT_NOT_FOUND if info is None else \
                path._writable(placement, epoch)
            if status == Status.OK:
                assert info is not None
                attempted = True
                try:
                    if path._prefers(info):
                        view = borrowed.enter_context(path.shm.borrow(info, placement))
                        fill(index, view)
                    else:  # another host: fill a host buffer, send it once done
                        view = memoryview(bytearray(placement.length))
                        fill(index, view)
                        remote.append((index, (info, placement, [view])))
                    filled.setdefault(index, view)
                except KVPoolError as exc:
                    status = exc.status
                except Exception as exc:
                    logger.warning("filling %r failed: %s", keys[index], exc)
                    status = Status.TRANSFER_FAILED
            if status != Status.OK:
                statuses[index] = status
        if done is not None and attempted:
            try:
                done()
            except Exception as exc:
                logger.warning("finishing the fills of %d keys failed: %s", len(keys), exc)
                for index in filled:
                    statuses[index] = Status.TRANSFER_FAILED
        if checksums is not None:  # over the bytes as they landed, while still mapped
            for index, view in filled.items():
                if statuses[index] == Status.OK and len(view) <= path.checksum_max_bytes:
                    checksums[index] = checksum([view])
    remote = [(index, item) for index, item in remote if statuses[index] == Status.OK]
    if remote:
        transferred = await path.transfer([item for _, item in remote], writing=True)
        for (index, _), status in zip(remote, transferred, strict=True):
            if status != Status.OK:
                statuses[index] = status
    await path._settle(jobs, keys, checksums, statuses)
    return statuses


async def read_with(path: DataPath, keys: Sequence[bytes], consume: Consumer,
                    done: Done | None = None) -> list[int]:
    """Like ``read``, but ``consume`` takes each object (see the module docstring); per key
    its size, or a negative Status (LEASE_EXPIRED when the lease ran out before ``consume``
    and ``done`` returned: what was taken must not be used)."""
    results, deadline, infos = await path._get_replicas(keys)
    out = [0] * len(keys)
    views: dict[int, memoryview] = {}
    remote: list[tuple[int, Item]] = []
    taken: list[int] = []
    with contextlib.ExitStack() as borrowed:  # same-host replicas stay mapped until done
        for index, result in enumerate(results):
            out[index] = int(result.status) if result.status != Status.OK else \
                int(Status.SEGMENT_NOT_FOUND)
            candidates = sorted((p for p in result.placements if p.segment_id in infos),
                                key=lambda p: not path._prefers(infos[p.segment_id]))
            for placement in candidates if result.status == Status.OK else []:
                info = infos[placement.segment_id]
                if not path._prefers(info):  # another host: read into a host buffer first
                    views[index] = memoryview(bytearray(placement.length))
                    remote.append((index, (info, placement, [views[index]])))
                    break
                try:
                    views[index] = borrowed.enter_context(path.shm.borrow(info, placement))
                    break
                except KVPoolError as exc:  # try the next replica
                    out[index] = int(exc.status)
                    if exc.status in (Status.SEGMENT_NOT_FOUND, Status.TRANSFER_FAILED):
                        path.forget(info.segment_id)
        if remote:
            statuses = await path.transfer([item for _, item in remote], writing=False)
            for (index, _), status in zip(remote, statuses, strict=True):
                if status != Status.OK:
                    out[index] = int(status)
                    del views[index]
        attempted = False  # a consume ran: done() must end its copies before the views go
        for index, view in views.items():
            expected = results[index].checksum
            if expected and path.checksum_max_bytes and checksum([view]) != expected:
                out[index] = int(Status.CHECKSUM_MISMATCH)
                continue
            attempted = True
            try:
                consume(index, view)
            except Exception as exc:
                logger.warning("consuming %r failed: %s", keys[index], exc)
                out[index] = int(Status.TRANSFER_FAILED)
                continue
            taken.append(index)
        if attempted and done is not None:
            try:
                done()
            except Exception as exc:
                logger.warning("finishing the reads of %d keys failed: %s", len(taken), exc)
                for index in taken:
                    out[index] = int(Status.TRANSFER_FAILED)
                taken = []
    # the bytes may have been replaced once the lease ran out
    in_time = time.monotonic() <= deadline
    for index in taken:
        out[index] = results[index].size_bytes if in_time else int(Status.LEASE_EXPIRED)
    return out
