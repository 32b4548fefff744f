"""The client side of every Master call: the request it sends and how its answer reads.

Each function returns a :class:`Call`: the method, the request message, and ``decode``, which
turns the answer message into domain values (raising KVPoolError where the call as a whole
failed). A stub of any kind (blocking, asyncio, another language) sends ``call.request`` over
either transport and returns ``call.decode(answer)``; no stub builds a message itself.
Client-scoped calls carry the caller's ``client_token`` (see ``capability.client_token``).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, NamedTuple, TypeVar, cast

from kvpool_wire._pb import kvpool_pb2 as pb
from kvpool_wire.convert import descriptor_of
from kvpool_wire.methods import RPC_METHODS, RpcMethod
from kvpool_wire.partitions import PartitionEndpoint
from kvpool_wire.status import KVPoolError, Status
from kvpool_wire.types import (
    ClientId,
    Placement,
    PutOptions,
    ReadResult,
    SegmentId,
    SegmentInfo,
    Tier,
)

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Call(Generic[T]):
    """One request to send and the reading of its answer."""

    method: RpcMethod
    request: Any
    decode: Callable[[Any], T]


@dataclass(frozen=True, slots=True)
class RegisterAnswer:
    """A RegisterClient answer, as sent (times in ms)."""

    status: Status
    client_ttl_ms: int
    capability_key: bytes
    client_token: bytes
    master_id: str
    default_lease_ttl_ms: int
    fast_port: int
    fast_socket: str
    master_pid: int
    retry_after_ms: int
    capability_epoch: int
    master_clock_ms: int
    max_batch_keys: int = 0  # 0: the master did not say
    # a partitioned master: every partition, the answering one (0) first; empty otherwise
    partitions: tuple[PartitionEndpoint, ...] = ()
    partition_ticket: bytes = b""


_STATUS_BY_INT: dict[int, Status] = {int(s): s for s in Status}


def status_of(value: int) -> Status:
    """The Status of a wire value (INTERNAL_ERROR for one this side does not know)."""
    return _STATUS_BY_INT.get(value, Status.INTERNAL_ERROR)


def statuses_of(values: Sequence[int]) -> list[Status]:
    """``status_of`` of every value."""
    get = _STATUS_BY_INT.get
    return [get(v, Status.INTERNAL_ERROR) for v in values]


def placements_of(replicas: Any) -> tuple[Placement, ...]:
    """The placements of one key's ``Replicas`` message."""
    placements = replicas.placements
    if len(placements) == 1:  # one replica: the common case, without a generator
        p = placements[0]
        return (Placement(p.segment_id, p.offset, p.length, p.capability_expiry_ms,
                          p.capability, p.put_id),)
    return tuple(Placement(p.segment_id, p.offset, p.length, p.capability_expiry_ms,
                           p.capability, p.put_id) for p in placements)


def columns_of(columns: Any, sizes_bytes: Sequence[int]) -> list[tuple[Placement, ...]]:
    """Per key the placements of a ``Columns`` message (see the proto), whose first replicas
    are ``sizes_bytes`` long (the objects' sizes). A ``more_keys`` index outside the batch is
    ignored (the answer is then short of that replica, never wrong about another key)."""
    expiry_ms = columns.capability_expiry_ms
    put_id = columns.put_id
    out: list[tuple[Placement, ...]] = [
        (Placement(segment_id, offset, size, expiry_ms, capability, put_id),)
        if segment_id else ()
        for segment_id, offset, capability, size in zip(
            columns.segment_ids, columns.offsets, columns.capabilities, sizes_bytes,
            strict=False)]
    for index, replicas in zip(columns.more_keys, columns.more, strict=False):
        if index < len(out) and out[index]:
            out[index] += placements_of(replicas)
    return out


def segment_info_of(d: Any) -> SegmentInfo:
    """A descriptor the master sent (an unknown tier reads as DRAM)."""
    return SegmentInfo(SegmentId(d.segment_id), ClientId(d.client_id), d.size_bytes,
                       Tier(d.tier) if d.tier in Tier._value2member_map_ else Tier.DRAM,
                       d.host_id, d.shm_name, d.tcp_endpoint, d.engine_endpoint,
                       d.engine_base_address, d.file_path, d.ownership_proof)


def _status_field(response: Any) -> Status:
    return status_of(response.status)


def _statuses_field(response: Any) -> list[Status]:
    return statuses_of(response.statuses)


def _checked(what: str, read: Callable[[Any], T]) -> Callable[[Any], T]:
    """``read``, after raising KVPoolError unless the answer's ``status`` is OK."""
    def decode(response: Any) -> T:
        if response.status != pb.STATUS_OK:
            raise KVPoolError(status_of(response.status), what)
        return read(response)
    return decode


# --- clients and segments --------------------------------------------------------------------

def _register_answer(r: Any) -> RegisterAnswer:
    return RegisterAnswer(status_of(r.status), r.client_ttl_ms, r.capability_key, r.client_token,
                          r.master_id, r.default_lease_ttl_ms, r.fast_port, r.fast_socket,
                          r.master_pid, r.retry_after_ms, r.capability_epoch, r.master_clock_ms,
                          r.max_batch_keys,
                          tuple(PartitionEndpoint(p.port, p.fast_port, p.fast_socket, p.master_pid)
                                for p in r.partitions), r.partition_ticket)


def register_client(client_id: str, host_id: str, hostname: str, client_token: bytes,
                    capability_key: bytes = b"", partition_ticket: bytes = b""
                    ) -> Call[RegisterAnswer]:
    """Register, or re-register proving ``client_token`` (empty for a new client); with
    ``capability_key`` and ``partition_ticket`` (from partition 0's answer), join a later
    partition of a partitioned master."""
    return Call(RPC_METHODS["RegisterClient"], pb.RegisterClientRequest(
        client_id=client_id, host_id=host_id, hostname=hostname, client_token=client_token,
        capability_key=capability_key, partition_ticket=partition_ticket), _register_answer)


def heartbeat(client_id: str, client_token: bytes) -> Call[tuple[Status, int, int]]:
    """(OK or UNKNOWN_CLIENT, the master's capability clock in ms when OK, how many tier
    copies wait for this client)."""
    return Call(RPC_METHODS["Heartbeat"], pb.HeartbeatRequest(
        client_id=client_id, client_token=client_token),
        lambda r: (status_of(r.status), r.master_clock_ms, r.copy_tasks_waiting))


def unregister_client(client_id: str, client_token: bytes) -> Call[Status]:
    """Leave: OK (segments unmounted, objects dropped now) or UNKNOWN_CLIENT."""
    return Call(RPC_METHODS["UnregisterClient"], pb.UnregisterClientRequest(
        client_id=client_id, client_token=client_token), _status_field)


def mount_segment(client_id: str, client_token: bytes, segment: SegmentInfo) -> Call[Status]:
    """Mount (or identically remount) a segment the caller owns."""
    return Call(RPC_METHODS["MountSegment"], pb.MountSegmentRequest(
        client_id=client_id, segment=descriptor_of(segment), client_token=client_token),
        _status_field)


def unmount_segment(client_id: str, client_token: bytes, segment_id: str) -> Call[Status]:
    """Unmount a segment; its objects are dropped."""
    return Call(RPC_METHODS["UnmountSegment"], pb.UnmountSegmentRequest(
        client_id=client_id, segment_id=segment_id, client_token=client_token), _status_field)


def get_segments(segment_ids: Sequence[str]) -> Call[list[SegmentInfo | None]]:
    """Descriptors (with ownership proofs) of the given segments, None where unknown."""
    return Call(RPC_METHODS["GetSegments"], pb.GetSegmentsRequest(segment_ids=segment_ids),
                lambda r: [segment_info_of(d) if s == pb.STATUS_OK else None
                           for s, d in zip(r.statuses, r.segments, strict=False)])


# --- objects ---------------------------------------------------------------------------------

PutStartAnswer = list[tuple[Status, tuple[Placement, ...]]]


def replicas_of(r: Any, sizes_bytes: Sequence[int]) -> list[tuple[Placement, ...]]:
    """Per key the placements of a PutStart or GetReplicas answer, in either form (its
    ``Columns``, whose first replicas are ``sizes_bytes`` long, or a ``Replicas`` per key)."""
    if r.HasField("columns"):
        return columns_of(r.columns, sizes_bytes)
    return [placements_of(p) if p.placements else () for p in r.replicas]


def _put_start_answer(sizes_bytes: Sequence[int], r: Any) -> PutStartAnswer:
    return [(status_of(s), placements) for s, placements in zip(
        r.statuses, replicas_of(r, sizes_bytes), strict=False)]


def put_start(client_id: str, client_token: bytes, keys: Sequence[bytes],
              sizes_bytes: Sequence[int], options: PutOptions,
              parent_keys: Sequence[bytes] | None = None,
              ended: EndedLeases = ()) -> Call[PutStartAnswer]:
    """Allocate per key: (OK, placements) | (ALREADY_EXISTS | NO_SPACE | ..., ()); leases in
    ``ended`` end first, so their space can serve this put."""
    return Call(RPC_METHODS["PutStart"], pb.PutStartRequest(
        client_id=client_id, client_token=client_token, keys=keys, sizes_bytes=sizes_bytes,
        parent_keys=parent_keys or (), ended_lease_ids=ended, columns=True,
        options=pb.PutOptions(replica_num=options.replica_num,
                              preferred_segment=options.preferred_segment,
                              prefer_same_host=options.prefer_same_host,
                              pin=cast(pb.Pin, int(options.pin)))),
        functools.partial(_put_start_answer, sizes_bytes))


def put_end(client_id: str, client_token: bytes, keys: Sequence[bytes],
            checksums: Sequence[int] | None = None) -> Call[list[Status]]:
    """Commit PENDING keys: OK per key, or NOT_FOUND / PERMISSION_DENIED / ..."""
    return Call(RPC_METHODS["PutEnd"], pb.PutEndRequest(
        client_id=client_id, keys=keys, checksums=checksums or (), client_token=client_token),
        _statuses_field)


def put_revoke(client_id: str, client_token: bytes, keys: Sequence[bytes]) -> Call[list[Status]]:
    """Abandon PENDING keys (after a failed transfer): OK per key or why not."""
    return Call(RPC_METHODS["PutRevoke"], pb.PutRevokeRequest(
        client_id=client_id, keys=keys, client_token=client_token), _statuses_field)


#: Leases a client finished reading under, by id (see ``EndedLease``).
EndedLeases = Sequence[int]


class ReplicasAnswer(NamedTuple):
    """A GetReplicas answer: per key where its bytes are (with a read lease) or NOT_FOUND; the
    lease in s, counted from when the call was sent; the ids of the leases to end once read
    (none when they cannot be ended; a batch sent as several calls has one per call)."""

    results: list[ReadResult[Placement]]
    lease_ttl_s: float
    lease_ids: tuple[int, ...]


def _replicas_answer(r: Any) -> ReplicasAnswer:
    sizes = r.sizes_bytes
    results = [ReadResult(status_of(s), size, placements, checksum)
               for s, size, placements, checksum in zip(
                   r.statuses, sizes, replicas_of(r, sizes), r.checksums, strict=False)]
    return ReplicasAnswer(results, r.lease_ttl_ms / 1000, (r.lease_id,) if r.lease_id else ())


def get_replicas(client_id: str, keys: Sequence[bytes], client_token: bytes = b"",
                 ended: EndedLeases = ()) -> Call[ReplicasAnswer]:
    """Where each key's bytes are, under a read lease; with the caller's ``client_token`` the
    lease is its own to end (``ended``: leases it finished reading under, sent along)."""
    return Call(RPC_METHODS["GetReplicas"], pb.GetReplicasRequest(
        client_id=client_id, keys=keys, client_token=client_token,
        ended_lease_ids=ended, columns=True), _replicas_answer)


def exist(client_id: str, keys: Sequence[bytes]) -> Call[tuple[list[Status], list[int]]]:
    """(per key OK or NOT_FOUND, its size in bytes, 0 when absent)."""
    return Call(RPC_METHODS["Exist"], pb.ExistRequest(client_id=client_id, keys=keys),
                lambda r: (statuses_of(r.statuses), list(r.sizes_bytes)))


def tiers(client_id: str, keys: Sequence[bytes]) -> Call[list[Tier | None]]:
    """Per key, the tier of its fastest replica, None when it is not READY (an Exist)."""
    def decode(r: Any) -> list[Tier | None]:
        tiers = [Tier(t) if t in Tier._value2member_map_ else Tier.SSD for t in r.tiers] \
            or [Tier.DRAM] * len(r.statuses)
        return [tier if status == pb.STATUS_OK else None
                for status, tier in zip(r.statuses, tiers, strict=True)]
    return Call(RPC_METHODS["Exist"], pb.ExistRequest(client_id=client_id, keys=keys), decode)


@dataclass(frozen=True, slots=True)
class CopyTask:
    """A copy between two of this client's segments the master asks for (see the README,
    "SSD tier"): ``source`` and ``target`` carry segment, offset and length only."""

    task_id: int
    key: bytes
    source: Placement
    target: Placement
    checksum: int
    start_within_s: float


def copy_tasks(client_id: str, client_token: bytes, done: Sequence[tuple[int, Status]],
               max_tasks: int, wait_s: float = 0.0) -> Call[list[CopyTask]]:
    """Report the results ``done`` ((task id, status) each) and fetch up to ``max_tasks``
    new tasks; when none waits, the master answers once some do or ``wait_s`` passed (a
    master that does not wait answers at once)."""
    request = pb.CopyTasksRequest(
        client_id=client_id, client_token=client_token, max_tasks=max_tasks,
        wait_ms=max(0, int(wait_s * 1000)),
        done=[pb.CopyResult(task_id=task_id, status=cast(Any, int(status)))
              for task_id, status in done])

    def read(r: Any) -> list[CopyTask]:
        return [CopyTask(t.task_id, t.key,
                         Placement(SegmentId(t.source.segment_id), t.source.offset,
                                   t.source.length),
                         Placement(SegmentId(t.target.segment_id), t.target.offset,
                                   t.target.length),
                         t.checksum, t.start_within_ms / 1000) for t in r.tasks]
    return Call(RPC_METHODS["CopyTasks"], request, _checked("CopyTasks", read))


def query_prefix(client_id: str, keys: Sequence[bytes]) -> Call[int]:
    """The number of leading keys that are READY (each is leased)."""
    return Call(RPC_METHODS["QueryPrefix"], pb.QueryPrefixRequest(client_id=client_id, keys=keys),
                _checked("QueryPrefix", lambda r: int(r.num_ready)))


def remove(client_id: str, keys: Sequence[bytes], force: bool = False,
           client_token: bytes = b"", ended: EndedLeases = ()) -> Call[list[Status]]:
    """Per key OK | NOT_FOUND | HAS_LEASE (unless ``force``) | ... (``ended``: leases the
    caller finished reading under, honoured with its ``client_token``; ended first)."""
    return Call(RPC_METHODS["Remove"], pb.RemoveRequest(
        client_id=client_id, keys=keys, force=force, client_token=client_token,
        ended_lease_ids=ended), _statuses_field)


def remove_all(client_id: str, force: bool = False) -> Call[int]:
    """How many objects went."""
    return Call(RPC_METHODS["RemoveAll"], pb.RemoveAllRequest(client_id=client_id, force=force),
                _checked("RemoveAll", lambda r: int(r.num_removed)))


def remove_by_regex(client_id: str, pattern: str, force: bool = False) -> Call[int]:
    """How many objects whose key matches ``pattern`` went (INVALID_ARGUMENT: bad pattern)."""
    return Call(RPC_METHODS["RemoveByRegex"], pb.RemoveByRegexRequest(
        client_id=client_id, pattern=pattern, force=force),
        _checked(f"RemoveByRegex {pattern!r}", lambda r: int(r.num_removed)))


def get_stats() -> Call[dict[str, Any]]:
    """The master's status document (clients, segments, capacity, usage, objects)."""
    return Call(RPC_METHODS["GetStats"], pb.GetStatsRequest(),
                _checked("GetStats", lambda r: cast(dict[str, Any], json.loads(r.json))))
