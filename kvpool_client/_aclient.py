"""AsyncKVPoolClient: the client on an event loop (the sync client runs its start, close and
async writes on a loop thread of its own).

Rules of this file:
- Every public call is normalised into one batch of distinct keys (``api``, ``core.keys``) and
  handed to the asyncio driver (``drivers.aio``); single-key forms are thin wrappers that
  raise KVPoolError, batch forms return one Status (or int) per key.
- ``start`` joins the pool: ``member.Member`` holds everything a started client has, and
  ``close`` flushes async writes (reporting those that failed) and has it leave.
- Nothing is tied to the thread that created the client: the sync facade may be called from
  any thread (MindIE puts from a background thread).
"""

from __future__ import annotations

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
from kvpool_client.buffers import (
    BufferRegistry,
    KeyLike,
    address_of,
    byte_view,
    regions_of,
    slice_view,
    to_key,
)
from kvpool_client.config import ClientConfig
from kvpool_client.core.read_plan import KeyReplicas
from kvpool_client.core.regions import Regions
from kvpool_client.drivers.aio import AsyncDataPath
from kvpool_client.drivers.parts import Consumer, Done, Filler
from kvpool_client.liveness import MasterAddress
from kvpool_client.member import Member
from kvpool_client.metrics import ClientMetrics
from kvpool_client.rpc import MasterSession
from kvpool_client.segments import host_id
from kvpool_client.transfer.engine import EngineTransport
from kvpool_wire.status import KVPoolError, Status
from kvpool_wire.types import PutOptions

logger = logging.getLogger(__name__)

_OK_STATUSES = (Status.OK, Status.ALREADY_EXISTS)


class AsyncKVPoolClient:
    """A kvpool client on the running event loop. Build, then ``await start()`` (or use
    ``async with``, or ``await AsyncKVPoolClient.from_config(path)``)."""

    def __init__(self, config: ClientConfig, *, engine: Any = None) -> None:
        """``engine``: a Mooncake ``TransferEngine`` the caller built and initialised (with the
        ``P2PHANDSHAKE`` metadata) for this client to move bytes with, instead of its own."""
        self.config = config
        self._engine = engine
        self.metrics = ClientMetrics()
        self.buffers = BufferRegistry()
        name = config.client_id or f"{socket.gethostname()[:32]}-{os.getpid()}-" \
                                   f"{secrets.token_hex(4)}"
        self.client_id = name
        self.host_id = host_id()
        self._master = MasterAddress.of(config)
        self._session = MasterSession()  # this client's token and master clock, for all stubs
        self._member: Member | None = None  # set by start
        self._metrics_server: Any = None
        self._default_options = PutOptions(replica_num=config.replica_num,
                                           preferred_segment=config.preferred_segment,
                                           prefer_same_host=config.prefer_alloc_in_same_node)
        self._started = False
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
        """Join the pool (``member.Member.join``: segments created and served, registered,
        mounted, heartbeating).

        Raises KVPoolError (RPC_FAILED / TIMEOUT when the master cannot be reached,
        NO_SPACE when /dev/shm cannot hold the segments, ...); nothing is left behind then.
        """
        if self._started:
            return
        self._started = True
        member = await Member.join(self.config, self.client_id, self.host_id, self._master,
                                   self._session, self.metrics, self._engine)
        if self.config.metrics_port >= 0:
            try:
                self._start_metrics_server(self.config.metrics_port, self.config.metrics_host)
            except BaseException:
                await member.leave()
                raise
        self._member = member

    async def close(self) -> None:
        """Flush async writes, leave the pool (segments unmounted, objects on them dropped) and
        free every resource. Idempotent.

        Raises KVPoolError when async writes failed (after everything was closed).
        """
        if self._closed:
            return
        self._closed = True
        failure: KVPoolError | None = None
        member = self._member
        if member is not None:
            try:
                await member.writer.close()
                member.writer.raise_failures()
            except KVPoolError as exc:
                failure = exc
            await member.leave()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
            self._metrics_server = None
        if failure is not None:
            raise failure

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
        member = self._member
        return member.hostname if member is not None else self.config.local_hostname

    @property
    def engine_session(self) -> str:
        """The session id (``"host:port"``) of this client's transfer engine, "" when it has
        none (shared memory and kvpool's TCP move its bytes)."""
        member = self._member
        return member.engine.session_id if member is not None and member.engine else ""

    @property
    def segment_ids(self) -> list[str]:
        """Ids of the segments this client contributes."""
        return list(self._member.segments) if self._member is not None else []

    @property
    def master_answers(self) -> bool:
        """Whether the master answers this client's heartbeats and counts it alive (False
        before start and after close)."""
        member = self._member
        return member is not None and not self._closed and member.liveness.master_answers

    @property
    def member(self) -> Member:
        """What this started client holds (segments, server, stub, liveness, drivers). Raises
        KVPoolError UNAVAILABLE before start and after close."""
        member = self._member
        if member is None or self._closed:
            raise KVPoolError(Status.UNAVAILABLE, "the client is closed" if self._closed
                              else "the client is not started")
        return member

    def _path(self) -> AsyncDataPath:
        return self.member.path()

    def options(self, options: PutOptions | None) -> PutOptions:
        """``options``, or the configured defaults when None."""
        return self._default_options if options is None else options

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
                await self.member.writer.submit(batch.keys, batch.values, resolved)
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

    async def batch_tiers(self, keys: Sequence[KeyLike]) -> list[str | None]:
        """Per key the tier its fastest copy is on ("DRAM" or "SSD"), None when it does not
        exist (an Exist: it leases the keys like one). Raises KVPoolError when the master
        cannot be reached."""
        tiers = await self._path().rpc.tiers(self.client_id, [to_key(k) for k in keys])
        return [tier.name if tier is not None else None for tier in tiers]

    async def get_size(self, key: KeyLike) -> int | None:
        """The object's size in bytes, or None when it does not exist."""
        statuses, sizes = await self._path().rpc.exist(self.client_id, [to_key(key)])
        return sizes[0] if statuses[0] == Status.OK else None

    async def batch_replicas(self, keys: Sequence[KeyLike]) -> list[KeyReplicas]:
        """Per key where it lies: ``(size_bytes, [(placement, segment descriptor or None)])``,
        or None when it does not exist. Nothing is read; the read lease of the lookup is given
        back with the next call. Raises KVPoolError when the master cannot be reached."""
        return await self._path().replicas([to_key(k) for k in keys])

    async def query_prefix(self, keys: Sequence[KeyLike]) -> int:
        """The number of leading keys that exist (each of them gets a read lease)."""
        raws = [to_key(k) for k in keys]
        started = time.perf_counter()
        num_ready = int(await self._path().rpc.query_prefix(self.client_id, raws))
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
        return int(await self._path().rpc.remove_all(self.client_id, force))

    async def remove_by_regex(self, pattern: str, force: bool = False) -> int:
        """Remove objects whose key (decoded as UTF-8) matches ``pattern``; returns how many.
        Raises KVPoolError INVALID_ARGUMENT for a bad pattern."""
        return int(await self._path().rpc.remove_by_regex(self.client_id, pattern, force))

    # -- buffers, async writes, metrics -----------------------------------------------------------

    async def register_buffer(self, buf: Any) -> None:
        """Register a buffer used by put_from/get_into (optional; saves deriving its view, and
        with a transfer engine lets it move the buffer's bytes in place)."""
        view = self.buffers.register(buf)
        engine = self.member.engine
        if engine is not None and not view.readonly and view.nbytes:
            address = address_of(view)
            if not engine.registered(address, view.nbytes):
                engine.register(address, view.nbytes)

    async def unregister_buffer(self, buf: Any) -> None:
        """Forget a registered buffer. Raises KVPoolError INVALID_ARGUMENT if it was not."""
        view = self.buffers.view(buf)
        self.buffers.unregister(buf)
        engine = self.member.engine
        if engine is not None and view.nbytes and not view.readonly:
            engine.unregister(address_of(view))

    async def register_memory(self, address: int, nbytes: int) -> None:
        """Let this client's transfer engine move ``[address, address + nbytes)`` in place
        (host or device memory, e.g. a KV-cache tensor): regions ``AddressRange(address, n)``
        inside it then go straight between it and the pool. Raises KVPoolError
        INVALID_ARGUMENT when this client has no transfer engine."""
        self._engine_or_raise().register(address, nbytes)

    async def unregister_memory(self, address: int) -> None:
        """Withdraw a range ``register_memory`` registered at ``address``."""
        self._engine_or_raise().unregister(address)

    def _engine_or_raise(self) -> EngineTransport:
        engine = self.member.engine
        if engine is None:
            raise KVPoolError(Status.INVALID_ARGUMENT, "this client has no transfer engine "
                              "(see the config keys 'transport' and 'protocol')")
        return engine

    async def flush(self, timeout_s: float | None = None) -> None:
        """Wait for async writes and pipelined commits. Raises KVPoolError TIMEOUT, or the first
        failure's status with the number of writes that failed since the last flush."""
        await self.member.writer.flush(timeout_s)

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

