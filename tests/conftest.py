"""Shared fixtures: a real `kvpool-master` process on 127.0.0.1.

Fixtures:
- ``start_master(*args, env=None, executable=None, timeout_s=30, **flags) -> MasterProcess``:
  starts ``python -m kvpool_master.cli --host 127.0.0.1 --port 0 --fast-port 0 --metrics-port 0
  --ready-file F`` plus ``--flag value`` for each keyword (``eviction_ratio=0.1`` ->
  ``--eviction-ratio 0.1``) and the raw ``args``; waits for the ready file. Every process it
  started is stopped (SIGTERM, then SIGKILL) by pid when the test ends.
- ``master``: one master with default settings.
- ``lean_socket(port, timeout_s=5, ssl_context=None) -> LeanSocket``: a blocking raw
  lean-framing connection for tests that craft frames: ``.send(method, request_id, payload)``,
  ``.send_raw(data)``, ``.recv() -> (method, request_id, payload)`` (raises ConnectionError on
  close), ``.call(method, payload) -> (method, payload)``, ``.close()``. Closed at test end.

A MasterProcess has ``.address`` ("127.0.0.1:PORT"), ``.grpc_port``, ``.fast_port``,
``.metrics_port``, ``.metrics_url`` ("http://127.0.0.1:PORT"), ``.pid``, ``.proc``,
``.log_path`` / ``.log()`` (its stderr), ``.stop(timeout_s=10) -> exit code`` and ``.kill()``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import ssl
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import pytest

HOST = "127.0.0.1"


class MasterProcess:
    """A running master started by :func:`launch_master`."""

    def __init__(self, proc: subprocess.Popen[bytes], ready: dict[str, Any], log_path: Path,
                 workdir: Path) -> None:
        self.proc = proc
        self.pid = proc.pid
        self.grpc_port = int(ready["grpc_port"])
        self.fast_port = int(ready["fast_port"])
        self.metrics_port = int(ready["metrics_port"])
        self.master_id = str(ready.get("master_id", ""))
        #: a partitioned master: every partition's ports and pid, this process's first
        self.partitions: list[dict[str, Any]] = list(ready.get("partitions", []))
        self.log_path = log_path
        self.workdir = workdir

    @property
    def address(self) -> str:
        """gRPC address, "127.0.0.1:PORT"."""
        return f"{HOST}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        """Base URL of /metrics, /healthz and /status."""
        return f"http://{HOST}:{self.metrics_port}"

    def log(self) -> str:
        """What the master wrote to stderr so far."""
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout_s: float = 10.0) -> int:
        """SIGTERM, wait up to ``timeout_s``, then SIGKILL; return the exit code."""
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGTERM)
            try:
                return self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        return int(self.proc.wait(timeout_s))

    def kill(self) -> None:
        """SIGKILL (also continues a SIGSTOPped process) and reap."""
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
        self.proc.wait(10)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (an exited one that nobody reaped yet does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return False


def stop_pid(pid: int, timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` for a process that is not this one's child to be gone, then
    SIGKILL it; True when it had gone by itself."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return True
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    return False


def launch_master(workdir: Path, *args: str, env: dict[str, str] | None = None,
                  executable: Sequence[str] | None = None, timeout_s: float = 30.0,
                  default_ports: bool = True, **flags: Any) -> MasterProcess:
    """Start a master process and wait until its ready file appears (see the module doc)."""
    workdir.mkdir(parents=True, exist_ok=True)
    fd, ready_name = tempfile.mkstemp(prefix="ready-", suffix=".json", dir=workdir)
    os.close(fd)
    os.unlink(ready_name)
    ready_path = Path(ready_name)
    log_path = ready_path.with_suffix(".log")
    command = list(executable or [sys.executable, "-m", "kvpool_master.cli"])
    if default_ports:
        command += ["--host", HOST, "--port", "0", "--fast-port", "0", "--metrics-port", "0"]
    command += ["--ready-file", str(ready_path)]
    for name, value in flags.items():
        command += [f"--{name.replace('_', '-')}", str(value)]
    command += list(args)
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_MASTER_")}
    full_env.update(env or {})
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=full_env,
                                stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ready_path.exists():
            try:
                ready = json.loads(ready_path.read_text())
            except ValueError:
                ready = None
            if ready is not None:
                return MasterProcess(proc, ready, log_path, workdir)
        if proc.poll() is not None:
            raise RuntimeError(f"master exited with {proc.returncode} before it was ready:\n"
                               f"{log_path.read_text(errors='replace')}")
        time.sleep(0.02)
    proc.kill()
    proc.wait(10)
    raise RuntimeError(f"master not ready within {timeout_s} s:\n"
                       f"{log_path.read_text(errors='replace')}")


class LeanSocket:
    """A blocking lean-framing connection that sends whatever bytes a test crafts."""

    def __init__(self, port: int, timeout_s: float = 5.0,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        raw = socket.create_connection((HOST, port), timeout=timeout_s)
        self.sock = ssl_context.wrap_socket(raw, server_hostname=HOST) if ssl_context else raw
        self._next_id = 1

    def send_raw(self, data: bytes) -> None:
        """Send bytes as they are."""
        self.sock.sendall(data)

    def send(self, method: int, request_id: int, payload: bytes) -> None:
        """Send one well-framed frame."""
        self.send_raw(struct.pack("<IBI", len(payload) + 5, method, request_id) + payload)

    def _recv_exact(self, size: int) -> bytes:
        chunks = []
        while size:
            chunk = self.sock.recv(min(size, 1 << 20))
            if not chunk:
                raise ConnectionError("lean connection closed by the master")
            chunks.append(chunk)
            size -= len(chunk)
        return b"".join(chunks)

    def recv(self) -> tuple[int, int, bytes]:
        """Read one frame: (method, request_id, payload)."""
        (length,) = struct.unpack("<I", self._recv_exact(4))
        body = self._recv_exact(length)
        method, request_id = struct.unpack_from("<BI", body)
        return method, request_id, body[5:]

    def call(self, method: int, payload: bytes) -> tuple[int, bytes]:
        """Send one frame and read its answer: (method, payload)."""
        request_id = self._next_id
        self._next_id += 1
        self.send(method, request_id, payload)
        answer_method, answer_id, answer = self.recv()
        assert answer_id == request_id
        return answer_method, answer

    def close(self) -> None:
        """Close the socket."""
        self.sock.close()


class StartMaster(Protocol):
    def __call__(self, *args: str, env: dict[str, str] | None = None,
                 executable: Sequence[str] | None = None, timeout_s: float = 30.0,
                 default_ports: bool = True, **flags: Any) -> MasterProcess: ...


@pytest.fixture
def start_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StartMaster]:
    """Factory of master processes; each is stopped by pid at the end of the test."""
    started: list[MasterProcess] = []
    workdir = tmp_path_factory.mktemp("master")

    def start(*args: str, env: dict[str, str] | None = None,
              executable: Sequence[str] | None = None, timeout_s: float = 30.0,
              default_ports: bool = True, **flags: Any) -> MasterProcess:
        process = launch_master(workdir, *args, env=env, executable=executable,
                                timeout_s=timeout_s, default_ports=default_ports, **flags)
        started.append(process)
        return process

    try:
        yield start
    finally:
        for process in started:
            if process.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGCONT)  # in case a test left it stopped
                process.stop(timeout_s=10)
            for partition in process.partitions[1:]:   # they stop with partition 0; if not:
                stop_pid(int(partition["pid"]), timeout_s=15)


@pytest.fixture
def lean_socket() -> Iterator[Any]:
    """Factory of raw lean-framing connections, closed at the end of the test."""
    opened: list[LeanSocket] = []

    def connect(port: int, timeout_s: float = 5.0,
                ssl_context: ssl.SSLContext | None = None) -> LeanSocket:
        conn = LeanSocket(port, timeout_s, ssl_context)
        opened.append(conn)
        return conn

    try:
        yield connect
    finally:
        for conn in opened:
            conn.close()


@pytest.fixture
def master(start_master: StartMaster) -> MasterProcess:
    """A master with default settings on 127.0.0.1 (ephemeral ports)."""
    return start_master()


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A throwaway CA, a server certificate for 127.0.0.1 and a client certificate (paths)."""
    import shutil

    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI missing")
    d = tmp_path_factory.mktemp("pki")

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out",
            "ca.crt", "-days", "2", "-subj", "/CN=kvpool-test-ca")
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1,DNS:localhost"),
                      ("client", "extendedKeyUsage=clientAuth")):
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out",
                f"{name}.csr", "-subj", f"/CN=kvpool-{name}")
        (d / f"{name}.ext").write_text(ext + "\n")
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                "-CAcreateserial", "-out", f"{name}.crt", "-days", "2", "-extfile",
                f"{name}.ext")
    return {n: str(d / n) for n in ("ca.crt", "server.crt", "server.key", "client.crt",
                                    "client.key")}
