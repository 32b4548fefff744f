"""Churn through another process's segment: put -> get -> remove(force), kvpool beside Mooncake.

One process contributes a segment (``--segment-gib``, default 2) and does nothing else; a second
process, contributing none, loops over batches of ``--batch`` x ``--object-mib`` MiB objects:
put them (they land in the first process's segment), get them back (checked), remove them with
``force``. ``--through-gib`` (default 4) passes through the segment, twice its size by default,
so a put only finds room when the bytes of the batches before it were freed.

kvpool frees a force-removed object's bytes when no read lease protects them: the reader gives
its lease back with its next call (here, the remove). The same loop runs against Mooncake
(``mooncake_master`` and ``mooncake.store`` of the peer venv, ``--mooncake auto``: /tmp/peer-venv)
with the same lease time (5 s), one after the other in one run.

Prints per store: batches, failed puts (and their statuses), failed gets, GB/s of the loop, and
kvpool / Mooncake. Every process it starts listens on 127.0.0.1 only and is stopped by pid.

Usage: python benchmarks/churn_bench.py [--segment-gib 2] [--through-gib 4] [--mooncake auto]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

HOST = "127.0.0.1"
MiB = 1 << 20
GiB = 1 << 30
PEER_PYTHON = "/tmp/peer-venv/bin/python"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


# -- the two roles, in their own processes ---------------------------------------------------------

def kvpool_store(master: str, segment_bytes: int) -> Any:
    from kvpool_client.client import KVPoolClient
    from kvpool_client.config import ClientConfig

    return KVPoolClient(ClientConfig.from_dict({
        "master_server_address": master, "global_segment_size": segment_bytes}))


def mooncake_store(master: str, segment_bytes: int) -> Any:
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    local_buffer = 512 * MiB if segment_bytes == 0 else 16 * MiB
    rc = store.setup(HOST, "P2PHANDSHAKE", segment_bytes, local_buffer, "tcp", "", master)
    if rc != 0:
        raise RuntimeError(f"MooncakeDistributedStore.setup returned {rc}")
    return store


def role_owner(backend: str, master: str, segment_bytes: int) -> None:
    """Contribute the segment; stay until stdin closes."""
    store = (kvpool_store if backend == "kvpool" else mooncake_store)(master, segment_bytes)
    print(json.dumps({"ready": True}), flush=True)
    sys.stdin.read()
    if backend == "kvpool":
        store.close()


def role_churn(backend: str, master: str, batch: int, object_bytes: int,
               through_bytes: int) -> None:
    """The loop; prints one JSON line of results."""
    import numpy as np

    store = (kvpool_store if backend == "kvpool" else mooncake_store)(master, 0)
    values = [np.full(object_bytes, i % 251, dtype=np.uint8).tobytes() for i in range(batch)]
    rounds = max(1, through_bytes // (batch * object_bytes))
    failed_puts: dict[str, int] = {}
    failed_gets = bad_bytes = 0
    started = time.perf_counter()
    for round_ in range(rounds):
        keys = [f"churn-{round_}-{i}" for i in range(batch)]
        statuses = [int(s) for s in store.put_batch(keys, values)] if backend == "kvpool" else \
            _mooncake_put_batch(store, keys, values)
        stored = [k for k, s in zip(keys, statuses, strict=True) if s == 0]
        for s in statuses:
            if s != 0:
                failed_puts[str(s)] = failed_puts.get(str(s), 0) + 1
        got = store.get_batch(stored)
        for key, value in zip(stored, got, strict=True):
            if not value:
                failed_gets += 1
            elif value != values[int(key.rsplit("-", 1)[1])]:
                bad_bytes += 1
        for key in stored:
            if backend == "kvpool":
                store.batch_remove([key], force=True)
            else:
                store.remove(key, True)
    secs = time.perf_counter() - started
    print(json.dumps({"rounds": rounds, "batch": batch, "failed_puts": failed_puts,
                      "failed_gets": failed_gets, "bad_bytes": bad_bytes, "secs": secs,
                      "gbps": rounds * batch * object_bytes * 2 / secs / 1e9}), flush=True)
    if backend == "kvpool":
        store.close()


def _mooncake_put_batch(store: Any, keys: list[str], values: list[bytes]) -> list[int]:
    rc = store.put_batch(keys, values)
    if rc == 0:
        return [0] * len(keys)
    # Which keys failed: the batch answers one code for all of them.
    return [0 if store.is_exist(k) == 1 else int(rc) for k in keys]


# -- the orchestrator ------------------------------------------------------------------------------

@contextlib.contextmanager
def started(command: list[str], log: str, **kwargs: Any) -> Iterator[subprocess.Popen[str]]:
    with open(log, "ab") as out:
        proc = subprocess.Popen(command, stderr=out, text=True, start_new_session=True, **kwargs)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()


def master_command(backend: str, python: str) -> tuple[list[str], str]:
    port = free_port()
    address = f"{HOST}:{port}"
    if backend == "kvpool":
        return [python, "-m", "kvpool_master.cli", "--host", HOST, "--port", str(port),
                "--metrics-port", "-1", "--default-kv-lease-ttl", "5000"], address
    binary = subprocess.run(
        [python, "-c", "import mooncake, os; print(os.path.join(os.path.dirname("
                       "mooncake.__file__), 'mooncake_master'))"],
        capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    return [binary, f"--rpc_address={HOST}", f"--rpc_port={port}", f"--metrics_port={free_port()}",
            f"--metrics_host={HOST}", f"--http_metadata_server_host={HOST}",
            "--default_kv_lease_ttl=5000", "--logtostderr"], address


def wait_port(address: str, proc: subprocess.Popen[str], timeout_s: float = 30.0) -> None:
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the master exited with {proc.returncode}")
        with contextlib.suppress(OSError):
            socket.create_connection((host, int(port)), timeout=1).close()
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the master did not listen on {address} in {timeout_s:g} s")
        time.sleep(0.1)


def run_backend(backend: str, python: str, args: argparse.Namespace, logdir: str) -> dict[str, Any]:
    log = os.path.join(logdir, f"{backend}.log")
    command, address = master_command(backend, python)
    me = os.path.abspath(__file__)
    with started(command, log) as master:
        wait_port(address, master)
        if backend == "kvpool":
            time.sleep(0.5)  # the ready port answers before the servicer; be gentle
        owner_cmd = [python, me, "--_role", "owner", "--_backend", backend, "--_master", address,
                     "--segment-gib", str(args.segment_gib)]
        with started(owner_cmd, log, stdin=subprocess.PIPE, stdout=subprocess.PIPE) as owner:
            assert owner.stdout is not None
            if json.loads(owner.stdout.readline() or "{}").get("ready") is not True:
                raise RuntimeError(f"the {backend} segment owner did not start; see {log}")
            churn = subprocess.run(
                [python, me, "--_role", "churn", "--_backend", backend, "--_master", address,
                 "--batch", str(args.batch), "--object-mib", str(args.object_mib),
                 "--through-gib", str(args.through_gib)],
                capture_output=True, text=True, timeout=args.timeout_s)
            with open(log, "a") as out:
                out.write(churn.stderr)
            if churn.returncode != 0:
                raise RuntimeError(f"the {backend} churn loop failed; see {log}")
            result: dict[str, Any] = json.loads(churn.stdout.strip().splitlines()[-1])
            return result


def add_common_arguments(ap: argparse.ArgumentParser) -> None:
    """The options of a benchmark run beside Mooncake, and the hidden ones of its roles."""
    ap.add_argument("--mooncake", default="auto",
                    help="'auto' (the peer venv when present), 'off', or a python with Mooncake")
    ap.add_argument("--timeout-s", type=float, default=600.0)
    ap.add_argument("--_role", help=argparse.SUPPRESS)
    ap.add_argument("--_backend", help=argparse.SUPPRESS)
    ap.add_argument("--_master", help=argparse.SUPPRESS)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--segment-gib", type=float, default=2.0)
    ap.add_argument("--through-gib", type=float, default=4.0)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--object-mib", type=float, default=1.0)
    add_common_arguments(ap)
    args = ap.parse_args()
    if args._role == "owner":
        role_owner(args._backend, args._master, int(args.segment_gib * GiB))
        return 0
    if args._role == "churn":
        role_churn(args._backend, args._master, args.batch, int(args.object_mib * MiB),
                   int(args.through_gib * GiB))
        return 0
    logdir = tempfile.mkdtemp(prefix="kvpool-churn-bench-")
    results: dict[str, dict[str, Any]] = {"kvpool": run_backend("kvpool", sys.executable, args,
                                                                logdir)}
    mooncake = PEER_PYTHON if args.mooncake == "auto" else args.mooncake
    if args.mooncake != "off" and os.path.exists(mooncake):
        results["mooncake"] = run_backend("mooncake", mooncake, args, logdir)
    print(f"churn: {args.batch} x {args.object_mib:g} MiB batches, put -> get -> "
          f"remove(force), {args.through_gib:g} GiB through another process's "
          f"{args.segment_gib:g} GiB segment; leases 5 s")
    print(f"  {'store':10} {'batches':>8} {'failed puts':>22} {'failed gets':>12} "
          f"{'wrong bytes':>12} {'GB/s':>7}")
    for name, r in results.items():
        failed = sum(r["failed_puts"].values())
        detail = f"{failed} {r['failed_puts'] or ''}".strip()
        print(f"  {name:10} {r['rounds']:>8} {detail:>22} {r['failed_gets']:>12} "
              f"{r['bad_bytes']:>12} {r['gbps']:>7.2f}")
    if "mooncake" in results:
        ratio = results["kvpool"]["gbps"] / results["mooncake"]["gbps"]
        print(f"  kvpool / Mooncake GB/s: {ratio:.2f}")
    print(f"logs: {logdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
