"""Member: a started client's place in the pool, complete when built.

``await Member.join(...)`` is the client's start:
1. remove shared memory left by dead processes of the cluster, create this client's segments;
2. serve them (the data server refuses every request until the master's key is known), and
   register them with the transfer engine when this client uses one;
3. register (waiting for an id whose previous holder is dying), stamp the ownership proof into
   the segments, mount them;
4. build the parts both drivers share, the asyncio driver and the async writer; start
   heartbeating.
Each step registers its undo as it succeeds: ``leave()`` runs them in reverse, and a join that
fails half way runs those it has, so nothing is left behind either way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
from dataclasses import dataclass, field
from functools import partial

from kvpool_client.asyncwrite import AsyncWriter
from kvpool_client.config import ClientConfig
from kvpool_client.core.regions import Regions, total_bytes
from kvpool_client.drivers.aio import AsyncDataPath
from kvpool_client.drivers.blocking import BlockingDataPath
from kvpool_client.drivers.parts import Parts
from kvpool_client.liveness import Liveness, MasterAddress, register_waiting
from kvpool_client.loops import off_loop
from kvpool_client.metrics import ClientMetrics
from kvpool_client.rpc import MasterRpc, MasterSession
from kvpool_client.segments import LocalSegment, cleanup_stale_segments, split_sizes
from kvpool_client.ssd import SsdSegment, cleanup_stale_files
from kvpool_client.tiercopy import TierCopier
from kvpool_client.transfer.copy import ParallelCopier
from kvpool_client.transfer.engine import DEFAULT_STAGING_BYTES, EngineTransport, open_engine
from kvpool_client.transfer.files import FileTransport
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
#: How long a join waits for the master to mount a segment whose id it is still sweeping.
MOUNT_WAIT_S = 120.0


def checksum_max_bytes(setting: bool | str) -> int:
    """The largest object a put checksums under the ``checksum`` setting (0: none)."""
    if setting == "auto":
        return CHECKSUM_AUTO_MAX_BYTES
    return (1 << 63) if setting else 0


def copy_threads() -> int:
    """Threads that copy one large shared-memory batch (the caller counted, when it takes
    part), for config ``copy_threads: 0``: one per four cores this process may run on, at
    least two and at most four (README, "Data plane", has the measurements behind it)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        cpus = os.cpu_count() or 1
    return 1 if cpus < 2 else min(4, max(2, cpus // 4))


@dataclass(eq=False)
class Member:
    """What a started client holds: its segments and their server, its master stub, its
    liveness, the drivers' shared parts, the asyncio driver and the async writer."""

    config: ClientConfig
    client_id: str
    host_id: str
    master: MasterAddress
    session: MasterSession
    segments: dict[str, LocalSegment]
    ssd_segments: dict[str, SsdSegment]
    copier: TierCopier | None  # None: this client has no SSD tier
    server: DataServer | None  # None: this client contributes no memory
    engine: EngineTransport | None  # None: no transfer engine (shm and kvpool's TCP only)
    rpc: MasterRpc
    liveness: Liveness
    parts: Parts
    datapath: AsyncDataPath
    writer: AsyncWriter
    _undo: contextlib.AsyncExitStack
    _rpc_epoch: int = 0
    _background: set[asyncio.Task[None]] = field(default_factory=set)

    @classmethod
    async def join(cls, config: ClientConfig, client_id: str, host_id: str,
                   master: MasterAddress, session: MasterSession,
                   metrics: ClientMetrics, engine: object = None) -> Member:
        """Join the pool (see the module's steps); ``engine``: a TransferEngine the caller
        built and initialised, used instead of one of this client's own. Raises KVPoolError
        (RPC_FAILED / TIMEOUT when the master cannot be reached, NO_SPACE when /dev/shm cannot
        hold the segments, PERMISSION_DENIED when the master's ``--engine-transport`` refuses
        this client's choice, ...), after undoing what was done."""
        undo = contextlib.AsyncExitStack()
        try:
            return await cls._join(config, client_id, host_id, master, session, metrics, undo,
                                   engine)
        except BaseException:
            await undo.aclose()
            raise

    @classmethod
    async def _join(cls, config: ClientConfig, client_id: str, host_id: str,
                    master: MasterAddress, session: MasterSession, metrics: ClientMetrics,
                    undo: contextlib.AsyncExitStack, handed_engine: object) -> Member:
        segments = await _create_segments(config, client_id, undo)
        ssd_segments = await _create_ssd_segments(config, client_id, undo)
        engine = await _engine_transport(config, handed_engine, segments, undo)
        huge_bytes = sum(s.huge_bytes for s in segments.values())
        metrics.segment_page_bytes.update({
            "2MiB": huge_bytes, "4KiB": sum(s.size_bytes for s in segments.values()) - huge_bytes})
        server = _serve(config, {**segments, **ssd_segments}, session, metrics, undo)
        hostname = server.endpoint if server is not None else config.local_hostname

        def descriptors() -> list[SegmentInfo]:
            endpoint = server.endpoint if server is not None else ""
            session_id = engine.session_id if engine is not None else ""
            return [s.describe(host_id, endpoint, session_id) for s in segments.values()] + \
                [s.describe(host_id, endpoint) for s in ssd_segments.values()]

        def stamp_segments(key: bytes) -> None:
            """Write the ownership proof of ``key`` into every segment (before mounting)."""
            for segment in segments.values():
                segment.stamp_owner(key)
            for ssd in ssd_segments.values():
                ssd.stamp_owner(key)

        def set_serving_key(key: bytes) -> None:
            if server is not None:
                server.capability_key = key  # a plain attribute read at every request

        rpc = master.stub(session=session)
        undo.push_async_callback(rpc.close)
        registration = await register_waiting(rpc, client_id, host_id, hostname)
        undo.push_async_callback(_unregister, rpc, client_id)
        set_serving_key(registration.capability_key)
        stamp_segments(registration.capability_key)
        mounted = descriptors()
        for descriptor in mounted:
            status = await _mount_when_swept(rpc, client_id, descriptor)
            if status == Status.PERMISSION_DENIED:
                raise KVPoolError(status, f"the master refused segment {descriptor.segment_id}"
                                  f" {'with' if engine else 'without'} a transfer engine "
                                  "(its --engine-transport setting)")
            if status not in _OK_STATUSES:
                # SEGMENT_ALREADY_EXISTS: another live client mounted a segment of this id.
                raise KVPoolError(status, f"mounting segment {descriptor.segment_id} failed")
        liveness = Liveness(
            master=master, session=session, client_id=client_id, host_id=host_id,
            hostname=hostname, registration=registration,
            registered_at=registration.clock.sent_s, segments=descriptors,
            set_serving_key=set_serving_key, stamp_segments=stamp_segments,
            interval_s=config.heartbeat_interval_s, metrics=metrics)
        parts = Parts(
            client_id=client_id, local_host_id=host_id, transport=config.transport,
            shm=ShmTransport(segments, copier=ParallelCopier(
                config.copy_threads or copy_threads()), populate=config.populate_peer_segments),
            checksum_max_bytes=checksum_max_bytes(config.checksum), metrics=metrics,
            liveness=liveness, session=session, engine=engine,
            files=FileTransport(ssd_segments, host_id))
        parts.remember(mounted)
        undo.push_async_callback(parts.shm.close)
        undo.callback(parts.files.close)

        async def write(keys: list[bytes], regions: list[Regions],
                        options: PutOptions) -> list[Status]:
            """The async writer's write (it still runs while ``close`` drains the queue)."""
            return await datapath.write(keys, regions, [total_bytes(r) for r in regions],
                                        options)

        writer = AsyncWriter(write, config.async_write_queue_size, metrics)
        timeout_s = config.rpc_timeout_s * 2
        datapath = AsyncDataPath(
            parts, rpc, TcpTransport(timeout_s=config.transfer_timeout_s),
            reregistered=partial(_reregistered, rpc, liveness, client_id, host_id, hostname,
                                 timeout_s),
            remounted=partial(_remounted, liveness, timeout_s),
            commits=writer if config.commit_nowait else None)
        undo.push_async_callback(datapath.tcp.close)
        liveness.start()
        undo.push_async_callback(off_loop, liveness.stop)
        copier = None
        if ssd_segments:
            copier = TierCopier(client_id, partial(master.blocking_stub, session), segments,
                                ssd_segments, config.ssd_copy_threads, metrics,
                                min(config.ssd_poll_interval_s, config.rpc_timeout_s / 2),
                                partitions=lambda: len(session.partitions))
            session.on_copy_tasks = copier.poke
            copier.start()
            undo.push_async_callback(off_loop, copier.stop)
        logger.info("client %s joined %s with %d segments (%d bytes), data server %s",
                    client_id, config.master_server_address, len(segments),
                    config.global_segment_size, hostname)
        return cls(config=config, client_id=client_id, host_id=host_id, master=master,
                   session=session, segments=segments, ssd_segments=ssd_segments,
                   copier=copier, server=server, engine=engine, rpc=rpc,
                   liveness=liveness, parts=parts, datapath=datapath, writer=writer,
                   _undo=undo)

    @property
    def hostname(self) -> str:
        """``"ip:port"`` of the data server (``local_hostname`` when it serves nothing)."""
        return self.server.endpoint if self.server is not None else self.config.local_hostname

    def path(self) -> AsyncDataPath:
        """The asyncio driver; after a re-registration, first lets this loop's stub learn the
        master's (new) fast port, in the background."""
        epoch = self.liveness.epoch
        if epoch != self._rpc_epoch:
            self._rpc_epoch = epoch
            task = asyncio.get_running_loop().create_task(_refresh_stub(
                self.rpc, self.liveness, self.client_id, self.host_id, self.hostname))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        return self.datapath

    def blocking_path(self) -> BlockingDataPath:
        """A blocking driver over these parts, for the sync client (its own master stub and
        TCP connections; the same segments, mappings and liveness)."""
        return BlockingDataPath(
            self.parts, self.master.blocking_stub(self.session),
            BlockingTcpTransport(timeout_s=self.config.transfer_timeout_s),
            membership=self.liveness, host_id=self.host_id, hostname=self.hostname,
            reregister_timeout_s=self.config.rpc_timeout_s * 2)

    async def leave(self) -> None:
        """Stop heartbeating, close the drivers' connections, leave the pool (segments
        unmounted, objects on them dropped), stop serving and free the segments."""
        await self._undo.aclose()


async def _create_segments(config: ClientConfig, client_id: str,
                           undo: contextlib.AsyncExitStack) -> dict[str, LocalSegment]:
    removed = cleanup_stale_segments(config.cluster_id)
    if removed:
        logger.info("removed %d stale segments of cluster %s", len(removed), config.cluster_id)
    segments: dict[str, LocalSegment] = {}
    for index, size_bytes in enumerate(split_sizes(config.global_segment_size,
                                                   config.max_segment_size)):
        # Pre-faulting takes ~0.15 s per GiB: keep the event loop free meanwhile.
        segment = await asyncio.to_thread(LocalSegment.create, config.cluster_id, client_id,
                                          index, size_bytes, huge_pages=config.use_hugepage)
        undo.callback(segment.close)
        segments[segment.segment_id] = segment
    return segments


async def _create_ssd_segments(config: ClientConfig, client_id: str,
                               undo: contextlib.AsyncExitStack) -> dict[str, SsdSegment]:
    """The SSD tier's segment (none without one); files left by earlier processes go first:
    what they held was dropped by the master when their owner expired."""
    size_bytes = config.ssd_bytes
    if not size_bytes:
        return {}
    removed = await asyncio.to_thread(cleanup_stale_files, config.ssd_path, config.cluster_id)
    if removed:
        logger.info("removed %d stale SSD segment files under %s", len(removed), config.ssd_path)
    segment = await asyncio.to_thread(SsdSegment.create, config.ssd_path, config.cluster_id,
                                      client_id, 0, size_bytes)
    undo.callback(segment.close)
    return {segment.segment_id: segment}


def wants_engine(config: ClientConfig) -> bool:
    """Whether the config asks for the engine transport: ``"transport": "engine"``, or
    ``"auto"`` with a ``protocol`` only a transfer engine speaks."""
    return config.transport == "engine" or (
        config.transport == "auto" and config.protocol not in ("tcp", "ascend_no_transport"))


async def _engine_transport(config: ClientConfig, handed: object,
                            segments: dict[str, LocalSegment],
                            undo: contextlib.AsyncExitStack) -> EngineTransport | None:
    """The engine transport with every segment registered, or None when the config does not
    ask for one. With ``"transport": "auto"`` an engine that is not installed or does not start
    is a warning (kvpool's TCP moves the bytes); with ``"engine"`` it is an error."""
    if not wants_engine(config) and handed is None:
        return None
    host = config.data_host
    try:
        engine = handed if handed is not None else \
            await asyncio.to_thread(open_engine, host, config.protocol, config.device_name)
        transport = EngineTransport(engine, host, staging_bytes=config.local_buffer_size
                                    or DEFAULT_STAGING_BYTES)
    except KVPoolError as exc:
        if config.transport == "engine":
            raise
        logger.warning("protocol %r: no transfer engine (%s); kvpool's TCP moves the bytes "
                       "between hosts", config.protocol, exc.message)
        return None
    undo.callback(transport.close)
    for segment in segments.values():
        transport.register(segment.address, segment.size_bytes)
        undo.callback(transport.unregister, segment.address)
    logger.info("transfer engine %s (protocol %s) reaches %d segments", transport.session_id,
                config.protocol, len(segments))
    return transport


def _serve(config: ClientConfig, segments: dict[str, LocalSegment | SsdSegment],
           session: MasterSession,
           metrics: ClientMetrics, undo: contextlib.AsyncExitStack) -> DataServer | None:
    """Serve ``segments`` (None when there are none), refusing everything until the master's
    key for this client is installed."""
    if not segments:
        return None
    unreachable = config.unreachable_by_peers()
    if unreachable:
        logger.warning("%s", unreachable)
    server = DataServer(segments, secrets.token_bytes(32), host=config.data_host,
                        frame_timeout_s=config.transfer_timeout_s,
                        clock=lambda: session.clock,
                        idle_timeout_s=config.data_idle_timeout_s,
                        max_connections_per_peer=config.data_max_connections_per_peer,
                        port=config.data_port)
    try:
        server.start()
    except OSError as exc:
        low, high = config.data_port
        ports = "any port" if not low else f"port {low}" if low == high else f"ports {low}-{high}"
        raise KVPoolError(Status.INVALID_ARGUMENT, f"this client's data server cannot listen on "
                          f"{config.data_host}, {ports} (data_port): {exc.strerror or exc}"
                          ) from None
    undo.push_async_callback(off_loop, server.close)
    metrics.watch_refusals(lambda: {
        "refused": server.refused_total, "bad_frame": server.bad_frames_total,
        "timeout": server.timeouts_total,
        "too_many_connections": server.connections_rejected_total,
        "unproven_connection_closed": server.connections_evicted_total})
    return server


async def _unregister(rpc: MasterRpc, client_id: str) -> None:
    """Tell the master this client is gone, so its objects go now and not after client_ttl
    (an unreachable master expires it after client_ttl instead)."""
    try:
        await rpc.unregister_client(client_id)
    except KVPoolError as exc:
        logger.warning("leaving the pool: the master did not answer (%s); it expires this "
                       "client after client_ttl", exc)


async def _refresh_stub(rpc: MasterRpc, liveness: Liveness, client_id: str, host_id: str,
                        hostname: str) -> None:
    """After a re-registration, let ``rpc`` learn the master's (new) fast port.

    Registering again is idempotent for a known client (same key). Should the master have
    forgotten this client once more meanwhile, the key differs: liveness re-registers.
    """
    try:
        registration = await rpc.register_client(client_id, host_id, hostname)
    except KVPoolError as exc:
        logger.debug("refreshing the master stub failed: %s", exc)
        return
    if registration.capability_key != liveness.registration.capability_key:
        liveness.request_reregister()


async def _mount_when_swept(rpc: MasterRpc, client_id: str, descriptor: SegmentInfo,
                            wait_s: float | None = None) -> Status:
    """Mount ``descriptor`` and return the master's answer. The master answers the mount of a
    segment id it is still sweeping (the segment of this client id's previous holder, lost
    when it left or expired) only once that sweep is done, which may take longer than one
    call's deadline (10 M objects: about 10-20 s): a call that times out is made again, for
    at most ``wait_s`` (``MOUNT_WAIT_S``), each one answered once the segment is mounted.

    Raises KVPoolError as the call does (TIMEOUT once ``wait_s`` has passed)."""
    give_up_at = asyncio.get_running_loop().time() + (MOUNT_WAIT_S if wait_s is None
                                                      else wait_s)
    while True:
        try:
            status: Status = await rpc.mount_segment(client_id, descriptor)
            return status
        except KVPoolError as exc:
            if exc.status != Status.TIMEOUT or asyncio.get_running_loop().time() >= give_up_at:
                raise
            logger.info("mounting segment %s: no answer yet (the master answers once it has "
                        "swept a segment lost under this id); asking again",
                        descriptor.segment_id)


async def _remounted(liveness: Liveness, timeout_s: float) -> bool:
    """Wait for a re-registration under way to mount this client's segments again; False when
    none was under way (or it did not end in time)."""
    remount = liveness.remounting()
    if remount is None:
        return False
    try:
        await asyncio.wait_for(asyncio.wrap_future(remount), timeout_s)
    except (TimeoutError, KVPoolError):
        return False
    return True


async def _reregistered(rpc: MasterRpc, liveness: Liveness, client_id: str, host_id: str,
                        hostname: str, timeout_s: float) -> None:
    """Wait for liveness to re-register this client (a call answered UNKNOWN_CLIENT)."""
    try:
        await asyncio.wait_for(asyncio.wrap_future(liveness.request_reregister()), timeout_s)
    except TimeoutError:
        raise KVPoolError(Status.UNKNOWN_CLIENT, "the master does not know this client and "
                          f"re-registration did not finish within {timeout_s:g} s") from None
    await _refresh_stub(rpc, liveness, client_id, host_id, hostname)
