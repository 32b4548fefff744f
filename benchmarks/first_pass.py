"""The first pass over another process's segment against the steady state, kvpool beside Mooncake.

One process contributes a segment (``--segment-gib``, default 2) and does nothing else. A writer
process (contributing none) puts ``--fill`` of it (default 0.75) in batches of 32 x 1 MiB: the
first pass lands on pages its mapping has never touched; it removes them all and puts them
again: the steady state. A fresh reader process then reads them twice with ``batch_get_into``
into one reused buffer: cold, then warm. Each worker measures memcpy (numpy, warm buffers of one
batch) in the same process, and every figure is printed as GB/s and as a ratio to it.

Configurations, one after the other in one run:
- kvpool, 4 KiB pages, no populate (``populate_peer_segments`` false: each page faults on its
  first copy);
- kvpool, 4 KiB pages, with populate (the default: page tables filled on a background thread);
- kvpool, huge pages (``use_hugepage``: 2 MiB pages when ``/dev/shm`` gives them; the owner's
  log says which);
- Mooncake 0.3.13 (the peer venv, ``--mooncake auto``), tcp protocol, and with
  ``MC_STORE_USE_HUGEPAGE=1`` when the host has HugeTLB pages for it.

Every process it starts listens on 127.0.0.1 only and is stopped by pid.

Usage: python benchmarks/first_pass.py [--segment-gib 2] [--fill 0.75] [--mooncake auto]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from churn_bench import (  # noqa: E402  (a sibling benchmark: its orchestration is shared)
    HOST,
    PEER_PYTHON,
    GiB,
    MiB,
    add_common_arguments,
    master_command,
    started,
    wait_port,
)

BATCH = 32
OBJECT_BYTES = 1 * MiB


def open_store(backend: str, master: str, segment_bytes: int, options: dict[str, Any]) -> Any:
    if backend == "kvpool":
        from kvpool_client.client import KVPoolClient
        from kvpool_client.config import ClientConfig

        return KVPoolClient(ClientConfig.from_dict({
            "master_server_address": master, "global_segment_size": segment_bytes, **options}))
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup(HOST, "P2PHANDSHAKE", segment_bytes, 64 * MiB, "tcp", "", master)
    if rc != 0:
        raise RuntimeError(f"MooncakeDistributedStore.setup returned {rc}")
    return store


def memcpy_gbps() -> float:
    import numpy as np

    src = np.ones(BATCH * OBJECT_BYTES, dtype=np.uint8)
    dst = np.zeros_like(src)
    dst[:] = src  # both warm
    rounds = 16
    started_s = time.perf_counter()
    for _ in range(rounds):
        dst[:] = src
    return rounds * src.nbytes / (time.perf_counter() - started_s) / 1e9


class Worker:
    """One process's view: a store, one batch-sized buffer, and the store's batch calls."""

    def __init__(self, backend: str, master: str, options: dict[str, Any]) -> None:
        import numpy as np

        self.backend = backend
        self.store = open_store(backend, master, 0, options)
        self.buffer = np.full(BATCH * OBJECT_BYTES, 7, dtype=np.uint8)
        self.address = self.buffer.ctypes.data
        if backend == "mooncake":
            rc = self.store.register_buffer(self.address, self.buffer.nbytes)
            if rc != 0:
                raise RuntimeError(f"register_buffer returned {rc}")

    def _spans(self, count: int) -> tuple[Any, ...]:
        """Where ``count`` objects lie in the buffer, as each store's batch calls take it."""
        offsets = [i * OBJECT_BYTES for i in range(count)]
        if self.backend == "kvpool":
            return self.buffer, offsets, [OBJECT_BYTES] * count
        return [self.address + offset for offset in offsets], [OBJECT_BYTES] * count

    def put(self, keys: list[str]) -> None:
        failed = [int(c) for c in self.store.batch_put_from(keys, *self._spans(len(keys)))
                  if int(c) != 0]
        if failed:
            raise RuntimeError(f"{len(failed)} puts failed: {sorted(set(failed))}")

    def get(self, keys: list[str]) -> None:
        short = [s for s in self.store.batch_get_into(keys, *self._spans(len(keys)))
                 if s != OBJECT_BYTES]
        if short:
            raise RuntimeError(f"{len(short)} gets failed: {sorted(set(short))}")

    def remove(self, keys: list[str]) -> None:
        for key in keys:
            self.store.remove(key, True)  # force: both stores take it second

    def timed_pass(self, batches: list[list[str]], op: str) -> float:
        """GB/s of one pass of ``op`` over every batch."""
        call = getattr(self, op)
        started_s = time.perf_counter()
        for keys in batches:
            call(keys)
        return sum(map(len, batches)) * OBJECT_BYTES / (time.perf_counter() - started_s) / 1e9

    def close(self) -> None:
        if self.backend == "kvpool":
            self.store.close()


def batches_of(fill_bytes: int) -> list[list[str]]:
    count = max(1, fill_bytes // (BATCH * OBJECT_BYTES))
    return [[f"fp-{b}-{i}" for i in range(BATCH)] for b in range(count)]


def role_writer(backend: str, master: str, fill_bytes: int, options: dict[str, Any]) -> None:
    worker = Worker(backend, master, options)
    batches = batches_of(fill_bytes)
    first = worker.timed_pass(batches, "put")
    for keys in batches:
        worker.remove(keys)
    steady = worker.timed_pass(batches, "put")
    print(json.dumps({"memcpy": memcpy_gbps(), "put_first": first, "put_steady": steady}),
          flush=True)
    worker.close()


def role_reader(backend: str, master: str, fill_bytes: int, options: dict[str, Any]) -> None:
    worker = Worker(backend, master, options)
    batches = batches_of(fill_bytes)
    first = worker.timed_pass(batches, "get")
    steady = worker.timed_pass(batches, "get")
    print(json.dumps({"memcpy": memcpy_gbps(), "get_first": first, "get_steady": steady}),
          flush=True)
    worker.close()


def role_owner(backend: str, master: str, segment_bytes: int, options: dict[str, Any]) -> None:
    store = open_store(backend, master, segment_bytes, options)
    huge = store.metrics.segment_page_bytes.get("2MiB", 0) if backend == "kvpool" else -1
    print(json.dumps({"ready": True, "huge_bytes": huge}), flush=True)
    sys.stdin.read()
    if backend == "kvpool":
        store.close()


def run_config(name: str, backend: str, python: str, options: dict[str, Any], env: dict[str, str],
               args: argparse.Namespace, logdir: str) -> dict[str, Any]:
    log = os.path.join(logdir, f"{name}.log")
    command, address = master_command(backend, python)
    me = os.path.abspath(__file__)
    common = ["--_backend", backend, "--_master", address, "--_options", json.dumps(options),
              "--segment-gib", str(args.segment_gib), "--fill", str(args.fill)]
    penv = {**os.environ, **env}
    with started(command, log) as master:
        wait_port(address, master)
        if backend == "kvpool":
            time.sleep(0.5)  # the ready port answers before the servicer; be gentle
        with started([python, me, "--_role", "owner", *common], log, stdin=subprocess.PIPE,
                     stdout=subprocess.PIPE, env=penv) as owner:
            assert owner.stdout is not None
            ready = json.loads(owner.stdout.readline() or "{}")
            if ready.get("ready") is not True:
                raise RuntimeError(f"the {name} segment owner did not start; see {log}")
            result: dict[str, Any] = {"huge_bytes": ready["huge_bytes"]}
            for role in ("writer", "reader"):
                done = subprocess.run([python, me, "--_role", role, *common], env=penv,
                                      capture_output=True, text=True, timeout=args.timeout_s)
                with open(log, "a") as out:
                    out.write(done.stderr)
                if done.returncode != 0:
                    raise RuntimeError(f"the {name} {role} failed; see {log}")
                figures = json.loads(done.stdout.strip().splitlines()[-1])
                memcpy = figures.pop("memcpy")
                result.update({k: (v, v / memcpy) for k, v in figures.items()})
            return result


def hugetlb_free_bytes() -> int:
    fields: dict[str, int] = {}
    with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            name, _, value = line.partition(":")
            fields[name] = int(value.split()[0])
    return fields.get("HugePages_Free", 0) * fields.get("Hugepagesize", 0) * 1024


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--segment-gib", type=float, default=2.0)
    ap.add_argument("--fill", type=float, default=0.75, help="share of the segment put per pass")
    add_common_arguments(ap)
    ap.add_argument("--_options", default="{}", help=argparse.SUPPRESS)
    args = ap.parse_args()
    segment_bytes = int(args.segment_gib * GiB)
    fill_bytes = int(segment_bytes * args.fill)
    if args._role:
        role = {"owner": role_owner, "writer": role_writer, "reader": role_reader}[args._role]
        role(args._backend, args._master, segment_bytes if args._role == "owner" else fill_bytes,
             json.loads(args._options))
        return 0
    logdir = tempfile.mkdtemp(prefix="kvpool-first-pass-")
    configs: list[tuple[str, str, str, dict[str, Any], dict[str, str]]] = [
        ("kvpool 4K, no populate", "kvpool", sys.executable, {"populate_peer_segments": False},
         {}),
        ("kvpool 4K, populate", "kvpool", sys.executable, {}, {}),
        ("kvpool huge pages", "kvpool", sys.executable, {"use_hugepage": True}, {}),
    ]
    mooncake = PEER_PYTHON if args.mooncake == "auto" else args.mooncake
    if args.mooncake != "off" and os.path.exists(mooncake):
        configs.append(("Mooncake", "mooncake", mooncake, {}, {}))
        if hugetlb_free_bytes() >= segment_bytes + 256 * MiB:
            configs.append(("Mooncake HugeTLB", "mooncake", mooncake, {},
                            {"MC_STORE_USE_HUGEPAGE": "1"}))
    results = {name: run_config(name, backend, python, options, env, args, logdir)
               for name, backend, python, options, env in configs}
    print(f"first pass: {BATCH} x 1 MiB batches, {fill_bytes / GiB:.2f} GiB through another "
          f"process's {args.segment_gib:g} GiB segment; GB/s and (ratio to memcpy, same process)")
    columns = ("put_first", "put_steady", "get_first", "get_steady")
    print(f"  {'configuration':26} {'2 MiB pages':>12} " + " ".join(f"{c:>16}" for c in columns))
    for name, r in results.items():
        huge = "n/a" if r["huge_bytes"] < 0 else f"{r['huge_bytes'] / GiB:.2f} GiB"
        cells = " ".join(f"{r[c][0]:>7.2f} ({r[c][1]:.2f}) ".rjust(16) for c in columns)
        print(f"  {name:26} {huge:>12} {cells}")
    print(f"logs: {logdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
