"""The batch handlers of the Master service, shared by the gRPC and the lean-framing transports.

Rules of this file:
- ``Servicer.serve(method, payload, transport)`` is the one path every request takes: parse
  (``convert``), call the core with the serving clock's ``now``, sign placements, encode, time it,
  count it, drain the core's events. Transports only move bytes and map failures.
- Handlers are synchronous: the core never awaits, so each request is atomic on the event loop
  (each step of a call served in steps, below, is).
- While ``read_only`` (the state directory cannot be written, see ``persist.py``) every call
  in ``WRITE_METHODS`` (those that can change durable state) answers UNAVAILABLE per item
  without reaching the core; reads, heartbeats and stats are served. A call whose events the
  server refuses to let answer (``on_events`` returns False) answers UNAVAILABLE too.
- Expected outcomes travel in-band as ``Status`` values. A request that cannot be served at all
  raises :class:`BadRequest` (INVALID_ARGUMENT for the call); anything else escaping a handler is
  a bug and raises :class:`InternalError` after being logged.
- Calls in ``CLIENT_SCOPED`` first prove the caller's ``client_token`` (``core.authenticate``)
  here, before any handler runs; a refusal answers its status for the call or every item and
  changes nothing. Handlers only see proven callers.
- Capabilities carry this master's ``capability_epoch`` (random at every start) and expire on
  its capability clock (monotonic ms since start), which every registration and heartbeat
  answer reports; a PutStart's WRITE capabilities name a fresh ``put_id``. The partitions of
  a partitioned master share one epoch and one clock (``partition.py``).
- A partitioned master (README, "Partitions"): partition 0 registers clients, once
  ``partition_map`` is set (UNAVAILABLE before), and answers with the map and a ticket for
  the client's key, numbered and issued now; a later partition registers only a client
  presenting such a ticket within its time (PERMISSION_DENIED otherwise), under that key
  (``core.join_client``: a ticket older than the holder's refused). A partition refuses
  a PutStart with a key of another partition (INVALID_ARGUMENT): no reader would look there.
- The leases a ``GetReplicas`` says its reader ended are ended once its answer went out
  (``finish``, which the lean transport calls after writing, and any next call or tick
  before it runs); those a ``PutStart`` or ``Remove`` carries, before them (they may need the
  space).
- Two calls may answer later (``serve`` returns a ``Pending``; the transport awaits it while
  it serves others): a removal too large for one call, once its job is done, and a
  ``CopyTasks`` that asked to wait (``wait_ms``) when no task waits for its caller, as soon
  as one does or when the wait ends (at most ``MAX_COPY_WAIT_S``; a newer wait of the same
  caller, even one that fetches nothing, answers the older at once).
- A call over many keys is served in steps, other requests in between, and answers once
  all are done (``Stepped``): one call of 100,000 keys held the loop for up to a second.
  ``PutStart`` and ``PutEnd`` step by ``STEP_KEYS`` keys, ``GetReplicas`` by
  ``READ_STEP_KEYS`` (it signs a capability per replica; every step's keys are held under
  the one lease id the answer names), ``Exist`` by ``EXIST_STEP_KEYS``. The lean transport
  serves a connection's later calls only after it (clients rely on the calls of one
  connection being served in order). A write step that finds the master read-only, or any
  step whose events the server refuses, makes the whole call answer UNAVAILABLE, as one call
  would. A stepped call is timed (``rpc_done``) from its start to its last step. Each step's
  answer is serialized as it is made; the whole answer is their concatenation (protobuf
  parses concatenated messages as one merged message), so no step serializes it whole.
  ``GetStats`` is served in steps too: its document has a row per segment
  (``status_document`` hands it out in pieces, each made in a step).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, TypeVar

from kvpool_master.clock import ServingClock
from kvpool_master.core.events import Event
from kvpool_master.core.keyregex import compile_key_pattern
from kvpool_master.core.master import MasterCore
from kvpool_master.core.sweeps import RemoveJob
from kvpool_master.partition import SOLE, PartitionTerms
from kvpool_wire import capability, convert
from kvpool_wire.convert import BadRequest
from kvpool_wire.methods import RpcMethod
from kvpool_wire.partitions import PartitionEndpoint, partition_of, stray, ticket_number
from kvpool_wire.partitions import ticket as partition_ticket
from kvpool_wire.status import Status
from kvpool_wire.types import ClientId, Extent, Op, SegmentInfo, Tier

log = logging.getLogger("kvpool.master.rpc")
T = TypeVar("T")

__all__ = ["CLIENT_SCOPED", "EXIST_STEP_KEYS", "READ_STEP_KEYS", "STEP_KEYS", "WRITE_METHODS",
           "BadRequest", "InternalError", "Pending", "RpcObserver", "Servicer", "Stepped"]

#: Calls that act as their ``client_id``: the caller proves it with its client token.
CLIENT_SCOPED = frozenset({"Heartbeat", "UnregisterClient", "MountSegment", "UnmountSegment",
                           "PutStart", "PutEnd", "PutRevoke", "CopyTasks"})
#: Calls that can change durable state (clients, segments, objects): refused while read-only.
WRITE_METHODS = frozenset({"RegisterClient", "UnregisterClient", "MountSegment",
                           "UnmountSegment", "PutStart", "PutEnd", "PutRevoke", "Remove",
                           "RemoveAll", "RemoveByRegex", "CopyTasks"})


#: The longest a CopyTasks call waits for tasks, whatever it asked.
MAX_COPY_WAIT_S = 10.0


class Pending:
    """The answer of a call that waits: ``await answer()`` gives its bytes once ``resolve``
    was called, or once ``wait_s`` passed (None: no limit)."""

    def __init__(self, build: Callable[[], bytes], wait_s: float | None = None) -> None:
        self._build = build
        self._wait_s = wait_s
        self._done = asyncio.Event()

    def resolve(self) -> None:
        self._done.set()

    async def answer(self) -> bytes:
        if self._wait_s is None:
            await self._done.wait()
        else:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._done.wait(), self._wait_s)
        return self._build()


class Stepped(Pending):
    """The answer of a call served in steps: ``answer()`` runs the steps left, letting the
    event loop serve others between them, then builds the answer. Transports serve the
    connection's later calls only after it."""

    def __init__(self, steps: Iterator[None], build: Callable[[], bytes]) -> None:
        super().__init__(build)
        self._steps = steps
        self.on_done: Callable[[bool], None] | None = None  # called with ``failed`` at the end

    async def answer(self) -> bytes:
        failed = True
        try:
            for _ in self._steps:
                await asyncio.sleep(0)
            answer = self._build()
            failed = False
            return answer
        except Exception as exc:
            log.exception("a call served in steps failed unexpectedly")
            raise InternalError(f"a step failed: {type(exc).__name__}") from None
        finally:
            if self.on_done is not None:
                self.on_done(failed)


#: Removals (``RemoveAll``, ``RemoveByRegex``) walking the table at once: every sweep step runs
#: each of them over its entries, so more are refused (RESOURCE_EXHAUSTED) until one ends.
MAX_REMOVAL_JOBS = 16
#: Keys one step of a ``PutStart`` or ``PutEnd`` serves (a few ms of work).
STEP_KEYS = 512
#: Keys one step of a ``GetReplicas`` serves (a capability signed per replica: about as long).
READ_STEP_KEYS = 512
#: Keys one step of an ``Exist`` serves (a lookup each).
EXIST_STEP_KEYS = 4096


class InternalError(RuntimeError):
    """A handler failed unexpectedly (a bug); the call answers INTERNAL and the master goes on."""


class RpcObserver(Protocol):
    """What the servicer reports per call (implemented by ``kvpool_master.metrics``)."""

    def rpc_done(self, method: str, transport: str, duration_s: float, failed: bool) -> None: ...


class Servicer:
    """Serves every Master RPC against one core."""

    def __init__(self, core: MasterCore, clock: ServingClock, observer: RpcObserver, *,
                 master_id: str, on_events: Callable[[list[Event]], bool],
                 status_document: Callable[[], Iterator[str]],
                 partition: PartitionTerms = SOLE) -> None:
        self._core = core
        self._clock = clock
        self._observer = observer
        self._master_id = master_id
        self._on_events = on_events
        self._status_document = status_document
        self.partition = partition
        if partition.count > 1:  # one epoch and one clock for every partition
            self._clock_start_s = partition.clock_origin_s
            self.capability_epoch = partition.epoch
        else:
            self._clock_start_s = time.monotonic()
            self.capability_epoch = int.from_bytes(os.urandom(8), "little") >> 1
        # partition 0 of several: where every partition serves, once all of them do (until
        # then registrations answer UNAVAILABLE)
        self.partition_map: tuple[PartitionEndpoint, ...] = ()
        self._tickets = itertools.count(1)  # partition 0: the number of its next ticket
        self._last_put_id = 0
        self.fast_port = 0  # advertised to clients once the lean port is bound
        self.fast_socket = ""  # abstract Unix socket name of the lean framing, once bound
        self.read_only = False  # set by the server while the state directory cannot be written
        # called after a call that left the core with upkeep to do (sweeping lost segments or
        # running removal jobs, a deferred eviction pass: the server then runs ``upkeep``
        # between requests until it is done)
        self.on_upkeep_due: Callable[[], None] | None = None
        self._removals: list[tuple[RemoveJob, Pending]] = []  # answers waiting for a job
        # mounts waiting for the sweep of a segment lost under their id: (segment, the caller
        # and its token, answer, its status once mounted)
        self._mounts: list[tuple[SegmentInfo, tuple[ClientId, bytes], Pending,
                                 list[Status]]] = []
        self._copy_waits: dict[ClientId, Pending] = {}  # CopyTasks calls waiting for tasks
        # (reader, request) of GetReplicas whose ended leases wait until its answer went out
        self._ends_later: list[tuple[ClientId, Any]] = []
        self._handlers: dict[str, Callable[[Any], Any]] = {
            "RegisterClient": self._register_client,
            "Heartbeat": self._heartbeat,
            "UnregisterClient": self._unregister_client,
            "MountSegment": self._mount_segment,
            "UnmountSegment": self._unmount_segment,
            "GetSegments": self._get_segments,
            "PutStart": self._put_start,
            "PutEnd": self._put_end,
            "PutRevoke": self._put_revoke,
            "GetReplicas": self._get_replicas,
            "Exist": self._exist,
            "QueryPrefix": self._query_prefix,
            "Remove": self._remove,
            "RemoveAll": self._remove_all,
            "RemoveByRegex": self._remove_by_regex,
            "GetStats": self._get_stats,
            "CopyTasks": self._copy_tasks,
        }

    def serve(self, method: RpcMethod, payload: bytes, transport: str) -> bytes | Pending:
        """Answer one request given as protobuf bytes; return the answer's protobuf bytes, or,
        for a call that answers later (see the rules above), a ``Pending`` whose ``answer()``
        gives them (the transport awaits it; other requests are served meanwhile).

        Raises BadRequest (malformed or unusable request; nothing changed) or InternalError.
        """
        if self._ends_later:  # a transport that did not call finish: in order, before this
            self.finish()
        started_s = time.perf_counter()
        failed = True
        timed = True
        try:
            request = convert.parse_request(method, payload)
            self._check_lists(request)
            name = method.name
            if self.read_only and name in WRITE_METHODS:
                response = convert.refused_response(request, Status.UNAVAILABLE)
            elif name in CLIENT_SCOPED and (
                    caller := self._core.authenticate(*convert.decode_caller(request))
            ) != Status.OK:
                response = convert.refused_response(request, caller)
            else:
                response = self._handlers[name](request)
                events = self._core.take_events()
                if events and not self._on_events(events):
                    response = convert.refused_response(request, Status.UNAVAILABLE)
            failed = False
            if isinstance(response, Stepped):
                response.on_done = lambda failed, since_s=started_s: self._observer.rpc_done(
                    name, transport, time.perf_counter() - since_s, failed)
                timed = False  # once its last step is done
                return response
            if isinstance(response, Pending):
                return response
            return convert.serialize(response)
        except BadRequest:
            raise
        except Exception as exc:
            log.exception("%s failed unexpectedly", method.name)
            raise InternalError(f"{method.name} failed: {type(exc).__name__}") from None
        finally:
            self._after_step()
            if timed:
                self._observer.rpc_done(method.name, transport,
                                        time.perf_counter() - started_s, failed)

    def finish(self) -> None:
        """End the leases that the last ``GetReplicas`` calls carried, once their answers went
        out: a reader's hand-back then costs the next call nothing. (Ending a lease only lets
        bytes go sooner; done a few microseconds later, nothing is served that should not
        be.)"""
        later = self._ends_later
        if not later:
            return
        self._ends_later = []
        now = self._clock.now()
        for reader, request in later:
            self._end_leases(reader, request, now)
        events = self._core.take_events()
        if events:
            self._on_events(events)

    def tick(self) -> None:
        """Let the core expire clients, reclaim stale PENDING objects and evict in background."""
        self.finish()
        self._core.tick(self._clock.now())
        events = self._core.take_events()
        if events:
            self._on_events(events)
        self._wake_copiers()
        self._upkeep_work()

    def upkeep(self) -> bool:
        """One step of the core's upkeep (a few milliseconds at most: ``MasterCore.upkeep``);
        True while more is left. Removals it finished get their answers."""
        more = self._core.upkeep(self._clock.now())
        events = self._core.take_events()
        if events:
            self._on_events(events)
        if self._removals:
            done = [p for job, p in self._removals if job.done]
            if done:
                self._removals = [(job, p) for job, p in self._removals if not job.done]
                for pending in done:
                    pending.resolve()
        if self._mounts:
            self._retry_mounts()
        return more

    def _wake_copiers(self) -> None:
        """Answer the waiting CopyTasks calls of owners that got tasks."""
        fresh = self._core.take_fresh_copy_owners()
        if fresh and self._copy_waits:
            for owner in fresh:
                pending = self._copy_waits.pop(owner, None)
                if pending is not None:
                    pending.resolve()

    def _upkeep_work(self) -> None:
        if self._core.upkeep_due and self.on_upkeep_due is not None:
            self.on_upkeep_due()

    # -- signing ----------------------------------------------------------------------------------

    def capability_clock_ms(self) -> int:
        """The capability clock: monotonic milliseconds since this master started (since
        partition 0 started, for every partition of a partitioned master)."""
        return int((time.monotonic() - self._clock_start_s) * 1000)

    def _signer(self, op: Op, expiry_ms: int, put_id: int = 0) -> Callable[[Extent], bytes]:
        """Signs one answer's capabilities with each segment owner's key (none: no key)."""
        return capability.extent_signer(self._core.segment_key, op, expiry_ms,
                                        self.capability_epoch, put_id)

    def _check_lists(self, request: Any) -> None:
        """Refuse a request any of whose lists is longer than ``max_batch_keys``, before any
        work per item (clients split longer batches: such a request is not a client's)."""
        limit = self._core.config.max_batch_keys
        for field, value in request.ListFields():
            if _is_repeated(field) and len(value) > limit:
                raise BadRequest(f"{field.name} holds {len(value)} items, above max_batch_keys "
                                 f"{limit}")

    def _check_batch(self, keys: Sequence[object]) -> None:
        if len(keys) > self._core.config.max_batch_keys:
            raise BadRequest(f"batch of {len(keys)} items is above max_batch_keys "
                             f"{self._core.config.max_batch_keys}")

    def _check_own(self, keys: Sequence[bytes]) -> None:
        """Refuse keys of another partition: readers look for a key only in its own."""
        part = self.partition
        if part.count > 1 and keys:
            position = stray(keys, part.index, part.count)
            if position is not None:
                raise BadRequest(f"key {keys[position]!r} belongs to partition "
                                 f"{partition_of(keys[position], part.count)} of "
                                 f"{part.count}, not to this one ({part.index})")

    # -- clients and segments ---------------------------------------------------------------------

    def _register_client(self, request: Any) -> Any:
        client_id, host_id, _hostname, token, joining_key, ticket = \
            convert.decode_register_client(request)
        now = self._clock.now()
        part = self.partition
        partitions: tuple[PartitionEndpoint, ...] = ()
        issued = b""
        if part.index:  # a later partition: only partition 0's ticket registers
            number = ticket_number(part.secret, client_id, joining_key, ticket,
                                   self.capability_clock_ms())
            status, key = (Status.PERMISSION_DENIED, b"") if number is None else \
                self._core.join_client(client_id, host_id, joining_key, now, number)
        elif part.count > 1 and not self.partition_map:
            status, key = Status.UNAVAILABLE, b""   # the other partitions are starting
        else:
            status, key = self._core.register_client(
                client_id, host_id, os.urandom(capability.KEY_BYTES), now, token)
            if part.count > 1 and key:
                partitions = self.partition_map
                issued = partition_ticket(part.secret, client_id, key, next(self._tickets),
                                          self.capability_clock_ms())
        retry_after_s = (self._core.holder_expires_in_s(client_id, now)
                         if status == Status.CLIENT_ALREADY_EXISTS else 0.0)
        config = self._core.config
        return convert.encode_register_client(
            status, client_ttl_s=config.client_ttl_s, capability_key=key,
            client_token=capability.client_token(key) if key else b"",
            fast_port=self.fast_port, master_id=self._master_id,
            default_lease_ttl_s=config.default_lease_ttl_s, fast_socket=self.fast_socket,
            master_pid=os.getpid(), retry_after_s=retry_after_s,
            master_clock_ms=self.capability_clock_ms(), capability_epoch=self.capability_epoch,
            max_batch_keys=config.max_batch_keys, partitions=partitions, partition_ticket=issued)

    def _heartbeat(self, request: Any) -> Any:
        client_id = convert.decode_client_id(request)
        status = self._core.heartbeat(client_id, self._clock.now())
        return convert.encode_heartbeat(status, self.capability_clock_ms(),
                                        self._core.copy_tasks_waiting(client_id))

    def _copy_tasks(self, request: Any) -> Any:
        client_id, done, max_tasks, wait_s = convert.decode_copy_tasks(request)
        status, tasks = self._core.copy_tasks(client_id, done, max_tasks, self._clock.now())
        # the copier starts no copy after half the ttl: the target is reused only later
        start_within_ms = int(self._core.config.copy_task_ttl_s * 500)
        older = self._copy_waits.pop(client_id, None)
        if older is not None:  # a newer call of the same caller answers the older at once
            older.resolve()
        if tasks or status != Status.OK or not wait_s or not max_tasks:
            return convert.encode_copy_tasks(status, tasks, start_within_ms)

        def answer() -> bytes:
            if self._copy_waits.get(client_id) is pending:
                del self._copy_waits[client_id]
            later = self._core.hand_copy_tasks(client_id, max_tasks, self._clock.now())
            return convert.serialize(convert.encode_copy_tasks(Status.OK, later,
                                                               start_within_ms))
        pending = Pending(answer, min(wait_s, MAX_COPY_WAIT_S))
        self._copy_waits[client_id] = pending
        return pending

    def _unregister_client(self, request: Any) -> Any:
        status = self._core.unregister_client(convert.decode_client_id(request),
                                              self._clock.now())
        return convert.status_response(_response_of(request), status)

    def _mount_segment(self, request: Any) -> Any:
        client_id, segment = convert.decode_mount_segment(request)
        if segment.client_id != client_id:
            status = Status.PERMISSION_DENIED  # a client mounts only its own segments
        else:
            status = self._core.mount_segment(segment, self._clock.now())
            if status == Status.UNAVAILABLE:   # a segment lost under its id is being swept
                return self._mount_later(request, segment)
        return convert.status_response(_response_of(request), status)

    def _mount_later(self, request: Any, segment: SegmentInfo) -> Pending:
        """The answer of a mount that waits for the sweep of a segment lost under its id:
        ``upkeep`` mounts it once that sweep is done (``_retry_mounts``)."""
        answered = [Status.UNAVAILABLE]

        def answer() -> bytes:
            return convert.serialize(convert.status_response(_response_of(request),
                                                             answered[0]))
        pending = Pending(answer)
        self._mounts.append((segment, convert.decode_caller(request), pending, answered))
        return pending

    def _retry_mounts(self) -> None:
        """Mount the waiting segments whose id is swept by now, and answer their calls."""
        waiting = []
        for segment, caller, pending, answered in self._mounts:
            if self.read_only:   # refused, as any write is meanwhile
                answered[0] = Status.UNAVAILABLE
                pending.resolve()
                continue
            if self._core.authenticate(*caller) != Status.OK:   # the caller left meanwhile
                answered[0] = Status.UNKNOWN_CLIENT
                pending.resolve()
                continue
            status = self._core.mount_segment(segment, self._clock.now())
            events = self._core.take_events()
            if events and not self._on_events(events):
                status = Status.UNAVAILABLE   # not logged: refused, as any write then
            elif status == Status.UNAVAILABLE:
                waiting.append((segment, caller, pending, answered))
                continue
            answered[0] = status
            pending.resolve()
        self._mounts = waiting

    def _unmount_segment(self, request: Any) -> Any:
        client_id, segment_id = convert.decode_unmount_segment(request)
        status = self._core.unmount_segment(client_id, segment_id, self._clock.now())
        return convert.status_response(_response_of(request), status)

    def _get_segments(self, request: Any) -> Any:
        segment_ids = convert.decode_get_segments(request)
        self._check_batch(segment_ids)
        infos = self._core.get_segments(segment_ids)
        return convert.encode_get_segments(infos, [self._ownership_proof(i) for i in infos])

    def _ownership_proof(self, info: SegmentInfo | None) -> bytes:
        """What the owner of ``info`` stamped into its segment (``capability.ownership_proof``)."""
        key = self._core.segment_key(info.segment_id) if info is not None else None
        if info is None or not key:
            return b""
        # the name a same-host reader opens: shared memory, or an SSD segment's file
        return capability.ownership_proof(key, info.segment_id, info.shm_name or info.file_path,
                                          info.size_bytes)

    # -- writes -----------------------------------------------------------------------------------

    def _put_start(self, request: Any) -> Any:
        client_id, keys, sizes_bytes, options, parent_keys = convert.decode_put_start(request)
        self._check_own(keys)
        if request.ended_lease_ids or request.ended_leases:
            self._end_leases(ClientId(client_id), request)
        expiry_ms = (self.capability_clock_ms()
                     + int(self._core.config.write_capability_ttl_s * 1000))
        self._last_put_id += 1
        put_id = self._last_put_id
        signer = self._signer(Op.WRITE, expiry_ms, put_id)
        run_signer = capability.run_signer(self._core.segment_key, Op.WRITE, expiry_ms,
                                           self.capability_epoch, put_id)
        columns = request.columns

        def step(lo: int, hi: int | None) -> Any:
            results = self._core.put_start(
                ClientId(client_id), _span(keys, lo, hi), _span(sizes_bytes, lo, hi), options,
                self._clock.now(), _span(parent_keys, lo, hi) if parent_keys is not None else None)
            return convert.encode_put_start(results, expiry_ms, signer, put_id, columns, lo,
                                            run_signer)

        return self._in_steps(request, len(keys), step, len(sizes_bytes) == len(keys) and (
            parent_keys is None or len(parent_keys) == len(keys)),
            caller=convert.decode_caller(request))

    def _put_end(self, request: Any) -> Any:
        client_id, keys, checksums = convert.decode_put_end(request)

        def step(lo: int, hi: int | None) -> Any:
            statuses = self._core.put_end(client_id, _span(keys, lo, hi), self._clock.now(),
                                          _span(checksums, lo, hi) if checksums is not None
                                          else None)
            return convert.encode_statuses(_response_of(request), statuses)

        return self._in_steps(request, len(keys), step,
                              checksums is None or len(checksums) == len(keys),
                              caller=convert.decode_caller(request))

    def _in_steps(self, request: Any, num_keys: int, step: Callable[[int, int | None], Any],
                  well_formed: bool = True, step_keys: int = STEP_KEYS, writes: bool = True,
                  lead: Callable[[], Any] | None = None,
                  caller: tuple[ClientId, bytes] | None = None) -> Any:
        """Serve a call's keys with ``step(lo, hi)`` (the answer for keys lo..hi): at once when
        they are few (or the call is malformed: the core answers it whole), as ``step(0,
        None)``, which passes the decoded lists on as they are, else the first
        ``step_keys`` now and the rest as a ``Stepped`` answer. Each step's answer is
        serialized as it is made and the answer is their concatenation, which protobuf parses
        as those messages merged (repeated fields appended in order): no step serializes the
        whole answer. ``lead`` may give a message to put first (or None). A ``writes`` call is
        refused if the master turns read-only between its steps, and a ``caller``'s call once
        its token stops proving it (it left, and the id may have a new holder): a step acts
        as the client id, so it must still be the caller's."""
        if num_keys <= step_keys or not well_formed \
                or num_keys > self._core.config.max_batch_keys:
            return step(0, None)
        parts = [convert.serialize(step(0, step_keys))]
        refused: Status | None = None

        def steps() -> Iterator[None]:
            nonlocal refused
            for lo in range(step_keys, num_keys, step_keys):
                yield
                if writes and self.read_only:
                    refused = Status.UNAVAILABLE
                    return
                if caller is not None and self._core.authenticate(*caller) != Status.OK:
                    refused = Status.UNKNOWN_CLIENT
                    return
                parts.append(convert.serialize(step(lo, min(num_keys, lo + step_keys))))
                if not self._after_step():
                    refused = Status.UNAVAILABLE
                    return

        def build() -> bytes:
            if refused is not None:
                return convert.serialize(convert.refused_response(request, refused))
            first = lead() if lead is not None else None
            if first is not None:
                parts.insert(0, convert.serialize(first))
            return b"".join(parts)

        return Stepped(steps(), build)

    def _after_step(self) -> bool:
        """After a call, or one step of a ``Stepped`` one: hand the core's events to the
        server, answer waiting copiers, start the upkeep; False when the server refused the
        events."""
        events = self._core.take_events()
        kept = not events or self._on_events(events)
        self._wake_copiers()
        self._upkeep_work()
        return kept

    def _put_revoke(self, request: Any) -> Any:
        client_id, keys = convert.decode_keys(request)
        statuses = self._core.put_revoke(ClientId(client_id), keys, self._clock.now())
        return convert.encode_statuses(_response_of(request), statuses)

    # -- reads ------------------------------------------------------------------------------------

    def _get_replicas(self, request: Any) -> Any:
        client_id, keys = convert.decode_keys(request)
        reader = self._proven_reader(request)
        if reader is not None and (request.ended_lease_ids or request.ended_leases):
            self._ends_later.append((reader, request))  # see finish
        lease_ttl_s = self._core.config.default_lease_ttl_s
        expiry_ms = self.capability_clock_ms() + int(lease_ttl_s * 1000)
        signer = self._signer(Op.READ, expiry_ms)
        columns_signer = capability.columns_signer(self._core.segment_key, Op.READ, expiry_ms,
                                                   self.capability_epoch)
        lease_id = 0  # the reader's lease, numbered by the first step
        columns = request.columns

        def step(lo: int, hi: int | None) -> Any:
            nonlocal lease_id
            results = self._core.get_replicas(_span(keys, lo, hi), self._clock.now(), reader,
                                              lease_id)
            if reader is not None:
                lease_id = self._core.last_lease_id
            return convert.encode_get_replicas(results, lease_ttl_s, expiry_ms, signer,
                                               lease_id, columns, lo, columns_signer)

        return self._in_steps(request, len(keys), step, step_keys=READ_STEP_KEYS, writes=False)

    def _proven_reader(self, request: Any) -> ClientId | None:
        """The request's client when it carries that client's token (its leases are then its
        own to end), else None: reads need no identity, and an unproven one is not taken."""
        token = request.client_token
        if not token:
            return None
        client_id = ClientId(request.client_id)
        return client_id if self._core.authenticate(client_id, token) == Status.OK else None

    def _end_leases(self, reader: ClientId, request: Any, now: float | None = None) -> None:
        now = self._clock.now() if now is None else now
        for lease_id in convert.decode_ended_lease_ids(request):
            self._core.end_lease(reader, lease_id, now)

    def _exist(self, request: Any) -> Any:
        _client_id, keys = convert.decode_keys(request)
        # Steps served before the first SSD segment was mounted carry no tiers (every key was
        # in DRAM); they come first (the pool never goes back to one tier), so once a later
        # step carries tiers, a lead part gives those keys theirs, in order.
        untiered = 0
        tiered = False

        def step(lo: int, hi: int | None) -> Any:
            nonlocal untiered, tiered
            part = _span(keys, lo, hi)
            statuses, sizes_bytes = self._core.exist(part, self._clock.now())
            tiers = self._core.tiers_of(part)
            if tiers is None:
                untiered += len(part)
            else:
                tiered = True
            return convert.encode_exist(statuses, sizes_bytes, tiers)

        def lead() -> Any:
            return convert.encode_exist([], [], [Tier.DRAM] * untiered) \
                if tiered and untiered else None

        return self._in_steps(request, len(keys), step, step_keys=EXIST_STEP_KEYS,
                              writes=False, lead=lead)

    def _query_prefix(self, request: Any) -> Any:
        _client_id, keys = convert.decode_keys(request)
        if len(keys) > self._core.config.max_batch_keys:
            return convert.encode_query_prefix(Status.INVALID_ARGUMENT, 0)
        num_ready = self._core.query_prefix(keys, self._clock.now())
        return convert.encode_query_prefix(Status.OK, num_ready,
                                           self._core.tiers_of(keys[:num_ready]))

    # -- removal and admin ------------------------------------------------------------------------

    def _remove(self, request: Any) -> Any:
        _client_id, keys, force = convert.decode_remove(request)
        if (request.ended_lease_ids or request.ended_leases) and \
                (reader := self._proven_reader(request)) is not None:
            self._end_leases(reader, request)
        statuses = self._core.remove(keys, force, self._clock.now())
        return convert.encode_statuses(_response_of(request), statuses)

    def _remove_all(self, request: Any) -> Any:
        _client_id, force = convert.decode_remove_all(request)
        if len(self._removals) >= MAX_REMOVAL_JOBS:
            return convert.encode_num_removed(_response_of(request), Status.RESOURCE_EXHAUSTED, 0)
        return self._removal(request, self._core.start_remove(None, force, self._clock.now()))

    def _remove_by_regex(self, request: Any) -> Any:
        _client_id, pattern, force = convert.decode_remove_by_regex(request)
        compiled = compile_key_pattern(pattern)
        if compiled is None:
            return convert.encode_num_removed(_response_of(request), Status.INVALID_ARGUMENT, 0)
        if len(self._removals) >= MAX_REMOVAL_JOBS:
            return convert.encode_num_removed(_response_of(request), Status.RESOURCE_EXHAUSTED, 0)
        return self._removal(request, self._core.start_remove(compiled, force,
                                                              self._clock.now()))

    def _removal(self, request: Any, job: RemoveJob) -> Any:
        """The answer of a removal: now when it is done, else once ``upkeep`` finished it."""
        def answer() -> bytes:
            return convert.serialize(convert.encode_num_removed(_response_of(request),
                                                                Status.OK, job.removed))
        if job.done:
            return convert.encode_num_removed(_response_of(request), Status.OK, job.removed)
        pending = Pending(answer)
        self._removals.append((job, pending))
        return pending

    def _get_stats(self, request: Any) -> Any:
        """The status document, made in steps (it grows with the segments)."""
        text: list[str] = []

        def steps() -> Iterator[None]:
            for piece in self._status_document():
                text.append(piece)
                yield

        return Stepped(steps(), lambda: convert.serialize(
            convert.encode_stats(Status.OK, "".join(text))))


def _span(items: list[T], lo: int, hi: int | None) -> list[T]:
    """``items[lo:hi]``; all of ``items``, as they are, for ``hi`` None (a call served whole:
    the common case, without a copy, and a malformed call's lists as they came)."""
    return items if hi is None else items[lo:hi]


def _response_of(request: Any) -> Any:
    return convert.response_type_of(request)


def _is_repeated(field: Any) -> bool:
    """Whether a field descriptor is of a list (``is_repeated`` where protobuf has it; its
    ``label`` is deprecated there)."""
    repeated = getattr(field, "is_repeated", None)
    return bool(repeated) if repeated is not None else field.label == field.LABEL_REPEATED
