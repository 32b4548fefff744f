"""The asyncio driver: runs the core's plans on an event loop.

Rules of this file:
- Write: ``PutStart`` (again once re-registered, when the master no longer knew this client)
  -> copy every writable placement (shared memory and TCP parts concurrently) -> ``PutEnd``
  (sent without waiting when ``commit_nowait``: the master serves this client's later calls
  after it, so read-your-writes holds) ; ``PutRevoke`` for keys whose copy failed.
- Read: ``GetReplicas`` -> attempts as the plan says -> judged by the plan.
- Batches of at least twice ``PIPELINE_MIN_BYTES`` are cut into concurrent sub-batches (at
  most ``PIPELINE_MAX_PARTS``), so that master calls of one overlap the copies of another.
- Call-level failures (the master cannot be reached) raise KVPoolError before anything
  changed; everything after ``PutStart`` / ``GetReplicas`` ends up in per-key statuses.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

from kvpool_client.core.put_plan import PutPlan, answered_again, granted_any, space_refused
from kvpool_client.core.read_plan import DstFor, KeyReplicas, ReadItem, ReadPlan
from kvpool_client.core.regions import Regions
from kvpool_client.drivers.parts import Consumer, Done, Filler, Parts
from kvpool_client.rpc import MasterRpc
from kvpool_client.transfer.tcp_client import TcpTransport
from kvpool_wire.status import KVPoolError, Status
from kvpool_wire.types import PutOptions, SegmentInfo

logger = logging.getLogger(__name__)

PIPELINE_MIN_BYTES = 8 << 20
PIPELINE_MAX_PARTS = 2


class CommitWatcher(Protocol):
    """Where commits sent without waiting report (see asyncwrite.AsyncWriter.watch_commit)."""

    def watch_commit(self, keys: Sequence[bytes], future: asyncio.Future[list[Status]]) -> None: ...


class AsyncDataPath:
    """Moves objects between caller regions and the pool on an event loop."""

    def __init__(self, parts: Parts, rpc: MasterRpc, tcp: TcpTransport,
                 reregistered: Callable[[], Awaitable[None]],
                 remounted: Callable[[], Awaitable[bool]],
                 commits: CommitWatcher | None) -> None:
        self.parts = parts
        self.rpc = rpc
        self.tcp = tcp
        self._reregistered = reregistered
        #: waits for a re-registration under way to mount the segments again (False: none)
        self._remounted = remounted
        #: commits are sent without waiting and reported here (None: each write waits)
        self._commits = commits

    async def resolve(self, segment_ids: set[str]) -> dict[str, SegmentInfo]:
        """Every known descriptor, after asking the master for those of ``segment_ids`` not
        known yet."""
        parts = self.parts
        missing = parts.missing(segment_ids)
        return parts.learn(missing, await self.rpc.get_segments(missing) if missing else [])

    async def transfer(self, items: Sequence[ReadItem], *, writing: bool) -> list[Status]:
        """Move every item through its transport (shared memory, the engine and TCP
        concurrently)."""
        parts = self.parts
        statuses, jobs = parts.route(items)
        runs = [self._run_part(name, [items[i] for i in part], writing) for name, part in jobs]
        results = [await runs[0]] if len(runs) == 1 else await asyncio.gather(*runs)
        for (_, part), part_statuses in zip(jobs, results, strict=True):
            parts.merge(items, statuses, part, part_statuses)
        return statuses

    async def _run_part(self, name: str, chosen: list[ReadItem], writing: bool) -> list[Status]:
        started = time.perf_counter()
        engine = self.parts.engine
        if name in ("engine", "file"):  # blocking calls: on a worker thread
            files = self.parts.files
            call = (files.write_batch if writing else files.read_batch) if name == "file" \
                else (engine.write_batch if writing else engine.read_batch)  # type: ignore[union-attr]
            statuses = list(await asyncio.to_thread(call, chosen))
            self.parts.observe(name, writing, chosen, statuses, started)
            return statuses
        transport: Any = self.parts.shm if name == "shm" else self.tcp
        if writing:
            statuses = await transport.write_batch(chosen)
        else:
            statuses = await transport.read_batch(chosen)
        self.parts.observe(name, writing, chosen, statuses, started)
        return list(statuses)

    # -- writes -----------------------------------------------------------------------------------

    async def write(self, keys: list[bytes], regions: list[Regions], sizes: list[int],
                    options: PutOptions) -> list[Status]:
        """Write distinct keys of non-empty regions; one Status per key (ALREADY_EXISTS is OK).
        Raises KVPoolError only when every ``PutStart`` failed: then nothing was written."""
        spans = pipeline_spans(sizes)
        if len(spans) == 1:
            return await self._write(keys, regions, sizes, options)
        results = await asyncio.gather(
            *(self._write(keys[a:b], regions[a:b], sizes[a:b], options) for a, b in spans),
            return_exceptions=True)
        return joined(results, spans)

    async def _write(self, keys: list[bytes], regions: list[Regions], sizes: list[int],
                     options: PutOptions) -> list[Status]:
        plan = self.parts.put_plan(keys, regions, sizes)
        epoch = await self._start(plan, options)
        if plan.placements:
            jobs = plan.writable(await self.resolve(plan.segment_ids), self.parts.window(epoch))
            if jobs:
                items = [(info, placement, regions[index]) for _, index, info, placement in jobs]
                plan.copied(jobs, await self.transfer(items, writing=True))
            await self._settle(plan)
        return plan.statuses

    async def write_with(self, keys: list[bytes], sizes: list[int], options: PutOptions,
                         fill: Filler, done: Done | None = None) -> list[Status]:
        """Like ``write``, with ``fill`` moving the bytes (see ``parts``)."""
        plan = self.parts.put_plan(keys, None, sizes)
        epoch = await self._start(plan, options)
        if not plan.placements:
            return plan.statuses
        jobs = plan.writable(await self.resolve(plan.segment_ids), self.parts.window(epoch))
        with contextlib.ExitStack() as borrowed:
            remote = self.parts.fill(plan, jobs, fill, done, borrowed)
        if remote:
            self.parts.sent(plan, remote,
                            await self.transfer([item for _, item in remote], writing=True))
        await self._settle(plan)
        return plan.statuses

    async def _start(self, plan: PutPlan, options: PutOptions) -> int:
        """Send ``PutStart`` (again once re-registered, when the master no longer knew this
        client); return the epoch the placements were granted in."""
        parts, rpc = self.parts, self.rpc
        epoch = parts.epoch
        answers = await rpc.put_start(parts.client_id, plan.keys, plan.sizes, options)
        if answers and all(status == Status.UNKNOWN_CLIENT for status, _ in answers):
            await self._reregistered()
            epoch = parts.epoch
            answers = await rpc.put_start(parts.client_id, plan.keys, plan.sizes, options)
        refused = space_refused(answers)
        if refused and await self._remounted():
            # Asked while this client's segments were being mounted again: ask once more.
            if not granted_any(answers):
                epoch = parts.epoch
            again = await rpc.put_start(parts.client_id, [plan.keys[i] for i in refused],
                                        [plan.sizes[i] for i in refused], options)
            answers = answered_again(answers, refused, again)
        plan.started(answers)
        return epoch

    async def _settle(self, plan: PutPlan) -> None:
        """Revoke the keys whose copy failed, commit the rest."""
        client_id = self.parts.client_id
        revoke = plan.revoke_keys()
        if revoke:
            try:
                await self.rpc.put_revoke(client_id, revoke)
            except KVPoolError as exc:
                # The master reclaims them after put_start_discard_timeout anyway.
                logger.warning("put_revoke of %d keys failed: %s", len(revoke), exc)
        indices = plan.commit_indices()
        if not indices:
            return
        keys = [plan.keys[i] for i in indices]
        checksums = plan.commit_checksums(indices)
        if self._commits is not None:
            self._commits.watch_commit(keys, self.rpc.put_end_nowait(client_id, keys, checksums))
            return
        try:
            plan.committed(indices, await self.rpc.put_end(client_id, keys, checksums))
        except KVPoolError as exc:
            plan.failed(indices, exc.status)

    # -- reads ------------------------------------------------------------------------------------

    async def read(self, keys: Sequence[bytes], dst_for: DstFor,
                   dst_sizes: Sequence[int] | None = None) -> list[int]:
        """Read objects into the regions ``dst_for(index, size_bytes)`` returns (or a Status to
        fail that key). Per key the bytes read, or a negative Status. With ``dst_sizes`` (known
        in advance) large batches are cut into concurrent sub-batches, like writes. Raises
        KVPoolError only when every ``GetReplicas`` failed."""
        spans = pipeline_spans(dst_sizes) if dst_sizes is not None else [(0, len(keys))]
        if len(spans) == 1:
            return await self._read(keys, dst_for)
        results = await asyncio.gather(
            *(self._read(keys[a:b], _shifted(dst_for, a)) for a, b in spans),
            return_exceptions=True)
        return [int(x) for x in joined(results, spans)]

    async def replicas(self, keys: Sequence[bytes]) -> list[KeyReplicas]:
        """Where each object lies (``ReadPlan.replicas``); the read lease the lookup took is
        given back at once, as nothing is read."""
        plan, infos = await self._grant(keys)
        self.rpc.session.end_lease(*plan.lease())
        return plan.replicas(infos)

    async def _grant(self, keys: Sequence[bytes]) -> tuple[ReadPlan, dict[str, SegmentInfo]]:
        plan = self.parts.read_plan(keys)
        sent_s = time.monotonic()
        answer = await self.rpc.get_replicas(self.parts.client_id, keys)
        plan.granted(answer.results, sent_s, answer.lease_ttl_s, answer.lease_ids)
        needed = plan.segment_ids
        return plan, (await self.resolve(needed) if needed else {})

    async def _read(self, keys: Sequence[bytes], dst_for: DstFor) -> list[int]:
        plan, infos = await self._grant(keys)
        plan.choose(infos, dst_for, self.parts.prefers)
        while items := plan.attempt():
            statuses = await self.transfer(items, writing=False)
            plan.attempted(statuses, time.monotonic())
        self.rpc.session.end_lease(*plan.lease())
        return plan.results

    async def read_with(self, keys: Sequence[bytes], consume: Consumer,
                        done: Done | None = None) -> list[int]:
        """Like ``read``, with ``consume`` taking the bytes (see ``parts``); LEASE_EXPIRED
        when the lease ran out before ``consume`` and ``done`` returned."""
        plan, infos = await self._grant(keys)
        with contextlib.ExitStack() as borrowed:  # same-host replicas stay mapped until done
            views, remote = self.parts.borrow_replicas(plan, infos, borrowed)
            if remote:
                self.parts.received(plan, views, remote, await self.transfer(
                    [item for _, item in remote], writing=False))
            self.parts.consume(plan, views, consume, done)
        self.rpc.session.end_lease(*plan.lease())
        return plan.results


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


def joined(results: Sequence[object], spans: list[tuple[int, int]]) -> list[Any]:
    """Per-key results of sub-batches, in order; a sub-batch that raised fails its keys alone,
    unless every one raised (then the first error is raised, nothing having happened)."""
    errors = [p for p in results if isinstance(p, BaseException)]
    if len(errors) == len(results):
        raise errors[0]
    out: list[Any] = []
    for part, (start, end) in zip(results, spans, strict=True):
        if isinstance(part, KVPoolError):
            out.extend([part.status] * (end - start))
        elif isinstance(part, BaseException):
            raise part
        else:
            assert isinstance(part, list)
            out.extend(part)
    return out
