#!/usr/bin/env python3
"""kvpool client benchmark, in the shape of Mooncake Store's peer benchmark (run both side
by side).

Starts its own ``kvpool-master`` on 127.0.0.1 (free ports) and one or two client processes
(``KVPoolClient``), and measures

  limits  single-thread memcpy (numpy, 256 MiB) and loopback TCP between two processes
          (1 MiB send/recv_into chunks), plus a 64 B TCP ping-pong RTT; at start and at end
  a       one client, objects in its own segment: put/get throughput at 4 KiB .. 16 MiB with
          four APIs (put/get, put_from/get_into, put_batch/get_batch,
          batch_put_from/batch_get_into; batch = 32; *_from/*_into on registered numpy memory)
  c       p50/p99 latency of single put/get at 64 KiB and 1 MiB, one client
  d       two client processes A and B, placement forced with preferred_segment so that every
          transfer crosses processes: get(B <- A's segment) and put(A -> B's segment), over
          shared memory (transport auto) and over forced TCP (transport tcp), with latency

Each figure is the median of --reps repetitions (default 3) of a fixed number of operations;
ratios use the larger of the start and end medians of each limit, except that the zero-copy
batches of phase d also pair each repetition with its transport's limit (memcpy for shm,
loopback TCP for tcp) measured right before it (the machine is shared: its bandwidth drifts
during a run), and their targets use the median of those paired ratios. The JSON goes to --out
(default /tmp/kvpool-client-bench-<UTC date>.json) and a table, ending with the targets, is
printed. Every process started here is stopped by pid at the end (also on error, Ctrl-C or
SIGTERM), and children die with the orchestrator (PR_SET_PDEATHSIG). Everything is on 127.0.0.1.

Usage:  python benchmarks/client_bench.py [--quick] [--reps N] [--only limits,a,c,d] [--out FILE]
        [--sizes 4KiB,1MiB] [--master-busy-poll-us US] [--mooncake auto|off|PYTHON]
        [--engine-site DIR]   (with --only d-engine,d-tcp: the engine transport beside TCP)
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime as _dt
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any

from kvpool_wire.status import KVPoolError

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
HOST = "127.0.0.1"
BATCH = 32
APIS = ("single", "single_zc", "batch", "batch_zc")

# Targets: (what, row selector, limit, ratio) and ops/s floors.
RATIO_TARGETS = 0.70
# Force-removed objects keep their bytes until their read leases lapse (readers may still be
# copying); a short lease lets repetitions reuse the space.
LEASE_TTL_MS = 2000
OPS_TARGETS = {("put", 4 * KiB): 4400.0, ("get", 4 * KiB): 8200.0}


def warm_object_bytes(buffer_bytes: int) -> int:
    """Object size of the warm-up for a worker whose zero-copy buffers hold ``buffer_bytes``:
    16 MiB, or less when they hold fewer than BATCH objects of that size (``--sizes`` without
    16MiB; whole pages)."""
    return min(16 * MiB, max(4 * KiB, buffer_bytes // BATCH // (4 * KiB) * (4 * KiB)))


def memcpy_gbps(src: Any, dst: Any) -> float:
    """Single-thread memcpy, ``src`` into ``dst`` (numpy arrays), median of 3, in GB/s."""
    import numpy as np

    times = []
    for _ in range(3):
        started = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - started)
    return src.nbytes / statistics.median(times) / 1e9


def set_pdeathsig() -> None:
    """Ask the kernel to SIGKILL this process when its parent dies."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)


def fmt_size(n: int) -> str:
    if n >= MiB and n % MiB == 0:
        return f"{n // MiB} MiB"
    if n >= KiB and n % KiB == 0:
        return f"{n // KiB} KiB"
    return f"{n} B"


def median(xs: list[Any]) -> Any:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


class Chan:
    """Line-delimited JSON over a socket (socketpair between orchestrator and worker)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""

    def send(self, obj: Any) -> None:
        self.sock.sendall(json.dumps(obj).encode() + b"\n")

    def recv(self, timeout: float | None = None) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self.buf:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("no reply from worker")
                self.sock.settimeout(left)
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                raise EOFError("worker closed its channel")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)


# --- worker process: owns one KVPoolClient -------------------------------------------------------

class ClientWorker:
    def __init__(self, cfg: dict[str, Any]) -> None:
        import numpy as np

        from kvpool_client.client import KVPoolClient
        from kvpool_client.config import ClientConfig

        self.np = np
        self.client = KVPoolClient(ClientConfig.from_dict(cfg["client"]))
        zc = int(cfg["zc_bytes"])
        rng = np.random.default_rng(os.getpid())
        self.src = rng.integers(0, 256, zc, dtype=np.uint8)
        self.dst = np.ones(zc, dtype=np.uint8)  # written once: pages faulted in before timing
        self.client.register_buffer(self.src)
        self.client.register_buffer(self.dst)

    def _options(self, preferred: str | None) -> Any:
        from kvpool_wire.types import PutOptions

        return PutOptions(preferred_segment=preferred) if preferred else None

    def cmd_info(self) -> dict[str, Any]:
        return {"segment_ids": self.client.segment_ids, "hostname": self.client.hostname,
                "client_id": self.client.client_id, "pid": os.getpid()}

    def cmd_remove_all(self) -> int:
        return int(self.client.remove_all(force=True))

    def cmd_put(self, api: str, size: int, keys: list[str],
                preferred: str | None = None) -> dict[str, Any]:
        c, opts, n = self.client, self._options(preferred), len(keys)
        fails = 0
        value = self.src[:size].tobytes()
        chunks = [keys[b:b + BATCH] for b in range(0, n, BATCH)]
        t0 = time.perf_counter()
        if api == "single":
            for k in keys:
                try:
                    c.put(k, value, options=opts)
                except KVPoolError:
                    fails += 1
        elif api == "single_zc":
            for i, k in enumerate(keys):
                try:
                    c.put_from(k, self.src, (i % BATCH) * size, size, options=opts)
                except KVPoolError:
                    fails += 1
        elif api == "batch":
            values = [value] * BATCH
            for ch in chunks:
                fails += sum(1 for s in c.put_batch(ch, values[:len(ch)], options=opts) if s)
        elif api == "batch_zc":
            offsets = [j * size for j in range(BATCH)]
            sizes = [size] * BATCH
            for ch in chunks:
                fails += sum(1 for s in c.batch_put_from(ch, self.src, offsets[:len(ch)],
                                                         sizes[:len(ch)], options=opts) if s)
        else:
            raise ValueError(api)
        return {"secs": time.perf_counter() - t0, "n": n, "failed": fails}

    def cmd_get(self, api: str, size: int, keys: list[str]) -> dict[str, Any]:
        c, n = self.client, len(keys)
        fails = 0
        last: Any = None
        chunks = [keys[b:b + BATCH] for b in range(0, n, BATCH)]
        t0 = time.perf_counter()
        if api == "single":
            for k in keys:
                try:
                    last = c.get(k)
                except KVPoolError:
                    last = None
                fails += last is None or len(last) != size
        elif api == "single_zc":
            for i, k in enumerate(keys):
                try:
                    fails += c.get_into(k, self.dst, (i % BATCH) * size, size) != size
                except KVPoolError:
                    fails += 1
        elif api == "batch":
            for ch in chunks:
                values = c.get_batch(ch)
                fails += sum(1 for v in values if v is None or len(v) != size)
                last = values[-1]
        elif api == "batch_zc":
            offsets = [j * size for j in range(BATCH)]
            sizes = [size] * BATCH
            for ch in chunks:
                fails += sum(1 for r in c.batch_get_into(ch, self.dst, offsets[:len(ch)],
                                                         sizes[:len(ch)]) if r != size)
        else:
            raise ValueError(api)
        secs = time.perf_counter() - t0
        # content check of one object, outside the timed region: the writer stored src[slot]
        slot = (n - 1) % BATCH if api.endswith("zc") else 0
        got = self.dst[slot * size:(slot + 1) * size].tobytes() if api.endswith("zc") else last
        return {"secs": secs, "n": n, "failed": int(fails), "last": got is not None,
                "digest": _digest(got) if got is not None else None,
                "slot": slot}

    def cmd_fill(self, total_bytes: int, preferred: str) -> list[str]:
        """Put objects into segment ``preferred`` (faulting in this process's mapping of it);
        returns their keys. Raises if any put fails: a partial warm-up would leave pages to
        fault during the timed repetitions."""
        size = warm_object_bytes(len(self.src))
        keys = [f"__warm-{os.getpid()}-{preferred}-{i}" for i in range(total_bytes // size)]
        for b in range(0, len(keys), BATCH):
            chunk = keys[b:b + BATCH]
            statuses = self.client.batch_put_from(
                chunk, self.src, [j * size for j in range(len(chunk))], [size] * len(chunk),
                options=self._options(preferred))
            if any(statuses):
                raise RuntimeError(f"warm-up put failed: {sorted({int(s) for s in statuses})}")
        return keys

    def cmd_read_all(self, keys: list[str]) -> int:
        """Read the objects ``cmd_fill`` wrote (faulting in this process's mapping of their
        segment); returns bytes. Raises if any read fails."""
        size, done = warm_object_bytes(len(self.src)), 0
        for b in range(0, len(keys), BATCH):
            chunk = keys[b:b + BATCH]
            got = self.client.batch_get_into(chunk, self.dst, [j * size for j in range(len(chunk))],
                                             [size] * len(chunk))
            if any(r != size for r in got):
                raise RuntimeError(f"warm-up read failed: {sorted({r for r in got if r != size})}")
            done += sum(got)
        return done

    def cmd_digest(self, size: int, slot: int) -> str:
        return _digest(self.src[slot * size:(slot + 1) * size].tobytes())

    def _lat(self, ns: list[int], fails: int) -> dict[str, Any]:
        a = self.np.asarray(ns, dtype=self.np.float64) / 1e3
        return {"p50_us": float(self.np.percentile(a, 50)),
                "p99_us": float(self.np.percentile(a, 99)), "failed": fails}

    def cmd_lat_put(self, api: str, size: int, keys: list[str],
                    preferred: str | None = None) -> dict[str, Any]:
        c, opts, value = self.client, self._options(preferred), self.src[:size].tobytes()
        ns = []
        for i, k in enumerate(keys):
            t = time.perf_counter_ns()
            if api == "single":
                c.put(k, value, options=opts)
            else:
                c.put_from(k, self.src, (i % BATCH) * size, size, options=opts)
            ns.append(time.perf_counter_ns() - t)
        return self._lat(ns, 0)

    def cmd_lat_get(self, api: str, size: int, keys: list[str]) -> dict[str, Any]:
        c = self.client
        ns, fails = [], 0
        for i, k in enumerate(keys):
            t = time.perf_counter_ns()
            try:
                if api == "single":
                    fails += c.get(k) is None
                else:
                    fails += c.get_into(k, self.dst, (i % BATCH) * size, size) != size
            except KVPoolError:
                fails += 1
            ns.append(time.perf_counter_ns() - t)
        return self._lat(ns, fails)

    def cmd_close(self) -> None:
        self.client.close()


def _digest(data: bytes) -> str:
    import hashlib

    return hashlib.blake2b(data, digest_size=16).hexdigest()


def worker_main(fd: int, log_path: str, parent_pid: int) -> None:
    set_pdeathsig()
    if os.getppid() != parent_pid:
        os._exit(3)
    logfd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(logfd, 1)
    os.dup2(logfd, 2)
    chan = Chan(socket.socket(fileno=fd))
    worker: ClientWorker | None = None
    while True:
        try:
            msg = chan.recv()
        except EOFError:
            break
        cmd, kw = msg["cmd"], msg.get("kw", {})
        try:
            if cmd == "init":
                worker = ClientWorker(kw)
                result = worker.cmd_info()
            elif cmd == "exit":
                chan.send({"ok": True, "res": None})
                break
            else:
                result = getattr(worker, "cmd_" + cmd)(**kw)
            chan.send({"ok": True, "res": result})
        except Exception:
            chan.send({"ok": False, "err": traceback.format_exc()})
    os._exit(0)


def tcp_sender_main(port: int, total: int, chunk: int, reps: int, pingpong: int) -> None:
    set_pdeathsig()
    payload = b"\xa5" * chunk
    for _ in range(reps):
        s = socket.create_connection((HOST, port))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sent = 0
        while sent < total:
            s.sendall(payload)
            sent += chunk
        s.shutdown(socket.SHUT_WR)
        s.recv(1)
        s.close()
    s = socket.create_connection((HOST, port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for _ in range(pingpong):
        s.sendall(b"q" * 64)
        got = 0
        while got < 64:
            got += len(s.recv(64 - got))
    s.close()


# --- orchestrator --------------------------------------------------------------------------------

class Procs:
    """Every process this run starts, stopped by pid in reverse order."""

    def __init__(self) -> None:
        self.items: list[tuple[str, subprocess.Popen[bytes]]] = []

    def add(self, name: str, p: subprocess.Popen[bytes]) -> None:
        self.items.append((name, p))

    def stop(self, p: subprocess.Popen[bytes], grace: float = 5.0) -> None:
        if p.poll() is None:
            try:
                os.kill(p.pid, signal.SIGTERM)
                p.wait(grace)
            except ProcessLookupError:
                pass
            except subprocess.TimeoutExpired:
                os.kill(p.pid, signal.SIGKILL)
                p.wait(5)
        self.items = [(n, q) for n, q in self.items if q is not p]

    def stop_all(self) -> list[str]:
        stopped = []
        for name, p in reversed(list(self.items)):
            if p.poll() is None:
                stopped.append(f"{name} pid {p.pid}")
            self.stop(p)
        return stopped


def _sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


class Master:
    def __init__(self, procs: Procs, logdir: str, name: str,
                 extra_args: tuple[str, ...] = ()) -> None:
        self.log = os.path.join(logdir, f"{name}.log")
        ready = os.path.join(logdir, f"{name}.ready.json")
        args = [sys.executable, "-m", "kvpool_master.cli", "--host", HOST, "--port", "0",
                "--fast-port", "0", "--metrics-port", "-1", "--ready-file", ready,
                "--log-level", "warning", "--default-kv-lease-ttl", str(LEASE_TTL_MS),
                *extra_args]
        with open(self.log, "ab") as lf:
            self.p = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=lf,
                                      stderr=subprocess.STDOUT, preexec_fn=set_pdeathsig,
                                      start_new_session=True)
        procs.add(name, self.p)
        deadline = time.monotonic() + 30
        while not os.path.exists(ready):
            if self.p.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"kvpool-master did not start; see {self.log}")
            time.sleep(0.05)
        time.sleep(0.05)
        with open(ready) as f:
            self.addr = f"{HOST}:{json.load(f)['grpc_port']}"


class Worker:
    def __init__(self, procs: Procs, logdir: str, name: str, cfg: dict[str, Any],
                 env: dict[str, str] | None = None) -> None:
        self.name = name
        self.log = os.path.join(logdir, f"{name}.log")
        parent, child = socket.socketpair()
        self.p = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--_worker", str(child.fileno()),
             self.log, str(os.getpid())], pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL,
            start_new_session=True, env={**os.environ, **(env or {})})
        child.close()
        procs.add(name, self.p)
        self.chan = Chan(parent)
        self.info = self.call("init", timeout=180, **cfg)

    def call(self, cmd: str, timeout: float = 600, **kw: Any) -> Any:
        self.chan.send({"cmd": cmd, "kw": kw})
        try:
            rep = self.chan.recv(timeout)
        except (TimeoutError, EOFError) as e:
            raise RuntimeError(f"worker {self.name} ({cmd}): {e!r}; see {self.log}") from e
        if not rep["ok"]:
            raise RuntimeError(f"worker {self.name} ({cmd}) failed:\n{rep['err']}")
        return rep["res"]

    def close(self, procs: Procs) -> None:
        try:
            self.call("close", timeout=60)
            self.call("exit", timeout=10)
            self.p.wait(10)
        except (RuntimeError, subprocess.TimeoutExpired):
            pass
        procs.stop(self.p)


def deferred_bytes(m: Master) -> int:
    """Bytes the master keeps for removed objects until their read leases lapse."""
    import asyncio

    from kvpool_client.cli_status import fetch_stats
    from kvpool_client.liveness import MasterAddress

    document = asyncio.run(fetch_stats(MasterAddress(m.addr, 10.0, None, "", True)))
    return int(document["objects"].get("deferred_free_bytes", 0))


def tcp_loopback(procs: Procs, total_bytes: int, reps: int, pingpong: int
                 ) -> tuple[list[float], list[int]]:
    """Loopback TCP between this process and a sender process, 1 MiB send / recv_into chunks:
    (GB/s per repetition of ``total_bytes``, ns per 64 B ping-pong)."""
    chunk = MiB
    ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    ls.bind((HOST, 0))
    ls.listen(4)
    ls.settimeout(60)
    port = ls.getsockname()[1]
    p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--_tcp_sender", str(port),
                          str(total_bytes), str(chunk), str(reps), str(pingpong)],
                         stdin=subprocess.DEVNULL, start_new_session=True)
    procs.add("tcp_sender", p)
    mv = memoryview(bytearray(chunk))
    vals: list[float] = []
    rtts: list[int] = []
    try:
        for _ in range(reps):
            c, _a = ls.accept()
            got, t0 = 0, None
            while True:
                k = c.recv_into(mv, chunk)
                if k == 0:
                    break
                if t0 is None:
                    t0 = time.perf_counter()
                got += k
            vals.append(got / (time.perf_counter() - (t0 or 0)) / 1e9)
            c.sendall(b"x")
            c.close()
        c, _a = ls.accept()
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(pingpong):
            got = 0
            t = time.perf_counter_ns()
            while got < 64:
                got += len(c.recv(64 - got))
            c.sendall(b"r" * 64)
            rtts.append(time.perf_counter_ns() - t)
        c.close()
        p.wait(30)
    finally:
        ls.close()
        procs.stop(p)
    return vals, rtts


def measure_limits(procs: Procs, reps: int, quick: bool) -> dict[str, Any]:
    import numpy as np

    out: dict[str, Any] = {}
    n = 256 * MiB
    src = np.ones(n, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    vals = []
    for _ in range(reps):
        iters = 2 if quick else 5
        t0 = time.perf_counter()
        for _i in range(iters):
            np.copyto(dst, src)
        vals.append(iters * n / (time.perf_counter() - t0) / 1e9)
    out["memcpy_GBps"] = {"reps": vals, "median": median(vals)}
    del src, dst
    vals, rtts = tcp_loopback(procs, (512 * MiB) if quick else (2 * GiB), reps,
                              500 if quick else 2000)
    out["tcp_loopback_GBps"] = {"reps": vals, "median": median(vals)}
    r = np.asarray(rtts[10:], dtype=np.float64) / 1e3
    out["tcp_rtt_us"] = {"p50": float(np.percentile(r, 50)), "p99": float(np.percentile(r, 99))}
    return out


def tp_entry(size: int, n: int, secs: list[float], fails: list[int],
             extra: dict[str, Any] | None = None) -> dict[str, Any]:
    e = {"size": size, "n_ops": n, "reps_secs": secs, "ops_s": median([n / s for s in secs]),
         "GBps": median([n * size / s / 1e9 for s in secs]), "failed_ops_reps": fails}
    e.update(extra or {})
    return e


def paired_entry(size: int, n: int, secs: list[float], baseline_gbps: list[float]
                 ) -> dict[str, Any]:
    """Ratios to the baseline (memcpy or loopback TCP) measured right before each repetition,
    and their median (empty when no baseline was paired)."""
    if not baseline_gbps:
        return {}
    ratios = [n * size / s / 1e9 / b for s, b in zip(secs, baseline_gbps, strict=True)]
    return {"baseline_GBps_reps": baseline_gbps, "baseline_ratio_reps": ratios,
            "baseline_ratio_paired": median(ratios)}


class PairedBaselines:
    """The limits measured on demand, right before a repetition they are compared with, so
    that a machine whose bandwidth drifts during the run (shared, noisy) is compared with
    itself: single-thread memcpy (numpy, 256 MiB, median of 3) and loopback TCP (as in the
    limits phase: ``tcp_bytes`` through a fresh connection)."""

    def __init__(self, procs: Procs, tcp_bytes: int) -> None:
        import numpy as np

        self._procs = procs
        self._tcp_bytes = tcp_bytes
        self._src = np.ones(256 * MiB, dtype=np.uint8)
        self._dst = np.zeros_like(self._src)

    def gbps(self, transport: str) -> float:
        """The limit of ``transport`` ("auto": memcpy, "tcp" and "engine" over the engine's
        tcp protocol: loopback TCP), in GB/s."""
        if transport in ("tcp", "engine"):
            return tcp_loopback(self._procs, self._tcp_bytes, 1, 0)[0][0]
        return memcpy_gbps(self._src, self._dst)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="few ops, 1 rep: a smoke test")
    ap.add_argument("--segment-gib", type=float, default=4.0, help="segment per client")
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", default="limits,a,c,d",
                    help="comma list of phases (d-shm / d-tcp: one transport of d; d-engine: "
                         "two clients on different host ids through Mooncake's TransferEngine "
                         "over its tcp protocol, not part of d)")
    ap.add_argument("--engine-site", default=os.environ.get("KVPOOL_ENGINE_SITE", ""),
                    help="a directory holding mooncake-transfer-engine-non-cuda (pip install "
                         "--target DIR), added to the d-engine clients' path")
    ap.add_argument("--sizes", default="",
                    help="comma list of object sizes to run, e.g. 1MiB,16MiB (default: all)")
    ap.add_argument("--mooncake", default="auto",
                    help="after ours, run the peer Mooncake benchmark (phases a and d) for a "
                         "same-run comparison: 'auto' (when /tmp/peer-venv exists), 'off', or "
                         "the python of a venv with the Mooncake wheel")
    ap.add_argument("--mooncake-bench", default=os.environ.get(
        "KVPOOL_PEER_BENCH", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                          "shared", "peer", "mooncake_bench.py")),
                    help="path of mooncake_bench.py")
    ap.add_argument("--master-busy-poll-us", type=int, default=None,
                    help="the master's --busy-poll-us (default: the master's own default)")
    args = ap.parse_args()
    master_args = (() if args.master_busy_poll_us is None
                   else ("--busy-poll-us", str(args.master_busy_poll_us)))
    if args.quick:
        args.reps = 1
        args.segment_gib = min(args.segment_gib, 2.0)
    phases = set(args.only.split(","))
    for s in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, _sigterm)
    date = _dt.datetime.now(_dt.timezone.utc)
    out_path = args.out or f"/tmp/kvpool-client-bench-{date.strftime('%Y-%m-%d')}.json"
    logdir = tempfile.mkdtemp(prefix="kvpool-client-bench-")
    seg = int(args.segment_gib * GiB)
    if args.quick:
        sizes = {4 * KiB: (256, 1024), 64 * KiB: (256, 512), MiB: (64, 64), 16 * MiB: (32, 32)}
    else:
        sizes = {4 * KiB: (2048, 16384), 64 * KiB: (2048, 8192), MiB: (512, 1024),
                 16 * MiB: (64, 128)}
    if args.sizes:
        wanted = {fmt_size(size).replace(" ", ""): size for size in sizes}
        unknown = [name for name in args.sizes.split(",") if name not in wanted]
        if unknown:
            ap.error(f"--sizes: unknown {unknown}; choose from {sorted(wanted)}")
        sizes = {wanted[name]: sizes[wanted[name]] for name in args.sizes.split(",")}

    def n_for(size: int, api: str) -> int:
        n = sizes[size][1] if api.startswith("batch") else sizes[size][0]
        # 0.4: a repetition's objects, plus the previous one's still leased (freed when the
        # leases lapse), stay under the eviction watermark
        return min(n, max(BATCH, int(0.4 * seg / size) // BATCH * BATCH))

    lat_n = 200 if args.quick else 1000
    zc_bytes = BATCH * max(*sizes, MiB)  # the latency phases put 64 KiB and 1 MiB objects
    res: dict[str, Any] = {
        "meta": {"date_utc": date.isoformat(timespec="seconds"),
                 "python": platform.python_version(),
                 "kernel": platform.release(), "nproc": os.cpu_count(),
                 "loadavg_start": os.getloadavg(), "reps": args.reps, "quick": args.quick,
                 "batch": BATCH, "host": HOST, "global_segment_size": seg, "logdir": logdir,
                 "GB": "1e9 bytes"},
        "notes": [], "errors": {}}
    procs = Procs()
    t_start = time.monotonic()

    def phase(name: str, fn: Any) -> None:
        print(f"[bench] phase {name} ...", file=sys.stderr, flush=True)
        try:
            fn()
        except KeyboardInterrupt:
            raise
        except Exception:
            res["errors"][name] = traceback.format_exc()
            print(f"[bench] phase {name} FAILED:\n{res['errors'][name]}", file=sys.stderr)
        finally:
            for left in procs.stop_all():
                res["notes"].append(f"phase {name}: stopped leftover {left}")

    def settle(m: Master) -> None:
        """After removing a repetition, wait (if needed) until the space still held for readers'
        leases is small enough for the next repetition to fit without eviction."""
        deadline = time.monotonic() + 2 * LEASE_TTL_MS / 1000 + 5
        while deferred_bytes(m) > 0.25 * seg and time.monotonic() < deadline:
            time.sleep(0.1)

    def client_cfg(m: Master, transport: str = "auto") -> dict[str, Any]:
        engine = {"protocol": "tcp"} if transport == "engine" else {}
        return {"client": {"master_server_address": m.addr, "global_segment_size": seg,
                           "transport": transport, "rpc_timeout_s": 30,
                           "transfer_timeout_s": 60, **engine},
                "zc_bytes": zc_bytes}

    def worker_env(transport: str, name: str) -> dict[str, str] | None:
        """Engine clients believe they are on different hosts (no shared memory), and find
        the engine wheel in --engine-site."""
        if transport != "engine":
            return None
        path = os.pathsep.join(p for p in (args.engine_site, os.environ.get("PYTHONPATH", ""))
                               if p)
        return {"KVPOOL_HOST_ID": f"bench-{name}", "PYTHONPATH": path, "GLOG_minloglevel": "2"}

    def run_single() -> None:
        m = Master(procs, logdir, "master-single", master_args)
        w = Worker(procs, logdir, "client-single", client_cfg(m))
        single: dict[str, Any] = {"worker": w.info}
        res["single_client"] = single
        own = w.info["segment_ids"][0]
        if "a" in phases:
            rows = []
            for size in sizes:
                acc = {api: {"put": [], "get": [], "pf": [], "gf": [], "ok": []} for api in APIS}
                for rep in range(args.reps):
                    for api in APIS:
                        n = n_for(size, api)
                        keys = [f"a-{size}-{api}-{rep}-{i}" for i in range(n)]
                        p = w.call("put", api=api, size=size, keys=keys, preferred=own)
                        g = w.call("get", api=api, size=size, keys=keys)
                        ok = g["digest"] == w.call("digest", size=size, slot=g["slot"])
                        w.call("remove_all")
                        settle(m)
                        a = acc[api]
                        a["put"].append(p["secs"])
                        a["pf"].append(p["failed"])
                        a["get"].append(g["secs"])
                        a["gf"].append(g["failed"])
                        a["ok"].append(ok)
                for api in APIS:
                    a, n = acc[api], n_for(size, api)
                    rows.append({"api": api, "op": "put", **tp_entry(size, n, a["put"], a["pf"])})
                    rows.append({"api": api, "op": "get",
                                 **tp_entry(size, n, a["get"], a["gf"],
                                            {"content_ok": all(a["ok"])})})
            single["throughput"] = rows
        if "c" in phases:
            lats = []
            for size in (64 * KiB, MiB):
                for api in ("single", "single_zc"):
                    reps = []
                    for rep in range(args.reps):
                        keys = [f"c-{size}-{api}-{rep}-{i}" for i in range(lat_n)]
                        reps.append({"put": w.call("lat_put", api=api, size=size, keys=keys,
                                                   preferred=own),
                                     "get": w.call("lat_get", api=api, size=size, keys=keys)})
                        w.call("remove_all")
                    lats.append(_lat_entry("local", size, api, lat_n, reps))
            single["latency"] = lats
        w.close(procs)
        procs.stop(m.p)

    def run_two(transport: str) -> None:
        m = Master(procs, logdir, f"master-two-{transport}", master_args)
        A = Worker(procs, logdir, f"client-A-{transport}", client_cfg(m, transport),
                   worker_env(transport, "A"))
        B = Worker(procs, logdir, f"client-B-{transport}", client_cfg(m, transport),
                   worker_env(transport, "B"))
        a_seg, b_seg = A.info["segment_ids"][0], B.info["segment_ids"][0]
        # Warm-up (as the peer benchmark does): each process maps the other's segment on first
        # use and takes a page fault per 4 KiB page it touches the first time.
        warm = int(0.9 * seg)
        B.call("read_all", keys=A.call("fill", total_bytes=warm, preferred=a_seg))
        A.call("fill", total_bytes=warm, preferred=b_seg)
        A.call("remove_all")
        settle(m)  # the warm-up's leases lapse, its space is free
        baselines = PairedBaselines(procs, (512 * MiB) if args.quick else (2 * GiB))
        rows = []
        for size in sizes:
            for api in ("single", "batch_zc"):
                n = n_for(size, api)
                acc: dict[str, list[Any]] = {k: [] for k in ("g", "gf", "gm", "p", "pf", "pm",
                                                              "ok")}
                # batches: their limit measured right before each repetition (paired ratios)
                paired = api == "batch_zc"
                for rep in range(args.reps):
                    keys = [f"dg-{size}-{api}-{rep}-{i}" for i in range(n)]
                    A.call("put", api=api, size=size, keys=keys, preferred=a_seg)
                    if paired:
                        acc["gm"].append(baselines.gbps(transport))
                    g = B.call("get", api=api, size=size, keys=keys)
                    acc["ok"].append(g["digest"] == A.call("digest", size=size, slot=g["slot"]))
                    acc["g"].append(g["secs"])
                    acc["gf"].append(g["failed"])
                    A.call("remove_all")
                    settle(m)
                    keys = [f"dp-{size}-{api}-{rep}-{i}" for i in range(n)]
                    if paired:
                        acc["pm"].append(baselines.gbps(transport))
                    p = A.call("put", api=api, size=size, keys=keys, preferred=b_seg)
                    acc["p"].append(p["secs"])
                    acc["pf"].append(p["failed"])
                    A.call("remove_all")
                    settle(m)
                rows.append({"transport": transport, "api": api, "op": "get(B<-A segment)",
                             **tp_entry(size, n, acc["g"], acc["gf"],
                                        {"content_ok": all(acc["ok"]),
                                         **paired_entry(size, n, acc["g"], acc["gm"])})})
                rows.append({"transport": transport, "api": api, "op": "put(A->B segment)",
                             **tp_entry(size, n, acc["p"], acc["pf"],
                                        paired_entry(size, n, acc["p"], acc["pm"]))})
        lats = []
        for size in (64 * KiB, MiB):
            reps = []
            for rep in range(args.reps):
                kg = [f"lg-{size}-{rep}-{i}" for i in range(lat_n)]
                A.call("put", api="batch_zc", size=size, keys=kg, preferred=a_seg)
                g = B.call("lat_get", api="single", size=size, keys=kg)
                kp = [f"lp-{size}-{rep}-{i}" for i in range(lat_n)]
                p = A.call("lat_put", api="single", size=size, keys=kp, preferred=b_seg)
                reps.append({"put": p, "get": g})
                A.call("remove_all")
            lats.append(_lat_entry(f"cross-process {transport}", size, "single", lat_n, reps))
        two = res.setdefault("two_clients", {"throughput": [], "latency": []})
        two["throughput"] += rows
        two["latency"] += lats
        B.close(procs)
        A.close(procs)
        procs.stop(m.p)

    rc = 0
    try:
        if "limits" in phases:
            phase("limits", lambda: res.__setitem__("limits",
                                                     measure_limits(procs, args.reps, args.quick)))
        if phases & {"a", "c"}:
            phase("single(a,c)", run_single)
        if phases & {"d", "d-shm"}:
            phase("two_clients shm", lambda: run_two("auto"))
        if phases & {"d", "d-tcp"}:
            phase("two_clients tcp", lambda: run_two("tcp"))
        if "d-engine" in phases:
            phase("two_clients engine", lambda: run_two("engine"))
        if "limits" in phases:
            phase("limits_end", lambda: res.__setitem__(
                "limits_end", measure_limits(procs, args.reps, args.quick)))
        lr = {}
        for k in ("memcpy_GBps", "tcp_loopback_GBps"):
            vals = [((res.get(ph) or {}).get(k) or {}).get("median")
                    for ph in ("limits", "limits_end")]
            vals = [v for v in vals if v]
            lr[k] = max(vals) if vals else None
        res["limits_for_ratios"] = lr
        res["targets"] = check_targets(res)
        python = PEER_PYTHON if args.mooncake == "auto" else args.mooncake
        if args.mooncake != "off" and os.path.exists(python) and \
                os.path.exists(args.mooncake_bench):
            phase("mooncake", lambda: res.__setitem__("mooncake", run_mooncake(
                python, args.mooncake_bench, args.reps, args.quick, logdir)))
            res["targets"] = check_targets(res)  # now also against Mooncake's same-run ops/s
    except KeyboardInterrupt as e:
        res["errors"]["interrupted"] = repr(e)
        rc = 130
    finally:
        left = procs.stop_all()
        if left:
            res["notes"].append(f"stopped at exit: {left}")
        res["meta"]["loadavg_end"] = os.getloadavg()
        res["meta"]["total_secs"] = round(time.monotonic() - t_start, 1)
        with open(out_path, "w") as f:
            json.dump(res, f, indent=1)
        print_table(res)
        print(f"\nJSON: {out_path}\nlogs: {logdir}")
    if res["errors"] and rc == 0:
        rc = 1
    return rc


PEER_PYTHON = "/tmp/peer-venv/bin/python"


def run_mooncake(python: str, bench: str, reps: int, quick: bool,
                 logdir: str) -> dict[str, Any]:
    """Run the peer benchmark's phases a and d; return its JSON."""
    out = os.path.join(logdir, "mooncake.json")
    command = [python, bench, "--only", "a,d", "--reps", str(reps), "--out", out]
    if quick:
        command.append("--quick")
    with open(os.path.join(logdir, "mooncake.log"), "wb") as log:
        subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=1800, check=False)
    with open(out) as f:
        result: dict[str, Any] = json.load(f)
    return result


def _lat_entry(case: str, size: int, api: str, n: int, reps: list[Any]) -> dict[str, Any]:
    return {"case": case, "size": size, "api": api, "n_ops": n,
            "put_p50_us": median([r["put"]["p50_us"] for r in reps]),
            "put_p99_us": median([r["put"]["p99_us"] for r in reps]),
            "get_p50_us": median([r["get"]["p50_us"] for r in reps]),
            "get_p99_us": median([r["get"]["p99_us"] for r in reps]),
            "failed": sum(r["put"]["failed"] + r["get"]["failed"] for r in reps)}


def check_targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, each with the measured value and whether it was met."""
    lr = res.get("limits_for_ratios") or {}
    memcpy, tcp = lr.get("memcpy_GBps"), lr.get("tcp_loopback_GBps")
    out = []
    for r in (res.get("two_clients") or {}).get("throughput", []):
        if r["api"] != "batch_zc":
            continue
        # paired: each repetition against its limit measured right before it; otherwise (none
        # was paired) against the larger of the start and end limits
        if r["transport"] == "auto" and r["size"] in (MiB, 16 * MiB):
            name, limit = "memcpy", memcpy
        elif r["transport"] == "tcp" and r["size"] == 16 * MiB:
            name, limit = "loopback TCP", tcp
        else:
            continue
        paired = r.get("baseline_ratio_paired")
        value = paired if paired is not None else (r["GBps"] / limit if limit else None)
        if value is not None:
            where = "shm" if r["transport"] == "auto" else "tcp"
            out.append({"target": f"{where} 2 procs batch_zc {fmt_size(r['size'])} {r['op']} "
                                  f">= 70% {name}{' (paired)' if paired is not None else ''}",
                        "value": value, "met": value >= RATIO_TARGETS})
    theirs = {(r["api"], r["op"], r["size"]): r["ops_s"]
              for r in ((res.get("mooncake") or {}).get("single_client") or {}).get(
                  "throughput", []) if r.get("ops_s")}
    for r in (res.get("single_client") or {}).get("throughput", []):
        floor = OPS_TARGETS.get((r["op"], r["size"]))
        if floor and r["api"] == "single":
            out.append({"target": f"single {r['op']} 4 KiB >= {floor:.0f} ops/s",
                        "value": r["ops_s"], "met": r["ops_s"] >= floor})
            same_run = theirs.get(("single", r["op"], r["size"]))
            if same_run:  # "at least Mooncake's ops/s", measured beside it
                out.append({"target": f"single {r['op']} 4 KiB >= Mooncake's, same run "
                                      f"({same_run:.0f} ops/s)", "value": r["ops_s"] / same_run,
                            "met": r["ops_s"] >= same_run})
    return out


def print_table(res: dict[str, Any]) -> None:
    m = res["meta"]
    print()
    print(f"kvpool client benchmark  {m['date_utc']}  python {m['python']}  "
          f"{m['nproc']} cores; reps={m['reps']} (median); GB = 1e9 B")
    print(f"loadavg start {tuple(round(x, 2) for x in m['loadavg_start'])} end "
          f"{tuple(round(x, 2) for x in m.get('loadavg_end', (0, 0, 0)))}; total "
          f"{m.get('total_secs')} s")
    lr = res.get("limits_for_ratios") or {}
    memcpy, tcp = lr.get("memcpy_GBps"), lr.get("tcp_loopback_GBps")

    def g(ph: str, k: str, f: str = "median") -> str:
        v = ((res.get(ph) or {}).get(k) or {}).get(f)
        return f"{v:8.2f}" if v is not None else "       -"

    if res.get("limits") or res.get("limits_end"):
        print("\n## Physical limits (medians at start and end; ratios use the larger)")
        print(f"  {'':<40} {'start':>8} {'end':>8}")
        print(f"  {'memcpy, numpy 1 thread, 256 MiB (GB/s)':<40} {g('limits', 'memcpy_GBps')} "
              f"{g('limits_end', 'memcpy_GBps')}")
        print(f"  {'loopback TCP, 2 procs, 1 MiB (GB/s)':<40} "
              f"{g('limits', 'tcp_loopback_GBps')} {g('limits_end', 'tcp_loopback_GBps')}")
        print(f"  {'loopback TCP 64 B RTT p50 (us)':<40} {g('limits', 'tcp_rtt_us', 'p50')} "
              f"{g('limits_end', 'tcp_rtt_us', 'p50')}")

    def pct(x: float | None, lim: float | None) -> str:
        return f"{100 * x / lim:5.0f}%" if (x is not None and lim) else "    -"

    sc = res.get("single_client") or {}
    if sc.get("throughput"):
        print("\n## a. One client, objects in its own segment (shm path)")
        print(f"  {'size':>7} {'api':<10} {'n':>5} | {'put ops/s':>10} {'put GB/s':>9} "
              f"{'%mcpy':>6} | {'get ops/s':>10} {'get GB/s':>9} {'%mcpy':>6} | fails")
        rows = sc["throughput"]
        for i in range(0, len(rows), 2):
            p, q = rows[i], rows[i + 1]
            fails = sum(p["failed_ops_reps"]) + sum(q["failed_ops_reps"])
            print(f"  {fmt_size(p['size']):>7} {p['api']:<10} {p['n_ops']:>5} | "
                  f"{p['ops_s']:10.0f} {p['GBps']:9.3f} {pct(p['GBps'], memcpy)} | "
                  f"{q['ops_s']:10.0f} {q['GBps']:9.3f} {pct(q['GBps'], memcpy)} | {fails}"
                  f"{'' if q.get('content_ok', True) else ' CONTENT MISMATCH'}")
    if sc.get("latency"):
        print("\n## c. Single-op latency, one client, own segment (us)")
        print(f"  {'size':>7} {'api':<10} {'n':>5} | {'put p50':>8} {'put p99':>8} | "
              f"{'get p50':>8} {'get p99':>8} | fails")
        for r in sc["latency"]:
            print(f"  {fmt_size(r['size']):>7} {r['api']:<10} {r['n_ops']:>5} | "
                  f"{r['put_p50_us']:8.0f} {r['put_p99_us']:8.0f} | {r['get_p50_us']:8.0f} "
                  f"{r['get_p99_us']:8.0f} | {r['failed']}")
    two = res.get("two_clients") or {}
    if two.get("throughput"):
        print("\n## d. Two client processes, every transfer crosses processes "
              "(placement forced)")
        print("  (%tcp, %mcpy: against the run's limits above; paired: the median of each "
              "repetition against its\n   transport's limit, memcpy or loopback TCP, measured "
              "right before it)")
        print(f"  {'transport':<9} {'op':<18} {'size':>7} {'api':<9} | {'ops/s':>9} "
              f"{'GB/s':>7} {'%tcp':>6} {'%mcpy':>6} {'paired':>6} | fails")
        for r in two["throughput"]:
            name = "shm" if r["transport"] == "auto" else r["transport"]
            paired = r.get("baseline_ratio_paired")
            print(f"  {name:<9} {r['op']:<18} {fmt_size(r['size']):>7} {r['api']:<9} | "
                  f"{r['ops_s']:9.0f} {r['GBps']:7.3f} {pct(r['GBps'], tcp)} "
                  f"{pct(r['GBps'], memcpy)} {pct(paired, 1.0)} | "
                  f"{sum(r['failed_ops_reps'])}"
                  f"{'' if r.get('content_ok', True) else ' CONTENT MISMATCH'}")
    if two.get("latency"):
        print("\n## d. Cross-process single-op latency (us): B gets from A's segment, A puts "
              "into B's")
        print(f"  {'case':<22} {'size':>7} | {'put p50':>8} {'put p99':>8} | {'get p50':>8} "
              f"{'get p99':>8} | fails")
        for r in two["latency"]:
            print(f"  {r['case']:<22} {fmt_size(r['size']):>7} | {r['put_p50_us']:8.0f} "
                  f"{r['put_p99_us']:8.0f} | {r['get_p50_us']:8.0f} {r['get_p99_us']:8.0f} | "
                  f"{r['failed']}")
    mc = res.get("mooncake")
    if mc:
        print_mooncake(res, mc)
    if res.get("targets"):
        print("\n## Targets")
        for t in res["targets"]:
            value = f"{100 * t['value']:.0f}%" if t["value"] < 10 else f"{t['value']:.0f}"
            print(f"  {'MET ' if t['met'] else 'MISS'}  {t['target']:<58} {value}")
    if res.get("errors"):
        print("\nERRORS:")
        for k, v in res["errors"].items():
            print(f"  {k}: {v.strip().splitlines()[-1] if v.strip() else v}")


def print_mooncake(res: dict[str, Any], mc: dict[str, Any]) -> None:
    """Our figures beside Mooncake's from the same run (its own client API, tcp protocol)."""
    ours_a = {(r["api"], r["op"], r["size"]): r
              for r in (res.get("single_client") or {}).get("throughput", [])}
    theirs_a = {(r["api"], r["op"], r["size"]): r
                for r in (mc.get("single_client") or {}).get("throughput", [])}
    print("\n## Beside Mooncake 0.3.13 (peer benchmark run right after this one; ratio = "
          "kvpool / Mooncake)")
    print(f"  {'row':<46} {'kvpool':>10} {'Mooncake':>10} {'ratio':>6}")
    for api, op, size, unit in (("single", "put", 4 * KiB, "ops_s"),
                                ("single", "get", 4 * KiB, "ops_s"),
                                ("batch_zc", "put", MiB, "GBps"), ("batch_zc", "get", MiB, "GBps"),
                                ("batch_zc", "put", 16 * MiB, "GBps"),
                                ("batch_zc", "get", 16 * MiB, "GBps")):
        a, b = ours_a.get((api, op, size)), theirs_a.get((api, op, size))
        if a and b:
            print(f"  {'a ' + api + ' ' + op + ' ' + fmt_size(size) + ' (' + unit + ')':<46} "
                  f"{a[unit]:10.2f} {b[unit]:10.2f} {a[unit] / b[unit]:6.2f}")
    ours_d = {(r["transport"], r["api"], r["op"], r["size"]): r
              for r in (res.get("two_clients") or {}).get("throughput", [])}
    for r in (mc.get("two_clients") or {}).get("throughput", []):
        if r["case"] != "d2_forced_remote" or r["size"] not in (4 * KiB, MiB, 16 * MiB):
            continue
        unit = "ops_s" if r["size"] == 4 * KiB else "GBps"
        for transport in ("auto", "tcp"):
            mine = ours_d.get((transport, r["api"], r["op"], r["size"]))
            if mine:
                name = f"d {'shm' if transport == 'auto' else 'tcp'} {r['op']} {r['api']} " \
                       f"{fmt_size(r['size'])}"
                print(f"  {name:<46} {mine[unit]:10.2f} {r[unit]:10.2f} "
                      f"{mine[unit] / r[unit]:6.2f}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--_worker":
        worker_main(int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
    elif len(sys.argv) > 1 and sys.argv[1] == "--_tcp_sender":
        tcp_sender_main(*(int(x) for x in sys.argv[2:7]))
    else:
        sys.exit(main())
