"""Wiring of the master daemon: one core, one event loop, three listeners, one tick.

Rules of this file:
- Everything runs on one uvloop event loop; the core is called only from it, so every request
  is atomic without locks.
- The core sees the serving clock (``clock.py``), never wall time.
- Side effects leave the core as events; ``_fan_out`` sends them to logs, metrics and the state
  store, in that order, before the answer of the request that caused them is written; when
  the store says that answer must not go out (``StateStore.record``), it answers UNAVAILABLE.
- A failed write to the state directory makes the master read-only (``persist.py``): calls
  that change durable state answer UNAVAILABLE, reads go on, ``/healthz`` answers 503 and
  ``kvpool_state_read_only`` is 1, until a full snapshot succeeds; the tick retries one with
  back-off (``STATE_RETRY_MIN_S`` doubling up to ``STATE_RETRY_MAX_S``).
- SIGTERM/SIGINT: stop accepting, let in-flight gRPC calls finish (bounded grace), flush the
  lean connections, close the state store, exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import resource
import signal
import ssl
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvpool_master.clock import ServingClock
from kvpool_master.config import MasterConfig, load_auth_token, public_settings
from kvpool_master.core import events as ev
from kvpool_master.core.master import CoreConfig, MasterCore
from kvpool_master.gcpause import GcPauses
from kvpool_master.looplag import LoopLag
from kvpool_master.metrics import HttpEndpoint, MasterMetrics
from kvpool_master.partition import SOLE, PartitionTerms, claim_state_dir, state_dir_of
from kvpool_master.persist import StateStore
from kvpool_master.rpc.lean import LeanServer
from kvpool_master.rpc.servicer import BadRequest, InternalError, Servicer
from kvpool_wire._pb import kvpool_pb2 as pb
from kvpool_wire.methods import RPC_METHODS, RpcMethod

log = logging.getLogger("kvpool.master")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Master"].full_name
TICK_INTERVAL_S = 0.1
#: Open files the master needs besides its lean connections: gRPC connections, the state
#: directory's files, the metrics endpoint's.
FILES_BESIDE_CONNECTIONS = 1024
#: How often a long restore logs how far it has read.
RESTORE_PROGRESS_EVERY_S = 5.0
STATE_FSYNC_INTERVAL_S = 0.05
MASTER_ID_NAME = "master_id"
STALL_THRESHOLD_S = 0.5
GRPC_KEEPALIVE_MS = 60_000
GRPC_KEEPALIVE_TIMEOUT_MS = 20_000
SHUTDOWN_GRACE_S = 10.0
STATE_RETRY_MIN_S = 0.5
STATE_RETRY_MAX_S = 30.0


def core_config(config: MasterConfig, partition: PartitionTerms = SOLE) -> CoreConfig:
    """The core's settings taken from the daemon's (and its partition's)."""
    return CoreConfig(
        partition_index=partition.index,
        partition_count=partition.count,
        client_ttl_s=config.client_ttl_s,
        default_lease_ttl_s=config.default_kv_lease_ttl_ms / 1000,
        put_start_discard_timeout_s=config.put_start_discard_timeout_s,
        write_capability_ttl_s=config.write_capability_ttl_s,
        max_segments_per_client=config.max_segments_per_client,
        eviction_high_watermark_ratio=config.eviction_high_watermark_ratio,
        eviction_ratio=config.eviction_ratio,
        eviction_policy=config.eviction_policy,
        max_key_bytes=config.max_key_bytes,
        max_batch_keys=config.max_batch_keys,
        engine_transport=config.engine_transport,
        ssd_promote_after_hits=config.ssd_promote_after_hits,
        copy_task_ttl_s=config.copy_task_ttl_s,
    )


class _RestoreProgress:
    """Logs how far a long restore has read, every ``every_s`` seconds (a restore of ten
    million objects takes tens of seconds, before the master listens)."""

    def __init__(self, started_s: float, every_s: float) -> None:
        self._started_s = started_s
        self._every_s = every_s
        self._next_s = started_s + every_s
        self._rows = 0

    def __call__(self, num_rows: int) -> None:
        self._rows += num_rows
        now_s = time.perf_counter()
        if now_s >= self._next_s:
            self._next_s = now_s + self._every_s
            log.info("restoring: %d objects of the snapshot read in %.0f s", self._rows,
                     now_s - self._started_s)


class MasterServer:
    """The running daemon: ``await start()``, then ``await serve_until_stopped()``."""

    def __init__(self, config: MasterConfig, partition: PartitionTerms = SOLE) -> None:
        config = replace(config, state_dir=state_dir_of(config.state_dir, partition))
        self.config = config
        self.partition = partition
        self.clock = ServingClock(stall_threshold_s=STALL_THRESHOLD_S)
        self.core = MasterCore(core_config(config, partition))
        self.core.defer_upkeep = True  # eviction passes between requests (upkeep)
        self.master_id = self._master_id(config)
        self.store: StateStore | None = None
        self._snapshot_retry_at_s = 0.0   # read-only: monotonic time of the next snapshot try
        self._snapshot_retry_s = STATE_RETRY_MIN_S
        self.metrics = MasterMetrics(self.core, self.clock, master_id=self.master_id,
                                     settings=public_settings(config))
        self._auth_token = load_auth_token(config)
        self.servicer = Servicer(self.core, self.clock, self.metrics, master_id=self.master_id,
                                 on_events=self._fan_out,
                                 status_document=self.metrics.status_text_steps,
                                 partition=partition)
        if partition.count > 1:
            self.metrics.partition_info = self._partition_info
        self._grpc: grpc.aio.Server | None = None
        self._health: health.aio.HealthServicer | None = None
        self._background: set[asyncio.Task[None]] = set()  # health updates in flight
        self._lean: LeanServer | None = None
        self._http: HttpEndpoint | None = None
        self._tick_task: asyncio.Task[None] | None = None
        self._upkeep_task: asyncio.Task[None] | None = None
        self._upkeep_wanted: asyncio.Event | None = None
        self._compact_task: asyncio.Task[None] | None = None
        self._compact_wanted: asyncio.Event | None = None
        self.gc_pauses = GcPauses()
        self.metrics.watch_gc(self.gc_pauses)
        self.loop_lag = LoopLag()
        self.metrics.watch_loop_lag(self.loop_lag)
        self._stop = asyncio.Event()
        self.grpc_port = 0
        self.fast_port = 0
        self.metrics_port = 0

    # -- start ------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Restore state, bind every listener, start the tick, write the ready file.

        Raises OSError/RuntimeError (after releasing whatever it had opened) when a listener
        cannot be bound or the state directory cannot be read.
        """
        try:
            await self._start()
        except BaseException:
            await self.stop()
            raise

    async def _start(self) -> None:
        self.gc_pauses.install()
        self._restore()
        await self._start_grpc()
        if self.config.fast_port >= 0:
            self._lean = LeanServer(
                self.servicer, max_connections=self.config.max_connections,
                max_frame_bytes=self.config.max_message_bytes,
                frame_timeout_s=self.config.frame_timeout_s, auth_token=self._auth_token,
                max_connections_per_peer=self.config.max_connections_per_peer,
                auth_timeout_s=self.config.auth_timeout_s,
                ssl_context=self._lean_ssl_context(), on_refusal=self.metrics.refused,
                busy_poll_us=self.config.busy_poll_us)
            self.metrics.watch_busy_poll(self._lean.poller)
            self.fast_port = await self._lean.start(self.config.host, self.config.fast_port)
            self.servicer.fast_port = self.fast_port
            if self.config.local_socket and not self.config.tls_enabled:
                try:
                    self.servicer.fast_socket = await self._lean.start_local()
                except OSError as exc:  # no abstract Unix sockets here: TCP only
                    log.warning("lean framing on a local Unix socket is off: %s", exc)
        if self.config.metrics_port >= 0:
            self._http = HttpEndpoint(self.metrics)
            self.metrics_port = await self._http.start(self.config.metrics_host,
                                                       self.config.metrics_port)
        self.gc_pauses.freeze_start_up()
        self._tick_task = asyncio.get_running_loop().create_task(self._tick_loop())
        self.loop_lag.start()
        self._upkeep_wanted = asyncio.Event()
        self.servicer.on_upkeep_due = self._upkeep_wanted.set
        self._upkeep_task = asyncio.get_running_loop().create_task(self._upkeep_loop())
        if self.store is not None:
            self._compact_wanted = asyncio.Event()
            self._compact_task = asyncio.get_running_loop().create_task(self._compact_loop())
        log.info("kvpool-master %s%s serving: grpc %s:%d, lean %s, metrics %s",
                 self.master_id, f" (partition {self.partition.index} of "
                 f"{self.partition.count})" if self.partition.count > 1 else "",
                 self.config.host, self.grpc_port,
                 f"{self.config.host}:{self.fast_port}" if self._lean else "off",
                 f"http://{self.config.metrics_host}:{self.metrics_port}/metrics"
                 if self._http else "off")
        if self.partition.count == 1:
            self.write_ready_file()

    def _grpc_credentials(self) -> grpc.ServerCredentials | None:
        config = self.config
        if not config.tls_cert:
            return None
        ca = Path(config.tls_ca).read_bytes() if config.tls_ca else None
        return grpc.ssl_server_credentials(
            [(Path(config.tls_key).read_bytes(), Path(config.tls_cert).read_bytes())],
            root_certificates=ca, require_client_auth=ca is not None)

    def _lean_ssl_context(self) -> ssl.SSLContext | None:
        config = self.config
        if not config.tls_cert:
            return None
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(config.tls_cert, config.tls_key)
        if config.tls_ca:
            context.load_verify_locations(config.tls_ca)
            context.verify_mode = ssl.CERT_REQUIRED
        return context

    async def _start_grpc(self) -> None:
        limit = self.config.max_message_bytes
        interceptors = ([_TokenInterceptor(self._auth_token, self.metrics.refused)]
                        if self._auth_token else [])
        server = grpc.aio.server(
            options=[("grpc.max_send_message_length", limit),
                     ("grpc.max_receive_message_length", limit),
                     ("grpc.so_reuseport", 0),
                     # A connection must finish its HTTP/2 (and TLS) handshake this soon.
                     ("grpc.server_handshake_timeout_ms", int(self.config.auth_timeout_s * 1000)),
                     # Pings find connections whose peer host vanished.
                     ("grpc.keepalive_time_ms", GRPC_KEEPALIVE_MS),
                     ("grpc.keepalive_timeout_ms", GRPC_KEEPALIVE_TIMEOUT_MS)],
            interceptors=interceptors,
            maximum_concurrent_rpcs=self.config.max_inflight_requests)
        handlers = {name: grpc.unary_unary_rpc_method_handler(self._grpc_behavior(method))
                    for name, method in RPC_METHODS.items()}
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        address = f"{self.config.host}:{self.config.port}"
        credentials = self._grpc_credentials()
        if credentials is None:
            self.grpc_port = server.add_insecure_port(address)
        else:
            self.grpc_port = server.add_secure_port(address, credentials)
        await server.start()
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._health = health_servicer
        self._grpc = server

    def _grpc_behavior(self, method: RpcMethod) -> Any:
        servicer = self.servicer

        async def behavior(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            try:
                answer = servicer.serve(method, request, "grpc")
                return answer if isinstance(answer, bytes) else await answer.answer()
            except BadRequest as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            except InternalError as exc:
                await context.abort(grpc.StatusCode.INTERNAL, str(exc))
            raise AssertionError("unreachable")  # abort() raises
        return behavior

    def _restore(self) -> None:
        """Open the state store and load the persisted index into the fresh core."""
        if not self.config.state_dir:
            if not log.isEnabledFor(logging.DEBUG):  # (debug logs every event)
                self.core.skip_object_events()  # nothing else reads them
            return
        self.store = StateStore(self.config.state_dir, fsync=self.config.state_fsync,
                                fsync_interval_s=STATE_FSYNC_INTERVAL_S,
                                restore_grace_s=self.config.restore_grace_s,
                                compact_log_bytes=self.config.state_compact_bytes,
                                compact_log_ratio=self.config.state_compact_ratio,
                                background=True)
        log.info("restoring the index from %s", self.config.state_dir)
        started_s = time.perf_counter()
        report = self.store.load(self.core, self.clock.now(),
                                 _RestoreProgress(started_s, RESTORE_PROGRESS_EVERY_S))
        restore_s = time.perf_counter() - started_s
        log.info("restored from %s in %.1f s: %d clients, %d segments, %d objects (%d log "
                 "records, %d rows dropped, %d objects dropped for overlapping extents, %d "
                 "torn log bytes cut); segments have %g s from now to be remounted, their "
                 "free space is held back for %g s", self.config.state_dir, restore_s,
                 report.num_clients, report.num_segments, report.num_objects,
                 report.num_log_records, report.num_dropped_rows,
                 report.num_conflicting_objects, report.truncated_log_bytes,
                 self.config.restore_grace_s, self.config.write_capability_ttl_s)
        self.metrics.watch_store(self.store, report, restore_s)

    def _partition_info(self) -> dict[str, Any]:
        """/status of a partition: its index and their count, and for partition 0 where
        every partition serves (as registrations give it; a caller that did not register
        learns the others from it)."""
        return {"index": self.partition.index, "count": self.partition.count,
                "endpoints": [asdict(e) for e in self.servicer.partition_map]}

    @staticmethod
    def _master_id(config: MasterConfig) -> str:
        """A new id per start; with --state-dir the id of the index, kept across restarts.

        Clients compare it to tell a restart that kept their objects from one that did not.
        """
        if not config.state_dir:
            return uuid.uuid4().hex
        path = Path(config.state_dir) / MASTER_ID_NAME
        with contextlib.suppress(OSError):
            existing = path.read_text().strip()
            if existing:
                return existing
        master_id = uuid.uuid4().hex
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(master_id + "\n")
        os.replace(tmp, path)
        return master_id

    def write_ready_file(self, partitions: list[dict[str, Any]] | None = None) -> None:
        """Write the ready file (when configured): this process's ports, and with
        ``partitions`` those of every partition, this one first."""
        if not self.config.ready_file:
            return
        document: dict[str, Any] = {
            "grpc_port": self.grpc_port, "fast_port": self.fast_port,
            "metrics_port": self.metrics_port, "pid": os.getpid(), "master_id": self.master_id}
        if partitions is not None:
            document["partitions"] = partitions
        path = Path(self.config.ready_file)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(document))
        os.replace(tmp, path)  # readers never see a half-written file

    # -- running ----------------------------------------------------------------------------------

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(TICK_INTERVAL_S)
            try:
                self.servicer.tick()
                self._tick_store()
                self.gc_pauses.collect_recent()
            except Exception:
                log.exception("tick failed")

    async def _upkeep_loop(self) -> None:
        """Run the core's upkeep (sweeps of lost segments, removal jobs, deferred eviction
        passes) a step at a time, letting requests in between the steps."""
        wanted = self._upkeep_wanted
        assert wanted is not None
        while True:
            await wanted.wait()
            wanted.clear()
            try:
                while self.servicer.upkeep():
                    await asyncio.sleep(0)
            except Exception:
                log.exception("an upkeep step failed")

    async def _compact_loop(self) -> None:
        """Write a background compaction of the state log, and then move the objects read
        meanwhile, a step at a time, letting requests in between the steps."""
        wanted = self._compact_wanted
        store = self.store
        assert wanted is not None and store is not None
        while True:
            await wanted.wait()
            wanted.clear()
            try:
                while (delay := store.compact_step(self.core)) is not None:
                    await asyncio.sleep(delay)
            except Exception:
                log.exception("compacting the state log failed")

    def _tick_store(self) -> None:
        store = self.store
        if store is None:
            return
        if not store.healthy:
            now_s = time.monotonic()
            if now_s < self._snapshot_retry_at_s:
                return
            try:
                store.compact(self.core)
            except OSError as exc:
                self._snapshot_retry_at_s = now_s + self._snapshot_retry_s
                log.warning("state snapshot failed (%s); read-only, next try in %g s", exc,
                            self._snapshot_retry_s)
                self._snapshot_retry_s = min(2 * self._snapshot_retry_s, STATE_RETRY_MAX_S)
                return
            log.warning("state directory whole again after a full snapshot: accepting changes")
            self._snapshot_retry_s = STATE_RETRY_MIN_S
            self._snapshot_retry_at_s = 0.0
            self.servicer.read_only = False
            self._report_health(serving=True)
            return
        store.flush(self.core)  # the "batch" policy's bound on unsynced changes
        self._note_store_health()

    def _fan_out(self, events: list[ev.Event]) -> bool:
        """Log and persist ``events``; return False when the answer of the call that caused
        them must not go out (see ``StateStore.record``)."""
        every = log.isEnabledFor(logging.DEBUG)
        for event in events:
            if every or type(event) in _INFO_EVENTS:
                _log_event(event)
        store = self.store
        if store is None:
            return True
        may_answer = store.record(self.core, events)
        if self._compact_wanted is not None and (store.compacting or self.core.settling):
            self._compact_wanted.set()
        if not store.healthy:
            self._note_store_health()
        return may_answer

    def _note_store_health(self) -> None:
        store = self.store
        if store is not None and not store.healthy and not self.servicer.read_only:
            self.servicer.read_only = True
            self.metrics.state_write_failures.inc()
            self._snapshot_retry_at_s = time.monotonic() + self._snapshot_retry_s
            self._report_health(serving=False)

    def _report_health(self, *, serving: bool) -> None:
        """gRPC health of the Master service follows /healthz: NOT_SERVING while read-only."""
        if self._health is None:
            return
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        task = asyncio.get_running_loop().create_task(self._health.set(SERVICE_NAME, status))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def request_stop(self) -> None:
        """Ask the server to shut down (what SIGTERM/SIGINT do)."""
        self._stop.set()

    async def serve_until_stopped(self) -> None:
        """Serve until SIGTERM/SIGINT or request_stop(), then shut down gracefully."""
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self.request_stop)
        await self._stop.wait()
        log.info("shutting down: finishing in-flight calls")
        await self.stop()

    async def stop(self) -> None:
        """Stop listening, finish in-flight calls, close persistence."""
        if self._health is not None:
            await self._health.enter_graceful_shutdown()  # health checks answer NOT_SERVING
        if self._grpc is not None:
            await self._grpc.stop(SHUTDOWN_GRACE_S)
        if self._lean is not None:
            await self._lean.close()
        if self._http is not None:
            await self._http.close()
        self.loop_lag.stop()
        for task in (self._tick_task, self._upkeep_task, self._compact_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self.store is not None:
            if not self.store.healthy:
                with contextlib.suppress(OSError):
                    self.store.compact(self.core)
            with contextlib.suppress(OSError):
                self.store.close()
        if self.config.ready_file:
            with contextlib.suppress(OSError):
                os.unlink(self.config.ready_file)
        self.gc_pauses.uninstall()
        log.info("stopped")


class _TokenInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """With a token configured, every gRPC call (Master, health, reflection) must carry
    ``authorization: Bearer <token>``. The check runs on the call's headers: a call without the
    token is answered UNAUTHENTICATED by a handler that never reads the request, so its
    message (up to max_message_bytes) is never buffered."""

    def __init__(self, token: str, refused: Callable[[str, str], None]) -> None:
        self._expected = f"Bearer {token}".encode()
        self._refused = refused
        self._deny = grpc.stream_stream_rpc_method_handler(_deny_unauthenticated)

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        for key, value in details.invocation_metadata or ():
            if key == "authorization" and isinstance(value, str) \
                    and hmac.compare_digest(value.encode(), self._expected):
                return await continuation(details)
        self._refused("grpc", "bad_token")
        return self._deny


async def _deny_unauthenticated(requests: Any, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                        "missing or wrong token: send 'authorization: Bearer <token>'")


#: Events logged above DEBUG; the others (one per object put, removed, ...) only at DEBUG.
_INFO_EVENTS = frozenset((ev.ClientRegistered, ev.ClientExpired, ev.ClientUnregistered,
                          ev.SegmentMounted, ev.SegmentUnmounted))


def _log_event(event: ev.Event) -> None:
    if isinstance(event, ev.ClientRegistered):
        log.info("client %s registered (host %s)", event.client_id, event.host_id)
    elif isinstance(event, ev.ClientExpired):
        log.warning("client %s expired: no heartbeat within client_ttl", event.client_id)
    elif isinstance(event, ev.ClientUnregistered):
        log.info("client %s unregistered", event.client_id)
    elif isinstance(event, ev.SegmentMounted):
        log.info("segment %s of %s mounted (%d bytes)", event.segment.segment_id,
                 event.segment.client_id, event.segment.size_bytes)
    elif isinstance(event, ev.SegmentUnmounted):
        log.info("segment %s of %s unmounted", event.segment_id, event.client_id)
    elif isinstance(event, ev.EvictionPass):
        log.debug("eviction pass: %d objects, %d bytes", event.num_objects, event.num_bytes)
    elif log.isEnabledFor(logging.DEBUG):
        log.debug("%s", event)


def raise_open_files_limit(max_connections: int) -> None:
    """Raise this process's soft limit of open files toward its hard limit, to what
    ``max_connections`` lean connections and the rest need (a shell's soft limit is often
    1,024: a few hundred clients would meet EMFILE); warn when the hard limit is lower."""
    wanted = max_connections + FILES_BESIDE_CONNECTIONS
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(hard, wanted)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        log.info("open-files limit raised from %d to %d", soft, target)
    if hard != resource.RLIM_INFINITY and hard < wanted:
        log.warning("the open-files hard limit is %d: fewer than --max-connections %d lean "
                    "connections can be served; raise it (systemd LimitNOFILE, ulimit -Hn)",
                    hard, max_connections)


async def run(config: MasterConfig) -> int:
    """Run the daemon until SIGTERM/SIGINT; return the exit code."""
    raise_open_files_limit(config.max_connections)
    if config.partitions > 1:
        from kvpool_master.partitioned import run_partitioned
        return await run_partitioned(config)
    claim_state_dir(config.state_dir, 1)
    server = MasterServer(config)
    await server.start()
    await server.serve_until_stopped()
    return 0
