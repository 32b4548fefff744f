"""The columnar form of PutStart and GetReplicas answers (``Columns`` in the proto): read back,
it gives exactly what the nested form gives, also when the answer was made in steps and
concatenated, with keys of several replicas and keys of none; it is sent only when asked for;
a malformed one never gives one key another key's replica."""

from __future__ import annotations

import asyncio
from typing import Any

from kvpool_master.clock import ServingClock
from kvpool_master.core.master import CoreConfig, MasterCore
from kvpool_master.rpc.servicer import READ_STEP_KEYS, Servicer, Stepped
from kvpool_wire import calls, convert
from kvpool_wire._pb import kvpool_pb2 as pb
from kvpool_wire.calls import _put_start_answer, _replicas_answer, columns_of
from kvpool_wire.methods import RPC_METHODS
from kvpool_wire.status import Status
from kvpool_wire.types import ClientId, Extent, PutOptions, ReadResult, SegmentId, SegmentInfo

SIZE = 8192


def _extents(*where: tuple[str, int]) -> tuple[Extent, ...]:
    return tuple(Extent(SegmentId(segment), offset, SIZE) for segment, offset in where)


RESULTS = [ReadResult(0, SIZE, _extents(("a", 0)), 11),
           ReadResult(int(Status.NOT_FOUND)),
           ReadResult(0, SIZE, _extents(("a", 8192), ("ssd", 0), ("b", 4096)), 12),
           ReadResult(0, SIZE, _extents(("b", 0)), 13)]


def _capability(p: Extent) -> bytes:
    return b"%s:%d" % (p.segment_id.encode(), p.offset)


def _read_answer(columns: bool, cut: int) -> Any:
    """The answer to RESULTS made in two steps (``cut`` keys, then the rest), concatenated."""
    parts = [convert.encode_get_replicas(RESULTS[:cut], 5.0, 777, _capability, 9, columns, 0),
             convert.encode_get_replicas(RESULTS[cut:], 5.0, 777, _capability, 9, columns, cut)]
    return pb.GetReplicasResponse.FromString(b"".join(p.SerializeToString() for p in parts))


def test_a_read_answer_in_columns_reads_as_the_nested_one() -> None:
    for cut in range(len(RESULTS) + 1):
        in_columns = _read_answer(True, cut)
        nested = _read_answer(False, cut)
        assert in_columns.HasField("columns") and not in_columns.replicas
        assert not nested.HasField("columns")
        assert _replicas_answer(in_columns) == _replicas_answer(nested)
    answer = _replicas_answer(_read_answer(True, 1))
    assert [len(r.placements) for r in answer.results] == [1, 0, 3, 1]
    assert [p.segment_id for p in answer.results[2].placements] == ["a", "ssd", "b"]
    assert {p.length for r in answer.results for p in r.placements} == {SIZE}
    assert answer.results[2].placements[1].capability == b"ssd:0"
    assert answer.lease_ids == (9,) and answer.results[3].checksum == 13


def test_a_put_answer_in_columns_reads_as_the_nested_one() -> None:
    results = [(Status.OK, _extents(("a", 0))), (Status.NO_SPACE, ()),
               (Status.OK, _extents(("a", 8192), ("b", 0)))]
    sizes = [SIZE] * 3
    for columns in (True, False):
        parts = [convert.encode_put_start(results[:1], 555, _capability, 42, columns, 0),
                 convert.encode_put_start(results[1:], 555, _capability, 42, columns, 1)]
        raw = b"".join(p.SerializeToString() for p in parts)
        answer = _put_start_answer(sizes, pb.PutStartResponse.FromString(raw))
        assert [s for s, _ in answer] == [Status.OK, Status.NO_SPACE, Status.OK]
        placements = [p for _, ps in answer for p in ps]
        assert [(p.segment_id, p.offset, p.length) for p in placements] == \
            [("a", 0, SIZE), ("a", 8192, SIZE), ("b", 0, SIZE)]
        assert {(p.put_id, p.capability_expiry_ms) for p in placements} == {(42, 555)}
        assert [p.capability for p in placements] == [b"a:0", b"a:8192", b"b:0"]


def test_a_malformed_columns_message_never_moves_a_replica_to_another_key() -> None:
    columns = pb.Columns(segment_ids=["a", ""], offsets=[0, 0], capabilities=[b"x", b""],
                         more_keys=[1, 7], more=[pb.Replicas(placements=[pb.Placement(
                             segment_id="b", offset=0, length=SIZE)])] * 2)
    placements = columns_of(columns, [SIZE, SIZE])
    assert [len(p) for p in placements] == [1, 0]   # key 1 has no first replica; 7 is absent
    short = pb.Columns(segment_ids=["a"], offsets=[0], capabilities=[b"x"])
    assert len(columns_of(short, [SIZE, SIZE])) == 1   # short: the caller's length check fails


def _servicer() -> tuple[Servicer, bytes]:
    core = MasterCore(CoreConfig())
    servicer = Servicer(core, ServingClock(), _Observer(), master_id="m",
                        on_events=lambda events: True, status_document=lambda: iter(["{}"]))
    token = _serve(servicer, calls.register_client("c", "h", "", b"")).client_token
    segment = SegmentInfo(SegmentId("s"), ClientId("c"), 4 * READ_STEP_KEYS * SIZE)
    assert _serve(servicer, calls.mount_segment("c", token, segment)) == Status.OK
    return servicer, token


class _Observer:
    def rpc_done(self, method: str, transport: str, duration_s: float, failed: bool) -> None:
        pass


def _raw(servicer: Servicer, method: str, request: Any) -> bytes:
    answer = servicer.serve(RPC_METHODS[method], request.SerializeToString(), "test")
    return asyncio.run(answer.answer()) if isinstance(answer, Stepped) else answer


def _serve(servicer: Servicer, call: calls.Call[Any]) -> Any:
    raw = _raw(servicer, call.method.name, call.request)
    return call.decode(call.method.response_type.FromString(raw))


def test_the_master_answers_in_columns_only_when_asked() -> None:
    servicer, token = _servicer()
    n = 2 * READ_STEP_KEYS + 3   # served in steps
    keys = [b"k%05d" % i for i in range(n)]
    started = _serve(servicer, calls.put_start("c", token, keys, [SIZE] * n, PutOptions()))
    assert [s for s, _ in started] == [Status.OK] * n
    assert _serve(servicer, calls.put_end("c", token, keys)) == [Status.OK] * n
    asked = [*keys, b"absent"]
    for columns in (True, False):
        request = pb.GetReplicasRequest(client_id="c", keys=asked, columns=columns)
        raw = pb.GetReplicasResponse.FromString(_raw(servicer, "GetReplicas", request))
        assert raw.HasField("columns") == columns and bool(raw.replicas) != columns
        results = _replicas_answer(raw).results
        assert [r.placements[0].offset for r in results[:n]] == \
            [ps[0].offset for _, ps in started]
        assert results[n].status == Status.NOT_FOUND and results[n].placements == ()
    plain = pb.PutStartRequest(client_id="c", client_token=token, keys=[b"x"],
                               sizes_bytes=[SIZE])
    answer = pb.PutStartResponse.FromString(_raw(servicer, "PutStart", plain))
    assert not answer.HasField("columns") and len(answer.replicas) == 1
