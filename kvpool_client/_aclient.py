"""AsyncKVPoolClient: the client on an event loop, and the owner of a client's lifecycle (the
sync client runs its start, close and async writes on a loop thread of its own).

Rules of this file:
- Every public call is normalised into one batch of distinct keys (``api``, ``core.keys``) and
  handed to the asyncio driver (``drivers.aio``); single-key forms are thin wrappers that
  raise KVPoolError, batch forms return one Status (or int) per key.
- Start: remove shared memory left by dead processes, create the segments, serve them
  (data server refusing everything until the master's key is known), register, mount, start
  heartbeating. Close undoes it in reverse and reports async writes that failed.
- Nothing is tied to the thread that created the client: the sync facade may be called from
  any thread (MindIE puts from a background thread).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import time
from collections.abc import Sequence
from typing import Any

from kvpool_client.api import (
    ReadRequest,
    SizedRequest,
    WriteRequest,
    attempt,
    each_position,
    key_batch,
    same_length,
    slices,
)
from kvpool_client.asyncwrite import AsyncWriter
from kvpool_client.buffers import (
    BufferRegistry,
    KeyLike,
    Regions,
    byte_view,
    regions_of,
    slice_view,
    to_key,
)
from kvpool_client.config import ClientConfig
from kvpool_client.drivers.aio import AsyncDataPath
from kvpool_client.drivers.blocking import BlockingDataPath
from kvpool_client.drivers.parts import Consumer, Done, Filler, Parts
from kvpool_client.liveness import Liveness, MasterAddress, register_waiting
from kvpool_client.metrics import ClientMetrics
from kvpool_client.rpc import MasterRpc, MasterSession
from kvpool_client.segments import LocalSegment, cleanup_stale_segments, host_id, split_sizes
from kvpool_client.transfer.copy import ParallelCopier
from kvpool_client.transfer.shm import ShmTransport
from kvpool_client.transfer.tcp import DataServer
from kvpool_client.transfer.tcp_blocking import BlockingTcpTransport
from kvpool_client.transfer.tcp_client import TcpTransport
from kvpool_wire.status import KVPoolError, Status
from kvpool_wire.types import PutOptions, SegmentInfo

logger = logging.getLogger(__name__)

_OK_STATUSES = (Status.OK, Status.ALREADY_EXISTS)
#: ``"checksum": "auto"`` checksums objects up to this size: hashing them costs little beside
#: the call itself (README, "Checksums").
CHECKSUM_AUTO_MAX_BYTES = 256 << 10


def checksum_max_bytes(setting: bool | str) -> int:
    """The largest object a put checksums under the ``checksum`` setting (0: none)."""
    if setting == "auto":
        return CHECKSUM_AUTO_MAX_BYTES
    return (1 << 63) if setting else 0


class AsyncKVPoolClient:
    """A kvpool client on the running event loop. Build, then ``await start()`` (or use
    ``async with``, or ``await AsyncKVPoolClient.from_config(path)``)."""

    def __init__(self, config: ClientConfig) -> None:
        self.config = config
        self.metrics = ClientMetrics()
        self.buffers = BufferRegistry()
        name = config.client_id or f"{socket.gethostname()[:32]}-{os.getpid()}-" \
                                   f"{secrets.token_hex(4)}"
        self.client_id = name
        self.host_id = host_id()
        self._master = MasterAddress.of(config)
        self._session = MasterSession()  # this client's token and master clock, for all stubs
        self._segments: dict[str, LocalSegment] = {}
        self._server: DataServer | None = None
        self._rpc: MasterRpc | None = None
        self._liveness: Liveness | None = None
        self.parts: Parts | None = None
        self._datapath: AsyncDataPath | None = None
        self._writer: AsyncWriter | None = None
        self._metrics_server: Any = None
        self._default_options = PutOptions(replica_num=config.replica_num,
                                           preferred_segment=config.preferred_segment,
                                           prefer_same_host=config.prefer_alloc_in_same_node)
        self._rpc_epoch = 0
        self._background: set[asyncio.Task[None]] = set()
        self._started = False
        self._registered = False
        self._closed = False

    # -- lifecycle --------------------------------------------------------------------------------

    @classmethod
    async def from_config(cls, path: str | None = None) -> AsyncKVPoolClient:
        """Return a started client configured by the JSON file ``path`` (default: the file named
        by KVPOOL_CONFIG_PATH or MOONCAKE_CONFIG_PATH). Raises KVPoolError (INVALID_ARGUMENT for
        a bad config, RPC_FAILED / TIMEOUT when the master cannot be reached)."""
        config = ClientConfig.from_file(path) if path else ClientConfig.from_env()
        client = cls(config)
        await client.start()
        return client

    async def start(self) -> None:
        """Create and serve the segments, register with the master and mount them.

        Raises KVPoolError (RPC_FAILED / TIMEOUT when the master cannot be reached,
        NO_SPACE when /dev/shm cannot hold the segments, ...); nothing is left behind then.
        """
        if self._started:
            return
        self._started = True
        try:
            await self._start()
        except BaseException:
            await self._shutdown()
            raise

    async def _start(self) -> None:
        config = self.config
        removed = cleanup_stale_segments(config.cluster_id)
        if removed:
            logger.info("removed %d stale segments of cluster %s", len(removed), config.cluster_id)
        for index, size_bytes in enumerate(split_sizes(config.global_segment_size,
                                                       config.max_segment_size)):
            # Pre-faulting takes ~0.15 s per GiB: keep the event loop free meanwhile.
            segment = await asyncio.to_thread(LocalSegment.create, config.cluster_id,
                                              self.client_id, index, size_bytes)
            self._segments[segment.segment_id] = segment
        if self._segments:
            # Refuses every request until the master's key for this client is installed.
            session = self._session
            self._server = DataServer(self._segments, secrets.token_bytes(32),
                                      host=config.data_host,
                                      frame_timeout_s=config.transfer_timeout_s,
                                      clock=lambda: session.clock,
                                      idle_timeout_s=config.data_idle_timeout_s,
                                      max_connections_per_peer=(
                                          config.data_max_connections_per_peer))
            self._server.start()
            self.metrics.watch_refusals(self._refusals)
        self._rpc = rpc = self._master.stub(session=self._session)
        registration = await register_waiting(rpc, self.client_id, self.host_id, self.hostname)
        self._registered = True
        if self._server is not None:
            self._server.capability_key = registration.capability_key
        self._stamp_segments(registration.capability_key)
        descriptors = self._descriptors()
        for descriptor in descriptors:
            status = await rpc.mount_segment(self.client_id, descriptor)
            if status not in _OK_STATUSES:
                # SEGMENT_ALREADY_EXISTS: another live client mounted a segment of this id.
                raise KVPoolError(status, f"mounting segment {descriptor.segment_id} failed")
        self._writer = AsyncWriter(self._write_normalised, config.async_write_queue_size,
                                   self.metrics)
        self._liveness = Liveness(
            master=self._master, session=self._session, client_id=self.client_id,
            host_id=self.host_id, hostname=self.hostname, registration=registration,
            registered_at=registration.clock.sent_s,
            segments=self._descriptors, set_serving_key=self._set_serving_key,
            stamp_segments=self._stamp_segments,
            interval_s=config.heartbeat_interval_s, metrics=self.metrics)
        self.parts = Parts(
            client_id=self.client_id, local_host_id=self.host_id, transport=config.transport,
            shm=ShmTransport(self._segments, copier=ParallelCopier(
                config.copy_threads or copy_threads())),
            checksum_max_bytes=checksum_max_bytes(config.checksum), metrics=self.metrics,
            liveness=self._liveness, session=self._session)
        self.parts.remember(descriptors)
        self._datapath = AsyncDataPath(
            self.parts, rpc, TcpTransport(timeout_s=config.transfer_timeout_s),
            reregistered=self._reregistered,
            commits=self._writer if config.commit_nowait else None)
        self._liveness.start()
        if config.metrics_port >= 0:
            self._start_metrics_server(config.metrics_port, config.metrics_host)
        logger.info("client %s joined %s with %d segments (%d bytes), data server %s",
                    self.client_id, config.master_server_address, len(self._segments),
                    config.global_segment_size, self.hostname)

    async def close(self) -> None:
        """Flush async writes, leave the pool (segments unmounted, objects on them dropped) and
        free every resource. Idempotent.

        Raises KVPoolError when async writes failed (after everything was closed).
        """
        if self._closed:
            return
        self._closed = True
        failure: KVPoolError | None = None
        if self._writer is not None:
            try:
                await self._writer.close()
                self._writer.raise_failures()
            except KVPoolError as exc:
                failure = exc
        await self._shutdown()
        if failure is not None:
            raise failure

    async def _shutdown(self) -> None:
        if self._liveness is not None:
            await asyncio.to_thread(self._liveness.stop)
        if self._rpc is not None and self._registered:
            await self._leave(self._rpc)
        if self._server is not None:
            await asyncio.to_thread(self._server.close)
        if self._datapath is not None:
            await self._datapath.parts.shm.close()
            await self._datapath.tcp.close()
        if self._rpc is not None:
            await self._rpc.close()
        for segment in self._segments.values():
            segment.close()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
            self._metrics_server = None

    async def _leave(self, rpc: MasterRpc) -> None:
        """Tell the master this client is gone, so its objects go now and not after client_ttl
        (an unreachable master expires it after client_ttl instead)."""
        try:
            await rpc.unregister_client(self.client_id)
        except KVPoolError as exc:
            logger.warning("leaving the pool: the master did not answer (%s); it expires this "
                           "client after client_ttl", exc)

    async def __aenter__(self) -> AsyncKVPoolClient:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if exc_info[0] is None:
            await self.close()
            return
        try:
            await self.close()
        except KVPoolError as exc:  # never mask the exception already in flight
            logger.error("close after an error: %s", exc)

    # -- identity ---------------------------------------------------------------------------------

    @property
    def hostname(self) -> str:
        """``"ip:port"`` of this client's data server (``local_hostname`` when it serves none)."""
        return self._server.endpoint if self._server is not None else self.config.local_hostname

    @property
    def segment_ids(self) -> list[str]:
        """Ids of the segments this client contributes."""
        return list(self._segments)

    def blocking_path(self) -> BlockingDataPath:
        """A blocking driver over this started client's parts, for the sync client (its own
        master stub and TCP connections; the same segments, mappings and liveness)."""
        parts, liveness = self.parts, self._liveness
        if parts is None or liveness is None:
            raise KVPoolError(Status.UNAVAILABLE, "the client is not started")
        return BlockingDataPath(
            parts, self._master.blocking_stub(self._session),
            BlockingTcpTransport(timeout_s=self.config.transfer_timeout_s),
            membership=liveness, host_id=self.host_id, hostname=self.hostname,
            reregister_timeout_s=self.config.rpc_timeout_s * 2)

    def _descriptors(self) -> list[SegmentInfo]:
        endpoint = self._server.endpoint if self._server is not None else ""
        return [s.describe(self.host_id, endpoint) for s in self._segments.values()]

    def _stamp_segments(self, key: bytes) -> None:
        """Write the ownership proof of ``key`` into every segment (before mounting them)."""
        for segment in self._segments.values():
            segment.stamp_owner(key)

    def _set_serving_key(self, key: bytes) -> None:
        if self._server is not None:
            self._server.capability_key = key  # a plain attribute read at every request

    def _refusals(self) -> dict[str, int]:
        server = self._server
        if server is None:
            return {}
        return {"refused": server.refused_total, "bad_frame": server.bad_frames_total,
                "timeout": server.timeouts_total,
                "too_many_connections": server.connections_rejected_total,
                "unproven_connection_closed": server.connections_evicted_total}

    # -- plumbing ---------------------------------------------------------------------------------

    def _path(self) -> AsyncDataPath:
        datapath = self._datapath
        if datapath is None or self._closed:
            raise KVPoolError(Status.UNAVAILABLE, "the client is closed" if self._closed
                              else "the client is not started")
        liveness = self._liveness
        if liveness is not None and liveness.epoch != self._rpc_epoch:
            self._rpc_epoch = liveness.epoch
            task = asyncio.get_running_loop().create_task(self._refresh_rpc())
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        return datapath

    async def _refresh_rpc(self) -> None:
        """After a re-registration, let this loop's stub learn the master's (new) fast port.

        Registering again is idempotent for a known client (same key). Should the master have
        forgotten this client once more meanwhile, the key differs: liveness re-registers.
        """
        if self._rpc is None or self._liveness is None:
            return
        try:
            registration = await self._rpc.register_client(self.client_id, self.host_id,
                                                           self.hostname)
        except KVPoolError as exc:
            logger.debug("refreshing the master stub failed: %s", exc)
            return
        if registration.capability_key != self._liveness.registration.capability_key:
            self._liveness.request_reregister()

    async def _reregistered(self) -> None:
        """Wait for liveness to re-register this client (a call answered UNKNOWN_CLIENT)."""
        liveness = self._liveness
        if liveness is None:
            raise KVPoolError(Status.UNKNOWN_CLIENT, "the master does not know this client")
        timeout_s = self.config.rpc_timeout_s * 2
        try:
            await asyncio.wait_for(asyncio.wrap_future(liveness.request_reregister()), timeout_s)
        except TimeoutError:
            raise KVPoolError(Status.UNKNOWN_CLIENT, "the master does not know this client and "
                              f"re-registration did not finish within {timeout_s:g} s") from None
        await self._refresh_rpc()

    def options(self, options: PutOptions | None) -> PutOptions:
        """``options``, or the configured defaults when None."""
        return self._default_options if options is None else options

    async def _write_normalised(self, keys: list[bytes], regions: list[Regions],
                                options: PutOptions) -> list[Status]:
        """Write distinct keys with non-empty regions; one Status per key. (The async writer's
        write: it still runs while ``close`` drains the queue.)"""
        datapath = self._datapath
        if datapath is None:
            raise KVPoolError(Status.UNAVAILABLE, "the client is not started")
        return await datapath.write(keys, regions, [sum(v.nbytes for v in r) for r in regions],
                                    options)

    async def _put_many(self, op: str, keys: Sequence[KeyLike], regions: list[Regions | None],
                        options: PutOptions | None, async_write: bool) -> list[Status]:
        """Write a batch (``regions[i]`` None: unusable); one Status per key."""
        started = time.perf_counter()
        request = WriteRequest(keys, regions)
        batch = request.batch
        datapath = self._path()
        resolved = self.options(options)
        sent: list[Status] = []
        if batch.keys:
            if async_write:
                assert self._writer is not None
                await self._writer.submit(batch.keys, batch.values, resolved)
                sent = [Status.OK] * len(batch.keys)
            else:
                try:
                    sent = await datapath.write(batch.keys, batch.values, request.sizes, resolved)
                except KVPoolError as exc:
                    sent = [exc.status] * len(batch.keys)
        statuses = request.finish(sent)
        self.metrics.observe_op(op, time.perf_counter() - started)
        self.metrics.count_failures(op, statuses)
        return statuses

    async def _put_one(self, op: str, key: KeyLike, parts: Regions, options: PutOptions | None,
                       async_write: bool) -> None:
        """Single-key put; raises KVPoolError with the reason."""
        (status,) = await self._put_many(op, [key], [parts], options, async_write)
        if status not in _OK_STATUSES:
            raise KVPoolError(status, f"{op} of key {key!r:.80} failed")

    async def _read_many(self, op: str, keys: Sequence[KeyLike],
                         dsts: Sequence[Regions | Status] | None) -> tuple[list[int], ReadRequest]:
        """Read keys into ``dsts`` (or fresh bytes when None). Returns (per key bytes read or a
        negative Status, the request, which holds the fresh bytes)."""
        started = time.perf_counter()
        request = ReadRequest(keys, dsts)
        results: list[int] = []
        if request.batch.keys:
            datapath = self._path()
            try:
                results = await datapath.read(request.batch.keys, request.dst_for,
                                              request.dst_sizes)
            except KVPoolError as exc:
                results = [int(exc.status)] * len(request.batch.keys)
        out = request.finish(results)
        self.metrics.observe_op(op, time.perf_counter() - started)
        self.metrics.count_lookups(len(keys), sum(1 for r in out if r >= 0))
        self.metrics.count_failures(op, [Status(r) for r in out if r < 0])
        return out, request

    async def _read_one(self, op: str, key: KeyLike, dst: Regions | None) -> tuple[int, bytes]:
        """Single-key read; returns (bytes read, fresh bytes when ``dst`` is None). Raises
        KVPoolError (NOT_FOUND, LEASE_EXPIRED, BUFFER_OVERFLOW, ...)."""
        to_key(key)  # a bad key raises rather than failing in the batch
        (result,), request = await self._read_many(op, [key], None if dst is None else [dst])
        if result < 0:
            raise KVPoolError(Status(result), f"{op} of key {key!r:.80} failed")
        return result, request.fresh.get(0, b"")

    # -- writes -----------------------------------------------------------------------------------

    async def put(self, key: KeyLike, data: Any, *, options: PutOptions | None = None,
                  async_write: bool = False) -> None:
        """Store ``data`` (any buffer) under ``key``; an existing key keeps its first value.

        With ``async_write`` the put is queued (waiting while the queue is full) and ``data``
        must stay unchanged until ``flush()``. Raises KVPoolError: INVALID_KEY,
        INVALID_ARGUMENT, NO_SPACE, TRANSFER_FAILED, TIMEOUT, RPC_FAILED, ...
        """
        await self._put_one("put", key, [byte_view(data)], options, async_write)

    async def put_from(self, key: KeyLike, buf: Any, offset: int, size: int, *,
                       options: PutOptions | None = None, async_write: bool = False) -> None:
        """Store ``buf[offset:offset+size]`` under ``key`` (zero-copy from the caller's buffer;
        registering it first saves re-deriving its view). Raises KVPoolError like put."""
        view = slice_view(self.buffers.view(buf), offset, size)
        await self._put_one("put_from", key, [view], options, async_write)

    async def put_batch(self, keys: Sequence[KeyLike], datas: Sequence[Any], *,
                        options: PutOptions | None = None,
                        async_write: bool = False) -> list[Status]:
        """Store each ``datas[i]`` under ``keys[i]``; one Status per key (OK when stored or
        already there)."""
        same_length(keys, datas)
        return await self._put_many("put_batch", keys, [attempt(byte_view, d) for d in datas],
                                    options, async_write)

    async def batch_put_from(self, keys: Sequence[KeyLike], bufs: Any, offsets: Sequence[int],
                             sizes: Sequence[int], *, options: PutOptions | None = None,
                             async_write: bool = False) -> list[Status]:
        """Store ``buf[offsets[i]:offsets[i]+sizes[i]]`` under ``keys[i]``, where ``bufs`` is one
        buffer for every key or a list with one buffer per key. One Status per key."""
        views = slices(self.buffers, keys, bufs, offsets, sizes, writable=False)
        return await self._put_many("batch_put_from", keys, views, options, async_write)

    async def batch_put_regions(self, keys: Sequence[KeyLike], regions: Sequence[Sequence[Any]],
                                options: PutOptions | None = None,
                                async_write: bool = False) -> list[Status]:
        """Store, per key, the concatenation of its regions (scatter-gather, zero-copy).
        One Status per key."""
        same_length(keys, regions)
        return await self._put_many("batch_put_regions", keys,
                                    [attempt(regions_of, r) for r in regions], options,
                                    async_write)

    async def batch_put_with(self, keys: Sequence[KeyLike], sizes: Sequence[int],
                             fill: Filler, options: PutOptions | None = None,
                             done: Done | None = None) -> list[Status]:
        """Store objects of ``sizes`` bytes that ``fill(index, view)`` writes, e.g. by device
        DMA, into each placement: on this host the segment's own memory, else a host buffer
        sent afterwards. ``fill`` must write all of ``view``; it may leave its copy in flight
        when ``done()`` is given, which is called once after every fill and before anything is
        committed or sent. One Status per key; a key whose ``fill`` raised fails alone
        (TRANSFER_FAILED; every filled key when ``done`` raised) and is never committed; a
        size that is not a positive int is INVALID_ARGUMENT; a repeated key is filled once
        (its first position) and reports that key's status."""
        request = SizedRequest(keys, sizes)
        batch = request.batch
        return await self._with("batch_put_with", batch, self._path().write_with(
            batch.keys, batch.values, self.options(options),
            lambda i, view: fill(request.position_of(i), view), done) if batch.keys else None)

    async def batch_get_with(self, keys: Sequence[KeyLike], consume: Consumer,
                             done: Done | None = None) -> list[int]:
        """Hand each object to ``consume(index, view)`` (e.g. device DMA out of it): on this
        host the segment's own memory, else a host buffer read first; with ``done``, consume
        may leave its copy in flight until ``done()``, called once after every consume. Per key
        the object's size, or a negative Status; LEASE_EXPIRED when the read lease ran out
        before ``consume`` (and ``done``) returned: what it took may have been overwritten and
        must be discarded. A repeated key is consumed for each of its positions."""
        batch = key_batch(keys)
        consume_all = each_position(batch, consume)
        out = [int(s) for s in await self._with(
            "batch_get_with", batch,
            self._path().read_with(batch.keys, consume_all, done) if batch.keys else None)]
        self.metrics.count_lookups(len(out), sum(1 for n in out if n >= 0))
        return out

    def pin_shared_memory(self, pin: Any, unpin: Any) -> None:
        """Run ``pin(view)`` on every shared-memory segment this client maps (its own too),
        now and later, and ``unpin(view)`` before one is unmapped: e.g. registering them with
        a device runtime so that ``batch_put_with`` / ``batch_get_with`` copies are DMA."""
        self._path().parts.shm.pin_mappings(pin, unpin)

    async def _with(self, op: str, batch: Any, call: Any) -> list[Any]:
        """Await ``call`` (None when no key is left) and spread its per-key results."""
        started = time.perf_counter()
        results: list[Any] = []
        if call is not None:
            try:
                results = await call
            except KVPoolError as exc:
                results = [exc.status] * len(batch.keys)
        statuses: list[Any] = batch.spread(results)
        self.metrics.observe_op(op, time.perf_counter() - started)
        self.metrics.count_failures(op, [int(s) for s in statuses])
        return statuses

    # -- reads ------------------------------------------------------------------------------------

    async def get(self, key: KeyLike) -> bytes | None:
        """Return the object's bytes, or None when the key does not exist. Raises KVPoolError
        (LEASE_EXPIRED, CHECKSUM_MISMATCH, TRANSFER_FAILED, RPC_FAILED, INVALID_KEY, ...)."""
        try:
            return (await self._read_one("get", key, None))[1]
        except KVPoolError as exc:
            if exc.status == Status.NOT_FOUND:
                return None
            raise

    async def get_into(self, key: KeyLike, buf: Any, offset: int, size: int) -> int:
        """Read the object into ``buf[offset:offset+size]``; return its size in bytes.

        Raises KVPoolError: NOT_FOUND, BUFFER_OVERFLOW (the object is larger than ``size``),
        INVALID_ARGUMENT (range outside the buffer, read-only buffer), LEASE_EXPIRED, ...
        """
        view = slice_view(self.buffers.view(buf, writable=True), offset, size)
        return (await self._read_one("get_into", key, [view]))[0]

    async def get_batch(self, keys: Sequence[KeyLike]) -> list[bytes | None]:
        """Return each object's bytes, None where the key is missing or its read failed (the
        failures are counted in metrics by status)."""
        out, request = await self._read_many("get_batch", keys, None)
        return request.objects(out)

    async def batch_get_into(self, keys: Sequence[KeyLike], bufs: Any, offsets: Sequence[int],
                             sizes: Sequence[int]) -> list[int]:
        """Read ``keys[i]`` into ``buf[offsets[i]:offsets[i]+sizes[i]]`` (``bufs`` as in
        batch_put_from); per key the bytes read, or a negative Status (NOT_FOUND,
        BUFFER_OVERFLOW, LEASE_EXPIRED, ...)."""
        views = slices(self.buffers, keys, bufs, offsets, sizes, writable=True)
        dsts: list[Regions | Status] = [v if v is not None else Status.INVALID_ARGUMENT
                                        for v in views]
        return (await self._read_many("batch_get_into", keys, dsts))[0]

    async def batch_get_regions(self, keys: Sequence[KeyLike],
                                regions: Sequence[Sequence[Any]]) -> list[int]:
        """Read each object into its regions, in order; per key the object's size in bytes, or
        a negative Status (BUFFER_OVERFLOW when the regions hold less than the object)."""
        same_length(keys, regions)
        dsts: list[Regions | Status] = []
        for parts in regions:
            views = attempt(regions_of, parts, writable=True)
            dsts.append(views if views is not None else Status.INVALID_ARGUMENT)
        return (await self._read_many("batch_get_regions", keys, dsts))[0]

    # -- lookups and removal ----------------------------------------------------------------------

    async def batch_exists(self, keys: Sequence[KeyLike]) -> list[bool]:
        """Per key, True when it exists (READY). Raises KVPoolError when the master cannot be
        reached, INVALID_KEY for a bad key."""
        raws = [to_key(k) for k in keys]
        started = time.perf_counter()
        statuses, _ = await self._path().rpc.exist(self.client_id, raws)
        self.metrics.observe_op("exists", time.perf_counter() - started)
        found = [s == Status.OK for s in statuses]
        self.metrics.count_lookups(len(raws), sum(found))
        return found

    async def exists(self, key: KeyLike) -> bool:
        """True when ``key`` exists. Raises KVPoolError like batch_exists."""
        return (await self.batch_exists([key]))[0]

    async def get_size(self, key: KeyLike) -> int | None:
        """The object's size in bytes, or None when it does not exist."""
        statuses, sizes = await self._path().rpc.exist(self.client_id, [to_key(key)])
        return sizes[0] if statuses[0] == Status.OK else None

    async def query_prefix(self, keys: Sequence[KeyLike]) -> int:
        """The number of leading keys that exist (each of them gets a read lease)."""
        raws = [to_key(k) for k in keys]
        started = time.perf_counter()
        num_ready = await self._path().rpc.query_prefix(self.client_id, raws)
        self.metrics.observe_op("query_prefix", time.perf_counter() - started)
        self.metrics.count_lookups(len(raws), num_ready)
        return num_ready

    async def batch_remove(self, keys: Sequence[KeyLike], force: bool = False) -> list[Status]:
        """Remove keys; per key OK, NOT_FOUND, HAS_LEASE (read lease live; unless ``force``)."""
        batch = key_batch(keys)
        answers: list[Status] = []
        if batch.keys:
            answers = await self._path().rpc.remove(self.client_id, batch.keys, force)
        return batch.spread(answers)

    async def remove(self, key: KeyLike, force: bool = False) -> None:
        """Remove ``key``. Raises KVPoolError NOT_FOUND, HAS_LEASE (unless ``force``), ..."""
        (status,) = await self.batch_remove([key], force)
        if status != Status.OK:
            raise KVPoolError(status, f"remove of key {key!r:.80} failed")

    async def remove_all(self, force: bool = False) -> int:
        """Remove every object (leased ones only with ``force``); returns how many went."""
        return await self._path().rpc.remove_all(self.client_id, force)

    async def remove_by_regex(self, pattern: str, force: bool = False) -> int:
        """Remove objects whose key (decoded as UTF-8) matches ``pattern``; returns how many.
        Raises KVPoolError INVALID_ARGUMENT for a bad pattern."""
        return await self._path().rpc.remove_by_regex(self.client_id, pattern, force)

    # -- buffers, async writes, metrics -----------------------------------------------------------

    async def register_buffer(self, buf: Any) -> None:
        """Register a buffer used by put_from/get_into (optional; saves deriving its view)."""
        self.buffers.register(buf)

    async def unregister_buffer(self, buf: Any) -> None:
        """Forget a registered buffer. Raises KVPoolError INVALID_ARGUMENT if it was not."""
        self.buffers.unregister(buf)

    async def flush(self, timeout_s: float | None = None) -> None:
        """Wait for async writes and pipelined commits. Raises KVPoolError TIMEOUT, or the first
        failure's status with the number of writes that failed since the last flush."""
        if self._writer is None:
            raise KVPoolError(Status.UNAVAILABLE, "the client is not started")
        await self._writer.flush(timeout_s)

    async def start_metrics_server(self, port: int, host: str = "127.0.0.1") -> int:
        """Serve this client's metrics on ``http://host:port/metrics``; returns the port."""
        return self._start_metrics_server(port, host)

    def _start_metrics_server(self, port: int, host: str) -> int:
        from prometheus_client import start_http_server

        if self._metrics_server is not None:
            raise KVPoolError(Status.INVALID_ARGUMENT, "the metrics server already runs")
        server, _thread = start_http_server(port, addr=host, registry=self.metrics.registry)
        self._metrics_server = server
        return int(server.server_port)


def copy_threads() -> int:
    """Threads that copy one large shared-memory batch (the caller counted, when it takes
    part), for config ``copy_threads: 0``: one per four cores this process may run on, at
    least two and at most four (README, "Data plane", has the measurements behind it)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        cpus = os.cpu_count() or 1
    return 1 if cpus < 2 else min(4, max(2, cpus // 4))
