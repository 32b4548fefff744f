"""What splitting the index across processes gains in the cores: puts and restore, 1 vs P.

``kvpool-master --partitions P`` (README, "Partitions") gives each of P processes the keys of
one hash partition. This measures the gain in the cores alone, without the RPCs and the
routing (``master_rpc.py --puts-only --partitions P`` measures through real masters): P
processes each run an in-process core (``master_core.py``'s) on their share of
``--objects`` at the same time, started together; then each snapshots its share and restores
it into a fresh core, again at the same time. Aggregate rates are total keys over the wall time
of the slowest process, against the same work done by one process in the same run.

    .venv/bin/python benchmarks/master_partitions.py [--objects 1000000] [--partitions 2 [4 ...]]

Keys are 64-byte hex strings in chains of 32 (parent keys, checksums), as ``master_core.py``.
On a machine with fewer free cores than partitions the gain is capped by the cores.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from master_core import fill, keys_of, make_core  # noqa: E402  (a sibling benchmark)

from kvpool_master.core.master import CoreConfig, MasterCore  # noqa: E402
from kvpool_master.persist import StateStore  # noqa: E402


def _share(start: int, count: int, together: Any, out: Any) -> None:
    """One partition: fill ``count`` objects, snapshot them, restore them (timed); waits on
    ``together`` (a barrier of every partition) before the fill and before the restore."""
    keys = keys_of(start, count)
    core = make_core(count, 0.95)
    together.wait()
    started = time.perf_counter()
    fill(core, keys, chain_length=32)
    filled = time.perf_counter()
    with tempfile.TemporaryDirectory() as state_dir:
        store = StateStore(state_dir, fsync="never")
        store.load(MasterCore(CoreConfig()), 0.0)
        store.compact(core)
        store.close()
        del core
        together.wait()
        restore_started = time.perf_counter()
        report = StateStore(state_dir).load(MasterCore(CoreConfig()), 0.0)
        restored = time.perf_counter()
        assert report.num_objects == count
    out.put((started, filled, restore_started, restored))


def run(num_objects: int, partitions: int) -> tuple[float, float]:
    """Return (fill wall seconds, restore wall seconds) of ``partitions`` processes."""
    context = multiprocessing.get_context("spawn")
    together = context.Barrier(partitions, timeout=1800)
    out = context.Queue()
    share = num_objects // partitions
    procs = [context.Process(target=_share, args=(i * share, share, together, out))
             for i in range(partitions)]
    for proc in procs:
        proc.start()
    results = [out.get(timeout=1800) for _ in procs]
    for proc in procs:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
    fill_s = max(r[1] for r in results) - min(r[0] for r in results)
    restore_s = max(r[3] for r in results) - min(r[2] for r in results)
    return fill_s, restore_s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--objects", type=int, default=1_000_000)
    ap.add_argument("--partitions", type=int, nargs="+", default=[2],
                    help="numbers of processes to compare with one (each a run of its own)")
    args = ap.parse_args()
    print(f"{args.objects:,} objects; {os.cpu_count()} CPUs")
    base_fill_s, base_restore_s = run(args.objects, 1)
    print(f"  {'processes':<10} {'put+commit keys/s':>18} {'restore s':>10}")
    print(f"  {1:<10} {args.objects / base_fill_s / 1e6:>16.3f} M {base_restore_s:>10.2f}",
          flush=True)
    for partitions in args.partitions:
        fill_s, restore_s = run(args.objects, partitions)
        print(f"  {partitions:<10} {args.objects / fill_s / 1e6:>16.3f} M {restore_s:>10.2f}"
              f"   gain: puts x{base_fill_s / fill_s:.2f}, "
              f"restore x{base_restore_s / restore_s:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
