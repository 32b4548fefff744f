"""SGLang HiCache storage backend ``KVPoolHiCacheStorage`` (``--hicache-storage-backend dynamic``
with ``interface_v1``), driven as SGLang's cache controller drives it, in its own process.

SGLang does not install lightly here (its package imports its GPU kernels and a long list of
dependencies), so the default test checks the class against the interface_v1 shape with SGLang
absent. With marker ``network``, the SGLang 0.5.23 wheel is downloaded at test time and its own
``hicache_storage.py`` and ``storage/backend_factory.py`` build the backend (``issubclass``
check, ``cls(storage_config, kwargs)``) and are its base class.
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


def run_driver(master: Any, src: Path | None) -> dict[str, Any]:
    command = [sys.executable, str(HERE / "sglang_driver.py"), "--master", master.address]
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
