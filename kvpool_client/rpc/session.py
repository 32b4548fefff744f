"""What every master stub of one client shares: its session (token, master clock), the
registration it learns, and every Master call by name.

Rules of this file:
- ``MasterCalls`` names each call once over the stub's ``_run``: a coroutine function in the
  asyncio stub (``rpc.aio``), a plain function in the blocking one (``rpc.blocking``). The
  requests and the reading of answers come from ``kvpool_wire.calls``.
- Identity: a ``MasterSession`` (shared by every stub of one client) holds the token the last
  registration returned, which every client-scoped call presents and a re-registration proves
  itself with, the best known sample of the master's capability clock, and the master's lean
  endpoints that registration advertised (every stub of the session follows them, so a stub
  that never registers, such as the heartbeat's, still calls over the lean framing).
- Batches of any length (keys, or segment ids for ``get_segments``): a batch longer than the
  master's ``max_batch_keys`` (learnt at registration) goes as several calls of at most that
  many keys, whose answers are joined in key order. The master decodes a call's request
  whole, as one step between other clients' calls, so this bounds how long one batch holds
  it. Parts are sent together (the asyncio stub) or in turn (the blocking one); a part that
  fails fails its own keys, and the batch raises only when every part failed, as a single
  call would.
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
from kvpool_wire.types import Placement, PutOptions, ReadResult, SegmentInfo

T = TypeVar("T")

#: The most keys one call carries until a registration tells the master's limit (its
#: default ``max_batch_keys``).
DEFAULT_MAX_CALL_KEYS = 16_384


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


@dataclass(frozen=True, slots=True)
class LeanEndpoints:
    """Where the master serves the lean framing, as a registration answer said: its port, its
    abstract Unix socket ("" for none) and the pid that socket must belong to."""

    port: int = 0
    socket: str = ""
    master_pid: int = 0


#: Before any registration: calls go over gRPC.
NO_LEAN = LeanEndpoints()


class MasterSession:
    """One client's standing with the master, shared by all of its stubs: the token of its
    latest registration and the best known sample of the master's capability clock (see
    ``kvpool_wire.capability``). ``token`` and ``clock`` are replaced whole, never mutated;
    the leases waiting to be ended are a list behind a lock (any thread reads and sends)."""

    __slots__ = ("token", "clock", "max_call_keys", "lean", "_ended", "_ended_lock",
                 "on_copy_tasks")

    def __init__(self) -> None:
        self.token = b""
        #: the master's lean endpoints, from the latest registration answer of any stub: every
        #: stub of the session follows them (the heartbeat stub never registers itself)
        self.lean = NO_LEAN
        #: the most keys one call carries: the master's max_batch_keys once a registration
        #: said it
        self.max_call_keys = DEFAULT_MAX_CALL_KEYS
        # called with the number of tier copies waiting, when a heartbeat says some do
        self.on_copy_tasks: Callable[[int], None] | None = None
        self.clock = MasterClock(0, 0, 0.0)
        self._ended: list[int] = []  # ids of leases read under, not sent yet
        self._ended_lock = threading.Lock()

    def end_lease(self, lease_ids: Sequence[int], keys: list[bytes]) -> None:
        """Reads under the leases ``lease_ids`` of ``keys`` are done: tell the master with this
        client's next GetReplicas, PutStart or Remove (no call of its own; a lease whose end is
        never sent runs its time; the master knows the keys, so only the ids go)."""
        if lease_ids and keys:
            with self._ended_lock:
                self._ended.extend(lease_ids)

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

    def _run_parts(self, parts: list[Call[Any]], join: Callable[[list[Any]], Any]) -> Any:
        """``join`` of the results of ``parts`` in order, a part that raised KVPoolError as
        that error (see the module rules)."""
        raise NotImplementedError

    def _batch(self, parts: list[Call[Any]], join: Callable[[list[Any]], Any]) -> Any:
        """Run a batch's calls: one as it is, several joined (see the module rules)."""
        return self._run(parts[0]) if len(parts) == 1 else self._run_parts(parts, join)

    def _spans(self, num_keys: int) -> list[tuple[int, int]]:
        """``[start, end)`` of each call a batch of ``num_keys`` goes as."""
        most = self.session.max_call_keys
        if num_keys <= most:
            return [(0, num_keys)]
        return [(start, min(start + most, num_keys)) for start in range(0, num_keys, most)]

    def _follow_lean(self) -> None:
        """Use the session's lean endpoints (``session.lean``, maybe new) from now on."""

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
        if answer.max_batch_keys:
            self.session.max_call_keys = answer.max_batch_keys
        self.session.lean = LeanEndpoints(answer.fast_port, answer.fast_socket, answer.master_pid)
        self._follow_lean()
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
        """-> descriptors of the given segments (None where unknown, or where their part of
        a long list failed)."""
        spans = self._spans(len(segment_ids))
        return self._batch([calls.get_segments(segment_ids[a:b]) for a, b in spans],
                           functools.partial(joined_lists, spans, lambda _: None))

    # -- objects ----------------------------------------------------------------------------------

    def put_start(self, client_id: str, keys: Sequence[bytes], sizes_bytes: Sequence[int],
                  options: PutOptions, parent_keys: Sequence[bytes] | None = None) -> Any:
        """Allocate space per key -> [(OK, placements) | (ALREADY_EXISTS | NO_SPACE | ..., ())]."""
        session = self.session
        ended = session.take_ended()
        spans = self._spans(len(keys))
        return self._batch([calls.put_start(client_id, session.token, keys[a:b], sizes_bytes[a:b],
                                            options, parent_keys[a:b] if parent_keys else None,
                                            ended if a == 0 else ()) for a, b in spans],
                           functools.partial(joined_lists, spans, lambda s: (s, ())))

    def put_end(self, client_id: str, keys: Sequence[bytes],
                checksums: Sequence[int] | None = None) -> Any:
        """Commit PENDING keys -> OK per key, or NOT_FOUND / PERMISSION_DENIED / ..."""
        return self._batch(*self.put_end_calls(client_id, keys, checksums))

    def put_end_calls(self, client_id: str, keys: Sequence[bytes],
                      checksums: Sequence[int] | None = None
                      ) -> tuple[list[Call[list[Status]]], Callable[[list[Any]], list[Status]]]:
        """The calls a commit of ``keys`` goes as, and how their answers join."""
        token = self.session.token
        spans = self._spans(len(keys))
        return ([calls.put_end(client_id, token, keys[a:b], checksums[a:b] if checksums else None)
                 for a, b in spans], functools.partial(joined_lists, spans, lambda s: s))

    def put_revoke(self, client_id: str, keys: Sequence[bytes]) -> Any:
        """Abandon PENDING keys (after a failed transfer) -> OK per key or why not."""
        token = self.session.token
        spans = self._spans(len(keys))
        return self._batch([calls.put_revoke(client_id, token, keys[a:b]) for a, b in spans],
                           functools.partial(joined_lists, spans, lambda s: s))

    def get_replicas(self, client_id: str, keys: Sequence[bytes]) -> Any:
        """-> ReplicasAnswer (per key where its bytes are, with a read lease, or NOT_FOUND;
        lease_ttl_s; lease_ids). The lease counts from when this call was sent: reads must
        finish within lease_ttl_s; ``session.end_lease(lease_ids, keys)`` once they did."""
        session = self.session
        ended = session.take_ended()
        spans = self._spans(len(keys))
        return self._batch([calls.get_replicas(client_id, keys[a:b], session.token,
                                               ended if a == 0 else ()) for a, b in spans],
                           functools.partial(_joined_replicas, spans))

    def exist(self, client_id: str, keys: Sequence[bytes]) -> Any:
        """-> (per key OK or NOT_FOUND, its size in bytes, 0 when absent)."""
        spans = self._spans(len(keys))
        return self._batch([calls.exist(client_id, keys[a:b]) for a, b in spans],
                           functools.partial(_joined_exist, spans))

    def tiers(self, client_id: str, keys: Sequence[bytes]) -> Any:
        """-> per key the tier of its fastest replica, None when it does not exist."""
        spans = self._spans(len(keys))
        return self._batch([calls.tiers(client_id, keys[a:b]) for a, b in spans],
                           functools.partial(joined_lists, spans, lambda _: None))

    def query_prefix(self, client_id: str, keys: Sequence[bytes]) -> Any:
        """-> the number of leading keys that are READY (each is leased). Raises unless OK."""
        spans = self._spans(len(keys))
        return self._batch([calls.query_prefix(client_id, keys[a:b]) for a, b in spans],
                           functools.partial(_joined_prefix, spans))

    def remove(self, client_id: str, keys: Sequence[bytes], force: bool = False) -> Any:
        """Remove keys -> OK | NOT_FOUND | HAS_LEASE (unless force) | ... per key."""
        session = self.session
        ended = session.take_ended()
        spans = self._spans(len(keys))
        return self._batch([calls.remove(client_id, keys[a:b], force, session.token,
                                         ended if a == 0 else ()) for a, b in spans],
                           functools.partial(joined_lists, spans, lambda s: s))

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


# -- joining the answers of a batch sent as several calls ---------------------------------------

def _check_parts(results: list[Any]) -> None:
    """Raise the first error when every part failed (the batch failed as one call would)."""
    if all(isinstance(r, KVPoolError) for r in results):
        raise results[0]


def joined_lists(spans: list[tuple[int, int]], failed: Callable[[Status], Any],
                 results: list[Any]) -> list[Any]:
    """The per-key lists of the parts, in order; ``failed(status)`` for each key of a part
    that raised."""
    _check_parts(results)
    out: list[Any] = []
    for part, (a, b) in zip(results, spans, strict=True):
        out.extend([failed(part.status)] * (b - a) if isinstance(part, KVPoolError) else part)
    return out


def _joined_exist(spans: list[tuple[int, int]],
                  results: list[Any]) -> tuple[list[Status], list[int]]:
    _check_parts(results)
    statuses: list[Status] = []
    sizes: list[int] = []
    for part, (a, b) in zip(results, spans, strict=True):
        if isinstance(part, KVPoolError):
            statuses.extend([part.status] * (b - a))
            sizes.extend([0] * (b - a))
        else:
            statuses.extend(part[0])
            sizes.extend(part[1])
    return statuses, sizes


def _joined_prefix(spans: list[tuple[int, int]], results: list[Any]) -> int:
    """The leading keys found: a part counts only when every part before it found all of its
    keys (sent together, later parts may lease keys past the first miss; their leases run
    out); a part that failed ends the count, and fails the call when it is the first."""
    if isinstance(results[0], KVPoolError):
        raise results[0]
    found = 0
    for part, (a, b) in zip(results, spans, strict=True):
        if isinstance(part, KVPoolError):
            break
        found += int(part)
        if part < b - a:
            break
    return found


def _joined_replicas(spans: list[tuple[int, int]], results: list[Any]) -> calls.ReplicasAnswer:
    """One answer: the results in order, the shortest lease, every lease's id."""
    _check_parts(results)
    out: list[ReadResult[Placement]] = []
    lease_ids: list[int] = []
    lease_ttl_s = min(r.lease_ttl_s for r in results if not isinstance(r, KVPoolError))
    for part, (a, b) in zip(results, spans, strict=True):
        if isinstance(part, KVPoolError):
            out.extend([ReadResult(part.status, 0, (), 0)] * (b - a))
        else:
            out.extend(part.results)
            lease_ids.extend(part.lease_ids)
    return calls.ReplicasAnswer(out, lease_ttl_s, tuple(lease_ids))
