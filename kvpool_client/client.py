"""KVPoolClient: the synchronous client.

Its calls run on the calling thread through the blocking driver (``drivers.blocking``): master
calls, shared-memory copies and TCP transfers, with no event loop and no thread handoff. The
client's lifecycle (segments, data server, registration, heartbeats) is an
:class:`AsyncKVPoolClient` on a loop thread of this client's, which also serves what needs an
event loop: async writes, and every call when ``commit_nowait`` is set (commits are sent
without waiting on that loop's master connection, and later calls must follow them there).

Any thread may call any method at the same time (MindIE puts from a background thread).
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Sequence
from typing import Any

from kvpool_client._aclient import AsyncKVPoolClient
from kvpool_client.api import (
    OneRead,
    ReadRequest,
    SizedRequest,
    WriteRequest,
    attempt,
    each_position,
    key_batch,
    same_length,
    slices,
)
from kvpool_client.buffers import KeyLike, byte_view, regions_of, slice_view, to_key
from kvpool_client.config import ClientConfig
from kvpool_client.core.read_plan import KeyReplicas
from kvpool_client.core.regions import Regions
from kvpool_client.drivers.blocking import BlockingDataPath
from kvpool_client.drivers.parts import Consumer, Done, Filler
from kvpool_client.loops import LoopThread
from kvpool_client.metrics import ClientMetrics
from kvpool_wire.status import KVPoolError, Status
from kvpool_wire.types import PutOptions

__all__ = ["AsyncKVPoolClient", "ClientConfig", "KVPoolClient"]

logger = logging.getLogger(__name__)

_OK_STATUSES = (Status.OK, Status.ALREADY_EXISTS)


def _close_at_exit(thread: LoopThread, client: AsyncKVPoolClient,
                   path: BlockingDataPath | None) -> None:
    """Best-effort close of a client nobody closed (garbage collection or interpreter exit)."""
    try:
        thread.run(client.close())
    except (KVPoolError, RuntimeError) as exc:
        logger.warning("closing an unclosed kvpool client: %s", exc)
    finally:
        if path is not None:
            path.close()
        thread.stop()


class KVPoolClient:
    """Synchronous kvpool client; see :class:`AsyncKVPoolClient` for every method's contract."""

    def __init__(self, config: ClientConfig, *, engine: Any = None) -> None:
        """Join the pool described by ``config`` (segments created, registered, mounted);
        ``engine`` as for AsyncKVPoolClient.

        Raises KVPoolError (RPC_FAILED / TIMEOUT when the master cannot be reached, ...).
        """
        self._thread = LoopThread("kvpool-client")
        self._client = AsyncKVPoolClient(config, engine=engine)
        self._path: BlockingDataPath | None = None
        try:
            self._thread.run(self._client.start())
            if not config.commit_nowait:
                self._path = self._client.member.blocking_path()
                self._path.refresh()
        except BaseException:
            try:
                self._thread.run(self._client.close())
            finally:
                self._thread.stop()
            raise
        self._finalizer = weakref.finalize(self, _close_at_exit, self._thread, self._client,
                                           self._path)

    @classmethod
    def from_config(cls, path: str | None = None) -> KVPoolClient:
        """A client configured by the JSON file ``path`` (default: the file named by
        KVPOOL_CONFIG_PATH or MOONCAKE_CONFIG_PATH). Raises KVPoolError."""
        return cls(ClientConfig.from_file(path) if path else ClientConfig.from_env())

    def close(self) -> None:
        """Flush async writes, leave the pool and free everything (idempotent). Raises
        KVPoolError when async writes failed (after everything was closed)."""
        if not self._finalizer.alive:
            return
        self._finalizer.detach()
        try:
            self._thread.run(self._client.close())
        finally:
            if self._path is not None:
                self._path.close()
            self._thread.stop()

    def __enter__(self) -> KVPoolClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if exc_info[0] is None:
            self.close()
            return
        try:
            self.close()
        except KVPoolError as exc:  # never mask the exception already in flight
            logger.error("close after an error: %s", exc)

    # -- identity ---------------------------------------------------------------------------------

    @property
    def config(self) -> ClientConfig:
        """The configuration this client runs with."""
        return self._client.config

    @property
    def client_id(self) -> str:
        """This client's id at the master."""
        return self._client.client_id

    @property
    def hostname(self) -> str:
        """``"ip:port"`` of this client's data server."""
        return self._client.hostname

    @property
    def engine_session(self) -> str:
        """See AsyncKVPoolClient.engine_session."""
        return self._client.engine_session

    @property
    def has_engine(self) -> bool:
        """Whether a transfer engine moves this client's bytes between hosts."""
        return bool(self._client.engine_session)

    @property
    def segment_ids(self) -> list[str]:
        """Ids of the segments this client contributes."""
        return self._client.segment_ids

    @property
    def master_answers(self) -> bool:
        """See AsyncKVPoolClient.master_answers."""
        return self._client.master_answers

    @property
    def metrics(self) -> ClientMetrics:
        """This client's metrics (``metrics.registry`` is a prometheus CollectorRegistry)."""
        return self._client.metrics

    @property
    def async_client(self) -> AsyncKVPoolClient:
        """The client that owns this one's lifecycle (its coroutines run on the loop thread)."""
        return self._client

    # -- plumbing ---------------------------------------------------------------------------------

    def _blocking(self) -> BlockingDataPath | None:
        """The blocking driver, or None when calls go through the loop (``commit_nowait``).
        Raises UNAVAILABLE once closed."""
        if not self._finalizer.alive:
            raise KVPoolError(Status.UNAVAILABLE, "the client is closed")
        path = self._path
        if path is not None:
            path.follow_epoch()
        return path

    # -- writes -----------------------------------------------------------------------------------

    def put(self, key: KeyLike, data: Any, *, options: PutOptions | None = None,
            async_write: bool = False) -> None:
        """See AsyncKVPoolClient.put."""
        self._put_one("put", key, attempt(byte_view, data), options, async_write)

    def put_from(self, key: KeyLike, buf: Any, offset: int, size: int, *,
                 options: PutOptions | None = None, async_write: bool = False) -> None:
        """See AsyncKVPoolClient.put_from."""
        view = slice_view(self._client.buffers.view(buf), offset, size)
        self._put_one("put_from", key, [view], options, async_write)

    def put_batch(self, keys: Sequence[KeyLike], datas: Sequence[Any], *,
                  options: PutOptions | None = None, async_write: bool = False) -> list[Status]:
        """See AsyncKVPoolClient.put_batch."""
        same_length(keys, datas)
        return self._put_many("put_batch", keys, [attempt(byte_view, d) for d in datas],
                              options, async_write)

    def batch_put_from(self, keys: Sequence[KeyLike], bufs: Any, offsets: Sequence[int],
                       sizes: Sequence[int], *, options: PutOptions | None = None,
                       async_write: bool = False) -> list[Status]:
        """See AsyncKVPoolClient.batch_put_from."""
        views = slices(self._client.buffers, keys, bufs, offsets, sizes, writable=False)
        return self._put_many("batch_put_from", keys, views, options, async_write)

    def batch_put_regions(self, keys: Sequence[KeyLike], regions: Sequence[Sequence[Any]],
                          options: PutOptions | None = None,
                          async_write: bool = False) -> list[Status]:
        """See AsyncKVPoolClient.batch_put_regions."""
        same_length(keys, regions)
        return self._put_many("batch_put_regions", keys,
                              [attempt(regions_of, r) for r in regions], options, async_write)

    def _put_one(self, op: str, key: KeyLike, parts: Regions | None,
                 options: PutOptions | None, async_write: bool) -> None:
        to_key(key)  # a bad key raises INVALID_KEY itself
        if parts is None:
            raise KVPoolError(Status.INVALID_ARGUMENT, f"{op}: the value is not a buffer")
        (status,) = self._put_many(op, [key], [parts], options, async_write)
        if status not in _OK_STATUSES:
            raise KVPoolError(status, f"{op} of key {key!r:.80} failed")

    def _put_many(self, op: str, keys: Sequence[KeyLike], regions: list[Regions | None],
                  options: PutOptions | None, async_write: bool) -> list[Status]:
        path = self._blocking()
        if path is None or async_write:
            result: list[Status] = self._thread.run(
                self._client._put_many(op, keys, regions, options, async_write))
            return result
        started = time.perf_counter()
        request = WriteRequest(keys, regions)
        batch = request.batch
        sent: list[Status] = []
        if batch.keys:
            try:
                sent = path.write(batch.keys, batch.values, request.sizes,
                                  self._client.options(options))
            except KVPoolError as exc:
                sent = [exc.status] * len(batch.keys)
        statuses = request.finish(sent)
        metrics = self._client.metrics
        metrics.observe_op(op, time.perf_counter() - started)
        metrics.count_failures(op, statuses)
        return statuses

    def batch_put_with(self, keys: Sequence[KeyLike], sizes: Sequence[int], fill: Filler,
                       options: PutOptions | None = None, done: Done | None = None
                       ) -> list[Status]:
        """See AsyncKVPoolClient.batch_put_with."""
        path = self._blocking()
        if path is None:
            result: list[Status] = self._thread.run(
                self._client.batch_put_with(keys, sizes, fill, options, done))
            return result
        request = SizedRequest(keys, sizes)
        batch = request.batch
        return self._with("batch_put_with", batch, lambda: path.write_with(
            batch.keys, batch.values, self._client.options(options),
            lambda i, view: fill(request.position_of(i), view), done))

    def _with(self, op: str, batch: Any, call: Any) -> list[Any]:
        started = time.perf_counter()
        results: list[Any] = []
        if batch.keys:
            try:
                results = call()
            except KVPoolError as exc:
                results = [exc.status] * len(batch.keys)
        statuses: list[Any] = batch.spread(results)
        metrics = self._client.metrics
        metrics.observe_op(op, time.perf_counter() - started)
        metrics.count_failures(op, [int(s) for s in statuses])
        return statuses

    def pin_shared_memory(self, pin: Any, unpin: Any) -> None:
        """See AsyncKVPoolClient.pin_shared_memory."""
        self._client.pin_shared_memory(pin, unpin)

    # -- reads ------------------------------------------------------------------------------------

    def get(self, key: KeyLike) -> bytes | None:
        """See AsyncKVPoolClient.get."""
        try:
            return self._read_one("get", key, None)[1]
        except KVPoolError as exc:
            if exc.status == Status.NOT_FOUND:
                return None
            raise

    def get_into(self, key: KeyLike, buf: Any, offset: int, size: int) -> int:
        """See AsyncKVPoolClient.get_into."""
        view = slice_view(self._client.buffers.view(buf, writable=True), offset, size)
        return self._read_one("get_into", key, [view])[0]

    def get_batch(self, keys: Sequence[KeyLike]) -> list[bytes | None]:
        """See AsyncKVPoolClient.get_batch."""
        out, request = self._read_many("get_batch", keys, None)
        return request.objects(out)

    def batch_get_into(self, keys: Sequence[KeyLike], bufs: Any, offsets: Sequence[int],
                       sizes: Sequence[int]) -> list[int]:
        """See AsyncKVPoolClient.batch_get_into."""
        views = slices(self._client.buffers, keys, bufs, offsets, sizes, writable=True)
        return self._read_many("batch_get_into", keys,
                               [v if v is not None else Status.INVALID_ARGUMENT for v in views])[0]

    def batch_get_regions(self, keys: Sequence[KeyLike],
                          regions: Sequence[Sequence[Any]]) -> list[int]:
        """See AsyncKVPoolClient.batch_get_regions."""
        same_length(keys, regions)
        dsts: list[Regions | Status] = []
        for parts in regions:
            views = attempt(regions_of, parts, writable=True)
            dsts.append(views if views is not None else Status.INVALID_ARGUMENT)
        return self._read_many("batch_get_regions", keys, dsts)[0]

    def batch_get_with(self, keys: Sequence[KeyLike], consume: Consumer,
                       done: Done | None = None) -> list[int]:
        """See AsyncKVPoolClient.batch_get_with."""
        path = self._blocking()
        if path is None:
            result: list[int] = self._thread.run(self._client.batch_get_with(keys, consume, done))
            return result
        batch = key_batch(keys)
        consume_all = each_position(batch, consume)
        out = [int(s) for s in self._with("batch_get_with", batch,
                                          lambda: path.read_with(batch.keys, consume_all, done))]
        self._client.metrics.count_lookups(len(out), sum(1 for n in out if n >= 0))
        return out

    def _read_one(self, op: str, key: KeyLike, dst: Regions | None) -> tuple[int, bytes]:
        raw = to_key(key)  # a bad key raises INVALID_KEY itself
        path = self._blocking()
        if path is None:
            (result,), request = self._read_many(op, [key], None if dst is None else [dst])
            fresh = request.fresh.get(0, b"")
        else:
            started = time.perf_counter()
            one = OneRead(raw, dst)
            try:
                result = path.read(one.keys, one.dst_for)[0]
            except KVPoolError as exc:
                result = int(exc.status)
            metrics = self._client.metrics
            metrics.observe_op(op, time.perf_counter() - started)
            metrics.count_lookups(1, result >= 0)
            metrics.count_failures(op, (result,))
            fresh = one.fresh
        if result < 0:
            raise KVPoolError(Status(result), f"{op} of key {key!r:.80} failed")
        return result, fresh

    def _read_many(self, op: str, keys: Sequence[KeyLike],
                   dsts: Sequence[Regions | Status] | None) -> tuple[list[int], ReadRequest]:
        path = self._blocking()
        if path is None:
            result: tuple[list[int], ReadRequest] = self._thread.run(
                self._client._read_many(op, keys, dsts))
            return result
        started = time.perf_counter()
        request = ReadRequest(keys, dsts)
        results: list[int] = []
        if request.batch.keys:
            try:
                results = path.read(request.batch.keys, request.dst_for)
            except KVPoolError as exc:
                results = [int(exc.status)] * len(request.batch.keys)
        out = request.finish(results)
        metrics = self._client.metrics
        metrics.observe_op(op, time.perf_counter() - started)
        metrics.count_lookups(len(keys), sum(1 for r in out if r >= 0))
        metrics.count_failures(op, [Status(r) for r in out if r < 0])
        return out, request

    # -- lookups and removal ----------------------------------------------------------------------

    def exists(self, key: KeyLike) -> bool:
        """See AsyncKVPoolClient.exists."""
        return self.batch_exists([key])[0]

    def batch_exists(self, keys: Sequence[KeyLike]) -> list[bool]:
        """See AsyncKVPoolClient.batch_exists."""
        path = self._blocking()
        if path is None:
            found: list[bool] = self._thread.run(self._client.batch_exists(keys))
            return found
        raws = [to_key(k) for k in keys]
        started = time.perf_counter()
        statuses, _ = path.rpc.exist(self.client_id, raws)
        metrics = self._client.metrics
        metrics.observe_op("exists", time.perf_counter() - started)
        found = [s == Status.OK for s in statuses]
        metrics.count_lookups(len(raws), sum(found))
        return found

    def batch_tiers(self, keys: Sequence[KeyLike]) -> list[str | None]:
        """See AsyncKVPoolClient.batch_tiers."""
        path = self._blocking()
        if path is None:
            tiers: list[str | None] = self._thread.run(self._client.batch_tiers(keys))
            return tiers
        return [t.name if t is not None else None
                for t in path.rpc.tiers(self.client_id, [to_key(k) for k in keys])]

    def get_size(self, key: KeyLike) -> int | None:
        """See AsyncKVPoolClient.get_size."""
        path = self._blocking()
        if path is None:
            size: int | None = self._thread.run(self._client.get_size(key))
            return size
        statuses, sizes = path.rpc.exist(self.client_id, [to_key(key)])
        return sizes[0] if statuses[0] == Status.OK else None

    def batch_replicas(self, keys: Sequence[KeyLike]) -> list[KeyReplicas]:
        """See AsyncKVPoolClient.batch_replicas."""
        path = self._blocking()
        if path is None:
            found: list[KeyReplicas] = self._thread.run(self._client.batch_replicas(keys))
            return found
        return path.replicas([to_key(k) for k in keys])

    def query_prefix(self, keys: Sequence[KeyLike]) -> int:
        """See AsyncKVPoolClient.query_prefix."""
        path = self._blocking()
        if path is None:
            num: int = self._thread.run(self._client.query_prefix(keys))
            return num
        raws = [to_key(k) for k in keys]
        started = time.perf_counter()
        num_ready: int = path.rpc.query_prefix(self.client_id, raws)
        metrics = self._client.metrics
        metrics.observe_op("query_prefix", time.perf_counter() - started)
        metrics.count_lookups(len(raws), num_ready)
        return num_ready

    def remove(self, key: KeyLike, force: bool = False) -> None:
        """See AsyncKVPoolClient.remove."""
        (status,) = self.batch_remove([key], force)
        if status != Status.OK:
            raise KVPoolError(status, f"remove of key {key!r:.80} failed")

    def batch_remove(self, keys: Sequence[KeyLike], force: bool = False) -> list[Status]:
        """See AsyncKVPoolClient.batch_remove."""
        path = self._blocking()
        if path is None:
            statuses: list[Status] = self._thread.run(self._client.batch_remove(keys, force))
            return statuses
        batch = key_batch(keys)
        answers = path.rpc.remove(self.client_id, batch.keys, force) if batch.keys else []
        return batch.spread(answers)

    def remove_all(self, force: bool = False) -> int:
        """See AsyncKVPoolClient.remove_all."""
        path = self._blocking()
        if path is None:
            num: int = self._thread.run(self._client.remove_all(force))
            return num
        removed: int = path.rpc.remove_all(self.client_id, force)
        return removed

    def remove_by_regex(self, pattern: str, force: bool = False) -> int:
        """See AsyncKVPoolClient.remove_by_regex."""
        path = self._blocking()
        if path is None:
            num: int = self._thread.run(self._client.remove_by_regex(pattern, force))
            return num
        removed: int = path.rpc.remove_by_regex(self.client_id, pattern, force)
        return removed

    # -- buffers, async writes, metrics -----------------------------------------------------------

    def register_buffer(self, buf: Any) -> None:
        """See AsyncKVPoolClient.register_buffer."""
        self._thread.run(self._client.register_buffer(buf))

    def unregister_buffer(self, buf: Any) -> None:
        """See AsyncKVPoolClient.unregister_buffer."""
        self._thread.run(self._client.unregister_buffer(buf))

    def register_memory(self, address: int, nbytes: int) -> None:
        """See AsyncKVPoolClient.register_memory."""
        self._thread.run(self._client.register_memory(address, nbytes))

    def unregister_memory(self, address: int) -> None:
        """See AsyncKVPoolClient.unregister_memory."""
        self._thread.run(self._client.unregister_memory(address))

    def flush(self, timeout_s: float | None = None) -> None:
        """See AsyncKVPoolClient.flush."""
        self._thread.run(self._client.flush(timeout_s))

    def start_metrics_server(self, port: int, host: str = "127.0.0.1") -> int:
        """See AsyncKVPoolClient.start_metrics_server."""
        port_bound: int = self._thread.run(self._client.start_metrics_server(port, host))
        return port_bound
