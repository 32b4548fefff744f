"""MindIE-shaped workers and scheduler against a real master, in their own processes.

Two TP ranks save the same prompt's blocks (rank 1 only its first six) from a background
thread, as MindIE's asyncWrite does; a scheduler counts the leading blocks after the on-chip
hits that exist on every rank; a fresh worker of rank 0 loads exactly those blocks into zeroed
caches and they are byte-exact. Once through the ``mooncake`` drop-in (MindIE's own calls,
``kvPoolConfig.backend = "mooncake"``) and once through the native ``KVPoolMempool``.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).parent
DROP_IN = HERE.parents[1] / "compat" / "mooncake"
NUM_BLOCKS, ON_CHIP_HITS = 8, 2


class Worker:
    """One ``mindie_worker.py`` process; commands go in as JSON lines, replies come back."""

    def __init__(self, mode: str, role: str, config: Path, *extra: str) -> None:
        env = dict(os.environ)
        if mode == "compat":  # the drop-in package shadows any other ``mooncake``
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(DROP_IN),
                                                              env.get("PYTHONPATH")]))
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "mindie_worker.py"), "--mode", mode, "--role", role,
             "--config", str(config), "--num-blocks", str(NUM_BLOCKS), *extra],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        assert self.read(timeout_s=120) == {"ready": True}

    def read(self, timeout_s: float = 60) -> Any:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 1.0)
            if ready:
                line = self.proc.stdout.readline()
                assert line, f"worker exited with {self.proc.poll()}"
                return json.loads(line)
            assert self.proc.poll() is None, f"worker exited with {self.proc.returncode}"
        raise AssertionError("no reply from the worker in time")

    def call(self, **command: Any) -> Any:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def stop(self) -> None:
        try:
            if self.proc.poll() is None:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait(10)
        finally:
            for pipe in (self.proc.stdin, self.proc.stdout):
                if pipe is not None:
                    pipe.close()


def write_mindie_config(path: Path, master: Any) -> Path:
    """The mooncake.json MindIE's configPath names, pointing at kvpool-master (mode 0600)."""
    path.write_text(json.dumps({
        "local_hostname": "127.0.0.1",
        "metadata_server": "P2PHANDSHAKE",
        "global_segment_size": 64 << 20,
        "local_buffer_size": 1 << 30,
        "protocol": "ascend",
        "device_name": "",
        "master_server_address": master.address,
        "use_ascend_direct": True,
    }))
    path.chmod(0o600)
    return path


@pytest.mark.parametrize("mode", ["compat", "native"])
def test_mindie_workers_and_scheduler(master: Any, tmp_path: Path, mode: str) -> None:
    config = write_mindie_config(tmp_path / "mooncake.json", master)
    workers: list[Worker] = []
    try:
        for rank in (0, 1):
            workers.append(Worker(mode, "worker", config, "--tp-rank", str(rank)))
        rank0, rank1 = workers
        saved0 = rank0.call(op="save", blocks=list(range(NUM_BLOCKS)), **{"async": True})
        assert saved0 == {"ok": [True] * NUM_BLOCKS, "thread": "async-write"}
        saved1 = rank1.call(op="save", blocks=list(range(6)), **{"async": True})
        assert saved1["ok"] == [True] * 6
        # a prefix on chip but not in the pool is saved again: existing keys succeed harmlessly
        assert rank0.call(op="save", blocks=[0, 1, 2])["ok"] == [True] * 3

        scheduler = Worker(mode, "scheduler", config)
        workers.append(scheduler)
        after_hits = NUM_BLOCKS - ON_CHIP_HITS
        # rank 1 lacks blocks 6 and 7, so only blocks 2..5 are hits on every rank
        assert scheduler.call(op="lookup", first_block=ON_CHIP_HITS,
                              num_blocks=after_hits) == {"hits": 4}
        assert scheduler.call(op="lookup", first_block=6, num_blocks=2) == {"hits": 0}

        reader = Worker(mode, "worker", config, "--tp-rank", "0", "--fill", "zeros")
        workers.append(reader)
        loaded = reader.call(op="load", blocks=list(range(ON_CHIP_HITS, NUM_BLOCKS)),
                             hits=ON_CHIP_HITS)
        assert loaded == {"ok": [True] * after_hits, "exact": True, "untouched": True}
        reader1 = Worker(mode, "worker", config, "--tp-rank", "1", "--fill", "zeros")
        workers.append(reader1)
        partial = reader1.call(op="load", blocks=[5, 6], hits=0)
        assert partial["ok"] == [True, False]  # a missing key fails alone
    finally:
        for worker in reversed(workers):
            worker.stop()
    assert all(w.proc.returncode == 0 for w in workers)
