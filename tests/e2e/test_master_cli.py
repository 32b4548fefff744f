"""The installed `kvpool-master` console script, run as an operator runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import pytest
from token_stub import TokenStub

from kvpool_wire._pb import kvpool_pb2 as pb

SCRIPT = Path(sys.executable).parent / "kvpool-master"
pytestmark = pytest.mark.skipif(not SCRIPT.exists(), reason=f"{SCRIPT} is not installed "
                                "(run `make install`)")


def _get(url: str) -> tuple[int, str, str]:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.status, response.headers["Content-Type"], response.read().decode()


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_MASTER_")}
    clean.update(env or {})
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=60,
                          env=clean, stdin=subprocess.DEVNULL)


def test_start_scrape_and_sigterm(start_master) -> None:
    master = start_master(executable=[str(SCRIPT)])
    with grpc.insecure_channel(master.address) as channel:
        stub = TokenStub(channel)
        assert stub.RegisterClient(pb.RegisterClientRequest(client_id="op")).status == \
            pb.STATUS_OK
    status, ctype, body = _get(master.metrics_url + "/metrics")
    assert status == 200 and ctype.startswith("text/plain")
    assert 'kvpool_rpc_requests_total{method="RegisterClient",transport="grpc"} 1.0' in body
    assert "kvpool_clients 1.0" in body
    status, _, body = _get(master.metrics_url + "/healthz")
    assert (status, body) == (200, "ok\n")
    status, ctype, body = _get(master.metrics_url + "/status")
    document = json.loads(body)
    assert ctype == "application/json"
    assert document["clients"] == 1 and document["objects"] == {
        "ready": 0, "pending": 0, "ready_bytes": 0, "deferred_free_bytes": 0,
        "quarantined_bytes": 0, "sweep_backlog_keys": 0, "held_extents": 0}
    # Mooncake's admin paths: no segment is mounted by a bare registration
    status, ctype, body = _get(master.metrics_url + "/get_all_segments")
    assert (status, body) == (200, "") and ctype.startswith("text/plain")
    status, _, body = _get(master.metrics_url + "/health")
    assert status == 200 and json.loads(body) == {"status": "ok", "role": "leader",
                                                   "service_ready": True}
    assert master.stop() == 0
    assert "stopped" in master.log()


def test_seed_command_verbatim(start_master) -> None:
    """The Mooncake command line from the MindIE guide, flag for flag."""
    env = {"KVPOOL_MASTER_HOST": "127.0.0.1", "KVPOOL_MASTER_FAST_PORT": "0",
           "KVPOOL_MASTER_METRICS_PORT": "0"}
    master = start_master("--port", "12345", "--eviction_high_watermark_ratio", "0.8",
                          "--eviction_ratio", "0.05", "--rpc_thread_num", "128",
                          executable=[str(SCRIPT)], default_ports=False, env=env)
    assert master.grpc_port == 12345
    settings = json.loads(_get(master.metrics_url + "/status")[2])["settings"]
    assert settings["eviction_high_watermark_ratio"] == 0.8
    assert settings["eviction_ratio"] == 0.05
    assert settings["rpc_thread_num"] == 128
    assert "rpc_thread_num 128 ignored" in master.log()
    assert master.stop() == 0


def test_precedence_flag_over_env_over_file_over_default(start_master, tmp_path: Path) -> None:
    config = tmp_path / "master.yaml"
    config.write_text("eviction-ratio: 0.1\neviction_high_watermark_ratio: 0.7\n"
                      "client_ttl: 4\ndefault_kv_lease_ttl: 2500\n")
    env = {"KVPOOL_MASTER_EVICTION_RATIO": "0.2", "KVPOOL_MASTER_CLIENT_TTL": "6"}
    master = start_master("--config", str(config), "--eviction_ratio", "0.3",
                          executable=[str(SCRIPT)], env=env)
    settings = json.loads(_get(master.metrics_url + "/status")[2])["settings"]
    assert settings["eviction_ratio"] == 0.3                  # flag
    assert settings["client_ttl_s"] == 6.0                    # env over file
    assert settings["eviction_high_watermark_ratio"] == 0.7   # file over default
    assert settings["default_kv_lease_ttl_ms"] == 2500        # file, in milliseconds
    assert settings["put_start_discard_timeout_s"] == 30.0    # default
    with grpc.insecure_channel(master.address) as channel:
        reply = TokenStub(channel).RegisterClient(
            pb.RegisterClientRequest(client_id="c"))
    assert reply.client_ttl_ms == 6000 and reply.default_lease_ttl_ms == 2500
    assert master.stop() == 0


def test_kubernetes_service_variables_are_not_settings(start_master) -> None:
    # what Kubernetes gives a pod for a Service named kvpool-master (enableServiceLinks)
    env = {"KVPOOL_MASTER_PORT": "tcp://10.96.12.34:50051",
           "KVPOOL_MASTER_SERVICE_HOST": "10.96.12.34",
           "KVPOOL_MASTER_SERVICE_PORT": "50051", "KVPOOL_MASTER_SERVICE_PORT_GRPC": "50051",
           "KVPOOL_MASTER_PORT_50051_TCP": "tcp://10.96.12.34:50051",
           "KVPOOL_MASTER_PORT_50051_TCP_PROTO": "tcp",
           "KVPOOL_MASTER_PORT_50051_TCP_PORT": "50051",
           "KVPOOL_MASTER_PORT_50051_TCP_ADDR": "10.96.12.34",
           "KVPOOL_MASTER_CLIENT_TTL": "7"}   # ... beside a setting, which still counts
    master = start_master(executable=[str(SCRIPT)], env=env)
    settings = json.loads(_get(master.metrics_url + "/status")[2])["settings"]
    assert settings["client_ttl_s"] == 7.0
    assert master.stop() == 0


def test_json_config_file(start_master, tmp_path: Path) -> None:
    config = tmp_path / "master.json"
    config.write_text(json.dumps({"eviction_policy": "prefix-lru", "max_batch_keys": 10}))
    master = start_master(config=str(config), executable=[str(SCRIPT)])
    settings = json.loads(_get(master.metrics_url + "/status")[2])["settings"]
    assert settings["eviction_policy"] == "prefix-lru" and settings["max_batch_keys"] == 10
    assert master.stop() == 0


@pytest.mark.parametrize(("args", "env", "needle"), [
    (["--no-such-flag", "1"], {}, "--no-such-flag"),
    (["--eviction_ratio", "1.5"], {}, "eviction_ratio"),
    (["--eviction-high-watermark-ratio", "abc"], {}, "eviction_high_watermark_ratio"),
    (["--port", "70000"], {}, "port"),
    (["--eviction-policy", "fifo"], {}, "eviction_policy"),
    (["--client-ttl", "0"], {}, "client_ttl"),
    (["--default-kv-lease-ttl", "2.5"], {}, "default_kv_lease_ttl"),
    (["--tls-cert", "/nonexistent/cert.pem", "--tls-key", "/nonexistent/key.pem"], {},
     "tls_cert"),
    (["--tls-ca", "/etc/hostname"], {}, "tls_ca"),
    ([], {"KVPOOL_MASTER_EVICTION_RATIO": "-1"}, "KVPOOL_MASTER_EVICTION_RATIO"),
    ([], {"KVPOOL_MASTER_NO_SUCH": "1"}, "KVPOOL_MASTER_NO_SUCH"),
    (["--config", "/nonexistent/master.yaml"], {}, "/nonexistent/master.yaml"),
])
def test_bad_settings_exit_2_with_one_line(args: list[str], env: dict[str, str],
                                           needle: str) -> None:
    result = _run(*args, env=env)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("kvpool-master: error:") and needle in lines[0]


@pytest.mark.parametrize(("text", "needle"), [
    ("eviction_ratio: [1, 2\n", "not valid YAML/JSON"),
    ("- just\n- a list\n", "mapping"),
    ("eviction_ratio: 0.1\nbogus_setting: 3\n", "bogus_setting"),
    ("max_batch_keys: -5\n", "max_batch_keys"),
])
def test_bad_config_file_exits_2(tmp_path: Path, text: str, needle: str) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    result = _run("--config", str(config))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and str(config) in lines[0], result.stderr


def test_help_explains_units_and_ignored_flags() -> None:
    result = _run("--help")
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    assert "--rpc_thread_num" in text and "ignored" in text and "one event loop" in text
    assert "MILLISECONDS" in text and "KVPOOL_MASTER_" in text
    assert "--eviction_high_watermark_ratio" in text and "--eviction-high-watermark-ratio" in text


def test_port_in_use_exits_1(master) -> None:
    result = _run("--host", "127.0.0.1", "--port", str(master.grpc_port), "--fast-port", "0",
                  "--metrics-port", "0")
    assert result.returncode == 1
    assert "cannot start" in result.stderr


@pytest.mark.parametrize("signum", ["SIGTERM", "SIGINT"])
def test_signal_during_traffic_finishes_calls_and_exits_0(start_master, signum: str) -> None:
    import signal
    from concurrent.futures import ThreadPoolExecutor

    master = start_master(executable=[str(SCRIPT)])
    keys = [f"k{i}".encode() for i in range(16_000)]   # under max_batch_keys
    with grpc.insecure_channel(master.address) as channel:
        stub = TokenStub(channel)
        assert stub.Heartbeat(pb.HeartbeatRequest(client_id="x")).status == \
            pb.STATUS_UNKNOWN_CLIENT

        def call(_: int) -> str:
            try:
                reply = stub.Exist(pb.ExistRequest(keys=keys), timeout=30)
            except grpc.RpcError as exc:
                return exc.code().name
            assert list(reply.statuses) == [pb.STATUS_NOT_FOUND] * len(keys)
            return "OK"

        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(call, i) for i in range(32)]
            os.kill(master.pid, getattr(signal, signum))
            outcomes = [f.result() for f in futures]
    # Every call either finished with its full answer (checked in call) or was never started:
    # gRPC refuses calls not yet handed to the server when it stops (UNAVAILABLE/CANCELLED).
    assert set(outcomes) <= {"OK", "UNAVAILABLE", "CANCELLED"}, outcomes
    assert "OK" in outcomes
    assert master.proc.wait(30) == 0
    assert "stopped" in master.log()


def test_fast_port_in_use_exits_1_without_leaking(master) -> None:
    result = _run("--host", "127.0.0.1", "--port", "0", "--fast-port", str(master.fast_port),
                  "--metrics-port", "0")
    assert result.returncode == 1
    assert "cannot start" in result.stderr and "Traceback" not in result.stderr
