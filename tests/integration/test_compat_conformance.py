"""Conformance of ``kvpool_client.compat.mooncake`` with Mooncake Store 0.3.13's return codes.

The call sequence lives in ``mooncake_sequence.py`` and runs in its own process against a real
kvpool master. Its results must equal ``EXPECTED`` (the codes of the calls engines make, as
observed on Mooncake 0.3.13.post1). With marker ``oracle``, the same sequence also runs
against the real Mooncake wheel (a virtualenv at ``$PEER_VENV``, default ``/tmp/peer-venv``,
with ``mooncake-transfer-engine-non-cuda==0.3.13.post1``) and its own ``mooncake_master``,
and the two results must match.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

SEQUENCE = Path(__file__).with_name("mooncake_sequence.py")
PEER_PYTHON = Path(os.environ.get("PEER_VENV", "/tmp/peer-venv")) / "bin" / "python"

XS = "x" * 100
EXPECTED: list[list[Any]] = [
    ["setup positional", 0],
    ["get_hostname is ip:port", True],
    ["remove_all force (clean start)", True],
    ["put", 0],
    ["put existing", 0],
    ["get keeps first", {"bytes": "first"}],
    ["get missing", {"bytes": ""}],
    ["put empty value", -600],
    ["is_exist present", 1],
    ["is_exist missing", 0],
    ["batch_is_exist", [1, 0, 1]],
    ["get_size", 5],
    ["get_size missing", -704],
    ["remove while leased", -706],
    ["remove force", 0],
    ["remove missing", -704],
    ["is_exist leases", [1, -706]],  # a lookup grants a read lease, as a get does
    ["batch_is_exist leases", [[1], -706]],
    ["get_size leases", [1, -706]],
    ["register_buffer", 0],
    ["put_from", 0],
    ["get_into too small", -600],
    ["get_into", 100],
    ["get_into bytes", {"bytes": XS}],
    ["get_into missing", -704],
    ["batch_put_from", [0, 0]],
    ["batch_put_from existing", [0, 0]],
    ["batch_get_into", [10, 20, -704, -600]],
    ["batch_get_into bytes", {"bytes": "A" * 10 + "B" * 20}],
    ["batch_get_into length mismatch", [-600]],
    ["batch_put_from length mismatch", [-600, -600]],
    ["multi put", [0, 0]],
    ["multi get", [30, 30, -704]],
    ["multi get bytes", {"bytes": "A" * 10 + "B" * 20}],
    ["multi get regions too small", [-600]],
    ["multi get regions larger", [-800]],
    ["multi put existing", [0]],
    ["multi put no regions", [-600]],
    ["put_batch", 0],
    ["put_batch length mismatch", -600],
    ["get_batch", [{"bytes": "one"}, {"bytes": ""}, {"bytes": "two"}]],
    ["batch_remove while leased", [-706, -704]],
    ["batch_remove force", [0, -704]],
    ["remove_by_regex force", 3],
    ["remove_by_regex bad pattern", -600],
    ["remove_all force", 7],
    ["put x1", 0],
    ["put x2", 0],
    ["put x3", 0],
    ["get x3 (leases it)", {"bytes": "3"}],
    ["remove_all skips leased", 2],
    ["remove_all force removes the rest", 1],
    ["is_exist after remove_all", [0, 0, 0, 0]],
    ["put preferred own segment", 0],
    ["multi put same node", [0]],
    ["get c2", {"bytes": "A" * 10 + "B" * 10}],
    ["unregister_buffer", 0],
    ["unregister_buffer again", -600],
    ["remove_all force (clean end)", 2],
    ["close", 0],
    ["close again", 0],
    ["engine initialize", 0],
    ["engine port is an int > 0", True],
    ["setup 8 positional with engine", 0],
    ["engine register_memory", 0],
    ["put_from engine memory", 0],
    ["get engine object", {"bytes": "registered on the engine"}],
    ["multi put MindIE config", [0]],
    ["remove_all force (engine store)", 2],
    ["close engine store", 0],
    ["setup dict", 0],
    ["dict store put/get", [0, {"bytes": "dict"}]],
    ["remove_all force (dict store)", 1],
    ["close dict store", 0],
]


def run_sequence(python: str, module: str, engine_module: str, master: str,
                 env: dict[str, str] | None = None) -> list[list[Any]]:
    """Run the sequence in a new process; return its steps."""
    proc = subprocess.run(
        [python, str(SEQUENCE), "--module", module, "--engine-module", engine_module,
         "--master", master],
        capture_output=True, text=True, timeout=180, env=env, stdin=subprocess.DEVNULL)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"sequence failed:\n{proc.stdout}\n{proc.stderr}"
    steps: list[list[Any]] = json.loads(lines[-1][len("RESULT "):])
    return steps


def kvpool_steps(master: Any) -> list[list[Any]]:
    return run_sequence(sys.executable, "kvpool_client.compat.mooncake",
                        "kvpool_client.compat.engine", master.address)


def assert_steps_equal(actual: list[list[Any]], expected: list[list[Any]], who: str) -> None:
    assert [label for label, _ in actual] == [label for label, _ in expected]
    diffs = [f"{label}: {who} gave {got!r}, expected {want!r}"
             for (label, got), (_, want) in zip(actual, expected, strict=True) if got != want]
    assert not diffs, "\n".join(diffs)


@pytest.mark.parametrize("partitions", [1, 3])
def test_compat_store_answers_mooncake_codes(start_master: Any, partitions: int) -> None:
    """The same codes from a master of one process and from one split into partitions (each
    batch of the sequence spans them)."""
    master = start_master(*(["--partitions", str(partitions)] if partitions > 1 else []))
    assert_steps_equal(kvpool_steps(master), EXPECTED, "kvpool")


# --- the oracle: the same sequence against the real Mooncake wheel ---

def _peer_has_mooncake() -> bool:
    if not PEER_PYTHON.exists():
        return False
    probe = subprocess.run([str(PEER_PYTHON), "-c", "import mooncake.store"],
                           capture_output=True, timeout=60, stdin=subprocess.DEVNULL)
    return probe.returncode == 0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextlib.contextmanager
def mooncake_master(tmp_path: Path) -> Any:
    """Start the wheel's own ``mooncake_master`` on 127.0.0.1; stop it by pid."""
    located = subprocess.run(
        [str(PEER_PYTHON), "-c",
         "import mooncake, os; print(os.path.join(os.path.dirname(mooncake.__file__),"
         " 'mooncake_master'))"], capture_output=True, text=True, timeout=60, check=True)
    binary = located.stdout.strip()
    rpc_port, metrics_port = _free_port(), _free_port()
    log = open(tmp_path / "mooncake_master.log", "wb")  # noqa: SIM115 - closed in finally
    proc = subprocess.Popen(
        [binary, "--rpc_address=127.0.0.1", f"--rpc_port={rpc_port}",
         "--metrics_host=127.0.0.1", f"--metrics_port={metrics_port}",
         "--http_metadata_server_host=127.0.0.1", "--logtostderr"],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, "mooncake_master exited"
            try:
                socket.create_connection(("127.0.0.1", rpc_port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "mooncake_master did not open its port"
                time.sleep(0.1)
        yield f"127.0.0.1:{rpc_port}"
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(10)
        log.close()


@pytest.mark.oracle
def test_same_results_as_the_real_mooncake_wheel(master: Any, tmp_path: Path) -> None:
    if not _peer_has_mooncake():
        pytest.skip(f"the real Mooncake wheel is not importable by {PEER_PYTHON} "
                    "(pip install mooncake-transfer-engine-non-cuda==0.3.13.post1 there)")
    with mooncake_master(tmp_path) as address:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MC_", "MOONCAKE_"))}
        real = run_sequence(str(PEER_PYTHON), "mooncake.store", "mooncake.engine", address,
                            env=env)
    assert_steps_equal(real, EXPECTED, "Mooncake")
    assert_steps_equal(kvpool_steps(master), real, "kvpool")
