"""A call served in steps, in process (the servicer over a real core, no transport): a master
that turns read-only between the steps of a write, or whose events for a step are refused,
answers the whole call UNAVAILABLE, as one call would; reads go on while read-only; an Exist
whose first SSD segment is mounted between its steps gives every key a tier; a small call is
answered at once; a stepped call is timed once, when its last step is done; a call whose
lists disagree in length is refused whole; a caller that leaves between steps, or while its
mount waits for a sweep, never acts as the client id's next holder."""

from __future__ import annotations

import asyncio
from typing import Any

from kvpool_master.clock import ServingClock
from kvpool_master.core.master import CoreConfig, MasterCore
from kvpool_master.rpc.servicer import EXIST_STEP_KEYS, READ_STEP_KEYS, STEP_KEYS, Servicer, Stepped
from kvpool_wire import calls
from kvpool_wire.status import Status
from kvpool_wire.types import ClientId, PutOptions, SegmentId, SegmentInfo, Tier


class _Observer:
    def __init__(self) -> None:
        self.done: list[tuple[str, bool]] = []

    def rpc_done(self, method: str, transport: str, duration_s: float, failed: bool) -> None:
        self.done.append((method, failed))


def _decoded(call: calls.Call[Any], answer: bytes | Stepped) -> Any:
    """The call's answer, read as a client reads it (after its steps, if it has them)."""
    if isinstance(answer, Stepped):
        answer = asyncio.run(answer.answer())
    return call.decode(call.method.response_type.FromString(answer))


def _serve(servicer: Servicer, call: calls.Call[Any]) -> Any:
    return _decoded(call, servicer.serve(call.method, call.request.SerializeToString(), "test"))


def _servicer(accept_events: list[bool]) -> tuple[Servicer, bytes]:
    core = MasterCore(CoreConfig())
    servicer = Servicer(core, ServingClock(), _Observer(), master_id="m",
                        on_events=lambda events: accept_events[0],
                        status_document=lambda: iter(["{}"]))
    token = _serve(servicer, calls.register_client("c", "h", "", b"")).client_token
    segment = SegmentInfo(SegmentId("s"), ClientId("c"), 64 * STEP_KEYS * 4096)
    assert _serve(servicer, calls.mount_segment("c", token, segment)) == Status.OK
    return servicer, token


def _put(servicer: Servicer, token: bytes, num_keys: int, name: bytes) -> Any:
    keys = [b"%s-%d" % (name, i) for i in range(num_keys)]
    call = calls.put_start("c", token, keys, [4096] * num_keys, PutOptions())
    return servicer.serve(call.method, call.request.SerializeToString(), "test"), call


def test_a_small_call_answers_at_once_and_a_large_one_in_steps() -> None:
    servicer, token = _servicer([True])
    small, _ = _put(servicer, token, STEP_KEYS, b"small")
    assert isinstance(small, bytes)
    large, call = _put(servicer, token, 3 * STEP_KEYS, b"large")
    assert isinstance(large, Stepped)
    assert [s for s, _ in _decoded(call, large)] == [Status.OK] * (3 * STEP_KEYS)


def test_read_only_between_steps_answers_the_call_unavailable() -> None:
    servicer, token = _servicer([True])
    large, call = _put(servicer, token, 3 * STEP_KEYS, b"large")
    assert isinstance(large, Stepped)
    servicer.read_only = True   # the state directory failed after the first step
    assert {s for s, _ in _decoded(call, large)} == {Status.UNAVAILABLE}


def test_refused_events_of_a_step_answer_the_call_unavailable() -> None:
    accept = [True]
    servicer, token = _servicer(accept)
    keys = [b"k-%d" % i for i in range(3 * STEP_KEYS)]
    started = _serve(servicer, calls.put_start("c", token, keys, [4096] * len(keys),
                                               PutOptions()))
    assert {s for s, _ in started} == {Status.OK}
    call = calls.put_end("c", token, keys)
    stepped = servicer.serve(call.method, call.request.SerializeToString(), "test")
    assert isinstance(stepped, Stepped)
    accept[0] = False          # the commits of the second step cannot be written
    assert set(_decoded(call, stepped)) == {Status.UNAVAILABLE}


def _ready(servicer: Servicer, token: bytes, num_keys: int) -> list[bytes]:
    keys = [b"r-%d" % i for i in range(num_keys)]
    assert {s for s, _ in _serve(servicer, calls.put_start("c", token, keys, [4096] * num_keys,
                                                           PutOptions()))} == {Status.OK}
    assert set(_serve(servicer, calls.put_end("c", token, keys))) == {Status.OK}
    return keys


def test_reads_in_steps_go_on_while_read_only() -> None:
    servicer, token = _servicer([True])
    keys = _ready(servicer, token, 3 * READ_STEP_KEYS)
    read = calls.get_replicas("c", keys, token, [])
    stepped = servicer.serve(read.method, read.request.SerializeToString(), "test")
    assert isinstance(stepped, Stepped)
    servicer.read_only = True
    answer = _decoded(read, stepped)
    assert {r.status for r in answer.results} == {Status.OK} and len(answer.lease_ids) == 1


def test_an_exist_whose_first_ssd_segment_comes_between_its_steps_gives_every_key_a_tier(
        tmp_path: Any) -> None:
    servicer, token = _servicer([True])
    keys = _ready(servicer, token, 2 * EXIST_STEP_KEYS)
    ask = calls.tiers("c", keys + [b"absent"])
    stepped = servicer.serve(ask.method, ask.request.SerializeToString(), "test")
    assert isinstance(stepped, Stepped)
    ssd = SegmentInfo(SegmentId("ssd"), ClientId("c"), 1 << 20, tier=Tier.SSD,
                      file_path=str(tmp_path / "ssd"))
    assert _serve(servicer, calls.mount_segment("c", token, ssd)) == Status.OK
    assert _decoded(ask, stepped) == [Tier.DRAM] * len(keys) + [None]


def test_a_stepped_call_is_timed_once_its_last_step_is_done() -> None:
    servicer, token = _servicer([True])
    observer = servicer._observer
    assert isinstance(observer, _Observer)
    large, call = _put(servicer, token, 3 * STEP_KEYS, b"large")
    assert isinstance(large, Stepped)
    assert ("PutStart", False) not in observer.done
    _decoded(call, large)
    assert observer.done.count(("PutStart", False)) == 1


def test_a_call_whose_lists_disagree_in_length_is_refused_whole() -> None:
    servicer, token = _servicer([True])
    for num_keys in (2, 3 * STEP_KEYS):   # one step or many: the core sees the lists as sent
        keys = [b"odd-%d-%d" % (num_keys, i) for i in range(num_keys)]
        started = _serve(servicer, calls.put_start("c", token, keys, [4096] * (num_keys + 1),
                                                   PutOptions()))
        assert {s for s, _ in started} == {Status.INVALID_ARGUMENT}
        started = _serve(servicer, calls.put_start("c", token, keys, [4096] * num_keys,
                                                   PutOptions()))
        assert {s for s, _ in started} == {Status.OK}
        ended = _serve(servicer, calls.put_end("c", token, keys, list(range(num_keys + 1))))
        assert set(ended) == {Status.INVALID_ARGUMENT}
        assert set(_serve(servicer, calls.exist("c", keys))[0]) == {Status.NOT_FOUND}


def test_a_caller_that_leaves_between_steps_acts_as_nobody_in_the_later_steps() -> None:
    """The caller unregisters after the first step and another process takes its client id:
    the later steps, which act as that id, must not act as the new holder (commit its put)."""
    servicer, old = _servicer([True])
    keys = [b"k-%d" % i for i in range(3 * STEP_KEYS)]
    started = _serve(servicer, calls.put_start("c", old, keys, [4096] * len(keys),
                                               PutOptions()))
    assert {s for s, _ in started} == {Status.OK}
    # the new holder's put of a key the old holder's PutEnd names past its first step
    victim = keys[-1]
    end = calls.put_end("c", old, [*keys[:-1], victim])
    stepped = servicer.serve(end.method, end.request.SerializeToString(), "test")
    assert isinstance(stepped, Stepped)
    assert _serve(servicer, calls.unregister_client("c", old)) == Status.OK
    new = _serve(servicer, calls.register_client("c", "h", "", b"")).client_token
    segment = SegmentInfo(SegmentId("s2"), ClientId("c"), 64 * 4096)
    assert _serve(servicer, calls.mount_segment("c", new, segment)) == Status.OK
    assert [s for s, _ in _serve(servicer, calls.put_start("c", new, [victim], [4096],
                                                            PutOptions()))] == [Status.OK]
    assert {s for s in _decoded(end, stepped)} == {Status.UNKNOWN_CLIENT}
    assert _serve(servicer, calls.exist("c", [victim]))[0] == [Status.NOT_FOUND]  # PENDING


def test_a_mount_waiting_for_a_sweep_is_not_made_for_the_ids_next_holder() -> None:
    """A mount that waits for the sweep of a segment lost under its id is made once the sweep
    is done, and only if its caller still holds the client id: not for a new holder."""
    from kvpool_master.rpc.servicer import Pending

    core = MasterCore(CoreConfig())
    core.defer_upkeep = True   # as the server runs it: sweeps in steps
    servicer = Servicer(core, ServingClock(), _Observer(), master_id="m",
                        on_events=lambda events: True, status_document=lambda: iter(["{}"]))
    old = _serve(servicer, calls.register_client("c", "h", "", b"")).client_token
    segment = SegmentInfo(SegmentId("s"), ClientId("c"), 8 * STEP_KEYS * 4096)
    assert _serve(servicer, calls.mount_segment("c", old, segment)) == Status.OK
    keys = [b"k-%d" % i for i in range(3 * STEP_KEYS)]   # more than a sweep takes at once
    _serve(servicer, calls.put_start("c", old, keys, [4096] * len(keys), PutOptions()))
    assert set(_serve(servicer, calls.put_end("c", old, keys))) == {Status.OK}
    assert _serve(servicer, calls.unmount_segment("c", old, "s")) == Status.OK
    again = calls.mount_segment("c", old, SegmentInfo(SegmentId("s"), ClientId("c"),
                                                      4 * STEP_KEYS * 4096))
    waiting = servicer.serve(again.method, again.request.SerializeToString(), "test")
    assert type(waiting) is Pending
    assert _serve(servicer, calls.unregister_client("c", old)) == Status.OK
    _serve(servicer, calls.register_client("c", "h", "", b""))   # the id's next holder
    for _ in range(10_000):
        if not servicer.upkeep():
            break
    servicer.upkeep()
    assert again.decode(again.method.response_type.FromString(waiting._build())) == \
        Status.UNKNOWN_CLIENT
    assert core.get_segments(["s"]) == [None]


def test_a_list_longer_than_a_batch_is_refused_before_any_work_per_item() -> None:
    """Clients split longer batches: a longer list is refused whole at once (INVALID_ARGUMENT
    for the call), not answered item by item."""
    import pytest

    from kvpool_master.rpc.servicer import BadRequest

    core = MasterCore(CoreConfig(max_batch_keys=100))
    servicer = Servicer(core, ServingClock(), _Observer(), master_id="m",
                        on_events=lambda events: True, status_document=lambda: iter(["{}"]))
    for call in (calls.get_replicas("c", [b"k"] * 101), calls.exist("c", [b"k"] * 101),
                 calls.remove("c", [b"k"] * 101, False, b"")):
        with pytest.raises(BadRequest, match="max_batch_keys"):
            servicer.serve(call.method, call.request.SerializeToString(), "test")
    assert _serve(servicer, calls.exist("c", [b"k"] * 100))[0] == [Status.NOT_FOUND] * 100


def test_removals_walking_the_table_at_once_are_bounded() -> None:
    """Each running removal is walked over by every sweep step: past MAX_REMOVAL_JOBS of
    them a removal is refused (RESOURCE_EXHAUSTED) until one ends, and nothing changes."""
    from kvpool_master.rpc.servicer import MAX_REMOVAL_JOBS, Pending

    servicer, token = _servicer([True])
    keys = [b"k-%d" % i for i in range(3 * STEP_KEYS)]   # more than a removal takes at once
    _serve(servicer, calls.put_start("c", token, keys, [4096] * len(keys), PutOptions()))
    assert set(_serve(servicer, calls.put_end("c", token, keys))) == {Status.OK}
    waiting = []
    for i in range(MAX_REMOVAL_JOBS):
        call = calls.remove_by_regex("c", f"^nothing-{i}$")
        waiting.append(servicer.serve(call.method, call.request.SerializeToString(), "test"))
    assert all(type(w) is Pending for w in waiting)
    import pytest

    from kvpool_wire.status import KVPoolError
    for refused in (calls.remove_by_regex("c", "^k-"), calls.remove_all("c")):
        with pytest.raises(KVPoolError) as error:
            _serve(servicer, refused)
        assert error.value.status == Status.RESOURCE_EXHAUSTED
    assert _serve(servicer, calls.exist("c", keys[:3]))[0] == [Status.OK] * 3
