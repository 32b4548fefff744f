"""LMCache's multiprocess mode (the server vLLM's ``LMCacheMPConnector`` talks to) with kvpool's
L2 adapter (``kvpool_client.connectors.lmcache_mp``), loaded by LMCache as a plugin: LMCache
0.5.6's own ``StorageManager`` (L1 manager, store and prefetch controllers) stores chunks into
the pool, drops them from L1 and prefetches them back from the pool, byte-exact, against a real
master (``lmcache_mp_driver.py``, run with the LMCache environment that ``make lmcache-env``
builds and ``.ci/run`` uses). Skipped, saying why, only where that environment does not exist.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).parent
ROOT = HERE.parents[1]
LMCACHE_PYTHON = Path(os.environ.get("KVPOOL_LMCACHE_PYTHON", ROOT / ".venv-lmcache/bin/python"))
NO_TELEMETRY = {"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1"}


def test_lmcache_storage_manager_stores_and_prefetches_through_the_pool(master: Any) -> None:
    if not LMCACHE_PYTHON.exists():
        pytest.skip(f"{LMCACHE_PYTHON} does not exist: run `make lmcache-env`")
    env = {k: v for k, v in os.environ.items()
           if k not in ("KVPOOL_CONFIG_PATH", "MOONCAKE_CONFIG_PATH")}
    proc = subprocess.run([str(LMCACHE_PYTHON), str(HERE / "lmcache_mp_driver.py"), "--master",
                           master.address], capture_output=True, text=True, timeout=240,
                          env={**env, **NO_TELEMETRY}, cwd=ROOT, stdin=subprocess.DEVNULL)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    assert result["reserved"] == 6
    assert result["in_pool"] == [True] * 6 + [False]  # the store controller pushed them
    assert result["dropped_from_l1"] == [6, 0]
    assert result["prefetched"] is True
    assert result["hits"] == result["l2_hits"] == list(range(6))  # all six from the pool
    assert result["exact"] is True
