"""RemoveByRegex cannot hold the master's event loop: patterns run on a linear-time engine.

With a backtracking engine ``(.+)+z`` against one 32-byte key takes minutes, during which the
master answers nobody. Here the pathological call answers in milliseconds and a probe ``Exist``
sent meanwhile on another connection answers at once; a pattern the engine cannot compile
(a backreference) answers INVALID_ARGUMENT and removes nothing."""

from __future__ import annotations

import time
from typing import Any

from kvpool_client.client import KVPoolClient
from kvpool_client.config import ClientConfig
from kvpool_wire._pb import kvpool_pb2 as pb
from kvpool_wire.methods import RPC_METHODS

LONG_KEY = "a" * 32


def _call(sock: Any, name: str, request: Any) -> Any:
    method = RPC_METHODS[name]
    answer_method, payload = sock.call(method.method_id, request.SerializeToString())
    assert answer_method == method.method_id, payload
    return method.response_type.FromString(payload)


def test_pathological_regex_answers_fast_and_the_loop_keeps_serving(
        start_master: Any, lean_socket: Any) -> None:
    master = start_master()
    config = ClientConfig.from_dict({"master_server_address": master.address,
                                     "global_segment_size": "16mb", "rpc_timeout_s": 5})
    with KVPoolClient(config) as client:
        client.put(LONG_KEY, b"x" * 100)
        client.put("keep-me", b"y" * 100)
        slow = lean_socket(master.fast_port, timeout_s=10)
        probe = lean_socket(master.fast_port, timeout_s=2)
        started = time.monotonic()
        slow.send(RPC_METHODS["RemoveByRegex"].method_id, 1,
                  pb.RemoveByRegexRequest(pattern="(.+)+z", force=True).SerializeToString())
        # The probe is served whatever the regex call is doing (it raises TimeoutError when
        # the master's loop is held).
        exist = _call(probe, "Exist", pb.ExistRequest(keys=[LONG_KEY.encode()]))
        probe_s = time.monotonic() - started
        assert list(exist.statuses) == [pb.STATUS_OK]
        _method, _request_id, payload = slow.recv()
        regex_s = time.monotonic() - started
        answer = pb.RemoveByRegexResponse.FromString(payload)
        assert (answer.status, answer.num_removed) == (pb.STATUS_OK, 0)
        print(f"(.+)+z over a {len(LONG_KEY)}-byte key: answered in {regex_s * 1000:.1f} ms; "
              f"probe Exist in {probe_s * 1000:.1f} ms")
        assert regex_s < 1.0 and probe_s < 1.0

        refused = _call(probe, "RemoveByRegex",
                        pb.RemoveByRegexRequest(pattern=r"(a)\1", force=True))
        assert (refused.status, refused.num_removed) == (pb.STATUS_INVALID_ARGUMENT, 0)
        removed = _call(probe, "RemoveByRegex", pb.RemoveByRegexRequest(pattern="^a+$",
                                                                          force=True))
        assert (removed.status, removed.num_removed) == (pb.STATUS_OK, 1)
        assert client.exists("keep-me") and not client.exists(LONG_KEY)
