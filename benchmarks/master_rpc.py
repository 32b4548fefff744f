"""Master RPC latency and throughput on loopback against a real `kvpool-master` process.

Measures, over gRPC and over the lean framing, through the client stub (``MasterRpc``):
- single-key ``Exist``: p50 / p99 latency of sequential calls;
- batched ``Exist`` with 1,000 keys per call: keys/s, one call at a time and with a few calls
  in flight (pipelined on the one lean connection / multiplexed on the gRPC channel);
- batched ``GetReplicas`` (a signed capability per key) and ``PutStart`` + ``PutEnd`` with
  1,000 keys per call, one call at a time: keys/s, decoding the answers included;
- in process, before the master starts: what serving ``PutStart`` + ``PutEnd`` of 512 keys
  costs the master per key (``Servicer.serve``: request, core, answer; no transport), of
  fresh keys and with the first 64 of each call in the pool already, and what serving a
  512-key ``GetReplicas`` under the reader's own leases costs;
  the master's encoding and the client's decoding of a
  512-key ``GetReplicas`` answer, per key, nested (a ``Replicas`` per key) and as ``Columns``
  (capabilities given, not signed), and decoding a ``PutStart`` request of 16,384 keys (one
  call at the master's default ``max_batch_keys``, decoded whole on its loop).
Targets: batched >= 1,000,000 keys/s, single p50 <= 150 µs.

``--puts-only`` measures only the lean puts (one and two in flight, ``--seconds`` each and no
cap on keys); ``--state-dir`` starts the master with a fresh state directory,
``--partitions N`` with N partitions (the client splits each call among them).
``--blocking-batches`` measures only the blocking stub's 32-key ``Exist`` and
``GetReplicas`` (what a synchronous engine call makes): with ``--partitions``, a batch's calls
to every partition sent together (the stub as it is) against the same stub taking each
partition's answer before it sends the next call, alternated round by round.

    .venv/bin/python benchmarks/master_rpc.py [--seconds 2] [--json out.json]
    .venv/bin/python benchmarks/master_rpc.py --puts-only --seconds 8 [--state-dir]
        [--partitions 2]
    .venv/bin/python benchmarks/master_rpc.py --blocking-batches --partitions 4
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import uvloop

from kvpool_client.rpc import BlockingMasterRpc, MasterRpc
from kvpool_master.clock import ServingClock
from kvpool_master.core.master import CoreConfig, MasterCore
from kvpool_master.rpc.servicer import STEP_KEYS, Servicer
from kvpool_wire import calls, capability, convert
from kvpool_wire._pb import kvpool_pb2 as pb
from kvpool_wire.status import Status
from kvpool_wire.types import (
    ClientId,
    Extent,
    Op,
    PutOptions,
    ReadResult,
    SegmentId,
    SegmentInfo,
)

BATCH_KEYS = 1000
TARGET_KEYS_PER_S = 1_000_000
TARGET_P50_US = 150.0


def start_master(workdir: Path, *flags: str) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    ready = workdir / "ready.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvpool_master.cli", "--host", "127.0.0.1", "--port", "0",
         "--fast-port", "0", "--metrics-port", "0", "--ready-file", str(ready),
         "--log-level", "warning", *flags], stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if ready.exists():
            return proc, json.loads(ready.read_text())
        if proc.poll() is not None:
            raise SystemExit(f"master exited with {proc.returncode}")
        time.sleep(0.02)
    proc.kill()
    raise SystemExit("master not ready in 30 s")


async def populate(address: str, keys: list[bytes]) -> MasterRpc:
    """Register the owner of the objects and put ``keys``; the owner must keep heartbeating."""
    rpc = MasterRpc(address)
    await rpc.register_client("bench", "bench-host", "")
    segment = SegmentInfo(SegmentId("bench-seg"), ClientId("bench"), 1 << 30)
    assert await rpc.mount_segment("bench", segment) == Status.OK
    for i in range(0, len(keys), BATCH_KEYS):
        chunk = keys[i:i + BATCH_KEYS]
        started = await rpc.put_start("bench", chunk, [4096] * len(chunk), PutOptions())
        assert all(s == Status.OK for s, _ in started)
        assert all(s == Status.OK for s in await rpc.put_end("bench", chunk))
    return rpc


async def heartbeat_forever(rpc: MasterRpc, client_id: str) -> None:
    """Keep ``client_id`` alive through measurements longer than the master's client TTL."""
    while True:
        await asyncio.sleep(1.0)
        assert await rpc.heartbeat(client_id) == Status.OK

async def single_latency(rpc: MasterRpc, key: bytes, seconds: float) -> dict[str, float]:
    for _ in range(200):  # warm up connection, caches
        await rpc.exist("bench", [key])
    samples = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end and len(samples) < 200_000:
        t0 = time.perf_counter()
        statuses, _ = await rpc.exist("bench", [key])
        samples.append(time.perf_counter() - t0)
    assert statuses == [Status.OK], statuses
    samples.sort()
    return {"calls": len(samples),
            "p50_us": samples[len(samples) // 2] * 1e6,
            "p99_us": samples[int(len(samples) * 0.99)] * 1e6,
            "mean_us": statistics.fmean(samples) * 1e6}


async def batched_throughput(rpc: MasterRpc, keys: list[bytes], seconds: float,
                             in_flight: int) -> dict[str, float]:
    batches = [keys[i:i + BATCH_KEYS] for i in range(0, len(keys), BATCH_KEYS)]
    await rpc.exist("bench", batches[0])
    done_keys = 0
    end = time.perf_counter() + seconds

    async def worker(offset: int) -> None:
        nonlocal done_keys
        i = offset
        while time.perf_counter() < end:
            statuses, _ = await rpc.exist("bench", batches[i % len(batches)])
            done_keys += len(statuses)
            i += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(in_flight)))
    elapsed_s = time.perf_counter() - t0
    return {"in_flight": in_flight, "keys_per_s": done_keys / elapsed_s}


async def batched_reads_and_puts(rpc: MasterRpc, name: str, keys: list[bytes],
                                 seconds: float) -> dict[str, float]:
    """Keys/s of 1,000-key ``GetReplicas`` over ``keys``, one call at a time, and of 1,000-key
    ``PutStart`` + ``PutEnd`` of fresh keys (at most 100 k of them a measurement) with one
    and with two puts in flight (the second: what the master carries while the client
    encodes and decodes another put, on another core)."""
    batches = [keys[i:i + BATCH_KEYS] for i in range(0, len(keys), BATCH_KEYS)]
    read_keys = 0
    t0 = time.perf_counter()
    while time.perf_counter() < t0 + seconds:
        answer = await rpc.get_replicas(name, batches[read_keys // BATCH_KEYS % len(batches)])
        read_keys += len(answer.results)
    read_s = time.perf_counter() - t0
    return {"get_replicas_keys_per_s": read_keys / read_s,
            "puts_keys_per_s": await put_throughput(rpc, name, seconds, 1),
            "puts_2_in_flight_keys_per_s": await put_throughput(rpc, name, seconds, 2)}


async def put_throughput(rpc: MasterRpc, name: str, seconds: float, in_flight: int,
                         max_keys: int = 100_000) -> float:
    """Keys/s of 1,000-key ``PutStart`` + ``PutEnd`` of fresh keys, ``in_flight`` puts at a
    time, for ``seconds`` or ``max_keys`` keys."""
    put_keys = 0
    end = time.perf_counter() + seconds

    async def worker(w: int) -> None:
        nonlocal put_keys
        while time.perf_counter() < end and put_keys < max_keys:
            fresh = [b"%s-put%d-%d-%08d" % (name.encode(), in_flight, w, put_keys + i)
                     for i in range(BATCH_KEYS)]
            put_keys += BATCH_KEYS
            started = await rpc.put_start(name, fresh, [4096] * BATCH_KEYS, PutOptions())
            assert all(s == Status.OK for s, _ in started)
            assert all(s == Status.OK for s in await rpc.put_end(name, fresh))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(in_flight)))
    return put_keys / (time.perf_counter() - t0)


def best_s(work: Any, repeats: int = 7, rounds: int = 50) -> float:
    """The best of ``repeats`` averages of ``rounds`` runs of ``work()``, in seconds."""
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(rounds):
            work()
        best = min(best, (time.perf_counter() - started) / rounds)
    return best


def answer_forms() -> dict[str, float]:
    """µs per key to encode (master) and decode (client) a 512-key ``GetReplicas`` answer in
    either form and to sign its capabilities (8 segments), and ms to decode a 16,384-key
    ``PutStart`` request."""
    num_keys = 512
    results = [ReadResult(0, 65536, (Extent(SegmentId(f"seg-{i % 8}"), i * 65536, 65536),), i)
               for i in range(num_keys)]
    signed = b"c" * 16
    figures: dict[str, float] = {}
    call = calls.get_replicas("bench", [b"k"] * num_keys)
    for form, columns in (("nested", False), ("columns", True)):
        def encode(columns: bool = columns) -> bytes:
            return convert.encode_get_replicas(results, 5.0, 1000, lambda _: signed, 7,
                                               columns).SerializeToString()
        raw = encode()
        figures[f"{form}_encode_us"] = best_s(encode) / num_keys * 1e6
        figures[f"{form}_decode_us"] = best_s(
            lambda raw=raw: call.decode(pb.GetReplicasResponse.FromString(raw))) / num_keys * 1e6
    extents = [r.placements[0] for r in results]
    figures["sign_us"] = best_s(lambda: list(map(capability.extent_signer(
        lambda _: b"k" * capability.KEY_BYTES, Op.READ, 1000, 7), extents))) / num_keys * 1e6
    offsets = [e.offset for e in extents]
    figures["sign_run_us"] = best_s(lambda: capability.run_signer(
        lambda _: b"k" * capability.KEY_BYTES, Op.WRITE, 1000, 7, 3)(
            SegmentId("seg-0"), offsets, 65536)) / num_keys * 1e6
    keys = [b"%064x" % i for i in range(16_384)]
    request = pb.PutStartRequest(client_id="bench", keys=keys, sizes_bytes=[65536] * len(keys),
                                 parent_keys=keys).SerializeToString()
    figures["put_start_16k_decode_ms"] = best_s(
        lambda: convert.decode_put_start(pb.PutStartRequest.FromString(request)), rounds=5) * 1e3
    return figures


#: Keys of each call that the second served-puts line finds in the pool already.
PRESENT_KEYS = 64


def served_puts(prefill_keys: int = 200_000, call_keys: int = 512,
                rounds: int = 400, present_keys: int = 0) -> dict[str, float]:
    """µs per key the master spends serving ``PutStart`` and ``PutEnd`` of fresh 64 KiB
    objects (``Servicer.serve`` in process: the request parsed, the core's work, the answer
    signed and encoded, as columns), ``call_keys`` keys a call, into a table of
    ``prefill_keys`` objects; the collector run as the master's tick runs it (see
    ``_serve_rounds``). With ``present_keys``, each call's first keys are objects the table
    has (a chain whose first blocks the pool holds): they answer ALREADY_EXISTS, and the
    commit names only the others, as a client's does; the figures stay per key of the
    call."""
    if call_keys > STEP_KEYS or present_keys * rounds > prefill_keys - prefill_keys % call_keys:
        raise ValueError("calls of at most STEP_KEYS keys; present keys need a prefill of "
                         "present_keys x rounds objects")
    servicer, token = _served_master(prefill_keys, call_keys)
    work = []
    for r in range(rounds):
        old = [_key(i) for i in range(r * present_keys, (r + 1) * present_keys)]
        first = prefill_keys + r * (call_keys - present_keys)
        fresh = [_key(i) for i in range(first, first + call_keys - present_keys)]
        work.append([_payload(calls.put_start("bench", token, old + fresh,
                                              [65536] * call_keys, PutOptions())),
                     _payload(calls.put_end("bench", token, fresh))])
    (start_s, end_s), gc_s = _serve_rounds(servicer, work, call_keys)
    served = call_keys * rounds
    return {"served_objects": prefill_keys, "served_put_start_us": start_s / served * 1e6,
            "served_put_end_us": end_s / served * 1e6,
            "served_collector_us": gc_s / served * 1e6}


def served_reads(objects: int = 200_000, call_keys: int = 512,
                 rounds: int = 400) -> dict[str, float]:
    """µs per key the master spends serving ``GetReplicas`` (``Servicer.serve`` in process,
    as ``served_puts``) of ``call_keys`` distinct random keys a call, under the reader's own
    leases, from a table of ``objects`` 64 KiB objects; the collector run as in
    ``served_puts``."""
    servicer, token = _served_master(objects, call_keys)
    rng = random.Random(7)
    work = []
    served = 0
    for _ in range(rounds):
        keys = list(dict.fromkeys(_key(rng.randrange(objects)) for _ in range(call_keys)))
        work.append([_payload(calls.get_replicas("bench", keys, token))])
        served += len(keys)
    (read_s,), gc_s = _serve_rounds(servicer, work, call_keys)
    return {"served_read_objects": objects, "served_read_us": read_s / served * 1e6,
            "served_read_collector_us": gc_s / served * 1e6}


def _key(i: int) -> bytes:
    """The ``i``-th key the served lines use."""
    return b"%064x" % i


def _payload(call: calls.Call[Any]) -> tuple[Any, bytes]:
    """The method and request bytes of ``call``."""
    return call.method, call.request.SerializeToString()


def _served_master(objects: int, call_keys: int) -> tuple[Servicer, bytes]:
    """A servicer on a core without per-object events (as a master without --state-dir),
    with the client "bench" registered and a 1 TiB segment of its mounted, holding the
    ``objects`` 64 KiB objects of keys ``_key(0)`` on, put and committed in ``call_keys``-key
    calls (each served in one step); and the client's token."""
    core = MasterCore(CoreConfig())
    core.skip_object_events()
    servicer = Servicer(core, ServingClock(), _NoMetrics(), master_id="bench",
                        on_events=lambda events: True, status_document=lambda: iter(["{}"]))

    def serve(call: calls.Call[Any]) -> Any:
        answer = servicer.serve(call.method, call.request.SerializeToString(), "lean")
        return call.decode(call.method.response_type.FromString(answer))

    token: bytes = serve(calls.register_client("bench", "h", "", b"")).client_token
    assert serve(calls.mount_segment("bench", token, SegmentInfo(
        SegmentId("seg"), ClientId("bench"), 1 << 40))) == Status.OK
    for start in range(0, objects - objects % call_keys, call_keys):
        keys = [_key(i) for i in range(start, start + call_keys)]
        for call in (calls.put_start("bench", token, keys, [65536] * call_keys, PutOptions()),
                     calls.put_end("bench", token, keys)):
            assert isinstance(servicer.serve(*_payload(call), "lean"), bytes)  # one step
    return servicer, token


def _serve_rounds(servicer: Servicer, rounds: list[list[tuple[Any, bytes]]],
                  call_keys: int) -> tuple[list[float], float]:
    """Serve each round's calls in turn (each answered in one step); return the seconds
    spent on the calls at each position of a round, summed over the rounds, and on the
    collector, run as the master's tick runs it: a full collection and a freeze every
    18 k keys (about what a tick sees at this rate), counted apart."""
    gc.collect()
    gc.freeze()
    spent = [0.0] * len(rounds[0])
    gc_s = 0.0
    tick_rounds = max(1, 18_000 // call_keys)
    for i, work in enumerate(rounds):
        for position, (method, payload) in enumerate(work):
            started = time.perf_counter()
            assert isinstance(servicer.serve(method, payload, "lean"), bytes)
            spent[position] += time.perf_counter() - started
        if i % tick_rounds == tick_rounds - 1:
            started = time.perf_counter()
            gc.collect()
            gc.freeze()
            gc_s += time.perf_counter() - started
    return spent, gc_s


class _NoMetrics:
    def rpc_done(self, method: str, transport: str, duration_s: float, failed: bool) -> None:
        pass


async def run_puts(address: str, seconds: float,
                   master_pids: list[int] | None = None) -> dict[str, float]:
    """Only puts, over the lean framing: keys/s of 1,000-key ``PutStart`` + ``PutEnd`` of
    fresh 4 KiB objects for ``seconds`` each, one and two calls in flight, into a segment
    large enough that nothing is evicted (the master only counts its bytes); with
    ``master_pids`` (the master's processes: every partition's), also the CPU seconds they
    and this process spent per million keys, from /proc."""
    name = "bench-putter"
    rpc = MasterRpc(address, use_fast_path=True, timeout_s=30)
    await rpc.register_client(name, "bench-host", "")
    segment = SegmentInfo(SegmentId(name + "-seg"), ClientId(name), 1 << 40)
    assert await rpc.mount_segment(name, segment) == Status.OK
    beating = asyncio.get_running_loop().create_task(heartbeat_forever(rpc, name))
    figures: dict[str, float] = {}
    for in_flight in (1, 2):
        masters_s, mine_s = _cpu_s(master_pids or []), _cpu_s([os.getpid()])
        started = time.perf_counter()
        rate = await put_throughput(rpc, name, seconds, in_flight, max_keys=1 << 62)
        millions = rate * (time.perf_counter() - started) / 1e6
        figures[f"puts_{in_flight}_in_flight_keys_per_s"] = rate
        if master_pids:
            figures[f"puts_{in_flight}_master_cpu_s_per_m_keys"] = \
                (_cpu_s(master_pids) - masters_s) / millions
            figures[f"puts_{in_flight}_client_cpu_s_per_m_keys"] = \
                (_cpu_s([os.getpid()]) - mine_s) / millions
    beating.cancel()
    await rpc.close()
    return figures


class _OneAfterAnother(BlockingMasterRpc):
    """The blocking stub taking each partition's answer before it sends the next call (its
    own sending and answering, in the other order)."""

    def _run_parts(self, parts: list[Any], join: Any) -> Any:
        return join([self._finish_part(call, self._send_part(partition, call))
                     for partition, call in parts])


def run_blocking_batches(address: str, seconds: float, rounds: int = 6,
                         batch_keys: int = 32) -> dict[str, list[float]]:
    """µs per 32-key ``Exist`` and ``GetReplicas`` of the blocking stub, parts sent together
    ("together") and one after another ("in_turn"), ``rounds`` of ``seconds / 2`` each per
    call and way, the ways taking turns to go first."""
    name = "bench-blocking"
    owner = BlockingMasterRpc(address, timeout_s=30)
    owner.register_client(name, "bench-host", "")
    assert owner.mount_segment(name, SegmentInfo(SegmentId(name + "-seg"), ClientId(name),
                                                 1 << 30)) == Status.OK
    keys = [b"blocking-%04d" % i for i in range(batch_keys)]
    started = owner.put_start(name, keys, [4096] * batch_keys, PutOptions())
    assert [status for status, _ in started] == [Status.OK] * batch_keys
    assert owner.put_end(name, keys) == [Status.OK] * batch_keys
    stubs = {"together": owner,
             "in_turn": _OneAfterAnother(address, timeout_s=30, session=owner.session)}
    figures: dict[str, list[float]] = {f"{way}_{call}_us": [] for way in stubs
                                       for call in ("exist", "get_replicas")}
    for round_index in range(rounds):
        ways = list(stubs.items()) if round_index % 2 == 0 else list(stubs.items())[::-1]
        for way, stub in ways:
            for call, work in (("exist", lambda s=stub: s.exist(name, keys)),
                               ("get_replicas", lambda s=stub: s.get_replicas(name, keys))):
                calls_made = 0
                started_s = time.perf_counter()
                while time.perf_counter() - started_s < seconds / 2:
                    work()
                    calls_made += 1
                figures[f"{way}_{call}_us"].append(
                    (time.perf_counter() - started_s) / calls_made * 1e6)
        owner.heartbeat(name)
    for stub in stubs.values():
        stub.close()
    return figures


def _cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds the processes ``pids`` spent so far (Linux /proc)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rpartition(")")[2].split()
        total += int(fields[11]) + int(fields[12])   # utime, stime
    return total / ticks


async def run(address: str, seconds: float, num_keys: int) -> dict[str, Any]:
    keys = [f"bench-key-{i:08d}".encode() for i in range(num_keys)]
    owner = await populate(address, keys)
    beating = asyncio.get_running_loop().create_task(heartbeat_forever(owner, "bench"))
    results: dict[str, Any] = {}
    for transport, fast in (("grpc", False), ("lean", True)):
        rpc = MasterRpc(address, use_fast_path=fast, timeout_s=30)
        await rpc.register_client("bench-reader-" + transport, "bench-host", "")
        name = "bench-reader-" + transport
        segment = SegmentInfo(SegmentId(name + "-seg"), ClientId(name), 1 << 30)
        assert await rpc.mount_segment(name, segment) == Status.OK
        reader_beating = asyncio.get_running_loop().create_task(heartbeat_forever(rpc, name))
        results[transport] = {
            "single_exist": await single_latency(rpc, keys[0], seconds),
            "batched_exist": [await batched_throughput(rpc, keys, seconds, n) for n in (1, 4)],
            "batched_reads_and_puts": await batched_reads_and_puts(rpc, name, keys, seconds),
        }
        reader_beating.cancel()
        assert await rpc.unregister_client(name) == Status.OK
        await rpc.close()
    beating.cancel()
    await owner.close()
    return results


def report(results: dict[str, Any], forms: dict[str, float]) -> None:
    print(f"512-key GetReplicas answer, per key: nested encode {forms['nested_encode_us']:.2f} "
          f"us / decode {forms['nested_decode_us']:.2f} us; columns encode "
          f"{forms['columns_encode_us']:.2f} us / decode {forms['columns_decode_us']:.2f} us; "
          f"signing its capabilities {forms['sign_us']:.2f} us a key (a run of one segment's "
          f"{forms['sign_run_us']:.2f} us); "
          f"a 16,384-key PutStart request decodes in {forms['put_start_16k_decode_ms']:.2f} ms")
    served = (forms["served_put_start_us"] + forms["served_put_end_us"]
              + forms["served_collector_us"])
    print(f"512-key PutStart + PutEnd served in process ({int(forms['served_objects']):,} "
          f"objects), per key: PutStart "
          f"{forms['served_put_start_us']:.2f} us, PutEnd {forms['served_put_end_us']:.2f} us, "
          f"collector {forms['served_collector_us']:.2f} us: {1 / served:.3f} M keys/s")
    present = forms["present"]
    served = (present["served_put_start_us"] + present["served_put_end_us"]
              + present["served_collector_us"])
    print(f"  the same with the first {PRESENT_KEYS} keys of each call in the pool already: "
          f"PutStart {present['served_put_start_us']:.2f} us, PutEnd "
          f"{present['served_put_end_us']:.2f} us a key of the call: {1 / served:.3f} M keys/s")
    read_us = forms["served_read_us"] + forms["served_read_collector_us"]
    print(f"512-key GetReplicas (a reader's leases) served in process "
          f"({int(forms['served_read_objects']):,} objects), per key: "
          f"{forms['served_read_us']:.2f} us, collector {forms['served_read_collector_us']:.2f} "
          f"us: {1 / read_us:.3f} M keys/s")
    for transport, r in results.items():
        single = r["single_exist"]
        print(f"{transport:5s} single Exist: p50 {single['p50_us']:7.1f} us  "
              f"p99 {single['p99_us']:7.1f} us  ({single['calls']} calls)")
        for b in r["batched_exist"]:
            print(f"{transport:5s} batched Exist x{BATCH_KEYS}, {b['in_flight']} in flight: "
                  f"{b['keys_per_s'] / 1e6:6.2f} M keys/s")
        rw = r["batched_reads_and_puts"]
        print(f"{transport:5s} batched GetReplicas x{BATCH_KEYS}: "
              f"{rw['get_replicas_keys_per_s'] / 1e6:6.3f} M keys/s; PutStart + PutEnd "
              f"x{BATCH_KEYS}: {rw['puts_keys_per_s'] / 1e6:6.3f} M keys/s, 2 in flight "
              f"{rw['puts_2_in_flight_keys_per_s'] / 1e6:6.3f} M keys/s")
    best_p50 = min(r["single_exist"]["p50_us"] for r in results.values())
    best_rate = max(b["keys_per_s"] for r in results.values() for b in r["batched_exist"])
    print(f"targets: single p50 <= {TARGET_P50_US:.0f} us -> best {best_p50:.1f} us "
          f"({'met' if best_p50 <= TARGET_P50_US else 'MISSED'}); batched >= "
          f"{TARGET_KEYS_PER_S / 1e6:.1f} M keys/s -> best {best_rate / 1e6:.2f} M keys/s "
          f"({'met' if best_rate >= TARGET_KEYS_PER_S else 'MISSED'})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="per measurement")
    parser.add_argument("--keys", type=int, default=20_000, help="objects in the pool")
    parser.add_argument("--address", default="", help="use a running master instead")
    parser.add_argument("--json", default="", help="also write the figures here")
    parser.add_argument("--served-objects", type=int, default=200_000,
                        help="objects in the table the in-process put line serves into")
    parser.add_argument("--puts-only", action="store_true",
                        help="only the lean puts, for --seconds each, with no cap on keys")
    parser.add_argument("--state-dir", action="store_true",
                        help="the master started here persists into a fresh state directory")
    parser.add_argument("--blocking-batches", action="store_true",
                        help="only the blocking stub's 32-key batches, parts sent together "
                             "against one after another")
    parser.add_argument("--partitions", type=int, default=1,
                        help="start the master with this many partitions (README, "
                             "'Partitions')")
    args = parser.parse_args()
    if not 0 < args.seconds <= 600:
        parser.error("--seconds must be in (0, 600]")
    if (args.state_dir or args.partitions != 1) and args.address:
        parser.error("--state-dir and --partitions apply to the master this starts, not to "
                     "--address")
    if not 1 <= args.partitions <= 64:
        parser.error("--partitions must be in [1, 64]")
    if args.served_objects < 0:
        parser.error("--served-objects must be >= 0")
    in_process = not (args.puts_only or args.blocking_batches)
    forms: dict[str, Any] = {} if not in_process else {   # in process, before any master runs
        **answer_forms(), **served_puts(prefill_keys=args.served_objects),
        **served_reads(max(args.served_objects, 512)),
        "present": served_puts(prefill_keys=max(args.served_objects, 400 * PRESENT_KEYS),
                               present_keys=PRESENT_KEYS)}
    proc = None
    with tempfile.TemporaryDirectory() as tmp:
        address = args.address
        if not address:
            flags = ("--state-dir", str(Path(tmp) / "state")) if args.state_dir else ()
            proc, ready = start_master(Path(tmp), *flags, "--partitions", str(args.partitions))
            address = f"127.0.0.1:{ready['grpc_port']}"
        try:
            pids = [int(p["pid"]) for p in ready.get("partitions", [])] or [ready["pid"]] \
                if proc is not None else None
            if args.blocking_batches:
                results = run_blocking_batches(address, args.seconds)
            else:
                results = uvloop.run(run_puts(address, args.seconds, pids) if args.puts_only
                                     else run(address, args.seconds, args.keys))
        finally:
            if proc is not None:
                os.kill(proc.pid, signal.SIGTERM)
                proc.wait(30)
    if args.blocking_batches:
        for call in ("exist", "get_replicas"):
            together, in_turn = results[f"together_{call}_us"], results[f"in_turn_{call}_us"]
            print(f"blocking stub, 32-key {call} ({args.partitions} partition(s)), µs a call "
                  f"over {len(together)} rounds: parts sent together "
                  f"{min(together):.0f}-{max(together):.0f} (median "
                  f"{statistics.median(together):.0f}), one after another "
                  f"{min(in_turn):.0f}-{max(in_turn):.0f} (median "
                  f"{statistics.median(in_turn):.0f})")
    elif args.puts_only:
        print(f"lean  PutStart + PutEnd x{BATCH_KEYS} for {args.seconds:g} s"
              f"{' (state directory)' if args.state_dir else ''}"
              f"{f', {args.partitions} partitions' if args.partitions > 1 else ''}: "
              f"{results['puts_1_in_flight_keys_per_s'] / 1e6:6.3f} M keys/s, 2 in flight "
              f"{results['puts_2_in_flight_keys_per_s'] / 1e6:6.3f} M keys/s")
        if "puts_2_master_cpu_s_per_m_keys" in results:
            master_s = results["puts_2_master_cpu_s_per_m_keys"]
            print(f"  2 in flight: the master's processes spent {master_s:.2f} CPU s per M keys "
                  f"({1 / master_s:.3f} M keys per CPU second: on {args.partitions} free "
                  f"core(s), one per partition, the master's work allows at most "
                  f"{args.partitions / master_s:.3f} M keys/s), this client "
                  f"{results['puts_2_client_cpu_s_per_m_keys']:.2f} CPU s per M keys")
    else:
        report(results, forms)
    if args.json:
        Path(args.json).write_text(json.dumps({**results, "answer_forms": forms}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
