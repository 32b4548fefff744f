"""Liveness: heartbeats on their own thread, re-registration, and the client's right to write.

Rules of this file:
- Heartbeats run on a private loop thread with their own :class:`MasterRpc`, so a busy data path
  (large copies, a full event loop) never delays them.
- ``alive_until`` is the last moment this client can be sure the master still counts it as alive:
  the send time of the last answered heartbeat plus ``client_ttl``. Past it (the process was
  paused, or the master is unreachable) the client may already be expired and the bytes it was
  told to write may belong to someone else: writes are abandoned and the data server refuses
  every capability until a heartbeat answers again.
- Identity is the session's token (``rpc.MasterSession``, shared with the data path's stub):
  heartbeats and re-registrations present it. A registration refused with
  CLIENT_ALREADY_EXISTS (a process with the same fixed id that has not expired yet, e.g. this
  process's previous incarnation) waits until the master says the id is free
  (``register_waiting``); a holder that keeps heartbeating is an error.
- ``UNKNOWN_CLIENT`` (master restarted, or this client was expired after a pause) re-registers,
  installs the new capability key in the data server *before* remounting (so capabilities
  signed for the old incarnation are refused from then on), remounts every segment and bumps
  ``epoch``: writes started in an older epoch are abandoned and revoked. Until the segments
  are mounted again the master may answer a put NO_SPACE (after a restart it knows no segment
  yet): ``remounting`` lets such a put wait for the remount and ask again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvpool_client.config import ClientConfig
from kvpool_client.loops import LoopThread
from kvpool_client.metrics import ClientMetrics
from kvpool_client.rpc import (
    BlockingMasterRpc,
    ClientIdTaken,
    MasterRpc,
    MasterSession,
    Registration,
    TlsConfig,
)
from kvpool_wire.status import KVPoolError, Status
from kvpool_wire.types import SegmentInfo

logger = logging.getLogger(__name__)

#: Retry pace while the master does not answer or a re-registration failed.
RETRY_INTERVAL_S = 0.2
#: A heartbeat never waits longer than this for its answer (it must not outlive the TTL).
MAX_HEARTBEAT_TIMEOUT_S = 2.0


@dataclass(frozen=True, slots=True)
class MasterAddress:
    """How to reach the master (each loop builds its own stub from it)."""

    address: str
    timeout_s: float
    tls: TlsConfig | None
    auth_token: str
    use_fast_path: bool
    busy_poll_us: int = 0

    @classmethod
    def of(cls, config: ClientConfig) -> MasterAddress:
        """How to reach the master of ``config``."""
        tls = TlsConfig(config.tls_ca, config.tls_cert, config.tls_key) \
            if (config.tls_ca or config.tls_cert) else None
        return cls(config.master_server_address, config.rpc_timeout_s, tls, config.auth_token,
                   config.use_fast_path, config.busy_poll_us)

    def stub(self, timeout_s: float | None = None,
             session: MasterSession | None = None) -> MasterRpc:
        """A new asyncio stub for the calling loop (acting for ``session``'s client, if given)."""
        return MasterRpc(self.address, timeout_s=timeout_s or self.timeout_s, tls=self.tls,
                         auth_token=self.auth_token, use_fast_path=self.use_fast_path,
                         session=session)

    def blocking_stub(self, session: MasterSession | None = None) -> BlockingMasterRpc:
        """A new blocking stub (any thread may call it)."""
        return BlockingMasterRpc(self.address, timeout_s=self.timeout_s, tls=self.tls,
                                 auth_token=self.auth_token, use_fast_path=self.use_fast_path,
                                 busy_poll_us=self.busy_poll_us, session=session)


#: A refused registration waits this much past the time the master said the id is free, and
#: gives up when the id is not free this long after the first answer said it would be.
REGISTER_WAIT_SLACK_S = 0.5
REGISTER_GIVE_UP_S = 3.0


async def register_waiting(rpc: MasterRpc, client_id: str, host_id: str,
                           hostname: str) -> Registration:
    """Register; when another client still holds the id, wait until the master says it is
    free (its holder silent for client_ttl) and try again. Raises ClientIdTaken when the holder
    outlives the first answer's estimate (it heartbeats: another live process uses the id)."""
    give_up_at = 0.0
    while True:
        try:
            registration: Registration = await rpc.register_client(client_id, host_id,
                                                                   hostname)
            return registration
        except ClientIdTaken as exc:
            now = time.monotonic()
            if not give_up_at:
                give_up_at = now + exc.retry_after_s + REGISTER_GIVE_UP_S
                logger.warning("client id %r is still held by a live client (a previous "
                               "incarnation of this process?); waiting %.1f s for the master "
                               "to expire it", client_id, exc.retry_after_s)
            if now + exc.retry_after_s > give_up_at:
                raise
            await asyncio.sleep(exc.retry_after_s + REGISTER_WAIT_SLACK_S)


class Liveness:
    """Keeps one client registered and alive; see the module docstring."""

    def __init__(self, *, master: MasterAddress, session: MasterSession, client_id: str,
                 host_id: str, hostname: str, registration: Registration, registered_at: float,
                 segments: Callable[[], list[SegmentInfo]],
                 set_serving_key: Callable[[bytes], None],
                 stamp_segments: Callable[[bytes], None], interval_s: float,
                 metrics: ClientMetrics) -> None:
        self._master = master
        self._session = session
        self._client_id = client_id
        self._host_id = host_id
        self._hostname = hostname
        self._segments = segments
        self._set_serving_key = set_serving_key
        self._stamp_segments = stamp_segments
        self._fixed_interval_s = interval_s
        self._metrics = metrics
        self._lock = threading.Lock()
        self._registration = registration
        self._epoch = 0
        self.alive_until = registered_at + registration.client_ttl_s
        self._suspended = False  # data server refusing everything while liveness is unproven
        self._unanswered = False  # the latest heartbeat got no answer
        self._needs_mount = False
        self._reregistering = False  # from sending RegisterClient until every segment is mounted
        self._waiters: list[concurrent.futures.Future[int]] = []
        self._thread: LoopThread | None = None
        self._wake: asyncio.Event | None = None
        self._task: concurrent.futures.Future[None] | None = None
        self._stopping = False

    # -- read by the data path (any thread) -------------------------------------------------------

    @property
    def epoch(self) -> int:
        """Incremented by every re-registration."""
        return self._epoch

    @property
    def registration(self) -> Registration:
        """The master's answer to the latest registration."""
        return self._registration

    def is_alive(self, now: float | None = None) -> bool:
        """True while the master certainly still counts this client as alive."""
        return (time.monotonic() if now is None else now) < self.alive_until

    @property
    def master_answers(self) -> bool:
        """Whether the master answered this client's latest heartbeat (or registration) and
        this client is alive there: False from a heartbeat that failed until one answers."""
        return not self._unanswered and self.is_alive()

    def request_reregister(self) -> concurrent.futures.Future[int]:
        """Ask for a re-registration now (a call got UNKNOWN_CLIENT).

        Returns a future of the new epoch; it fails with UNAVAILABLE when liveness stops first.
        """
        future: concurrent.futures.Future[int] = concurrent.futures.Future()
        with self._lock:
            if self._stopping:
                future.set_exception(KVPoolError(Status.UNAVAILABLE, "the client is closed"))
                return future
            self._waiters.append(future)
        self._poke()
        return future

    def remounting(self) -> concurrent.futures.Future[int] | None:
        """While a re-registration is under way (this client's segments may not all be mounted
        again yet), a future of its end, as ``request_reregister``; None otherwise."""
        future: concurrent.futures.Future[int] = concurrent.futures.Future()
        with self._lock:
            if not self._reregistering or self._stopping:
                return None
            self._waiters.append(future)
        self._poke()
        return future

    # -- lifecycle --------------------------------------------------------------------------------

    def start(self) -> None:
        """Start heartbeating on a private thread."""
        self._thread = LoopThread(f"kvpool-heartbeat-{self._client_id}")
        self._task = asyncio.run_coroutine_threadsafe(self._main(), self._thread.loop)

    def stop(self) -> None:
        """Stop heartbeating and wait for the thread (idempotent)."""
        with self._lock:
            self._stopping = True
            waiters, self._waiters = self._waiters, []
        for future in waiters:
            future.set_exception(KVPoolError(Status.UNAVAILABLE, "the client is closed"))
        if self._thread is None:
            return
        self._poke()
        if self._task is not None:
            try:
                self._task.result(timeout=self._master.timeout_s + 1.0)
            except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError):
                logger.warning("heartbeat thread did not stop in time")
        self._thread.stop()
        self._thread = None

    def _poke(self) -> None:
        thread, wake = self._thread, self._wake
        if thread is not None and wake is not None:
            with contextlib.suppress(RuntimeError):  # loop already closed
                thread.loop.call_soon_threadsafe(wake.set)

    # -- the heartbeat loop (private thread) ------------------------------------------------------

    def _interval_s(self) -> float:
        return self._fixed_interval_s or self._registration.client_ttl_s / 3

    async def _main(self) -> None:
        self._wake = asyncio.Event()
        timeout_s = min(self._master.timeout_s, MAX_HEARTBEAT_TIMEOUT_S,
                        max(self._registration.client_ttl_s / 3, 0.05))
        rpc = self._master.stub(timeout_s, self._session)
        next_beat = time.monotonic() + self._interval_s()
        try:
            while not self._stopping:
                now = time.monotonic()
                # Wake for the next beat, or exactly when liveness lapses, or when poked.
                wait_s = min(next_beat, self.alive_until if not self._suspended else next_beat)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), max(wait_s - now, 0.0))
                self._wake.clear()
                if self._stopping:
                    break
                self._check_lapse()
                if time.monotonic() < next_beat and not self._waiters:
                    continue
                ok = await self._beat(rpc)
                next_beat = time.monotonic() + (self._interval_s() if ok else RETRY_INTERVAL_S)
        finally:
            await rpc.close()

    def _check_lapse(self) -> None:
        if not self._suspended and not self.is_alive():
            logger.warning("client %s: no heartbeat answered for client_ttl; refusing data-plane "
                           "requests until the master answers", self._client_id)
            self._suspended = True
            self._set_serving_key(os.urandom(32))

    async def _beat(self, rpc: MasterRpc) -> bool:
        """One heartbeat (or re-registration); True when the master answered as hoped."""
        if self._waiters or self._reregistering:   # (a pending remount is part of one)
            # A re-registration whose answer was lost may have registered this client anew
            # (a new key): finish it (registering is idempotent) rather than trust a heartbeat.
            return await self._reregister(rpc)
        sent = time.monotonic()
        try:
            status = await rpc.heartbeat(self._client_id)
        except KVPoolError as exc:
            self._metrics.heartbeat_failures += 1
            self._unanswered = True
            logger.debug("heartbeat failed: %s", exc)
            self._check_lapse()
            return False
        if status == Status.OK:
            self._mark_alive(sent, self._registration.client_ttl_s)
            return True
        self._metrics.heartbeat_failures += 1
        if status == Status.UNKNOWN_CLIENT:
            logger.warning("client %s: master does not know this client (restarted, or this "
                           "client was expired); re-registering", self._client_id)
            return await self._reregister(rpc)
        logger.warning("heartbeat answered %s", status.name)
        return False

    async def _reregister(self, rpc: MasterRpc) -> bool:
        sent = time.monotonic()
        with self._lock:
            self._reregistering = True
        if not self._needs_mount:
            try:
                registration = await rpc.register_client(self._client_id, self._host_id,
                                                         self._hostname)
            except KVPoolError as exc:
                # ClientIdTaken too: another process took this id while this one was expired.
                logger.warning("re-registration failed: %s", exc)
                self._check_lapse()
                return False
            with self._lock:
                self._registration = registration
                self._epoch += 1
            # Before any segment is mounted again: capabilities of the old incarnation die here,
            # and the segments carry the proof of the (maybe new) key for their mappers.
            self._set_serving_key(registration.capability_key)
            self._stamp_segments(registration.capability_key)
            self._suspended = False
            self._metrics.reregistrations += 1
            self._needs_mount = True
        for segment in self._segments():
            try:
                status = await rpc.mount_segment(self._client_id, segment)
            except KVPoolError as exc:
                logger.warning("remount of segment %s failed: %s", segment.segment_id, exc)
                return False
            if status != Status.OK:
                # SEGMENT_ALREADY_EXISTS: another live client mounted a segment of this id.
                logger.error("remount of segment %s answered %s", segment.segment_id,
                             status.name)
                if status == Status.UNKNOWN_CLIENT:
                    self._needs_mount = False  # register again from the start
                    return False
        self._needs_mount = False
        self._mark_alive(sent, self._registration.client_ttl_s)
        with self._lock:
            self._reregistering = False
            waiters, self._waiters = self._waiters, []
        for future in waiters:
            future.set_result(self._epoch)
        logger.info("client %s re-registered (epoch %d)", self._client_id, self._epoch)
        return True

    def _mark_alive(self, sent: float, client_ttl_s: float) -> None:
        self._unanswered = False
        self.alive_until = max(self.alive_until, sent + client_ttl_s)
        if self._suspended:
            self._suspended = False
            self._set_serving_key(self._registration.capability_key)
            logger.info("client %s: master answers again; serving data-plane requests",
                        self._client_id)
