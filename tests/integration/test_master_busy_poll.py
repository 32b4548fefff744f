"""Busy polling on a live master: a client's bursts of calls are caught by lingers (counted in
the metrics), an idle master does not poll, ``--busy-poll-us 0`` turns it off, and a bad value
stops the master at start with the flag's name."""

from __future__ import annotations

import re
import time
import urllib.request
from typing import Any

import pytest

from kvpool_client.client import KVPoolClient
from kvpool_client.config import ClientConfig


def _busy_poll(master: Any) -> tuple[float, float, float]:
    with urllib.request.urlopen(master.metrics_url + "/metrics", timeout=10) as response:
        text = response.read().decode()

    def value(sample: str) -> float:
        match = re.search(rf"^{re.escape(sample)} (\S+)$", text, re.M)
        assert match, f"{sample} not exported"
        return float(match.group(1))
    return (value('kvpool_busy_poll_lingers_total{outcome="hit"}'),
            value('kvpool_busy_poll_lingers_total{outcome="miss"}'),
            value("kvpool_busy_poll_seconds_total"))


def _burst(master: Any, num_objects: int) -> None:
    config = ClientConfig.from_dict({"master_server_address": master.address,
                                     "global_segment_size": "16mb"})
    with KVPoolClient(config) as client:
        for i in range(num_objects):
            client.put(f"burst-{i}", b"v" * 4096)
        for i in range(num_objects):
            assert client.get(f"burst-{i}") == b"v" * 4096


def test_bursts_of_calls_are_caught_by_lingers(master: Any) -> None:
    _burst(master, 200)
    hits, misses, polled_s = _busy_poll(master)
    print(f"200 puts + 200 gets: {hits:.0f} lingers caught the next call, {misses:.0f} did not, "
          f"{polled_s * 1000:.1f} ms spent polling")
    assert hits > 0 and polled_s > 0
    time.sleep(0.5)  # idle: no call, so no linger
    assert _busy_poll(master)[2] == polled_s


def test_busy_poll_off(start_master: Any) -> None:
    master = start_master("--busy-poll-us", "0")
    _burst(master, 20)
    assert _busy_poll(master) == (0, 0, 0)


@pytest.mark.parametrize("value", ["-1", "fast", "20000"])
def test_a_bad_busy_poll_value_is_refused(start_master: Any, value: str) -> None:
    with pytest.raises(RuntimeError, match="busy.poll"):
        start_master("--busy-poll-us", value, timeout_s=10)
