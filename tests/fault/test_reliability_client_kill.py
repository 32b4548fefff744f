"""A writer process SIGKILLed in the middle of a batch put: no partial object is ever readable
(a reader polls the batch in flight and checks every byte), and the writer's segments are gone
within client_ttl + 1 s."""

from __future__ import annotations

import importlib.util
import json
import os
import select
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from kvpool_client.client import KVPoolClient
from kvpool_client.config import ClientConfig

CLIENT_TTL_S = 2.0
SIZE_BYTES = 2 << 20
BATCH = 8
WORKER_PATH = Path(__file__).with_name("_workers.py")


def _workers() -> Any:
    spec = importlib.util.spec_from_file_location("kvpool_fault_workers", WORKER_PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


workers = _workers()


def read_line(proc: subprocess.Popen[str], timeout_s: float) -> dict[str, Any]:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    assert ready, "writer silent"
    line = proc.stdout.readline()
    assert line, f"writer exited with {proc.poll()}"
    return dict(json.loads(line))


def mounted_clients(metrics_url: str) -> set[str]:
    with urllib.request.urlopen(metrics_url + "/status", timeout=10) as response:
        status = json.loads(response.read())
    return {s["client_id"] for s in status["segments"]["list"] if s.get("mounted", True)}


def test_writer_sigkilled_mid_batch_put(start_master: Any) -> None:
    master = start_master(client_ttl=CLIENT_TTL_S)
    cfg = {"master_server_address": master.address, "rpc_timeout_s": 2}
    with KVPoolClient(ClientConfig.from_dict({**cfg, "global_segment_size": "256mb"})) as reader:
        proc = subprocess.Popen(
            [sys.executable, str(WORKER_PATH), "put_loop",
             json.dumps({**cfg, "global_segment_size": "16mb"}), "kill", str(SIZE_BYTES),
             str(BATCH), reader.segment_ids[0]],
            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
        polled = partial = 0
        try:
            ready = read_line(proc, 60)
            assert reader.get("own-0") == workers.payload("own-0", 4096)
            reported = -1
            while reported < 5:
                # Poll the batch in flight: whatever is readable must be whole.
                keys = [f"kill-{reported + 1}-{i}" for i in range(BATCH)]
                for key, value in zip(keys, reader.get_batch(keys), strict=True):
                    polled += 1
                    partial += value is not None and value != workers.payload(key, SIZE_BYTES)
                assert proc.stdout is not None
                if select.select([proc.stdout], [], [], 0)[0]:
                    answer = read_line(proc, 10)
                    assert answer["statuses"] == ["OK"] * BATCH, answer
                    reported = answer["batch"]
            os.kill(proc.pid, signal.SIGKILL)  # somewhere inside the next put_batch
            killed_at = time.monotonic()
            proc.wait(10)
        finally:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(10)
            if proc.stdout is not None:
                proc.stdout.close()
        keys = [f"kill-{n}-{i}" for n in range(reported + 4) for i in range(BATCH)]
        outcome = {"whole": 0, "missing": 0, "partial": 0}
        for key, value in zip(keys, reader.get_batch(keys), strict=True):
            state = "missing" if value is None else \
                ("whole" if value == workers.payload(key, SIZE_BYTES) else "partial")
            outcome[state] += 1
        deadline = killed_at + CLIENT_TTL_S + 5
        while ready["client_id"] in mounted_clients(master.metrics_url):
            assert time.monotonic() < deadline, "writer's segment never went away"
            time.sleep(0.05)
        gone_s = time.monotonic() - killed_at
        print(f"partial objects readable while polling the batch in flight: {partial}/{polled} "
              f"reads; after SIGKILL: {outcome}")
        print(f"writer's segments gone {gone_s:.2f} s after SIGKILL "
              f"(client_ttl {CLIENT_TTL_S} s, bound {CLIENT_TTL_S + 1} s)")
        assert partial == 0 and outcome["partial"] == 0
        assert outcome["whole"] >= (reported + 1) * BATCH  # every reported batch is committed
        assert gone_s <= CLIENT_TTL_S + 1
        assert reader.get("own-0") is None  # went with its segment
