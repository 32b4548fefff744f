"""vLLM's ``MooncakeStoreConnector`` (GPU vLLM, in-tree) through the ``mooncake`` drop-in: its
worker's exact ``mooncake.store`` call sequence (``vllm_store_driver.py``, which names the vLLM
file and commit it follows), in two processes against a real master. One process stores blocks
of its KV cache, the other loads them into other blocks of its own cache, byte-exact; keys never
stored fail alone; the tier logging's replica lookup answers "memory"."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
DROP_IN = HERE.parents[1] / "compat" / "mooncake"


def _driver(role: str, master: Any) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("KVPOOL_CONFIG_PATH", "MOONCAKE_CONFIG_PATH")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(DROP_IN), env.get("PYTHONPATH")]))
    return subprocess.Popen([sys.executable, str(HERE / "vllm_store_driver.py"), "--role", role,
                             "--master", master.address], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _result(proc: subprocess.Popen[str]) -> dict[str, Any]:
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("RESULT "):
            result: dict[str, Any] = json.loads(line[len("RESULT "):])
            return result
    error = proc.stderr.read() if proc.stderr else ""
    raise AssertionError(f"driver failed: {proc.wait(10)}\n{error}")


def test_vllm_mooncake_store_connector_calls_through_the_dropin(master: Any) -> None:
    writer = _driver("put", master)
    reader = None
    try:
        put = _result(writer)
        assert put["setup"] == 0
        assert put["exists_before"] == [0] * 6
        assert put["put"] == [0] * 4
        assert put["exists_after"] == [1] * 4 + [0] * 2
        reader = _driver("get", master)
        out, err = reader.communicate(timeout=120)
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        assert reader.returncode == 0 and lines, f"reader failed:\n{out}\n{err}"
        got = json.loads(lines[-1][len("RESULT "):])
        assert got["setup"] == 0
        assert got["tiers"] == ["memory"] * 4 + ["unknown"] * 2
        assert got["get"][:4] == [got["block_bytes"]] * 4
        assert all(code < 0 for code in got["get"][4:])
        assert got["digests"] == put["digests"]  # every layer's K and V block, byte for byte
    finally:
        for proc in (writer, reader):
            if proc is not None and proc.poll() is None:
                proc.communicate("quit\n", timeout=30)
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=10)
