"""vllm-ascend 0.23.0's own transfer threads, saving to and loading from kvpool.

The wheel is downloaded from PyPI at test time (never committed); only
``vllm_ascend/distributed/kv_transfer/kv_pool/ascend_store/`` is unpacked, plus the 40-line
``kv_transfer/utils/mooncake_transfer_engine.py`` its Mooncake backend imports. Two TP ranks
run in their own processes (``vllm_ascend_driver.py``), once with the ``kvpool`` backend that
kvpool's ``vllm.general_plugins`` entry point registers, once with vllm-ascend's own
``MooncakeBackend`` over the ``mooncake`` drop-in package. Skipped, with the reason, only when
PyPI cannot be reached.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).parent
DROP_IN = HERE.parents[1] / "compat" / "mooncake"
WHEEL = "vllm-ascend==0.23.0"
SUBTREE = "vllm_ascend/distributed/kv_transfer/kv_pool/ascend_store/"
TE_FILE = "vllm_ascend/distributed/kv_transfer/utils/mooncake_transfer_engine.py"


@pytest.fixture(scope="module")
def ascend_store_src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Download the wheel and unpack only the files the test drives."""
    src = tmp_path_factory.mktemp("src")
    unpack_wheel(WHEEL, src, SUBTREE, TE_FILE)
    assert (src / SUBTREE / "kv_transfer.py").is_file()
    return src


def unpack_wheel(requirement: str, dest: Path, *prefixes: str) -> None:
    """Download ``requirement`` and unpack the files under ``prefixes`` into ``dest``; skip
    (printing why) only when PyPI is unreachable."""
    proc = subprocess.run([sys.executable, str(HERE / "wheels.py"), requirement, str(dest),
                           *prefixes], capture_output=True, text=True, timeout=900,
                          stdin=subprocess.DEVNULL)
    if proc.returncode == 3:
        print(f"skipping: {proc.stdout.strip()}")
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0, proc.stdout + proc.stderr


def run_ranks(src: Path, backend: str, master: Any, tmp_path: Path) -> list[dict[str, Any]]:
    config = tmp_path / "mooncake.json"
    config.write_text(json.dumps({
        "metadata_server": "P2PHANDSHAKE", "protocol": "ascend", "device_name": "",
        "global_segment_size": 32 << 20, "local_buffer_size": 0,
        "master_server_address": master.address, "preferred_segment": True,
        "prefer_alloc_in_same_node": True}))
    env = {k: v for k, v in os.environ.items() if k != "KVPOOL_CONFIG_PATH"}
    env["MOONCAKE_CONFIG_PATH"] = str(config)
    if backend == "mooncake":
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(DROP_IN), env.get("PYTHONPATH")]))
    procs = [subprocess.Popen([sys.executable, str(HERE / "vllm_ascend_driver.py"), "--src",
                               str(src), "--backend", backend, "--tp-rank", str(rank)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                              stdin=subprocess.DEVNULL)
             for rank in (0, 1)]
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=240)
            lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
            assert proc.returncode == 0 and lines, f"driver failed:\n{out}\n{err}"
            results.append(json.loads(lines[-1][len("RESULT "):]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=10)
    return results


@pytest.mark.network
@pytest.mark.parametrize("backend", ["kvpool", "mooncake"])
def test_vllm_ascend_transfer_threads(ascend_store_src: Path, master: Any, tmp_path: Path,
                                      backend: str) -> None:
    results = run_ranks(ascend_store_src, backend, master, tmp_path)
    all_saved: list[set[str]] = []
    for rank, result in enumerate(results):
        first, longer = result["saved_keys"]  # the re-save put nothing
        assert len(first) == 8 and len(longer) == 2
        assert set(longer).isdisjoint(first)
        assert result["lookups"] == [8, 8, 10]  # every save looked its keys up first
        for key in first + longer:
            assert key.startswith(f"Qwen3-8B@pcp0@dcp0@head_or_tp_rank:{rank}@pp_rank:0@"), key
        (loaded,) = result["loaded_keys"]
        saved_in_order = first + longer
        assert sorted(loaded) == sorted(saved_in_order[3:])  # only blocks after the 3 hits
        assert result["exact"] and result["untouched"]
        assert result["invalid_blocks"] == []
        assert result["missing_get"] == [-704]
        all_saved.append(set(saved_in_order))
    assert all_saved[0].isdisjoint(all_saved[1])  # TP ranks hold their own objects
    suffixes = [{k.rsplit("@", 1)[1] for k in keys} for keys in all_saved]
    assert suffixes[0] == suffixes[1]  # ... of the same blocks
