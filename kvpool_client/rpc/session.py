"""What every master stub of one client shares: its session (token, master clock), the
registration it learns, and every Master call by name.

Rules of this file:
- ``MasterCalls`` names each call once over the stub's ``_run``: a coroutine function in the
  asyncio stub (``rpc.aio``), a plain function in the blocking one (``rpc.blocking``). The
  requests and the reading of answers come from ``kvpool_wire.calls``.
- Identity: a ``MasterSession`` (shared by every stub of one client) holds the token the last
  registration returned, which every client-scoped call presents and a re-registration proves
  itself with, and the best known sample of the master's capability clock.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from kvpool_wire import calls
from kvpool_wire.calls import Call, RegisterAnswer
from kvpool_wire.capability import MasterClock
from kvpool_wire.status import KVPoolError, Status
from kvpool_wire.types import PutOptions, SegmentInfo

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Registration:
    """What the master told a client when it registered."""

    client_ttl_s: float
    capability_key: bytes
    master_id: str
    default_lease_ttl_s: float
    fast_port: int
    client_token: bytes = b""
    clock: MasterClock = MasterClock(0, 0, 0.0)


class MasterSession:
    """One client's standing with the master, shared by all of its stubs: the token of its
    latest registration and the best known sample of the master's capability clock (see
    ``kvpool_wire.capability``). ``token`` and ``clock`` are replaced whole, never mutated;
    the leases waiting to be ended are a list behind a lock (any thread reads and sends)."""

    __slots__ = ("token", "clock", "_ended", "_ended_lock", "on_copy_tasks")

    def __init__(self) -> None:
        self.token = b""
        # called with the number of tier copies waiting, when a heartbeat says some do
        self.on_copy_tasks: Callable[[int], None] | None = None
        self.clock = MasterClock(0, 0, 0.0)
        self._ended: list[int] = []  # ids of leases read under, not sent yet
        self._ended_lock = threading.Lock()

    def end_lease(self, lease_id: int, keys: list[bytes]) -> None:
        """Reads under lease ``lease_id`` of ``keys`` are done: tell the master with this
        client's next GetReplicas, PutStart or Remove (no call of its own; a lease whose end is
        never sent runs its time; the master knows the keys, so only the id goes)."""
        if lease_id and keys:
            with self._ended_lock:
                self._ended.append(lease_id)

    def take_ended(self) -> list[int]:
        """The ended leases not sent yet (the caller sends them)."""
        if not self._ended:
            return []
        with self._ended_lock:
            ended, self._ended = self._ended, []
        return ended

    def learn_clock(self, sample: MasterClock) -> None:
        """Keep the tighter of the known clock and ``sample`` (``sample`` on a new epoch)."""
        self.clock = self.clock.tighter(sample)


class ClientIdTaken(KVPoolError):
    """RegisterClient answered CLIENT_ALREADY_EXISTS: another live client (or one restored
    from the master's state) holds the id; it expires within ``retry_after_s``."""

    def __init__(self, client_id: str, retry_after_s: float) -> None:
        super().__init__(Status.CLIENT_ALREADY_EXISTS,
                         f"client id {client_id!r} is held by a live client; it is free in at "
                         f"most {retry_after_s:.1f} s unless that client heartbeats")
        self.retry_after_s = retry_after_s


@dataclass(frozen=True, slots=True)
class TlsConfig:
    """Client-side TLS: CA to trust (system CAs when empty); cert+key for mutual TLS."""

    ca_path: str = ""
    cert_path: str = ""
    key_path: str = ""


#: ``after(result, sent_s)``: what a call's result becomes, given when its request was sent.
After = Callable[[Any, float], Any]


class MasterCalls:
    """Every Master call by name. The return values are those documented on each method, as
    the stub's ``_run`` returns them: awaitables of them in the asyncio stub."""

    session: MasterSession

    def _run(self, call: Call[Any], after: After | None = None) -> Any:
        raise NotImplementedError

    def _learn_fast_path(self, answer: RegisterAnswer) -> None:
        """The master advertised (maybe new) lean-framing endpoints."""

    # -- clients and segments ---------------------------------------------------------------------

    def register_client(self, client_id: str, host_id: str, hostname: str) -> Any:
        """Register (or re-register, proving the session's token) a client -> Registration;
        raises ClientIdTaken when another client holds the id, KVPoolError unless OK."""
        return self._run(calls.register_client(client_id, host_id, hostname, self.session.token),
                         functools.partial(self._registered, client_id))

    def _registered(self, client_id: str, answer: RegisterAnswer, sent_s: float) -> Registration:
        if answer.status == Status.CLIENT_ALREADY_EXISTS:
            raise ClientIdTaken(client_id, answer.retry_after_ms / 1000)
        if answer.status != Status.OK:
            raise KVPoolError(answer.status, f"RegisterClient {client_id!r} refused")
        clock = MasterClock(answer.capability_epoch, answer.master_clock_ms, sent_s)
        self.session.token = answer.client_token
        self.session.learn_clock(clock)
        self._learn_fast_path(answer)
        return Registration(answer.client_ttl_ms / 1000, answer.capability_key, answer.master_id,
                            answer.default_lease_ttl_ms / 1000, answer.fast_port,
                            answer.client_token, clock)

    def heartbeat(self, client_id: str) -> Any:
        """OK, or UNKNOWN_CLIENT when the master forgot this client (re-register); an OK
        answer also tightens the session's sample of the master's clock."""
        return self._run(calls.heartbeat(client_id, self.session.token), self._beaten)

    def _beaten(self, answer: tuple[Status, int, int], sent_s: float) -> Status:
        status, master_clock_ms, copies_waiting = answer
        if status == Status.OK:
            session = self.session
            session.learn_clock(MasterClock(session.clock.epoch, master_clock_ms, sent_s))
            if copies_waiting and session.on_copy_tasks is not None:
                session.on_copy_tasks(copies_waiting)
        return status

    def copy_tasks(self, client_id: str, done: Sequence[tuple[int, Status]],
                   max_tasks: int, wait_s: float = 0.0) -> Any:
        """Report tier copies made and fetch more -> list of ``calls.CopyTask``; with
        ``wait_s``, the master may hold the answer that long until some wait (keep it well
        under the stub's timeout)."""
        return self._run(calls.copy_tasks(client_id, self.session.token, done, max_tasks,
                                          wait_s))

    def unregister_client(self, client_id: str) -> Any:
        """Graceful close -> OK (segments unmounted, objects dropped now) or UNKNOWN_CLIENT."""
        return self._run(calls.unregister_client(client_id, self.session.token))

    def mount_segment(self, client_id: str, segment: SegmentInfo) -> Any:
        """Mount (or identically remount) a segment this client owns -> Status."""
        return self._run(calls.mount_segment(client_id, self.session.token, segment))

    def unmount_segment(self, client_id: str, segment_id: str) -> Any:
        """Unmount a segment (its objects are dropped) -> Status."""
        return self._run(calls.unmount_segment(client_id, self.session.token, segment_id))

    def get_segments(self, segment_ids: Sequence[str]) -> Any:
        """-> descriptors of the given segments (None where unknown)."""
        return self._run(calls.get_segments(segment_ids))

    # -- objects ----------------------------------------------------------------------------------

    def put_start(self, client_id: str, keys: Sequence[bytes], sizes_bytes: Sequence[int],
                  options: PutOptions, parent_keys: Sequence[bytes] | None = None) -> Any:
        """Allocate space per key -> [(OK, placements) | (ALREADY_EXISTS | NO_SPACE | ..., ())]."""
        session = self.session
        return self._run(calls.put_start(client_id, session.token, keys, sizes_bytes,
                                         options, parent_keys, session.take_ended()))

    def put_end(self, client_id: str, keys: Sequence[bytes],
                checksums: Sequence[int] | None = None) -> Any:
        """Commit PENDING keys -> OK per key, or NOT_FOUND / PERMISSION_DENIED / ..."""
        return self._run(calls.put_end(client_id, self.session.token, keys, checksums))

    def put_revoke(self, client_id: str, keys: Sequence[bytes]) -> Any:
        """Abandon PENDING keys (after a failed transfer) -> OK per key or why not."""
        return self._run(calls.put_revoke(client_id, self.session.token, keys))

    def get_replicas(self, client_id: str, keys: Sequence[bytes]) -> Any:
        """-> ReplicasAnswer (per key where its bytes are, with a read lease, or NOT_FOUND;
        lease_ttl_s; lease_id). The lease counts from when this call was sent: reads must finish
        within lease_ttl_s; ``session.end_lease(lease_id, keys)`` once they did."""
        session = self.session
        return self._run(calls.get_replicas(client_id, keys, session.token,
                                            session.take_ended()))

    def exist(self, client_id: str, keys: Sequence[bytes]) -> Any:
        """-> (per key OK or NOT_FOUND, its size in bytes, 0 when absent)."""
        return self._run(calls.exist(client_id, keys))

    def tiers(self, client_id: str, keys: Sequence[bytes]) -> Any:
        """-> per key the tier of its fastest replica, None when it does not exist."""
        return self._run(calls.tiers(client_id, keys))

    def query_prefix(self, client_id: str, keys: Sequence[bytes]) -> Any:
        """-> the number of leading keys that are READY (each is leased). Raises unless OK."""
        return self._run(calls.query_prefix(client_id, keys))

    def remove(self, client_id: str, keys: Sequence[bytes], force: bool = False) -> Any:
        """Remove keys -> OK | NOT_FOUND | HAS_LEASE (unless force) | ... per key."""
        session = self.session
        return self._run(calls.remove(client_id, keys, force, session.token,
                                      session.take_ended()))

    def remove_all(self, client_id: str, force: bool = False) -> Any:
        """Remove every removable object -> how many. Raises unless OK."""
        return self._run(calls.remove_all(client_id, force))

    def remove_by_regex(self, client_id: str, pattern: str, force: bool = False) -> Any:
        """Remove objects whose key matches ``pattern`` -> how many (INVALID_ARGUMENT for a
        bad pattern)."""
        return self._run(calls.remove_by_regex(client_id, pattern, force))

    def get_stats(self) -> Any:
        """-> the master's /status document (clients, segments, capacity, usage, objects)."""
        return self._run(calls.get_stats())
