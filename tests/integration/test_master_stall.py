"""A master paused (SIGSTOP) for 2 x client_ttl expires no client; a silent client still is."""

from __future__ import annotations

import os
import re
import signal
import time
import urllib.request

import grpc
from token_stub import TokenStub

from kvpool_wire._pb import kvpool_pb2 as pb
from kvpool_wire._pb import kvpool_pb2_grpc as pb_grpc

CLIENT_TTL_S = 1.0


def _heartbeat(stub: pb_grpc.MasterStub, client_id: str) -> int:
    return int(stub.Heartbeat(pb.HeartbeatRequest(client_id=client_id), timeout=10).status)


def test_master_stall_expires_no_client(start_master) -> None:
    master = start_master(client_ttl=CLIENT_TTL_S)
    with grpc.insecure_channel(master.address) as channel:
        stub = TokenStub(channel)
        for client_id in ("c0", "c1", "c2"):
            assert stub.RegisterClient(pb.RegisterClientRequest(client_id=client_id)).status \
                == pb.STATUS_OK
        for _ in range(3):
            for client_id in ("c0", "c1", "c2"):
                assert _heartbeat(stub, client_id) == pb.STATUS_OK
            time.sleep(CLIENT_TTL_S / 4)
        os.kill(master.pid, signal.SIGSTOP)
        try:
            time.sleep(2.5 * CLIENT_TTL_S)
        finally:
            os.kill(master.pid, signal.SIGCONT)
        statuses = [_heartbeat(stub, c) for c in ("c0", "c1", "c2")]
        num_expired = statuses.count(pb.STATUS_UNKNOWN_CLIENT)
        print(f"master stalled {2.5 * CLIENT_TTL_S:.1f} s with client_ttl {CLIENT_TTL_S} s: "
              f"{num_expired} of 3 clients expired")
        assert statuses == [pb.STATUS_OK] * 3
        with urllib.request.urlopen(master.metrics_url + "/metrics", timeout=10) as response:
            text = response.read().decode()
        stalled_s = float(re.search(r"^kvpool_master_stalled_seconds_total (\S+)$", text,
                                    re.M).group(1))
        assert stalled_s >= 2.0
        assert "kvpool_clients_expired_total 0.0" in text

        # Control: a client that really goes silent is still expired, in serving time.
        silent_until = time.monotonic() + 3 * CLIENT_TTL_S
        while time.monotonic() < silent_until:
            for client_id in ("c0", "c1"):
                assert _heartbeat(stub, client_id) == pb.STATUS_OK
            time.sleep(CLIENT_TTL_S / 5)
        assert _heartbeat(stub, "c2") == pb.STATUS_UNKNOWN_CLIENT
        assert _heartbeat(stub, "c0") == pb.STATUS_OK
