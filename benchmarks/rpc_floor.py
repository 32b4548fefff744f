#!/usr/bin/env python3
"""Where a single put or get spends its time: the floor under the sync client's single ops.

Starts its own ``kvpool-master`` on 127.0.0.1 and measures, in one run:

  pingpong  64-byte ping-pong between two Python processes, loopback TCP and a Unix socket;
            on the Unix socket also with the caller, then both sides, polling instead of
            sleeping (what waking a sleeping process costs)
  lean      a raw lean-framing ``Exist`` of one key to the master (blocking socket, no client
            library), over loopback TCP and over the master's abstract Unix socket
  loop      one ``run_until_complete`` of an empty coroutine on a uvloop loop, on the main
            thread and on a worker thread (uvloop sets up signal wake-ups on the main thread),
            and handing an empty coroutine to a loop running on another thread
  client    the sync ``KVPoolClient``: single ``exists``, 4 KiB ``put`` and ``get``, with both
            the client and the master sleeping while they wait (``busy_poll_us`` 0 and
            ``--busy-poll-us 0``) and with the defaults (both poll briefly first)

Each figure is the median of --reps rounds. Every process started here is stopped by pid;
everything stays on 127.0.0.1.

Usage:  python benchmarks/rpc_floor.py [--ops N] [--reps N]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

from kvpool_client.client import KVPoolClient
from kvpool_client.config import ClientConfig
from kvpool_client.loops import LoopThread
from kvpool_client.rpc.endpoints import connect_local
from kvpool_wire._pb import kvpool_pb2 as pb


def per_op_us(fn: Callable[[], None], ops: int, reps: int) -> float:
    rounds = []
    for _ in range(reps):
        started = time.perf_counter()
        for _ in range(ops):
            fn()
        rounds.append((time.perf_counter() - started) / ops * 1e6)
    return statistics.median(rounds)


def pingpong_us(family: int, ops: int, reps: int, caller_polls: bool = False,
                echo_polls: bool = False) -> float:
    """Round trip of 64 bytes to an echoing child process; either side may poll a
    non-blocking socket instead of sleeping in ``recv``."""
    with tempfile.TemporaryDirectory() as tmp:
        if family == socket.AF_INET:
            server = socket.socket()
            server.bind(("127.0.0.1", 0))
        else:
            server = socket.socket(socket.AF_UNIX)
            server.bind(os.path.join(tmp, "echo.sock"))
        server.listen(1)
        address = server.getsockname()
        echo = subprocess.Popen([sys.executable, "-c", _ECHO, str(server.fileno()),
                                 str(int(echo_polls))], pass_fds=(server.fileno(),))
        try:
            sock = socket.socket(family)
            sock.connect(address)
            if family == socket.AF_INET:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            message = b"x" * 64

            def once() -> None:
                sock.sendall(message)
                sock.recv(64)

            def once_polling() -> None:
                sock.sendall(message)
                while True:
                    try:
                        sock.recv(64, socket.MSG_DONTWAIT)
                        return
                    except BlockingIOError:
                        pass

            per_op_us(once, 500, 1)
            result = per_op_us(once_polling if caller_polls else once, ops, reps)
            sock.close()
        finally:
            echo.wait(10)
            server.close()
    return result


_ECHO = """
import socket, sys
server = socket.socket(fileno=int(sys.argv[1]))
conn, _ = server.accept()
if conn.family == socket.AF_INET:
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
flags = socket.MSG_DONTWAIT if sys.argv[2] == "1" else 0
while True:
    try:
        data = conn.recv(64, flags)
    except BlockingIOError:
        continue
    if not data:
        break
    conn.sendall(data)
"""


def lean_exist_us(sock: socket.socket, ops: int, reps: int) -> float:
    payload = pb.ExistRequest(client_id="floor", keys=[b"absent"]).SerializeToString()
    frame = struct.pack("<IBI", len(payload) + 5, pb.METHOD_EXIST, 1) + payload

    def once() -> None:
        sock.sendall(frame)
        sock.recv(65536)

    per_op_us(once, 300, 1)
    return per_op_us(once, ops, reps)


def loop_run_us(ops: int, reps: int) -> tuple[float, float]:
    import uvloop

    async def nothing() -> None:
        return None

    def measure() -> float:
        loop = uvloop.new_event_loop()
        try:
            return per_op_us(lambda: loop.run_until_complete(nothing()), ops, reps)
        finally:
            loop.close()

    on_worker: list[float] = []
    worker = threading.Thread(target=lambda: on_worker.append(measure()))
    worker.start()
    worker.join()
    return measure(), on_worker[0]


def handoff_us(ops: int, reps: int) -> float:
    """What every call cost when the sync client handed it to a loop thread."""
    thread = LoopThread("rpc-floor-handoff")

    async def nothing() -> None:
        return None

    try:
        return per_op_us(lambda: thread.run(nothing()), ops, reps)
    finally:
        thread.stop()


def start_master(workdir: str, name: str, *extra: str) -> tuple[subprocess.Popen[bytes],
                                                                 dict[str, int]]:
    """A master on 127.0.0.1 with free ports; returns the process and its ready file."""
    ready = os.path.join(workdir, f"{name}.json")
    master = subprocess.Popen(
        [sys.executable, "-m", "kvpool_master.cli", "--host", "127.0.0.1", "--port", "0",
         "--fast-port", "0", "--metrics-port", "-1", "--log-level", "warning",
         "--ready-file", ready, *extra], stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while not os.path.exists(ready):
        if master.poll() is not None or time.monotonic() > deadline:
            master.kill()
            raise RuntimeError("kvpool-master did not start")
        time.sleep(0.05)
    time.sleep(0.05)
    with open(ready) as f:
        return master, json.load(f)


def raw_exist_rows(ports: dict[str, int], ops: int, reps: int,
                   what: str) -> list[tuple[str, float]]:
    tcp = socket.create_connection(("127.0.0.1", ports["fast_port"]))
    tcp.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    register = pb.RegisterClientRequest(client_id="floor", host_id="floor")
    body = register.SerializeToString()
    tcp.sendall(struct.pack("<IBI", len(body) + 5, pb.METHOD_REGISTER_CLIENT, 1) + body)
    reply = pb.RegisterClientResponse.FromString(tcp.recv(65536)[9:])
    rows = [(f"raw lean Exist, loopback TCP, {what}", lean_exist_us(tcp, ops, reps))]
    local = connect_local(reply.fast_socket, reply.master_pid)
    if local is not None:
        local.setblocking(True)
        rows.append((f"raw lean Exist, Unix socket, {what}", lean_exist_us(local, ops, reps)))
        local.close()
    tcp.close()
    return rows


def client_rows(ports: dict[str, int], busy_poll_us: int, ops: int, reps: int,
                what: str) -> list[tuple[str, float]]:
    config = ClientConfig.from_dict({"master_server_address": f"127.0.0.1:{ports['grpc_port']}",
                                     "global_segment_size": "64mb",
                                     "busy_poll_us": busy_poll_us})
    with KVPoolClient(config) as client:
        data = os.urandom(4096)
        counter = iter(range(10**9))
        keys: list[str] = []

        def put() -> None:
            keys.append(f"floor-{next(counter)}")
            client.put(keys[-1], data)

        rows = [(f"KVPoolClient.put 4 KiB, {what}", per_op_us(put, ops, reps))]
        reads = iter(keys * 2)
        rows.append((f"KVPoolClient.get 4 KiB, {what}",
                     per_op_us(lambda: client.get(next(reads)), ops, reps)))
        rows.append((f"KVPoolClient.exists, {what}",
                     per_op_us(lambda: client.exists("floor-0"), ops, reps)))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    ops, reps = args.ops, args.reps
    workdir = tempfile.mkdtemp(prefix="kvpool-rpc-floor-")
    masters: list[subprocess.Popen[bytes]] = []
    try:
        rows: list[tuple[str, float]] = [
            ("ping-pong 64 B, loopback TCP", pingpong_us(socket.AF_INET, ops, reps)),
            ("ping-pong 64 B, Unix socket", pingpong_us(socket.AF_UNIX, ops, reps)),
            ("ping-pong 64 B, Unix socket, caller polls",
             pingpong_us(socket.AF_UNIX, ops, reps, caller_polls=True)),
            ("ping-pong 64 B, Unix socket, both poll",
             pingpong_us(socket.AF_UNIX, ops, reps, caller_polls=True, echo_polls=True)),
        ]
        sleeping, sleeping_ports = start_master(workdir, "sleeping", "--busy-poll-us", "0")
        masters.append(sleeping)
        polling, polling_ports = start_master(workdir, "polling")
        masters.append(polling)
        rows += raw_exist_rows(sleeping_ports, ops, reps, "master sleeps")
        rows += raw_exist_rows(polling_ports, ops, reps, "master polls")
        main_us, worker_us = loop_run_us(ops, reps)
        rows += [("uvloop run_until_complete, main thread", main_us),
                 ("uvloop run_until_complete, worker thread", worker_us),
                 ("handoff of an empty coroutine to a loop thread", handoff_us(ops, reps))]
        rows += client_rows(sleeping_ports, 0, ops, reps, "both sleep")
        rows += client_rows(polling_ports, ClientConfig().busy_poll_us, ops, reps,
                            "both poll (defaults)")
    finally:
        for master in masters:
            master.terminate()
            master.wait(10)
    print(f"rpc floor: {ops} ops per round, median of {reps} rounds, "
          f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}")
    for name, value in rows:
        print(f"  {name:<54} {value:8.1f} us  ({1e6 / value:8.0f} /s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
