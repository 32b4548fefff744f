"""The ``kvpool-mooncake`` drop-in package builds, installs and answers as ``mooncake``."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

PACKAGE = Path(__file__).parents[2] / "compat" / "mooncake"


def test_dropin_installs_and_serves_mooncake_store_and_engine(master: Any, tmp_path: Path
                                                               ) -> None:
    target = tmp_path / "site"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation",
         "--disable-pip-version-check", "--no-index", "-q", "--target", str(target),
         str(PACKAGE)], capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert build.returncode == 0, build.stdout + build.stderr
    dist = list(target.glob("kvpool_mooncake-*.dist-info"))
    assert len(dist) == 1 and (target / "mooncake" / "store.py").is_file()
    script = textwrap.dedent(f"""
        import ctypes, mooncake
        from mooncake.engine import TransferEngine
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig
        from mooncake.store import FAILED, KVCACHE, ObjectDataType, TaskStatus, TensorParallelism
        assert KVCACHE is ObjectDataType.KVCACHE == 1 and FAILED is TaskStatus.FAILED
        assert TensorParallelism().axes == []
        assert mooncake.__file__.startswith({str(target)!r}), mooncake.__file__
        te = TransferEngine()
        assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "ascend", "") == 0
        store = MooncakeDistributedStore()
        assert store.setup(f"127.0.0.1:{{te.get_rpc_port()}}", "P2PHANDSHAKE", 16 << 20,
                           "1gb", "ascend", "", "{master.address}", te.get_engine()) == 0
        buf = ctypes.create_string_buffer(b"drop-in", 64)
        assert te.register_memory(ctypes.addressof(buf), 64) == 0
        config = ReplicateConfig()
        config.preferred_segment = f"127.0.0.1:{{te.get_rpc_port()}}"
        config.data_type = ObjectDataType.KVCACHE
        assert store.put_from("k", ctypes.addressof(buf), 7, config) == 0
        assert store.get("k") == b"drop-in"
        store.remove_all(True)
        assert store.close() == 0
        print("ok")
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
                         stdin=subprocess.DEVNULL)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout + run.stderr
