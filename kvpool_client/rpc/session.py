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
  call would (``rpc.joins``).
- A partitioned master (its registration answer lists the partitions): a batch's keys go
  to their partitions (``kvpool_wire.partitions``), each partition's in batch order, and
  the answers are joined at the keys' positions. Registration is partition 0's, then every
  other partition's with partition 0's ticket; heartbeats, segments, removals of every key
  and stats go to every partition; ``get_segments`` to partition 0, which knows every
  segment. Ended leases and copy results go to the partition their number names.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from kvpool_client.rpc.joins import (
    Route,
    all_ok,
    joined_exist,
    joined_lists,
    joined_prefix,
    joined_replicas,
    merged_status,
    picked,
    summed,
)
from kvpool_wire import calls
from kvpool_wire.calls import Call, RegisterAnswer
from kvpool_wire.capability import MasterClock
from kvpool_wire.partitions import PartitionEndpoint, partitions_of
from kvpool_wire.status import KVPoolError, Status
from kvpool_wire.types import PutOptions, SegmentInfo

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


class _Leg(Protocol):
    address: str


L = TypeVar("L", bound=_Leg)


def leg_for(legs: list[L], partition: int, host: str,
            partitions: Sequence[PartitionEndpoint],
            make: Callable[[str, int], L]) -> tuple[L, L | None]:
    """``legs[partition]`` (a stub's transports to one partition, ``make(address, partition)``
    makes one), made for every partition up to it as needed, or made again when the
    partition's address changed (the master restarted elsewhere); and the leg that replaced
    one had (the caller closes it), or None."""
    address = partition_address(host, partitions, partition)
    while len(legs) <= partition:
        legs.append(make(partition_address(host, partitions, len(legs)), len(legs)))
    leg = legs[partition]
    if leg.address == address:
        return leg, None
    legs[partition] = make(address, partition)
    return legs[partition], leg


def partition_address(host: str, partitions: Sequence[PartitionEndpoint], partition: int) -> str:
    """The gRPC address of ``partition`` of a partitioned master on ``host`` (that of
    partition 0, which the client was given); UNAVAILABLE when the master has no such
    partition any more (the client registers again and learns the new map)."""
    if partition >= len(partitions):
        raise KVPoolError(Status.UNAVAILABLE, f"the master has no partition {partition} now")
    port = partitions[partition].port
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class MasterSession:
    """One client's standing with the master, shared by all of its stubs: the token of its
    latest registration and the best known sample of the master's capability clock (see
    ``kvpool_wire.capability``). ``token`` and ``clock`` are replaced whole, never mutated;
    the leases waiting to be ended are a list behind a lock (any thread reads and sends)."""

    __slots__ = ("token", "clock", "max_call_keys", "lean", "partitions", "partition_ticket",
                 "_partition_leans", "_ended", "_ended_lock", "on_copy_tasks")

    def __init__(self) -> None:
        self.token = b""
        #: the master's lean endpoints, from the latest registration answer of any stub: every
        #: stub of the session follows them (the heartbeat stub never registers itself)
        self.lean = NO_LEAN
        #: the most keys one call carries: the master's max_batch_keys once a registration
        #: said it
        self.max_call_keys = DEFAULT_MAX_CALL_KEYS
        #: a partitioned master's partitions, as the latest registration listed them (its
        #: first is partition 0, ``lean`` above); empty for a master of one process
        self.partitions: tuple[PartitionEndpoint, ...] = ()
        self.partition_ticket = b""  # partition 0's ticket for joining the others
        self._partition_leans: tuple[LeanEndpoints, ...] = ()
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

    def keep_ended(self, lease_ids: list[int]) -> None:
        """Ended leases taken but not sent: they go with a later call."""
        if lease_ids:
            with self._ended_lock:
                self._ended.extend(lease_ids)

    def take_ended(self) -> list[int]:
        """The ended leases not sent yet (the caller sends them)."""
        if not self._ended:
            return []
        with self._ended_lock:
            ended, self._ended = self._ended, []
        return ended

    def learn_partitions(self, partitions: tuple[PartitionEndpoint, ...], ticket: bytes) -> None:
        """A registration's partitions (none, or one, for a master of one process)."""
        self.partitions = partitions if len(partitions) > 1 else ()
        self.partition_ticket = ticket
        self._partition_leans = tuple(LeanEndpoints(p.fast_port, p.fast_socket, p.master_pid)
                                      for p in self.partitions)

    def lean_of(self, partition: int) -> LeanEndpoints:
        """The lean endpoints of ``partition`` (0: ``lean``; NO_LEAN for one the master does
        not have), the same object until a registration changes them."""
        if not partition:
            return self.lean
        leans = self._partition_leans
        return leans[partition] if partition < len(leans) else NO_LEAN

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

#: (partition, call): one call of a batch and where it goes (0: the one master process)
Part = tuple[int, Call[Any]]


class MasterCalls:
    """Every Master call by name. The return values are those documented on each method, as
    the stub's ``_run`` returns them: awaitables of them in the asyncio stub."""

    session: MasterSession

    def _run(self, call: Call[Any], after: After | None = None, partition: int = 0) -> Any:
        raise NotImplementedError

    def _run_parts(self, parts: list[Part], join: Callable[[list[Any]], Any]) -> Any:
        """``join`` of the results of ``parts`` in order, a part that raised KVPoolError as
        that error (see the module rules)."""
        raise NotImplementedError

    def _then(self, first: Any, then: Callable[[Any], Any]) -> Any:
        """``then(result of first)``, and its result (awaited in the asyncio stub, where
        ``first`` and what ``then`` returns may be awaitables)."""
        raise NotImplementedError

    def _batch(self, parts: list[Part], join: Callable[[list[Any]], Any]) -> Any:
        """Run a batch's calls: one as it is, several joined (see the module rules)."""
        if len(parts) == 1:
            partition, call = parts[0]
            return self._run(call, None, partition)
        return self._run_parts(parts, join)

    def _routes(self, keys: Sequence[Any]) -> list[Route]:
        """The calls a batch of ``keys`` goes as: slices of at most ``max_call_keys`` keys, in
        order; for a partitioned master each partition's keys (in batch order) cut so."""
        session = self.session
        most = session.max_call_keys
        count = len(session.partitions)
        if count <= 1 or not keys:
            return self._slices(len(keys))
        positions: list[list[int]] = [[] for _ in range(count)]
        for position, partition in enumerate(partitions_of(keys, count)):
            positions[partition].append(position)
        return [(partition, mine[start:start + most])
                for partition, mine in enumerate(positions)
                for start in range(0, len(mine), most)]

    def _slices(self, num_keys: int) -> list[Route]:
        """A batch of ``num_keys`` for one process: slices of at most ``max_call_keys``, in
        order (one, empty, for none)."""
        most = self.session.max_call_keys
        if num_keys <= most:
            return [(0, range(num_keys))]
        return [(0, range(start, min(start + most, num_keys)))
                for start in range(0, num_keys, most)]

    def _everywhere(self) -> list[int]:
        """Every partition (the one master process: [0])."""
        return list(range(max(1, len(self.session.partitions))))

    def _ended_for(self, routes: list[Route]) -> list[Sequence[int]]:
        """The ended leases each route's call carries: each partition's with its first call
        (a lease's number names its partition); those of a partition no call goes to wait."""
        ended = self.session.take_ended()
        count = len(self.session.partitions)
        if count <= 1:
            return [ended if i == 0 else () for i in range(len(routes))]
        mine: list[list[int]] = [[] for _ in range(count)]
        for lease_id in ended:
            mine[lease_id % count].append(lease_id)
        out: list[Sequence[int]] = []
        for partition, _ in routes:
            out.append(mine[partition])
            mine[partition] = []
        self.session.keep_ended([lease_id for ids in mine for lease_id in ids])
        return out

    def _follow_lean(self) -> None:
        """Use the session's lean endpoints (``session.lean``, maybe new) from now on."""

    # -- clients and segments ---------------------------------------------------------------------

    def register_client(self, client_id: str, host_id: str, hostname: str) -> Any:
        """Register (or re-register, proving the session's token) a client -> Registration;
        with a partitioned master, at partition 0 and then at each of the others (with the
        ticket partition 0 gave). Raises ClientIdTaken when another client holds the id,
        KVPoolError unless OK."""
        return self._then(
            self._run(calls.register_client(client_id, host_id, hostname, self.session.token),
                      functools.partial(self._registered, client_id)),
            functools.partial(self._join_partitions, client_id, host_id, hostname))

    def _registered(self, client_id: str, answer: RegisterAnswer, sent_s: float) -> Registration:
        if answer.status == Status.CLIENT_ALREADY_EXISTS:
            raise ClientIdTaken(client_id, answer.retry_after_ms / 1000)
        if answer.status != Status.OK:
            raise KVPoolError(answer.status, f"RegisterClient {client_id!r} refused")
        clock = MasterClock(answer.capability_epoch, answer.master_clock_ms, sent_s)
        session = self.session
        session.token = answer.client_token
        session.learn_clock(clock)
        if answer.max_batch_keys:
            session.max_call_keys = answer.max_batch_keys
        session.lean = LeanEndpoints(answer.fast_port, answer.fast_socket, answer.master_pid)
        session.learn_partitions(answer.partitions, answer.partition_ticket)
        self._follow_lean()
        return Registration(answer.client_ttl_ms / 1000, answer.capability_key, answer.master_id,
                            answer.default_lease_ttl_ms / 1000, answer.fast_port,
                            answer.client_token, clock)

    def _join_partitions(self, client_id: str, host_id: str, hostname: str,
                         registration: Registration) -> Any:
        """``registration``, once every later partition registered the client too."""
        session = self.session
        if not session.partitions:
            return registration
        parts: list[Part] = [
            (partition, calls.register_client(client_id, host_id, hostname, session.token,
                                              registration.capability_key,
                                              session.partition_ticket))
            for partition in range(1, len(session.partitions))]

        def joined(answers: list[Any]) -> Registration:
            for partition, answer in enumerate(answers, 1):
                if isinstance(answer, KVPoolError):
                    raise answer
                status = answer.status
                if status != Status.OK or answer.capability_key != registration.capability_key:
                    raise KVPoolError(status if status != Status.OK else Status.INTERNAL_ERROR,
                                      f"partition {partition} refused client {client_id!r}")
            return registration
        return self._run_parts(parts, joined)

    def heartbeat(self, client_id: str) -> Any:
        """OK, or UNKNOWN_CLIENT when the master (any partition of it) forgot this client
        (re-register); an OK answer also tightens the session's sample of the master's
        clock."""
        call = calls.heartbeat(client_id, self.session.token)
        if not self.session.partitions:
            return self._run(call, self._beaten)
        sent_s = self._now_s()

        def joined(answers: list[Any]) -> Status:
            answered = [a for a in answers if not isinstance(a, KVPoolError)]
            if any(answer[0] == Status.UNKNOWN_CLIENT for answer in answered):
                return Status.UNKNOWN_CLIENT   # re-register (also where the map changed)
            for answer in answers:
                if isinstance(answer, KVPoolError):
                    raise answer
            status = all_ok([answer[0] for answer in answers])
            return self._beaten((status, max(answer[1] for answer in answers),
                                 sum(answer[2] for answer in answers)), sent_s)
        return self._run_parts([(p, call) for p in self._everywhere()], joined)

    def _now_s(self) -> float:
        """The clock ``After`` callbacks get their send time on."""
        raise NotImplementedError

    def _beaten(self, answer: tuple[Status, int, int], sent_s: float) -> Status:
        status, master_clock_ms, copies_waiting = answer
        if status == Status.OK:
            session = self.session
            session.learn_clock(MasterClock(session.clock.epoch, master_clock_ms, sent_s))
            if copies_waiting and session.on_copy_tasks is not None:
                session.on_copy_tasks(copies_waiting)
        return status

    def copy_tasks(self, client_id: str, done: Sequence[tuple[int, Status]],
                   max_tasks: int, wait_s: float = 0.0, partition: int = 0) -> Any:
        """Report tier copies made and fetch more -> list of ``calls.CopyTask``; with
        ``wait_s``, the master may hold the answer that long until some wait (keep it well
        under the stub's timeout). A partitioned master hands out each partition's copies
        on its own: ``partition`` is the one asked, ``done`` its tasks (a task's number names
        its partition)."""
        return self._run(calls.copy_tasks(client_id, self.session.token, done, max_tasks,
                                          wait_s), None, partition)

    def unregister_client(self, client_id: str) -> Any:
        """Graceful close -> OK (segments unmounted, objects dropped now) or UNKNOWN_CLIENT."""
        return self._on_every(calls.unregister_client(client_id, self.session.token), all_ok)

    def _on_every(self, call: Call[Any], join: Callable[[list[Any]], Any]) -> Any:
        """``call`` on every partition, the answers joined by ``join`` (for one master
        process: its answer)."""
        if not self.session.partitions:
            return self._run(call)
        return self._run_parts([(p, call) for p in self._everywhere()], join)

    def mount_segment(self, client_id: str, segment: SegmentInfo) -> Any:
        """Mount (or identically remount) a segment this client owns -> Status (on every
        partition of a partitioned master: each allocates in its share of it)."""
        return self._on_every(calls.mount_segment(client_id, self.session.token, segment),
                              all_ok)

    def unmount_segment(self, client_id: str, segment_id: str) -> Any:
        """Unmount a segment (its objects are dropped) -> Status."""
        return self._on_every(calls.unmount_segment(client_id, self.session.token, segment_id),
                              all_ok)

    def get_segments(self, segment_ids: Sequence[str]) -> Any:
        """-> descriptors of the given segments (None where unknown, or where their part of
        a long list failed); every partition knows every segment: partition 0 answers."""
        routes = self._slices(len(segment_ids))
        return self._batch([(0, calls.get_segments(picked(segment_ids, positions)))
                            for _, positions in routes],
                           functools.partial(joined_lists, routes, lambda _: None))

    # -- objects ----------------------------------------------------------------------------------

    def put_start(self, client_id: str, keys: Sequence[bytes], sizes_bytes: Sequence[int],
                  options: PutOptions, parent_keys: Sequence[bytes] | None = None) -> Any:
        """Allocate space per key -> [(OK, placements) | (ALREADY_EXISTS | NO_SPACE | ..., ())]."""
        session = self.session
        routes = self._routes(keys)
        ended = self._ended_for(routes)
        return self._batch([(partition, calls.put_start(
            client_id, session.token, picked(keys, positions), picked(sizes_bytes, positions),
            options, picked(parent_keys, positions) if parent_keys else None, ended[i]))
            for i, (partition, positions) in enumerate(routes)],
            functools.partial(joined_lists, routes, lambda s: (s, ())))

    def put_end(self, client_id: str, keys: Sequence[bytes],
                checksums: Sequence[int] | None = None) -> Any:
        """Commit PENDING keys -> OK per key, or NOT_FOUND / PERMISSION_DENIED / ..."""
        return self._batch(*self.put_end_calls(client_id, keys, checksums))

    def put_end_calls(self, client_id: str, keys: Sequence[bytes],
                      checksums: Sequence[int] | None = None
                      ) -> tuple[list[Part], Callable[[list[Any]], list[Status]]]:
        """The calls a commit of ``keys`` goes as, and how their answers join."""
        token = self.session.token
        routes = self._routes(keys)
        return ([(partition, calls.put_end(client_id, token, picked(keys, positions),
                                           picked(checksums, positions) if checksums else None))
                 for partition, positions in routes],
                functools.partial(joined_lists, routes, lambda s: s))

    def put_revoke(self, client_id: str, keys: Sequence[bytes]) -> Any:
        """Abandon PENDING keys (after a failed transfer) -> OK per key or why not."""
        token = self.session.token
        routes = self._routes(keys)
        return self._batch([(partition, calls.put_revoke(client_id, token,
                                                         picked(keys, positions)))
                            for partition, positions in routes],
                           functools.partial(joined_lists, routes, lambda s: s))

    def get_replicas(self, client_id: str, keys: Sequence[bytes]) -> Any:
        """-> ReplicasAnswer (per key where its bytes are, with a read lease, or NOT_FOUND;
        lease_ttl_s; lease_ids). The lease counts from when this call was sent: reads must
        finish within lease_ttl_s; ``session.end_lease(lease_ids, keys)`` once they did."""
        session = self.session
        routes = self._routes(keys)
        ended = self._ended_for(routes)
        return self._batch([(partition, calls.get_replicas(client_id, picked(keys, positions),
                                                           session.token, ended[i]))
                            for i, (partition, positions) in enumerate(routes)],
                           functools.partial(joined_replicas, routes))

    def exist(self, client_id: str, keys: Sequence[bytes]) -> Any:
        """-> (per key OK or NOT_FOUND, its size in bytes, 0 when absent)."""
        routes = self._routes(keys)
        return self._batch([(partition, calls.exist(client_id, picked(keys, positions)))
                            for partition, positions in routes],
                           functools.partial(joined_exist, routes))

    def tiers(self, client_id: str, keys: Sequence[bytes]) -> Any:
        """-> per key the tier of its fastest replica, None when it does not exist."""
        routes = self._routes(keys)
        return self._batch([(partition, calls.tiers(client_id, picked(keys, positions)))
                            for partition, positions in routes],
                           functools.partial(joined_lists, routes, lambda _: None))

    def query_prefix(self, client_id: str, keys: Sequence[bytes]) -> Any:
        """-> the number of leading keys that are READY (each is leased). Raises unless OK."""
        routes = self._routes(keys)
        return self._batch([(partition, calls.query_prefix(client_id, picked(keys, positions)))
                            for partition, positions in routes],
                           functools.partial(joined_prefix, routes))

    def remove(self, client_id: str, keys: Sequence[bytes], force: bool = False) -> Any:
        """Remove keys -> OK | NOT_FOUND | HAS_LEASE (unless force) | ... per key."""
        session = self.session
        routes = self._routes(keys)
        ended = self._ended_for(routes)
        return self._batch([(partition, calls.remove(client_id, picked(keys, positions), force,
                                                     session.token, ended[i]))
                            for i, (partition, positions) in enumerate(routes)],
                           functools.partial(joined_lists, routes, lambda s: s))

    def remove_all(self, client_id: str, force: bool = False) -> Any:
        """Remove every removable object -> how many. Raises unless OK."""
        return self._on_every(calls.remove_all(client_id, force), summed)

    def remove_by_regex(self, client_id: str, pattern: str, force: bool = False) -> Any:
        """Remove objects whose key matches ``pattern`` -> how many (INVALID_ARGUMENT for a
        bad pattern)."""
        return self._on_every(calls.remove_by_regex(client_id, pattern, force), summed)

    def get_stats(self) -> Any:
        """-> the master's /status document (clients, segments, capacity, usage, objects);
        a partitioned master's partitions' merged (``joins.merged_status``). A stub that did
        not register learns the partitions from partition 0's document."""
        if not self.session.partitions:
            return self._then(self._run(calls.get_stats()), self._stats_everywhere)
        return self._run_parts([(p, calls.get_stats()) for p in self._everywhere()],
                               merged_status)

    def _stats_everywhere(self, document: dict[str, Any]) -> Any:
        """``document``, or, when it is partition 0's of several, every partition's merged."""
        listed = document.get("partition", {}).get("endpoints", [])
        if len(listed) < 2 or self.session.partitions:
            return document
        self.session.learn_partitions(tuple(PartitionEndpoint(**e) for e in listed), b"")
        return self._run_parts([(p, calls.get_stats()) for p in self._everywhere()[1:]],
                               lambda others: merged_status([document, *others]))

