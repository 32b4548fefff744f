"""The write and read engines behind every client call (one implementation, batch-shaped).

Rules of this file:
- Write: ``put_start`` -> copy to every placement (shm on this host, tcp otherwise, or as the
  config forces) -> ``put_end`` (pipelined when ``commit_nowait``: the commit is sent before the
  call returns and the master serves this client's later calls after it, so read-your-writes
  holds) ; ``put_revoke`` for keys whose transfer failed. ``ALREADY_EXISTS`` is success.
- A write is abandoned (and revoked) when this client re-registered since its ``put_start``
  (epoch changed), when its liveness lapsed, or when the placement's write capability expired:
  the master may already have given those bytes to someone else.
- Read: ``get_replicas`` -> read one replica (same host first, the next one on failure) ->
  the lease must not have run out (deadline counted from when the request was sent) and the
  checksum must match where one was committed; otherwise the bytes are never reported as read.
- Call-level failures (the master cannot be reached) raise KVPoolError before anything changed;
  everything after ``put_start`` / ``get_replicas`` ends up in per-key statuses.
- ``write_with`` / ``read_with`` are the same engines with the caller moving the bytes: its
  ``fill(index, view)`` writes a placement (the segment's own bytes on this host, else a host
  buffer then sent over tcp) between ``put_start`` and ``put_end``; its ``consume(index,
  view)`` reads one replica, and what it read counts only if the lease held until it returned.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, Protocol

from kvpool_client._direct import (
    Consumer,
    Done,
    Filler,
    check_answers,
    lease_deadline,
    read_with,
    write_with,
)
from kvpool_client.buffers import Regions, checksum
from kvpool_client.metrics import ClientMetrics
from kvpool_client.rpc import MasterRpc
from kvpool_client.transfer import ShmTransport, TcpTransport, uses_shm
from kvpool_client.transfer.base import Item
from kvpool_wire.status import KVPoolError, Status
from kvpool_wire.types import Placement, PutOptions, SegmentInfo

logger = logging.getLogger(__name__)

#: A transfer failing so drops what this client knows of the segment (descriptor, mapping):
#: the next use asks the master again (PERMISSION_DENIED: a refused ownership proof, which an
#: owner that re-registered under a new key has replaced).
_FORGET_SEGMENT_ON = frozenset({Status.SEGMENT_NOT_FOUND, Status.TRANSFER_FAILED,
                                Status.PERMISSION_DENIED})
#: Writes stop this long before liveness or the write capability runs out.
WRITE_MARGIN_S = 0.05
#: Batches of at least twice this many bytes are cut into concurrent sub-batches (at most
#: PIPELINE_MAX_PARTS), so that master calls overlap copies; not while master calls block the
#: calling thread (see ``DataPath._spans``).
PIPELINE_MIN_BYTES = 8 << 20
PIPELINE_MAX_PARTS = 2


class LivenessView(Protocol):
    """What the data path reads from liveness (see liveness.Liveness)."""

    @property
    def epoch(self) -> int: ...

    def is_alive(self, now: float | None = None) -> bool: ...


class CommitWatcher(Protocol):
    """Where pipelined commits report (see asyncwrite.AsyncWriter.watch_commit)."""

    def watch_commit(self, keys: Sequence[bytes], future: asyncio.Future[list[Status]]) -> None: ...


DstFor = Callable[[int, int], "Regions | Status"]


class DataPath:
    """Moves objects between caller regions and the pool; see the module docstring."""

    def __init__(self, *, rpc: MasterRpc, client_id: str, local_host_id: str, transport: str,
                 shm: ShmTransport, tcp: TcpTransport, checksum_max_bytes: int,
                 commit_nowait: bool, metrics: ClientMetrics,
                 reregistered: Callable[[], Awaitable[None]]) -> None:
        self.rpc = rpc
        self.client_id = client_id
        self.local_host_id = local_host_id
        self.force_tcp = transport == "tcp"
        self.shm_only = transport == "shm"
        self.shm = shm
        self.tcp = tcp
        # objects up to this size get a checksum at put; reads check any committed one
        # (0: "checksum": false, neither)
        self.checksum_max_bytes = checksum_max_bytes
        self.commit_nowait = commit_nowait
        self.metrics = metrics
        self.liveness: LivenessView | None = None
        self.commits: CommitWatcher | None = None
        self._reregistered = reregistered
        self._segment_id_to_info: dict[str, SegmentInfo] = {}

    # -- segment descriptors ----------------------------------------------------------------------

    def remember(self, segments: Iterable[SegmentInfo]) -> None:
        """Cache descriptors known without asking the master (this client's own segments)."""
        for info in segments:
            self._segment_id_to_info[info.segment_id] = info

    def forget(self, segment_id: str) -> None:
        """Drop a cached descriptor (and mapping): the next use asks the master again."""
        self._segment_id_to_info.pop(segment_id, None)
        self.shm.forget(segment_id)

    async def resolve(self, segment_ids: Iterable[str]) -> dict[str, SegmentInfo]:
        """Return the descriptors of ``segment_ids`` that exist (cached, else one master call)."""
        known = self._segment_id_to_info
        missing = [s for s in set(segment_ids) if s not in known]
        if missing:
            for segment_id, info in zip(missing, await self.rpc.get_segments(missing),
                                        strict=True):
                if info is not None:
                    known[segment_id] = info
        return known

    def _prefers(self, info: SegmentInfo) -> bool:
        return uses_shm(info, self.local_host_id, self.force_tcp)

    # -- transfers --------------------------------------------------------------------------------

    async def transfer(self, items: list[Item], *, writing: bool) -> list[Status]:
        """Move every item through its transport (shm and tcp parts concurrently)."""
        shm_part: list[int] = []
        tcp_part: list[int] = []
        statuses = [Status.OK] * len(items)
        for index, item in enumerate(items):
            if self._prefers(item[0]):
                shm_part.append(index)
            elif self.shm_only:
                statuses[index] = Status.TRANSFER_FAILED  # transport "shm" forbids tcp
            else:
                tcp_part.append(index)
        jobs = [(name, transport, part) for name, transport, part in
                (("shm", self.shm, shm_part), ("tcp", self.tcp, tcp_part)) if part]
        if len(jobs) == 1:
            results = [await self._run_part(*jobs[0], items, writing)]
        else:
            results = list(await asyncio.gather(
                *(self._run_part(name, transport, part, items, writing)
                  for name, transport, part in jobs)))
        for (_, _, part), part_statuses in zip(jobs, results, strict=True):
            for index, status in zip(part, part_statuses, strict=True):
                statuses[index] = status
                if status in _FORGET_SEGMENT_ON:
                    self.forget(items[index][0].segment_id)
        return statuses

    async def _run_part(self, name: str, transport: ShmTransport | TcpTransport,
                        part: list[int], items: list[Item], writing: bool) -> list[Status]:
        chosen = [items[i] for i in part]
        started = time.perf_counter()
        if writing:
            statuses = await transport.write_batch(chosen)
        else:
            statuses = await transport.read_batch(chosen)
        num_bytes = sum(item[1].length for item, status in zip(chosen, statuses, strict=True)
                        if status == Status.OK)
        self.metrics.observe_transfer(name, "write" if writing else "read", num_bytes,
                                      time.perf_counter() - started)
        return statuses

    # -- writes -----------------------------------------------------------------------------------

    async def write(self, keys: list[bytes], regions: list[Regions], sizes: list[int],
                    options: PutOptions) -> list[Status]:
        """Write objects (each key once, each size > 0); one Status per key (OK on success,
        ALREADY_EXISTS counts as OK).

        Large batches are cut into a few sub-batches run concurrently, so that the master calls
        of one overlap the copies of another. Raises KVPoolError only when every ``put_start``
        failed (RPC_FAILED, TIMEOUT, ...): then nothing was written.
        """
        spans = self._spans(sizes)
        if len(spans) == 1:
            return await self._write_batch(keys, regions, sizes, options)
        parts = await asyncio.gather(
            *(self._write_batch(keys[a:b], regions[a:b], sizes[a:b], options) for a, b in spans),
            return_exceptions=True)
        return _joined(parts, spans)

    async def _write_batch(self, keys: list[bytes], regions: list[Regions], sizes: list[int],
                           options: PutOptions) -> list[Status]:
        limit = self.checksum_max_bytes
        checksums = [checksum(r) if size <= limit else 0 for r, size in
                     zip(regions, sizes, strict=True)] if limit else None
        epoch, statuses, jobs = await self._put_start(keys, sizes, options)
        if not jobs:
            return statuses
        for (index, _), status in zip(jobs, await self._write_placements(jobs, regions, epoch),
                                      strict=True):
            if status != Status.OK and statuses[index] == Status.OK:
                statuses[index] = status
        await self._settle(jobs, keys, checksums, statuses)
        return statuses

    async def _settle(self, jobs: list[tuple[int, Placement]], keys: list[bytes],
                      checksums: list[int] | None, statuses: list[Status]) -> None:
        """Revoke the keys of ``jobs`` that failed, commit the rest (statuses updated)."""
        written = sorted({i for i, _ in jobs if statuses[i] == Status.OK})
        failed = sorted({i for i, _ in jobs if statuses[i] != Status.OK})
        if failed:
            await self._revoke([keys[i] for i in failed])
        if written:
            await self._commit(written, keys, checksums, statuses)

    async def _put_start(self, keys: list[bytes], sizes: list[int], options: PutOptions
                         ) -> tuple[int, list[Status], list[tuple[int, Placement]]]:
        """``put_start`` (again once re-registered, when the master no longer knew this
        client); return (the epoch it was granted in, per-key statuses so far, (key index,
        placement) per placement to write)."""
        epoch = self._epoch()
        answers = await self.rpc.put_start(self.client_id, keys, sizes, options)
        if answers and all(status == Status.UNKNOWN_CLIENT for status, _ in answers):
            await self._wait_reregistered()
            epoch = self._epoch()
            answers = await self.rpc.put_start(self.client_id, keys, sizes, options)
        check_answers("PutStart", answers, keys)
        statuses = [Status.OK] * len(keys)
        jobs: list[tuple[int, Placement]] = []
        for index, (status, placements) in enumerate(answers):
            if status == Status.OK and placements:
                jobs.extend((index, placement) for placement in placements)
            elif status != Status.ALREADY_EXISTS:
                statuses[index] = status if status != Status.OK else Status.INTERNAL_ERROR
        return epoch, statuses, jobs

    async def _write_placements(self, jobs: list[tuple[int, Placement]], regions: list[Regions],
                                epoch: int) -> list[Status]:
        infos = await self.resolve(p.segment_id for _, p in jobs)
        statuses = [Status.OK] * len(jobs)
        items: list[Item] = []
        chosen: list[int] = []
        check = self._write_check(epoch)  # the whole batch is checked at this instant
        for k, (index, placement) in enumerate(jobs):
            info = infos.get(placement.segment_id)
            statuses[k] = Status.SEGMENT_NOT_FOUND if info is None else \
                self._writable(placement, epoch, check)
            if statuses[k] == Status.OK:
                assert info is not None
                items.append((info, placement, regions[index]))
                chosen.append(k)
        if items:
            for k, status in zip(chosen, await self.transfer(items, writing=True), strict=True):
                statuses[k] = status
        return statuses

    async def write_with(self, keys: list[bytes], sizes: list[int], options: PutOptions,
                         fill: Filler, done: Done | None = None) -> list[Status]:
        """Like ``write``, with ``fill`` moving the bytes (see ``_direct``)."""
        return await write_with(self, keys, sizes, options, fill, done)

    async def read_with(self, keys: Sequence[bytes], consume: Consumer,
                        done: Done | None = None) -> list[int]:
        """Like ``read``, with ``consume`` taking the bytes (see ``_direct``)."""
        return await read_with(self, keys, consume, done)

    def _writable(self, placement: Placement, epoch: int,
                  check: tuple[Status, float] | None = None) -> Status:
        """OK while this client may still write the placement. The master may have expired
        this client (paused process, lost heartbeats) and handed the range to another writer:
        then abandon rather than overwrite someone else's bytes. ``check``: what
        ``_write_check`` gave for a batch checked at one instant (taken now when None)."""
        status, now_ms = self._write_check(epoch) if check is None else check
        if status != Status.OK:
            return status
        if placement.capability_expiry_ms and placement.capability_expiry_ms < now_ms:
            return Status.TIMEOUT
        return Status.OK

    def _write_check(self, epoch: int) -> tuple[Status, float]:
        """(OK, or why nothing granted in ``epoch`` may be written any more; an upper bound
        of the master's capability clock, ``WRITE_MARGIN_S`` ahead, against which write
        capabilities are checked)."""
        now_ms = self.rpc.session.clock.now_ms(time.monotonic() + WRITE_MARGIN_S)
        if self._epoch() != epoch:
            return Status.UNKNOWN_CLIENT, now_ms
        liveness = self.liveness
        if liveness is not None and not liveness.is_alive(time.monotonic() + WRITE_MARGIN_S):
            return Status.TIMEOUT, now_ms
        return Status.OK, now_ms

    async def _revoke(self, keys: list[bytes]) -> None:
        try:
            await self.rpc.put_revoke(self.client_id, keys)
        except KVPoolError as exc:
            # The master reclaims them after put_start_discard_timeout anyway.
            logger.warning("put_revoke of %d keys failed: %s", len(keys), exc)

    async def _commit(self, written: list[int], keys: list[bytes], checksums: list[int] | None,
                      statuses: list[Status]) -> None:
        commit_keys = [keys[i] for i in written]
        commit_sums = [checksums[i] for i in written] if checksums is not None else None
        if self.commit_nowait and self.commits is not None:
            future = self.rpc.put_end_nowait(self.client_id, commit_keys, commit_sums)
            self.commits.watch_commit(commit_keys, future)
            return
        try:
            answers = await self.rpc.put_end(self.client_id, commit_keys, commit_sums)
            check_answers("PutEnd", answers, commit_keys)
        except KVPoolError as exc:
            answers = [exc.status] * len(written)
        for index, status in zip(written, answers, strict=True):
            if status not in (Status.OK, Status.ALREADY_EXISTS):
                statuses[index] = status

    # -- reads ------------------------------------------------------------------------------------

    async def read(self, keys: Sequence[bytes], dst_for: DstFor,
                   dst_sizes: Sequence[int] | None = None) -> list[int]:
        """Read objects into the regions ``dst_for(index, size_bytes)`` returns (or a Status to
        fail that key, e.g. BUFFER_OVERFLOW). Returns per key the bytes read, or a negative
        Status: NOT_FOUND, LEASE_EXPIRED, CHECKSUM_MISMATCH, TRANSFER_FAILED, ...

        With ``dst_sizes`` (the destination sizes, when known in advance) large batches are cut
        into sub-batches run concurrently, like writes. Raises KVPoolError only when every
        ``get_replicas`` failed.
        """
        spans = self._spans(dst_sizes) if dst_sizes is not None else [(0, len(keys))]
        if len(spans) == 1:
            return await self._read_batch(keys, dst_for)
        parts = await asyncio.gather(
            *(self._read_batch(keys[a:b], _shifted(dst_for, a)) for a, b in spans),
            return_exceptions=True)
        return [int(x) for x in _joined(parts, spans)]

    async def _get_replicas(self, keys: Sequence[bytes]
                            ) -> tuple[list[Any], float, dict[str, SegmentInfo]]:
        """``get_replicas``; return (its per-key results, the monotonic time by which the
        bytes must have been read, the descriptors of the segments they are on)."""
        sent = time.monotonic()
        results, lease_ttl_s = await self.rpc.get_replicas(self.client_id, keys)
        check_answers("GetReplicas", results, keys)
        need = [p.segment_id for r in results if r.status == Status.OK for p in r.placements]
        infos = await self.resolve(need) if need else {}
        return results, lease_deadline(sent, lease_ttl_s), infos

    async def _read_batch(self, keys: Sequence[bytes], dst_for: DstFor) -> list[int]:
        results, deadline, infos = await self._get_replicas(keys)
        out = [0] * len(keys)
        # job: (key index, candidate items in preference order); attempt n uses candidate n
        jobs: list[tuple[int, list[Item]]] = []
        for index, result in enumerate(results):
            if result.status != Status.OK:
                out[index] = int(result.status)
                continue
            dst = dst_for(index, result.size_bytes)
            if isinstance(dst, Status):
                out[index] = int(dst)
                continue
            candidates: list[Item] = [(infos[p.segment_id], p, dst) for p in result.placements
                                      if p.segment_id in infos]
            if not candidates:
                out[index] = int(Status.SEGMENT_NOT_FOUND)
                continue
            if len(candidates) > 1:
                candidates.sort(key=lambda item: not self._prefers(item[0]))
            jobs.append((index, candidates))
        attempt = 0
        while jobs:
            items = [candidates[attempt] for _, candidates in jobs]
            statuses = await self.transfer(items, writing=False)
            retry: list[tuple[int, list[Item]]] = []
            for (index, candidates), status in zip(jobs, statuses, strict=True):
                if status == Status.OK:
                    out[index] = self._check_read(results[index].size_bytes,
                                                  results[index].checksum, candidates[0][2],
                                                  deadline)
                elif attempt + 1 < len(candidates) and time.monotonic() < deadline:
                    retry.append((index, candidates))
                else:
                    out[index] = int(status)
            jobs = retry
            attempt += 1
        return out

    def _check_read(self, size_bytes: int, expected: int, dst: Sequence[memoryview],
                    deadline: float) -> int:
        if time.monotonic() > deadline:
            # The lease ran out while the bytes moved: they may have been overwritten.
            return int(Status.LEASE_EXPIRED)
        if expected and self.checksum_max_bytes and checksum(dst) != expected:
            return int(Status.CHECKSUM_MISMATCH)
        return size_bytes

    def _spans(self, sizes: Sequence[int]) -> list[tuple[int, int]]:
        """Sub-batches to run concurrently; one while master calls complete on the calling
        thread: there the batch is not waiting on the master and copies at once, and splitting
        it would move the call onto the loop (no polling, a loop wake-up per step)."""
        return [(0, len(sizes))] if self.rpc.blocks else pipeline_spans(sizes)

    # -- liveness hooks ---------------------------------------------------------------------------

    def _epoch(self) -> int:
        return self.liveness.epoch if self.liveness is not None else 0

    async def _wait_reregistered(self) -> None:
        await self._reregistered()


def pipeline_spans(sizes: Sequence[int]) -> list[tuple[int, int]]:
    """Cut a batch into ``[start, end)`` spans of about ``PIPELINE_MIN_BYTES`` or more, at most
    ``PIPELINE_MAX_PARTS`` of them (one span for small batches)."""
    total = sum(sizes)
    parts = min(PIPELINE_MAX_PARTS, total // PIPELINE_MIN_BYTES, len(sizes))
    if parts <= 1:
        return [(0, len(sizes))]
    share = total / parts
    spans: list[tuple[int, int]] = []
    start, acc = 0, 0
    for index, size in enumerate(sizes):
        acc += size
        if acc >= share * (len(spans) + 1) and len(spans) < parts - 1:
            spans.append((start, index + 1))
            start = index + 1
    spans.append((start, len(sizes)))
    return [span for span in spans if span[0] < span[1]]


def _shifted(dst_for: DstFor, start: int) -> DstFor:
    """``dst_for`` of a sub-batch that starts at index ``start`` of the whole batch."""
    def shifted(index: int, size_bytes: int) -> Regions | Status:
        return dst_for(start + index, size_bytes)
    return shifted


def _joined(parts: Sequence[object], spans: list[tuple[int, int]]) -> list[Any]:
    """Per-key results of sub-batches, in order; a sub-batch that raised fails its keys alone,
    unless every one raised (then the first error is raised, nothing having happened)."""
    errors = [p for p in parts if isinstance(p, BaseException)]
    if len(errors) == len(parts):
        raise errors[0]
    out: list[Any] = []
    for part, (start, end) in zip(parts, spans, strict=True):
        if isinstance(part, KVPoolError):
            out.extend([part.status] * (end - start))
        elif isinstance(part, BaseException):
            raise part
        else:
            assert isinstance(part, list)
            out.extend(part)
    return out


def split_sizes(total_bytes: int, max_bytes: int) -> list[int]:
    """Sizes of the segments that make up ``total_bytes`` (none for 0)."""
    if total_bytes <= 0:
        return []
    if max_bytes <= 0 or max_bytes >= total_bytes:
        return [total_bytes]
    full, rest = divmod(total_bytes, max_bytes)
    return [max_bytes] * full + ([rest] if rest else [])
