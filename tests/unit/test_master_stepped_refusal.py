"""A call served in steps, in process (the servicer over a real core, no transport): a master
that turns read-only between its steps, or whose events for a step are refused, answers the
whole call UNAVAILABLE, as one call would; a small call is answered at once."""

from __future__ import annotations

import asyncio
from typing import Any

from kvpool_master.clock import ServingClock
from kvpool_master.core.master import CoreConfig, MasterCore
from kvpool_master.rpc.servicer import STEP_KEYS, Servicer, Stepped
from kvpool_wire import calls
from kvpool_wire.status import Status
from kvpool_wire.types import ClientId, PutOptions, SegmentId, SegmentInfo


class _Observer:
    def rpc_done(self, method: str, transport: str, duration_s: float, failed: bool) -> None:
        pass


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
                        on_events=lambda events: accept_events[0], status_document=lambda: "{}")
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
