"""`kvpool status` and `kvpool bench` against a real master."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from typing import Any

from kvpool_client.client import KVPoolClient
from kvpool_client.config import ClientConfig


def kvpool(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvpool_client.cli", *args],
                          capture_output=True, text=True, timeout=timeout_s)


def test_status_shows_clients_segments_and_usage(master: Any) -> None:
    config = ClientConfig.from_dict({"master_server_address": master.address,
                                     "global_segment_size": "8mb"})
    with KVPoolClient(config) as c:
        c.put("status-key", b"v" * 1_000_000)
        done = kvpool("status", "--master", master.address)
        assert done.returncode == 0, done.stderr
        text = done.stdout
        assert f"kvpool master {master.address}" in text
        assert "clients: 1" in text
        assert c.segment_ids[0] in text and c.client_id in text
        assert "objects: 1 ready" in text
        assert "8.0 MiB" in text
        raw = kvpool("status", "--master", master.address, "--json")
        document = json.loads(raw.stdout)
        assert document["clients"] == 1 and document["objects"]["ready"] == 1


def test_status_of_an_unreachable_master_is_a_clear_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = kvpool("status", "--master", f"127.0.0.1:{port}", "--timeout", "1")
    assert done.returncode == 2
    assert "kvpool status: RPC_FAILED" in done.stderr or "TIMEOUT" in done.stderr
    bad = kvpool("status", "--master", "no-port")
    assert bad.returncode == 2 and "master_server_address" in bad.stderr


def test_bench_reports_every_api(master: Any) -> None:
    done = kvpool("bench", "--master", master.address, "-n", "64", "--size", "8kb", "--batch",
                  "16", "--api", "single,batch,zc,batch_zc", "--json")
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout)
    assert [r["api"] for r in results] == ["single", "batch", "zc", "batch_zc"]
    for r in results:
        for op in ("put", "get"):
            assert r[op]["failed"] == 0 and r[op]["ops_s"] > 0
    text = kvpool("bench", "--master", master.address, "-n", "16", "--size", "4kb",
                  "--transport", "tcp")
    assert text.returncode == 0, text.stderr
    assert "single" in text.stdout and "batch_zc" in text.stdout
    assert kvpool("bench", "--master", master.address, "--api", "nope").returncode == 2
