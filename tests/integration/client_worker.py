"""A kvpool client in its own process, driven by JSON lines (the client tests' second process).

Run as ``python client_worker.py CONFIG_JSON``: it joins the pool, prints ``{"ready": ...}``,
then answers one JSON line per command read on stdin. Tests load this file with
:func:`load` to use :class:`Worker` (which starts and stops such a process by pid) and
:func:`payload` (the deterministic bytes of a key, so every process can check every byte).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

PATH = Path(__file__).resolve()


def payload(key: str, size_bytes: int) -> bytes:
    """The bytes every test stores under ``key``: pseudo-random, seeded by the key."""
    seed = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(0, 256, size_bytes, dtype=np.uint8).tobytes()


def load() -> ModuleType:
    """This file as a module (tests/ is not a package)."""
    spec = importlib.util.spec_from_file_location("kvpool_test_client_worker", PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Worker:
    """Test side: one worker process, stopped by pid in ``stop``."""

    def __init__(self, config: dict[str, Any], *, env: dict[str, str] | None = None,
                 timeout_s: float = 60.0) -> None:
        full_env = dict(os.environ)
        full_env.update(env or {})
        self.proc = subprocess.Popen([sys.executable, str(PATH), json.dumps(config)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=None, env=full_env)
        self.pid = self.proc.pid
        self._pending = b""  # bytes read from the worker's stdout past the last full line
        self.info = self._read(timeout_s)
        if "ready" not in self.info:
            self.stop()
            raise RuntimeError(f"worker failed to start: {self.info}")

    def call(self, op: str, timeout_s: float = 60.0, **args: Any) -> dict[str, Any]:
        """Send one command and return its answer."""
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({"op": op, **args}) + "\n").encode())
        self.proc.stdin.flush()
        return self._read(timeout_s)

    def send(self, op: str, **args: Any) -> None:
        """Send a command without waiting for its answer."""
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({"op": op, **args}) + "\n").encode())
        self.proc.stdin.flush()

    def read(self, timeout_s: float = 60.0) -> dict[str, Any]:
        """The next line the worker printed."""
        return self._read(timeout_s)

    def _read(self, timeout_s: float) -> dict[str, Any]:
        """The next line, read from the pipe itself: lines that arrived together stay in
        ``_pending`` (a buffered reader would keep them where ``select`` cannot see them)."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"worker {self.pid} silent for {timeout_s} s")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    raise RuntimeError(f"worker {self.pid} exited with {self.proc.wait(5)}")
                self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        answer: dict[str, Any] = json.loads(line)
        return answer

    def kill(self) -> None:
        """SIGKILL (also continues a stopped process) and reap."""
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        """Close the client gracefully if it still answers, else kill; always reaped."""
        if self.proc.poll() is None:
            try:
                os.kill(self.pid, signal.SIGCONT)
                self.call("close", timeout_s=20)
                self.proc.wait(20)
            except (OSError, TimeoutError, RuntimeError, subprocess.TimeoutExpired):
                self.kill()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()


# --- worker side ---------------------------------------------------------------------------------

def _serve(config_json: str) -> None:
    from kvpool_client.client import KVPoolClient
    from kvpool_client.config import ClientConfig
    from kvpool_wire.status import KVPoolError, Status
    from kvpool_wire.types import PutOptions

    try:
        client = KVPoolClient(ClientConfig.from_dict(json.loads(config_json)))
    except KVPoolError as exc:  # the test reads why it did not start
        _reply({"error": exc.status.name, "message": str(exc)})
        return
    _reply({"ready": True, "client_id": client.client_id, "segment_ids": client.segment_ids,
            "hostname": client.hostname, "pid": os.getpid()})

    def options(cmd: dict[str, Any]) -> PutOptions | None:
        if cmd.get("segment"):
            return PutOptions(preferred_segment=cmd["segment"])
        return None

    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        try:
            if op == "close":
                client.close()
                _reply({"closed": True})
                return
            if op == "put":
                keys, size = cmd["keys"], cmd["size"]
                datas = [payload(k, size) for k in keys]
                api = cmd.get("api", "put_batch")
                if api == "put":
                    for k, d in zip(keys, datas, strict=True):
                        client.put(k, d, options=options(cmd))
                    statuses = [Status.OK] * len(keys)
                elif api == "batch_put_regions":
                    regions = [[memoryview(d)[: size // 2], memoryview(d)[size // 2:]]
                               for d in datas]
                    statuses = client.batch_put_regions(keys, regions, options(cmd))
                else:
                    statuses = client.put_batch(keys, datas, options=options(cmd))
                _reply({"statuses": [s.name for s in statuses]})
            elif op == "check":
                keys, size = cmd["keys"], cmd["size"]
                _reply({"results": _check(client, keys, size, cmd.get("api", "get_batch"))})
            elif op == "check_loop":
                # Read the keys again and again; count what each read gave (never 'mismatch').
                counts: dict[str, int] = {}
                deadline = time.monotonic() + cmd["seconds"]
                _reply({"looping": True})
                while time.monotonic() < deadline:
                    try:
                        results = _check(client, cmd["keys"], cmd["size"], "get_batch")
                    except KVPoolError as exc:
                        results = [exc.status.name]
                    for result in results:
                        counts[result] = counts.get(result, 0) + 1
                _reply({"counts": counts})
            elif op == "transports":
                _reply({"used": sorted({f"{t}:{o}" for (t, o) in client.metrics.transfer_bytes})})
            elif op == "engine_drop_segments":
                # Inject transfer errors: the engine stops reaching this client's segments.
                member = client._client.member  # the test reaches in: a fault to inject
                for segment in member.segments.values():
                    member.engine.unregister(segment.address)
                _reply({"dropped": len(member.segments)})
            elif op == "put_loop":
                # Put batches until killed; report each batch once it returned.
                size, batch = cmd["size"], cmd["batch"]
                for n in range(cmd["count"]):
                    keys = [f"{cmd['prefix']}-{n}-{i}" for i in range(batch)]
                    statuses = client.put_batch(keys, [payload(k, size) for k in keys],
                                                options=options(cmd))
                    _reply({"batch": n, "statuses": [s.name for s in statuses]})
                _reply({"done": True})
            elif op == "tiers":
                _reply({"tiers": client.batch_tiers(cmd["keys"])})
            elif op == "ssd":
                # Where this client's SSD segment is, and how its tier copies went.
                member = client._client.member  # the test reaches in: to inject disk faults
                metrics = client.metrics
                _reply({"paths": [s.path for s in member.ssd_segments.values()],
                        "done": sum(metrics.transfer_seconds[("ssd", kind)].count
                                    for kind in ("demote", "promote")
                                    if ("ssd", kind) in metrics.transfer_seconds),
                        "failed": sum(n for (op, _), n in metrics.op_failures.items()
                                      if op in ("demote", "promote"))})
            elif op == "flush":
                client.flush()
                _reply({"flushed": True})
            elif op == "info":
                _reply({"client_id": client.client_id, "segment_ids": client.segment_ids})
            else:
                _reply({"error": "INVALID_ARGUMENT", "message": f"unknown op {op!r}"})
        except KVPoolError as exc:
            _reply({"error": exc.status.name, "message": str(exc)})


def _check(client: Any, keys: list[str], size: int, api: str) -> list[str]:
    """Per key: 'ok', 'missing' or 'mismatch' (another status: its name)."""
    if api == "batch_get_into":  # into one registered buffer
        dst = np.zeros(len(keys) * size, dtype=np.uint8)
        client.register_buffer(dst)
        try:
            sizes = client.batch_get_into(keys, dst, [i * size for i in range(len(keys))],
                                          [size] * len(keys))
        finally:
            client.unregister_buffer(dst)
        values = [dst[i * size:(i + 1) * size].tobytes() if n == size else n
                  for i, n in enumerate(sizes)]
    else:
        values = client.get_batch(keys)
    out = []
    for key, value in zip(keys, values, strict=True):
        if value is None:
            out.append("missing")
        elif isinstance(value, int):
            out.append("missing" if value == -704 else f"status {value}")
        else:
            out.append("ok" if value == payload(key, size) else "mismatch")
    return out


def _reply(answer: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(answer) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    _serve(sys.argv[1])
