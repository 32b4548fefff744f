"""SGLang HiCache storage backend ``KVPoolHiCacheStorage`` (``--hicache-storage-backend dynamic``),
driven as SGLang's cache controllers drive it, in its own process: ``interface_v1``
(``sglang_driver.py``) and the v2 interface of hybrid models (``sglang_v2_driver.py``).

SGLang does not install lightly here (its package imports its GPU kernels and a long list of
dependencies), so the default tests check the class with SGLang absent. With marker
``network``, the SGLang 0.5.23 wheel is downloaded at test time and its own
``hicache_storage.py`` and ``storage/backend_factory.py`` build the backend (``issubclass``
check, ``cls(storage_config, kwargs)``) and are its base class; the v2 calls use SGLang's own
``PoolTransfer`` and also run against SGLang's reference backend ``HiCacheFile``, which must
answer the same.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).parent
WHEEL = "sglang==0.5.23"
FILES = ("sglang/srt/mem_cache/hicache_storage.py", "sglang/srt/mem_cache/storage/")


def run_driver(master: Any, src: Path | None, driver: str = "sglang_driver.py") -> dict[str, Any]:
    command = [sys.executable, str(HERE / driver), "--master", master.address]
    if src is not None:
        command += ["--src", str(src)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=240,
                          stdin=subprocess.DEVNULL)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"driver failed:\n{proc.stdout}\n{proc.stderr}"
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT "):])
    return result


def check(result: dict[str, Any]) -> None:
    assert result["set"] == [[True] * 6, [True] * 6]
    assert result["set_again"] == [True] * 3  # pages already stored succeed harmlessly
    assert result["exists"] == [6, 6]  # leading hits of an 8-page chain
    assert result["exists_one"] == [True, False]
    assert result["get"] == [[True] * 6, [True] * 6]
    assert result["exact"] is True  # both ranks' pages, byte for byte, from their own keys
    assert result["get_missing"] == [True, False, False]
    assert result["legacy_get"] is True and result["legacy_exact"] is True
    assert result["legacy_set"] is True and result["legacy_get_missing"] is True
    assert result["after_clear"] == [0, 6]  # clear() removed rank 0's pages only
    assert result["bad_pages"] == [False, False]


# SGLang's rules for these calls (hicache_storage.py, 0.5.23): 8 KV pages stored; Mamba states
# after pages 2 and 7 with a trailing window of one page restore prefixes of 3 and 8 pages;
# indexer pages 0..4 with ALL_PAGES restore up to 5; together only 3 remains.
V2_SHARED = {
    "kv_set": True,
    "set_v2": {"mamba": [True, True], "indexer": [True] * 5},
    "exists_mamba": [8, {"kv": 8, "mamba": 8}, [3, 8]],
    "exists_both": [3, {"kv": 8, "mamba": 8, "indexer": 5}, [3]],
    "exists_indexer_first": [3, {"kv": 8, "indexer": 5, "mamba": 8}, [3]],
    "exists_none": [8, {"kv": 8}, list(range(1, 9))],
    "get_v2": {"mamba": [True, False], "indexer": [True, True, False]},
    "get_exact": [True, True, True],
}
V2_KVPOOL_ONLY = {
    "exists_groups": [8, {"kv": 8, "indexer": 4}, list(range(1, 9))],  # two whole groups of 2
    "bad_indices": {"indexer": [False, False]},  # 2 keys, one page of host indices
    "anchorless_exists": [5, {"kv": 10, "indexer": 5}, list(range(1, 6))],
    "anchorless_v1": [True, True],
}


def check_v2(result: dict[str, Any]) -> None:
    assert result == {**V2_SHARED, **V2_KVPOOL_ONLY}


def test_hicache_storage_interface_v2_hit_policies_and_side_pools(master: Any) -> None:
    check_v2(run_driver(master, None, "sglang_v2_driver.py")["kvpool"])


def test_hicache_storage_interface_v1_shape(master: Any) -> None:
    result = run_driver(master, None)
    assert result["base"] == "object"
    check(result)


@pytest.fixture(scope="module")
def sglang_src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Download the SGLang wheel and unpack only its HiCache storage base and factory."""
    src = tmp_path_factory.mktemp("sglang-src")
    proc = subprocess.run([sys.executable, str(HERE / "wheels.py"), WHEEL, str(src), *FILES],
                          capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
    if proc.returncode == 3:
        print(f"skipping: {proc.stdout.strip()}")
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return src


@pytest.mark.network
def test_hicache_storage_with_sglangs_own_base_and_factory(master: Any, sglang_src: Path) -> None:
    result = run_driver(master, sglang_src)
    assert result["base"] == "HiCacheStorage"
    check(result)


@pytest.mark.network
def test_hicache_storage_v2_answers_as_sglangs_own_file_backend(master: Any,
                                                                sglang_src: Path) -> None:
    results = run_driver(master, sglang_src, "sglang_v2_driver.py")
    check_v2(results["kvpool"])
    assert results["file"] == V2_SHARED  # SGLang's reference backend, same calls
