"""Running a partitioned master: partition 0 starts the others and watches them
(README, "Partitions").

Rules of this file:
- The process an operator starts with ``--partitions N`` is partition 0: it listens where
  its settings say, draws the shared terms (``partition.py``), and starts partitions 1..N-1
  as child processes (``python -m kvpool_master.partitioned``) with the same settings but
  free gRPC and lean ports, metrics at ``--metrics-port + index`` and no ready file. A child
  reads its settings and terms as one JSON line on stdin (the secret never shows in a
  process listing or environment) and answers one JSON line on stdout once it serves.
- Partition 0 answers registrations only once every partition serves (UNAVAILABLE before,
  which clients retry), with the map of all of them; then it writes the ready file, which
  lists every partition's ports and pid.
- The partitions are one service: when a child exits, partition 0 stops and exits 1 (the
  service manager restarts the whole master, with a new epoch, as after any restart); when
  partition 0 stops, it closes the children's stdin, on which each stops (also when partition
  0 was killed), and kills those still running after the shutdown grace.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import sys
from typing import Any

from kvpool_master.cli import setup_logging
from kvpool_master.config import MasterConfig
from kvpool_master.partition import PartitionTerms, claim_state_dir
from kvpool_master.server import SHUTDOWN_GRACE_S, MasterServer, raise_open_files_limit
from kvpool_wire.partitions import PartitionEndpoint

log = logging.getLogger("kvpool.master")

#: How long partition 0 waits for a child to serve (a restore of its share included).
CHILD_START_TIMEOUT_S = 600.0


class _Child:
    """One started partition: its process, and what it said once it served."""

    def __init__(self, index: int, process: asyncio.subprocess.Process) -> None:
        self.index = index
        self.process = process
        self.ready: dict[str, Any] = {}

    async def serving(self) -> dict[str, Any]:
        """The child's ready line; RuntimeError when it exits or says nothing sensible."""
        assert self.process.stdout is not None
        line = await self.process.stdout.readline()
        try:
            ready: dict[str, Any] = json.loads(line)
            _endpoint(ready)
        except (ValueError, KeyError, TypeError):
            code = await self.process.wait()
            raise RuntimeError(f"partition {self.index} did not start (exit code {code}); "
                               "its log says why") from None
        self.ready = ready
        return ready

    async def stop(self) -> None:
        """Close its stdin (it stops), wait the shutdown grace, then kill it."""
        process = self.process
        if process.stdin is not None and not process.stdin.is_closing():
            process.stdin.close()
        try:
            await asyncio.wait_for(process.wait(), SHUTDOWN_GRACE_S + 5)
        except asyncio.TimeoutError:
            log.error("partition %d did not stop in time: killed", self.index)
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()


def child_config(config: MasterConfig, index: int) -> MasterConfig:
    """The settings of partition ``index`` (> 0), from partition 0's."""
    metrics_port = config.metrics_port + index if config.metrics_port > 0 else \
        config.metrics_port
    base = config.partition_ports + 2 * (index - 1) if config.partition_ports else 0
    return dataclasses.replace(config, port=base,
                               fast_port=(base + 1 if base else 0) if config.fast_port >= 0
                               else -1,
                               metrics_port=metrics_port, ready_file="", config="")


async def _start_child(config: MasterConfig, terms: PartitionTerms) -> _Child:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvpool_master.partitioned", stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE)
    assert process.stdin is not None
    settings = dataclasses.asdict(child_config(config, terms.index))
    process.stdin.write(json.dumps({
        "settings": settings, "index": terms.index, "count": terms.count,
        "secret": terms.secret.hex(), "epoch": terms.epoch,
        "clock_origin_s": terms.clock_origin_s}).encode() + b"\n")
    await process.stdin.drain()
    return _Child(terms.index, process)


async def run_partitioned(config: MasterConfig) -> int:
    """Run partition 0 and the others until SIGTERM/SIGINT or a partition's exit; return the
    exit code."""
    claim_state_dir(config.state_dir, config.partitions)
    terms = PartitionTerms.drawn(config.partitions)
    children: list[_Child] = []
    server: MasterServer | None = None
    served = False
    try:
        for partition in terms[1:]:
            children.append(await _start_child(config, partition))
        server = MasterServer(config, terms[0])
        await server.start()
        readies = await asyncio.wait_for(asyncio.gather(*(c.serving() for c in children)),
                                         CHILD_START_TIMEOUT_S)
        every = [_serving(server), *readies]
        server.servicer.partition_map = tuple(map(_endpoint, every))
        server.write_ready_file(every)
        log.info("all %d partitions serving", config.partitions)
        cores = len(os.sched_getaffinity(0))
        if config.partitions > cores:
            log.warning("%d partitions on %d core(s): they take turns on the cores, and each "
                        "busy-polls after it answers; partitions pay when each has a core of "
                        "its own (README, \"Partitions\")", config.partitions, cores)
        exited: list[int] = []

        async def watch(child: _Child) -> None:
            code = await child.process.wait()
            if code:
                exited.append(child.index)
            log.log(logging.ERROR if code else logging.INFO,
                    "partition %d exited (code %s): stopping the master", child.index, code)
            assert server is not None
            server.request_stop()
        watchers = [asyncio.get_running_loop().create_task(watch(c)) for c in children]
        served = True
        await server.serve_until_stopped()
        for task in watchers:
            task.cancel()
        return 1 if exited else 0
    finally:
        if server is not None and not served:
            await server.stop()
        await asyncio.gather(*(c.stop() for c in children))


def _serving(server: MasterServer) -> dict[str, Any]:
    """Where a partition serves: its line to partition 0 and its entry in the ready file."""
    return {"grpc_port": server.grpc_port, "fast_port": server.fast_port,
            "fast_socket": server.servicer.fast_socket, "metrics_port": server.metrics_port,
            "pid": os.getpid()}


def _endpoint(serving: dict[str, Any]) -> PartitionEndpoint:
    """The map's entry of a partition serving as ``serving`` says (``_serving``)."""
    return PartitionEndpoint(int(serving["grpc_port"]), int(serving["fast_port"]),
                             str(serving["fast_socket"]), int(serving["pid"]))


async def _serve_child(config: MasterConfig, terms: PartitionTerms) -> int:
    server = MasterServer(config, terms)
    await server.start()
    sys.stdout.write(json.dumps(_serving(server)) + "\n")
    sys.stdout.flush()
    loop = asyncio.get_running_loop()

    def on_stdin() -> None:  # partition 0 closed it, or died
        if not os.read(sys.stdin.fileno(), 4096):
            loop.remove_reader(sys.stdin.fileno())
            server.request_stop()
    loop.add_reader(sys.stdin.fileno(), on_stdin)
    await server.serve_until_stopped()
    return 0


def main() -> int:
    """A partition started by partition 0 (see the module rules)."""
    line = sys.stdin.buffer.readline()
    try:
        given = json.loads(line)
        config = MasterConfig(**given["settings"])
        terms = PartitionTerms(int(given["index"]), int(given["count"]),
                               bytes.fromhex(given["secret"]), int(given["epoch"]),
                               float(given["clock_origin_s"]))
    except (ValueError, KeyError, TypeError) as exc:
        print(f"kvpool-master partition: bad start line from partition 0: {exc}",
              file=sys.stderr)
        return 2
    setup_logging(config.log_level, terms.index)
    raise_open_files_limit(config.max_connections)
    try:
        import uvloop
        return int(uvloop.run(_serve_child(config, terms)))
    except (OSError, RuntimeError) as exc:
        print(f"kvpool-master partition {terms.index}: cannot start: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
