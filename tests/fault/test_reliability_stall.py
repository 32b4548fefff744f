"""A master SIGSTOPped for more than 2 x client_ttl while real clients keep heartbeating:
on resume it expires none of them and every object stays readable."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from helpers import metric_value

from kvpool_client.client import KVPoolClient
from kvpool_client.config import ClientConfig

CLIENT_TTL_S = 1.0
STALL_S = 2.5 * CLIENT_TTL_S


def metric(url: str, name: str) -> float:
    value = metric_value(url, name)
    assert value is not None, name
    return value


def test_master_stall_expires_no_real_client(start_master: Any) -> None:
    master = start_master(client_ttl=CLIENT_TTL_S)
    cfg = ClientConfig.from_dict({"master_server_address": master.address,
                                  "global_segment_size": "4mb", "rpc_timeout_s": 2})
    clients = [KVPoolClient(cfg) for _ in range(3)]
    try:
        for i, c in enumerate(clients):
            c.put(f"stall-{i}", bytes([i]) * 4096)
        os.kill(master.pid, signal.SIGSTOP)
        try:
            time.sleep(STALL_S)
        finally:
            os.kill(master.pid, signal.SIGCONT)
        time.sleep(3 * CLIENT_TTL_S)  # heartbeats resume; an expiry would show by now
        expired = metric(master.metrics_url, "kvpool_clients_expired_total")
        stalled_s = metric(master.metrics_url, "kvpool_master_stalled_seconds_total")
        reregistered = sum(c.metrics.reregistrations for c in clients)
        readable = sum(clients[(i + 1) % 3].get(f"stall-{i}") == bytes([i]) * 4096
                       for i in range(3))
        print(f"clients expired during {STALL_S:.1f} s stall (client_ttl {CLIENT_TTL_S} s): "
              f"{int(expired)} of 3; re-registrations {reregistered}; objects readable "
              f"{readable}/3; stall measured {stalled_s:.2f} s")
        assert expired == 0 and reregistered == 0 and readable == 3
        assert stalled_s >= 2 * CLIENT_TTL_S
    finally:
        for c in clients:
            c.close()
