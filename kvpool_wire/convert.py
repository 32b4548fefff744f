"""The only master code that touches protobuf: requests -> domain values -> responses.

Rules of this file:
- ``decode_*`` take a parsed request message and return plain domain values; ``encode_*`` take
  domain values and return a response message. Nothing here calls the core.
- Hot calls (exist, get_replicas, query_prefix, put_*) avoid per-key Python objects where the
  protobuf runtime allows: repeated scalar fields are copied with ``list(...)`` and answers are
  built by passing whole lists to the message constructor.
- A field that cannot be turned into a domain value raises :class:`BadRequest`; the servicer
  answers it with INVALID_ARGUMENT for the whole call and changes nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from google.protobuf.message import DecodeError, Message

from kvpool_wire._pb import kvpool_pb2 as pb
from kvpool_wire.capability import ColumnsSigner, RunSigner
from kvpool_wire.methods import RPC_METHODS, RpcMethod
from kvpool_wire.partitions import PartitionEndpoint
from kvpool_wire.placed import PlacedBatch
from kvpool_wire.readcolumns import ReadColumns
from kvpool_wire.status import Status
from kvpool_wire.types import (
    ClientId,
    Extent,
    ObjectKey,
    Pin,
    PutOptions,
    ReadResult,
    SegmentId,
    SegmentInfo,
    Tier,
)

#: Longest client id, host id, hostname, segment id or endpoint accepted, in characters.
MAX_NAME_CHARS = 512
#: Longest remove-by-regex pattern accepted, in characters.
MAX_PATTERN_CHARS = 4096
MAX_REPLICA_NUM = 16


class BadRequest(ValueError):
    """A request that cannot be served at all; the message says which field is wrong."""



def _pb(value: Any) -> Any:
    """``value`` (a Status, a list of them, or a tier number) where the generated stubs expect
    their enum types: the numbers are the same."""
    return value

def parse_request(method: RpcMethod, payload: bytes) -> Message:
    """Parse the protobuf bytes of ``method``'s request; raise BadRequest when malformed."""
    try:
        return method.request_type.FromString(payload)
    except (DecodeError, ValueError, RuntimeError) as exc:
        raise BadRequest(f"malformed {method.name} request: {exc}") from None


def serialize(message: Message) -> bytes:
    """Protobuf bytes of an answer."""
    return bytes(message.SerializeToString())


def _name(value: str, what: str, *, required: bool = True) -> str:
    if required and not value:
        raise BadRequest(f"{what} is empty")
    if len(value) > MAX_NAME_CHARS:
        raise BadRequest(f"{what} is longer than {MAX_NAME_CHARS} characters")
    return value


# --- clients and segments ----------------------------------------------------------------------

def decode_register_client(request: Any) -> tuple[ClientId, str, str, bytes, bytes, bytes]:
    """(client_id, host_id, hostname, client_token, capability_key, partition_ticket) of a
    RegisterClient request (the last two empty but for joining a later partition)."""
    return (ClientId(_name(request.client_id, "client_id")),
            _name(request.host_id, "host_id", required=False),
            _name(request.hostname, "hostname", required=False),
            request.client_token, request.capability_key, request.partition_ticket)


def encode_register_client(status: Status, *, client_ttl_s: float, capability_key: bytes,
                           client_token: bytes, fast_port: int, master_id: str,
                           default_lease_ttl_s: float, fast_socket: str = "",
                           master_pid: int = 0, retry_after_s: float = 0.0,
                           master_clock_ms: int = 0, capability_epoch: int = 0,
                           max_batch_keys: int = 0,
                           partitions: Sequence[PartitionEndpoint] = (),
                           partition_ticket: bytes = b"") -> pb.RegisterClientResponse:
    """The RegisterClient answer (key, token and ticket only when OK)."""
    return pb.RegisterClientResponse(
        partitions=[pb.PartitionEndpoint(port=p.port, fast_port=p.fast_port,
                                         fast_socket=p.fast_socket, master_pid=p.master_pid)
                    for p in partitions], partition_ticket=partition_ticket,
        status=_pb(status), client_ttl_ms=round(client_ttl_s * 1000), capability_key=capability_key,
        client_token=client_token, fast_port=max(fast_port, 0), master_id=master_id,
        default_lease_ttl_ms=round(default_lease_ttl_s * 1000), fast_socket=fast_socket,
        master_pid=master_pid if fast_socket else 0, retry_after_ms=math.ceil(retry_after_s * 1000),
        master_clock_ms=master_clock_ms, capability_epoch=capability_epoch,
        max_batch_keys=max_batch_keys)


def decode_client_id(request: Any) -> ClientId:
    """The client id of a request that carries only that (Heartbeat)."""
    return ClientId(_name(request.client_id, "client_id"))


def decode_caller(request: Any) -> tuple[ClientId, bytes]:
    """(client_id, client_token) of a client-scoped request, as sent (the core judges them)."""
    return ClientId(request.client_id), request.client_token


def encode_heartbeat(status: Status, master_clock_ms: int,
                     copy_tasks_waiting: int = 0) -> pb.HeartbeatResponse:
    """The Heartbeat answer."""
    return pb.HeartbeatResponse(status=_pb(status), master_clock_ms=master_clock_ms,
                                copy_tasks_waiting=copy_tasks_waiting)


def decode_copy_tasks(request: Any) -> tuple[ClientId, list[tuple[int, int]], int, float]:
    """(caller, [(task id, status)] reported, most tasks wanted, seconds to wait for some) of
    a CopyTasks request."""
    return (ClientId(_name(request.client_id, "client_id")),
            [(int(r.task_id), int(r.status)) for r in request.done], int(request.max_tasks),
            int(request.wait_ms) / 1000)


def encode_copy_tasks(status: Status, tasks: Sequence[Any], start_within_ms: int
                      ) -> pb.CopyTasksResponse:
    """The CopyTasks answer (``tasks``: core CopyTasks)."""
    return pb.CopyTasksResponse(status=_pb(status), tasks=[
        pb.CopyTask(task_id=t.task_id, key=t.key, checksum=t.entry.checksum,
                    start_within_ms=start_within_ms,
                    source=pb.Placement(segment_id=t.source.segment_id, offset=t.source.offset,
                                        length=t.source.length),
                    target=pb.Placement(segment_id=t.target.segment_id, offset=t.target.offset,
                                        length=t.target.length)) for t in tasks])


def status_response(response_type: type[Message], status: Status) -> Message:
    """An answer whose only field is ``status``."""
    return response_type(status=status)


def _segment_info(descriptor: Any, client_id: str) -> SegmentInfo:
    try:
        tier = Tier(descriptor.tier)
    except ValueError:
        raise BadRequest(f"unknown tier {descriptor.tier}") from None
    owner = descriptor.client_id or client_id
    return SegmentInfo(
        segment_id=SegmentId(_name(descriptor.segment_id, "segment.segment_id")),
        client_id=ClientId(_name(owner, "segment.client_id")),
        size_bytes=int(descriptor.size_bytes),
        tier=tier,
        host_id=_name(descriptor.host_id, "segment.host_id", required=False),
        shm_name=_name(descriptor.shm_name, "segment.shm_name", required=False),
        tcp_endpoint=_name(descriptor.tcp_endpoint, "segment.tcp_endpoint", required=False),
        engine_endpoint=_name(descriptor.engine_endpoint, "segment.engine_endpoint",
                              required=False),
        engine_base_address=int(descriptor.engine_base_address),
        file_path=_name(descriptor.file_path, "segment.file_path", required=False),
    )


def decode_mount_segment(request: Any) -> tuple[ClientId, SegmentInfo]:
    """(caller, segment) of a MountSegment request; the segment's owner defaults to the caller."""
    client_id = ClientId(_name(request.client_id, "client_id"))
    if not request.HasField("segment"):
        raise BadRequest("segment is missing")
    return client_id, _segment_info(request.segment, client_id)


def decode_unmount_segment(request: Any) -> tuple[ClientId, SegmentId]:
    """(client_id, segment_id) of an UnmountSegment request."""
    return (ClientId(_name(request.client_id, "client_id")),
            SegmentId(_name(request.segment_id, "segment_id")))


def decode_get_segments(request: Any) -> list[str]:
    """Segment ids asked for."""
    return list(request.segment_ids)


def descriptor_of(info: SegmentInfo, ownership_proof: bytes = b"") -> pb.SegmentDescriptor:
    """The protobuf descriptor of a segment (both directions use it)."""
    return pb.SegmentDescriptor(
        segment_id=info.segment_id, client_id=info.client_id, size_bytes=info.size_bytes,
        tier=_pb(int(info.tier)), host_id=info.host_id, shm_name=info.shm_name,
        tcp_endpoint=info.tcp_endpoint, engine_endpoint=info.engine_endpoint,
        engine_base_address=info.engine_base_address, file_path=info.file_path,
        ownership_proof=ownership_proof)


def encode_get_segments(infos: Sequence[SegmentInfo | None],
                        proofs: Sequence[bytes]) -> pb.GetSegmentsResponse:
    """One status and descriptor (with its ownership proof) per asked id
    (SEGMENT_NOT_FOUND + empty descriptor if absent)."""
    empty = pb.SegmentDescriptor()
    return pb.GetSegmentsResponse(
        statuses=_pb([Status.OK if info else Status.SEGMENT_NOT_FOUND for info in infos]),
        segments=[descriptor_of(info, proof) if info else empty
                  for info, proof in zip(infos, proofs, strict=True)])


# --- objects -------------------------------------------------------------------------------------

def decode_keys(request: Any) -> tuple[str, list[ObjectKey]]:
    """(client_id, keys) of a keyed request; the client id may be empty for reads."""
    return request.client_id, list(request.keys)


def _put_options(options: Any) -> PutOptions:
    try:
        pin = Pin(options.pin)
    except ValueError:
        raise BadRequest(f"unknown pin {options.pin}") from None
    replica_num = options.replica_num or 1
    if replica_num > MAX_REPLICA_NUM:
        raise BadRequest(f"replica_num {replica_num} is above {MAX_REPLICA_NUM}")
    return PutOptions(replica_num=replica_num,
                      preferred_segment=_name(options.preferred_segment, "preferred_segment",
                                              required=False),
                      prefer_same_host=options.prefer_same_host, pin=pin)


def decode_put_start(request: Any) -> tuple[ClientId, list[ObjectKey], list[int], PutOptions,
                                            list[ObjectKey] | None]:
    """(client_id, keys, sizes_bytes, options, parent_keys or None) of a PutStart request."""
    parent_keys = list(request.parent_keys) if len(request.parent_keys) else None
    return (ClientId(request.client_id), list(request.keys), list(request.sizes_bytes),
            _put_options(request.options), parent_keys)


def _add_replicas(replicas: Any, placements: Sequence[Extent], expiry_ms: int,
                  capability_of: Callable[[Extent], bytes], put_id: int = 0) -> None:
    """Append one key's replicas, each signed by ``capability_of``, to a repeated ``Replicas``
    field. Messages are built in place with ``add``: constructing sub-messages and passing
    them in lists copies each one, several times the cost on a batch's answer."""
    target = replicas.add().placements
    for p in placements:
        target.add(segment_id=p.segment_id, offset=p.offset, length=p.length,
                   capability_expiry_ms=expiry_ms, capability=capability_of(p), put_id=put_id)


def _add_all_replicas(response: Any, replicas_per_key: Iterable[Sequence[Extent]],
                      expiry_ms: int, capability_of: Callable[[Extent], bytes], put_id: int,
                      columns: bool, first_index: int) -> None:
    """Put each key's signed replicas into ``response``: its ``Columns`` when asked for, else
    a ``Replicas`` message per key."""
    if columns:
        _add_columns(response.columns, replicas_per_key, expiry_ms, capability_of, put_id,
                     first_index)
        return
    replicas = response.replicas
    for placements in replicas_per_key:
        _add_replicas(replicas, placements, expiry_ms, capability_of, put_id)


def _add_columns(columns: Any, replicas_per_key: Iterable[Sequence[Extent]], expiry_ms: int,
                 capability_of: Callable[[Extent], bytes], put_id: int,
                 first_index: int) -> None:
    """Put each key's replicas, signed by ``capability_of``, into ``columns`` (a ``Columns``
    message; the keys are those from index ``first_index`` of the batch on). A replica's
    length is not sent: it is the object's size (every replica of an object has its size)."""
    segment_ids: list[str] = []
    offsets: list[int] = []
    capabilities: list[bytes] = []
    more_keys: list[int] = []
    for index, placements in enumerate(replicas_per_key, first_index):
        if not placements:
            segment_ids.append("")
            offsets.append(0)
            capabilities.append(b"")
            continue
        first = placements[0]
        segment_ids.append(first.segment_id)
        offsets.append(first.offset)
        capabilities.append(capability_of(first))
        if len(placements) > 1:
            more_keys.append(index)
            _add_replicas(columns.more, placements[1:], expiry_ms, capability_of, put_id)
    columns.segment_ids.extend(segment_ids)
    columns.offsets.extend(offsets)
    columns.capabilities.extend(capabilities)
    columns.more_keys.extend(more_keys)
    columns.capability_expiry_ms = expiry_ms
    columns.put_id = put_id


def encode_put_start(results: Sequence[tuple[Status, Sequence[Extent]]], expiry_ms: int,
                     capability_of: Callable[[Extent], bytes], put_id: int,
                     columns: bool = False, first_index: int = 0,
                     run_signer: RunSigner | None = None) -> pb.PutStartResponse:
    """One status and signed replica list per key (capabilities of put ``put_id``), as
    ``Columns`` when asked for (``first_index``: where these keys start in the batch). The
    runs of a ``PlacedBatch`` go into the columns as they are, signed by ``run_signer``."""
    if columns and run_signer is not None and isinstance(results, PlacedBatch):
        response = pb.PutStartResponse(statuses=_pb(results.statuses()))
        target = response.columns
        size = results.run_size_bytes
        index = first_index
        for piece in results.pieces:
            if isinstance(piece, tuple):
                segment_id, offsets = piece
                target.segment_ids.extend([segment_id] * len(offsets))
                target.offsets.extend(offsets)
                target.capabilities.extend(run_signer(segment_id, offsets, size))
                index += len(offsets)
            else:
                _add_columns(target, (placements for _, placements in piece), expiry_ms,
                             capability_of, put_id, index)
                index += len(piece)
        target.capability_expiry_ms = expiry_ms
        target.put_id = put_id
        return response
    response = pb.PutStartResponse(statuses=_pb([status for status, _ in results]))
    _add_all_replicas(response, (placements for _, placements in results), expiry_ms,
                      capability_of, put_id, columns, first_index)
    return response


def decode_put_end(request: Any) -> tuple[ClientId, list[ObjectKey], list[int] | None]:
    """(client_id, keys, checksums or None) of a PutEnd request."""
    checksums = list(request.checksums) if len(request.checksums) else None
    return ClientId(request.client_id), list(request.keys), checksums


def encode_statuses(response_type: type[Message], statuses: Sequence[int]) -> Message:
    """An answer whose only field is the per-key ``statuses``."""
    return response_type(statuses=statuses)


def decode_ended_lease_ids(request: Any) -> list[int]:
    """The ids of the leases the request's client says it finished reading under (given as
    ids, or as ``EndedLease`` messages, whose keys the master does not need)."""
    ids = list(request.ended_lease_ids)
    if request.ended_leases:
        ids += [ended.lease_id for ended in request.ended_leases]
    return ids


def encode_get_replicas(results: Sequence[ReadResult[Extent]], lease_ttl_s: float,
                        expiry_ms: int, capability_of: Callable[[Extent], bytes],
                        lease_id: int = 0, columns: bool = False,
                        first_index: int = 0,
                        columns_signer: ColumnsSigner | None = None,
                        ) -> pb.GetReplicasResponse:
    """Per key: status, size, signed replicas (as ``Columns`` when asked for;
    ``first_index``: where these keys start in the batch), checksum; plus the lease every OK
    key holds (``lease_id``: the number its reader ends it by, 0 for a lease nobody can
    end). The columns of ``ReadColumns`` go into the answer's as they are, signed by
    ``columns_signer``."""
    if columns and columns_signer is not None and isinstance(results, ReadColumns):
        response = pb.GetReplicasResponse(
            statuses=_pb(results.statuses), sizes_bytes=results.sizes_bytes,
            checksums=results.checksums, lease_ttl_ms=round(lease_ttl_s * 1000),
            lease_id=lease_id)
        target = response.columns
        target.segment_ids.extend(results.segment_ids)
        target.offsets.extend(results.offsets)
        target.capabilities.extend(columns_signer(results.segment_ids, results.offsets,
                                                  results.sizes_bytes))
        for index, placements in sorted(results.more.items()):
            if len(placements) > 1:
                target.more_keys.append(first_index + index)
                _add_replicas(target.more, placements[1:], expiry_ms, capability_of, 0)
        target.capability_expiry_ms = expiry_ms
        return response
    response = pb.GetReplicasResponse(
        statuses=_pb([r.status for r in results]),
        sizes_bytes=[r.size_bytes for r in results],
        checksums=[r.checksum for r in results],
        lease_ttl_ms=round(lease_ttl_s * 1000), lease_id=lease_id)
    _add_all_replicas(response, (r.placements for r in results), expiry_ms, capability_of, 0,
                      columns, first_index)
    return response


def encode_exist(statuses: Sequence[int], sizes_bytes: Sequence[int],
                 tiers: Sequence[int] | None = None) -> pb.ExistResponse:
    """Per key: OK or NOT_FOUND, the size, and (with an SSD tier) the fastest tier."""
    if tiers is None:
        return pb.ExistResponse(statuses=_pb(statuses), sizes_bytes=sizes_bytes)
    return pb.ExistResponse(statuses=_pb(statuses), sizes_bytes=sizes_bytes, tiers=_pb(tiers))


def encode_query_prefix(status: Status, num_ready: int,
                        tiers: Sequence[int] | None = None) -> pb.QueryPrefixResponse:
    """How many leading keys are READY (and, with an SSD tier, the tier of each)."""
    return pb.QueryPrefixResponse(status=_pb(status), num_ready=num_ready, tiers=_pb(tiers or []))


def decode_remove(request: Any) -> tuple[str, list[ObjectKey], bool]:
    """(client_id, keys, force) of a Remove request."""
    return request.client_id, list(request.keys), bool(request.force)


def decode_remove_all(request: Any) -> tuple[str, bool]:
    """(client_id, force) of a RemoveAll request."""
    return request.client_id, bool(request.force)


def decode_remove_by_regex(request: Any) -> tuple[str, str, bool]:
    """(client_id, pattern, force) of a RemoveByRegex request."""
    if len(request.pattern) > MAX_PATTERN_CHARS:
        raise BadRequest(f"pattern is longer than {MAX_PATTERN_CHARS} characters")
    return request.client_id, request.pattern, bool(request.force)


def encode_num_removed(response_type: type[Message], status: Status, num_removed: int) -> Message:
    """A RemoveAll / RemoveByRegex answer."""
    return response_type(status=status, num_removed=num_removed)


def encode_stats(status: Status, document: str) -> pb.GetStatsResponse:
    """The GetStats answer: the /status JSON document."""
    return pb.GetStatsResponse(status=_pb(status), json=document)


def decode_auth(payload: bytes) -> str:
    """The token of a lean-framing METHOD_AUTH frame; BadRequest when malformed."""
    try:
        return str(pb.AuthRequest.FromString(payload).token)
    except (DecodeError, ValueError, RuntimeError) as exc:
        raise BadRequest(f"malformed AuthRequest: {exc}") from None


def encode_auth(status: Status) -> bytes:
    """Bytes of an AuthResponse."""
    return bytes(pb.AuthResponse(status=_pb(status)).SerializeToString())


_RESPONSE_BY_REQUEST: dict[Any, Any] = {m.request_type: m.response_type
                                         for m in RPC_METHODS.values()}


def response_type_of(request: Message) -> type[Message]:
    """The answer message type of a request message."""
    return _RESPONSE_BY_REQUEST[type(request)]  # type: ignore[no-any-return]


def refused_response(request: Message, status: Status) -> Message:
    """The answer to ``request`` with ``status`` for the call or for every item (one empty
    replica set per key where the answer carries placements)."""
    response = response_type_of(request)()
    fields = response.DESCRIPTOR.fields_by_name
    if "statuses" in fields:
        num_items = len(request.keys)
        response.statuses.extend([status] * num_items)
        if "replicas" in fields:
            for _ in range(num_items):
                response.replicas.add()
    else:
        response.status = status
    return response
