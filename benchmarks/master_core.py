"""In-process speed and memory of the master core (no RPC).

Prints keys/s for put_start+put_end, get_replicas, exist and query_prefix at batch sizes 1, 32
and 1000; one eviction pass over a full pool; resident memory per million objects; snapshot
and restore times; time to drop a segment; the allocator's fragmentation on a KV-like workload;
placement with up to 50,000 segments, and puts into a segment emptied by single removes; the
cyclic collector's pauses while the table fills, with and without the master's freeze policy;
the longest single step of a table under churn, and of a full pool under put/get churn.

    .venv/bin/python benchmarks/master_core.py            # about 1 min: 200k objects
    .venv/bin/python benchmarks/master_core.py --full     # one million objects (about 2 min)
    .venv/bin/python benchmarks/master_core.py --memory-objects 10000000   # memory, restore
    .venv/bin/python benchmarks/master_core.py --memory-objects 10000000 --keep-state DIR
    .venv/bin/python benchmarks/master_core.py --memory-objects 10000000 --control-seconds 300
    .venv/bin/python benchmarks/master_core.py --memory-objects 10000000 --slow-steps FILE
    .venv/bin/python benchmarks/master_core.py --restore DIR   # restore DIR alone, again
    .venv/bin/python benchmarks/master_core.py --log-batches   # the log's cost by batch size
    .venv/bin/python benchmarks/master_core.py --churn-objects 1000000     # a full pool churns
    .venv/bin/python benchmarks/master_core.py --evicting-objects 1000000  # evicting put steps

Keys are 64-byte hex strings (a sha256 block hash), objects 64 KiB, one replica. Reads are
measured twice: keys drawn at random from the whole table (each lookup misses the CPU caches,
the worst case) and one batch of 1000 keys read again and again (cache-warm, what a hot prefix
sees).
"""

from __future__ import annotations

import argparse
import gc
import operator
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from kvpool_master.core.allocator import Allocator
from kvpool_master.core.master import CoreConfig, MasterCore
from kvpool_master.core.sweeps import SWEEP_SCAN_KEYS
from kvpool_master.persist import StateStore
from kvpool_wire.types import ClientId, ObjectKey, PutOptions, SegmentId, SegmentInfo, Tier

OBJECT_BYTES = 64 << 10
CLIENT = ClientId("bench-client")
OPTIONS = PutOptions()


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def make_core(num_objects: int, fill_ratio: float, num_segments: int = 8) -> MasterCore:
    """A core whose capacity holds ``num_objects`` at ``fill_ratio`` of capacity."""
    core = MasterCore(CoreConfig())
    core.register_client(CLIENT, "bench-host", b"k" * 32, 0.0)
    capacity = int(num_objects * OBJECT_BYTES / fill_ratio)
    per_segment = -(-capacity // num_segments // 4096) * 4096
    for i in range(num_segments):
        core.mount_segment(SegmentInfo(SegmentId(f"seg-{i}"), CLIENT, per_segment), 0.0)
    return core


def keys_of(start: int, count: int) -> list[ObjectKey]:
    return [ObjectKey(b"%064x" % i) for i in range(start, start + count)]


def fill(core: MasterCore, keys: list[ObjectKey], batch: int = 1000, now: float = 1.0,
         chain_length: int = 0, every_batch: Callable[[], object] | None = None,
         on_events: Callable[[list[Any]], object] | None = None) -> None:
    """Put and commit ``keys`` as the RPC layer would: fresh int objects per size, a 64-bit
    checksum per object, and (``chain_length`` > 0) each key's predecessor in its chain as a
    fresh parent-key bytes object, as a decoded request carries them. ``every_batch`` runs
    after each batch; ``on_events`` takes each batch's events (the log's, say)."""
    rng = random.Random(len(keys))
    zero = int("0")
    for i in range(0, len(keys), batch):
        if every_batch is not None:
            every_batch()
        chunk = keys[i:i + batch]
        sizes = [OBJECT_BYTES + zero for _ in chunk]
        checksums = [rng.getrandbits(64) for _ in chunk]
        parents = None
        if chain_length:
            parents = [ObjectKey(bytes(keys[j - 1])) if j % chain_length else ObjectKey(b"")
                       for j in range(i, i + len(chunk))]
        core.put_start(CLIENT, chunk, sizes, OPTIONS, now, parent_keys=parents)
        core.put_end(CLIENT, chunk, now, checksums)
        events = core.take_events()
        if on_events is not None:
            on_events(events)


def rate(label: str, batch: int, run: Callable[[list[ObjectKey]], object],
         batches: list[list[ObjectKey]]) -> None:
    gc.collect()
    total = sum(len(b) for b in batches)
    started = time.perf_counter()
    for chunk in batches:
        run(chunk)
    elapsed = time.perf_counter() - started
    print(f"  {label:<30} batch {batch:>5}: {total / elapsed / 1e6:6.2f} M keys/s"
          f"  ({elapsed / len(batches) * 1e6:8.1f} us/call)")


def bench_ops(num_objects: int) -> None:
    print(f"ops (table of {num_objects:,} READY objects)")
    core = make_core(num_objects + 300_000, 0.5)
    fill(core, keys_of(0, num_objects))
    rng = random.Random(1)
    next_key = num_objects
    for batch in (1, 32, 1000):
        total = 32_000 if batch > 1 else 10_000
        fresh = keys_of(next_key, total)
        next_key += total
        sizes = [OBJECT_BYTES] * batch

        def put(chunk: list[ObjectKey], sizes: list[int] = sizes) -> None:
            core.put_start(CLIENT, chunk, sizes, OPTIONS, 2.0)
            core.put_end(CLIENT, chunk, 2.0)
            core.take_events()

        rate("put_start+put_end", batch, put, [fresh[i:i + batch] for i in range(0, total, batch)])
        if batch > 1:   # a master without --state-dir makes no per-object events
            fresh = keys_of(next_key, total)
            next_key += total
            core.skip_object_events()
            rate("  without object events", batch, put,
                 [fresh[i:i + batch] for i in range(0, total, batch)])
            core.object_events = True
        hits = [ObjectKey(b"%064x" % rng.randrange(num_objects)) for _ in range(total)]
        randoms = [hits[i:i + batch] for i in range(0, total, batch)]
        warm = [keys_of(5000, batch)] * (total // batch)
        rate("get_replicas (random)", batch, lambda c: core.get_replicas(c, 3.0), randoms)
        rate("get_replicas (warm)", batch, lambda c: core.get_replicas(c, 3.0), warm)
        rate("exist (random)", batch, lambda c: core.exist(c, 3.0), randoms)
        rate("exist (warm)", batch, lambda c: core.exist(c, 3.0), warm)
        chain = keys_of(rng.randrange(num_objects - total), total)
        rate("query_prefix (a stored chain)", batch, lambda c: core.query_prefix(c, 3.0),
             [chain[i:i + batch] for i in range(0, total, batch)])
    misses = [keys_of(10**12, 1000)] * 30
    rate("exist (absent keys)", 1000, lambda c: core.exist(c, 4.0), misses)


def bench_memory_and_eviction(num_objects: int, keep_state: str = "",
                              control_seconds: float = 0.0, slow_steps_path: str = "") -> None:
    print(f"memory, eviction, persistence ({num_objects:,} objects in chains of 32 blocks, "
          f"each with its parent key and a 64-bit checksum)")
    gc.collect()
    before = rss_bytes()
    # Capacity such that the table sits exactly at the 95 % high watermark when full.
    core = make_core(num_objects, 0.95)
    fill(core, keys_of(0, num_objects), chain_length=32)
    gc.collect()
    grown = rss_bytes() - before
    stats = core.stats()
    print(f"  RSS {rss_bytes() / 2**20:.0f} MiB in all; growth {grown / 2**20:.0f} MiB for "
          f"{stats.num_objects:,} objects = {grown / stats.num_objects:.0f} B/object "
          f"= {grown / stats.num_objects * 1e6 / 2**20:.0f} MiB per million")
    entry = next(core._objects.entries())
    print(f"  of which one object's own: entry {sys.getsizeof(entry)} B (its first replica "
          f"and recency links included), key {sys.getsizeof(entry.key)} B, offset and checksum "
          f"ints {sys.getsizeof(entry.offset) + sys.getsizeof(entry.checksum)} B; the rest is "
          f"the table's slot")
    started = time.perf_counter()
    gc.collect()
    print(f"  one full gc.collect() with this table alive: "
          f"{(time.perf_counter() - started) * 1e3:.0f} ms (a pause the server can avoid with "
          f"gc.freeze() after start-up)")
    with tempfile.TemporaryDirectory() as scratch:
        state_dir = keep_state or scratch
        store = StateStore(state_dir, fsync="never")
        store.load(MasterCore(CoreConfig()), 0.0)
        started = time.perf_counter()
        store.compact(core)
        elapsed = time.perf_counter() - started
        size = os.path.getsize(os.path.join(state_dir, "snapshot.kvp"))
        store.close()
        print(f"  snapshot (compaction): {elapsed:.2f} s, {size / 2**20:.0f} MiB on disk")
        # in a process of its own, as a master restarts (and its memory is its own)
        subprocess.run([sys.executable, os.path.abspath(__file__), "--restore", state_dir],
                       check=True)
    # Read a tenth of them so the LRU order is not insertion order, then let leases lapse.
    rng = random.Random(2)
    core.get_replicas([ObjectKey(b"%064x" % rng.randrange(num_objects))
                       for _ in range(num_objects // 10)], 5.0)
    core.take_events()
    started = time.perf_counter()
    core.put_start(CLIENT, keys_of(10**12, 1), [OBJECT_BYTES], OPTIONS, 100.0)
    elapsed = time.perf_counter() - started
    evicted = num_objects - core.stats().num_objects
    events = core.take_events()
    print(f"  put_start that crossed the watermark: evicted {evicted:,} objects "
          f"({evicted / num_objects:.1%}) in {elapsed * 1e3:.1f} ms, {len(events):,} events")
    started = time.perf_counter()
    core.unmount_segment(CLIENT, SegmentId("seg-0"), 101.0)
    elapsed = time.perf_counter() - started
    lost = len(core.take_events()) - 1
    steps: list[float] = []
    # each step over 10 ms: its share on the CPU (far less: the host ran something else) and
    # its CLOCK_MONOTONIC window (``--slow-steps``: to find it in a ``perf record -k
    # CLOCK_MONOTONIC`` of this process)
    slow: list[tuple[float, float, float]] = []
    longest_s = longest_cpu_s = 0.0   # and its CPU time
    sweep_started_s = time.monotonic()
    gc.disable()   # the server bounds the collector's pauses on its own (bench_gc_pauses)
    try:
        while core.sweeping:  # what the server does between requests, a step at a time
            step_started, step_cpu_started = time.monotonic(), time.thread_time()
            core.sweep(101.0)
            steps.append(time.monotonic() - step_started)
            if steps[-1] > 0.010:
                slow.append(((time.thread_time() - step_cpu_started) / steps[-1],
                             step_started, step_started + steps[-1]))
            if steps[-1] > longest_s:
                longest_s, longest_cpu_s = steps[-1], time.thread_time() - step_cpu_started
            lost += len(core.take_events())
    finally:
        gc.enable()
    swept = time.perf_counter() - started
    print(f"  unmount of one of 8 segments: {elapsed * 1e3:.1f} ms, then swept in "
          f"{swept * 1e3:.0f} ms, {len(steps):,} steps p50 / p99 / longest "
          f"{_p(steps, 0.5)} / {_p(steps, 0.99)} / {_p(steps, 1.0)} ms (the longest on the "
          f"CPU {longest_cpu_s * 1e3:.1f} ms; {lost:,} objects dropped; {len(slow)} steps over "
          f"10 ms, {sum(1 for share, _, _ in slow if share >= 0.8)} of them on the CPU "
          f"throughout)")
    if slow_steps_path:
        with open(slow_steps_path, "w") as out:   # the whole sweep first, then each step
            out.write(f"sweep {sweep_started_s:.6f} {time.monotonic():.6f} {len(steps)}\n")
            out.writelines(f"{start:.6f} {end:.6f}\n" for _, start, end in slow)
    if control_seconds:
        control_walk(core, control_seconds)


def control_walk(core: MasterCore, seconds: float) -> None:
    """Walk the table read-only as the sweep does, a shard's entries listed and read 2,048 at
    a time each step, for ``seconds``, the collector off: every step does the same work and
    changes nothing, so a step far longer than the others (with as much CPU time: not a wait
    to be scheduled) is the host's doing, not the core's."""
    size_of = operator.attrgetter("size_bytes")
    shards = core._objects.shards
    steps: list[tuple[float, float]] = []
    index = 0
    gc.disable()
    try:
        end_s = time.perf_counter() + seconds
        while time.perf_counter() < end_s:
            step_started, step_cpu_started = time.perf_counter(), time.thread_time()
            entries = list(shards[index % len(shards)].values())
            for start in range(0, len(entries), SWEEP_SCAN_KEYS):
                sum(map(size_of, entries[start:start + SWEEP_SCAN_KEYS]))
            steps.append((time.perf_counter() - step_started,
                          time.thread_time() - step_cpu_started))
            index += 1
    finally:
        gc.enable()
    walls = [wall for wall, _ in steps]
    slow = [(wall, cpu) for wall, cpu in steps if wall > 0.010]
    print(f"  control: the same table walked read-only for {seconds:.0f} s, a shard a step "
          f"({len(steps):,} steps): p50 / p99 / longest {_p(walls, 0.5)} / {_p(walls, 0.99)} / "
          f"{_p(walls, 1.0)} ms; {len(slow)} steps over 10 ms, "
          f"{sum(1 for wall, cpu in slow if cpu >= 0.8 * wall)} of them on the CPU throughout")


def bench_fragmentation() -> None:
    print("allocator fragmentation (KV-like: 95% 64 KiB blocks, 5% odd sizes; churn at the "
          "edge of a full 4 GiB segment)")
    rng = random.Random(3)
    allocator = Allocator(4 << 30)
    live: list[tuple[int, int]] = []
    odd = (4096, 12_000, 100_000, 300_000)
    refused_at: list[float] = []
    started = time.perf_counter()
    num_ops = 0
    for _ in range(300_000):
        size = OBJECT_BYTES if rng.random() < 0.95 else rng.choice(odd)
        offset = allocator.allocate(size)
        num_ops += 1
        if offset >= 0:
            live.append((offset, size))
            continue
        refused_at.append(allocator.used_bytes / allocator.size_bytes)
        for _ in range(3):   # make room at random places, as evictions of mixed ages would
            index = rng.randrange(len(live))
            live[index], live[-1] = live[-1], live[index]
            allocator.free(*live.pop())
            num_ops += 1
    elapsed = time.perf_counter() - started
    print(f"  {num_ops:,} allocate/free in {elapsed:.2f} s ({elapsed / num_ops * 1e6:.2f} us "
          f"each); {len(refused_at):,} refusals at a mean utilisation of "
          f"{sum(refused_at) / len(refused_at):.2%} (min {min(refused_at):.2%}); "
          f"{allocator.num_free_extents:,} free extents at the end")


def bench_many_segments() -> None:
    """A single-key put (put_start + put_end) with 8 to 50,000 mounted segments."""
    print("\nplacement with many segments (single-key put_start + put_end, 64 KiB objects)")
    for num_segments in (8, 1_000, 10_000, 50_000):
        core = MasterCore(CoreConfig())
        clients = [ClientId(f"owner-{n}") for n in range(-(-num_segments // 1000))]
        for client in clients:
            core.register_client(client, "bench-host", b"k" * 32, 0.0)
        for i in range(num_segments):
            core.mount_segment(SegmentInfo(SegmentId(f"seg-{i}"), clients[i // 1000],
                                           64 << 20), 0.0)
        keys = keys_of(0, 5_000)
        started = time.perf_counter()
        for key in keys:
            core.put_start(clients[0], [key], [OBJECT_BYTES], OPTIONS, 1.0)
            core.put_end(clients[0], [key], 1.0)
        elapsed = time.perf_counter() - started
        print(f"  {num_segments:>6,} segments: {elapsed / len(keys) * 1e6:7.1f} us a put")


def bench_gc_pauses(num_objects: int) -> None:
    """The collector's pauses while a core fills: as Python runs it, with the survivors of
    each full collection frozen, and with that plus the master's tick collection
    (``kvpool_master.gcpause``: ``collect_recent`` every tick; here every 100 ms of filling)."""
    from kvpool_master.gcpause import GcPauses

    print(f"\ncyclic collector while filling {num_objects:,} objects (longest pause, total, "
          "then one full collection)")
    for label, freeze, tick in (("as Python runs it", False, False),
                                ("frozen after full collections", True, False),
                                ("and collected every tick", True, True)):
        gc.collect()
        pauses = GcPauses(freeze=freeze)
        pauses.install()
        last = [time.perf_counter()]

        def every_batch(pauses: GcPauses = pauses, last: list[float] = last) -> None:
            if time.perf_counter() - last[0] >= 0.1:
                pauses.collect_recent()
                last[0] = time.perf_counter()
        try:
            core = make_core(num_objects, 0.9)
            fill(core, keys_of(0, num_objects), every_batch=every_batch if tick else None)
            started = time.perf_counter()
            gc.collect()
            full_ms = (time.perf_counter() - started) * 1e3
        finally:
            pauses.uninstall()
        print(f"  {label:<30} longest {max(pauses.longest_pause_s) * 1e3:6.1f} ms, total "
              f"{sum(pauses.pause_s) * 1e3:7.1f} ms, full collection {full_ms:6.1f} ms")
        del core
        gc.unfreeze()


def bench_put_after_removes() -> None:
    """32-key puts into one segment, fresh and after each of its objects was removed alone (a
    put -> get -> remove churn: every free pushes a placement-index entry)."""
    print("\nput after removes (one 2 GiB segment, 1,536 x 1 MiB objects in 32-key puts)")
    core = MasterCore(CoreConfig())
    core.register_client(CLIENT, "bench-host", b"k" * 32, 0.0)
    core.mount_segment(SegmentInfo(SegmentId("seg"), CLIENT, 2 << 30), 0.0)
    keys = keys_of(0, 1536)
    for round_ in range(3):
        started = time.perf_counter()
        for i in range(0, len(keys), 32):
            core.put_start(CLIENT, keys[i:i + 32], [1 << 20] * 32, OPTIONS, 1.0)
            core.put_end(CLIENT, keys[i:i + 32], 1.0)
        elapsed = time.perf_counter() - started
        label = "fresh segment" if round_ == 0 else f"after removes, round {round_}"
        print(f"  {label:<26} {len(keys) / elapsed / 1e3:7.1f} k keys/s")
        for key in keys:
            core.remove([key], True, 2.0)


def bench_table_churn(num_objects: int) -> None:
    """The longest single insert into a table of ``num_objects`` keys while keys come and go
    at a constant size, as under eviction: an ``OrderedDict`` now and then rebuilds its whole
    table in that one insert; the object table (sharded dicts and a linked recency list)
    rebuilds one shard at most."""
    from collections import OrderedDict

    from kvpool_master.core.objects import ObjectEntry, ObjectTable
    from kvpool_wire.types import Pin

    def churn(insert: Callable[[bytes], None], drop_oldest: Callable[[], object]) -> float:
        longest_s = 0.0
        for i in range(num_objects, num_objects + num_objects * 3 // 2):
            started = time.perf_counter()
            insert(b"%016d" % i)
            drop_oldest()
            longest_s = max(longest_s, time.perf_counter() - started)
        return longest_s

    ordered: OrderedDict[bytes, None] = OrderedDict((b"%016d" % i, None)
                                                    for i in range(num_objects))
    ordered_s = churn(lambda key: ordered.__setitem__(key, None),
                      lambda: ordered.popitem(last=False))
    ordered.clear()
    table = ObjectTable(track_children=False)

    def insert(key: bytes) -> None:
        entry = ObjectEntry(ObjectKey(key), 1, SegmentId("s"), 0, None, Pin.NONE, None)
        table.add_ready(ObjectKey(key), entry)

    for i in range(num_objects):
        insert(b"%016d" % i)
    table_s = churn(insert, lambda: table.pop(next(table.entries()).key))
    print(f"\ntable churn ({num_objects:,} keys, {num_objects * 3 // 2:,} inserts and deletes), "
          f"longest single insert: OrderedDict {ordered_s * 1e3:.1f} ms (a whole-table "
          f"rebuild), object table {table_s * 1e3:.2f} ms")


def bench_churn_steps(num_objects: int, turnovers: float = 1.5) -> None:
    """The longest single call while a full pool of ``num_objects`` churns: 100-key put
    batches (each evicting about as much as it puts, LRU victims scattered by 100-key reads
    of recent keys), for ``turnovers`` times the table. This is where whole-table steps
    show: a dict or set rebuilt as a whole, a list cut in one go, an eviction pass too long.
    Also prints the rate of the puts and commits in each turnover of the pool (LRU victims
    leave its free space in one-block holes, and the entries touched lie ever more scattered),
    and the process's memory per object after the fill and after each turnover.
    The cyclic collector is off meanwhile: the server bounds its pauses on its own (see
    ``bench_gc_pauses``), and one of Python's own full collections would hide the rest."""
    from kvpool_master.core import mutations

    gc.collect()
    base_bytes = rss_bytes()
    core = MasterCore(CoreConfig())
    core.register_client(CLIENT, "bench-host", b"k" * 32, 0.0)
    core.mount_segment(SegmentInfo(SegmentId("big"), CLIENT, num_objects * 4096), 0.0)
    for i in range(64):
        core.mount_segment(SegmentInfo(SegmentId(f"small-{i}"), CLIENT, 64 * 4096), 0.0)
    sizes = [4096] * 100
    for i in range(0, num_objects, 1000):
        chunk = keys_of(i, 1000)
        core.put_start(CLIENT, chunk, [4096] * 1000, OPTIONS, 1.0)
        core.put_end(CLIENT, chunk, 1.0)
        core.take_events()
    per_object_bytes = [(rss_bytes() - base_bytes) / len(core._objects)]
    passes: list[float] = []
    evict_pass = mutations.Mutations._evict_pass

    def timed_pass(self: mutations.Mutations, tier: Tier, need_bytes: int, now: float) -> int:
        started = time.perf_counter()
        try:
            return evict_pass(self, tier, need_bytes, now)
        finally:
            passes.append(time.perf_counter() - started)

    mutations.Mutations._evict_pass = timed_pass  # type: ignore[method-assign]
    gc.collect()
    gc.disable()
    rng = random.Random(3)
    longest = {"put_start": 0.0, "put_end": 0.0, "get_replicas": 0.0}
    num_puts = int(num_objects * turnovers) // 100 * 100
    putting_s = [0.0] * -(-num_puts // num_objects)  # puts and commits, per turnover
    now = 2.0
    try:
        for start in range(num_objects, num_objects + num_puts, 100):
            now += 0.001
            chunk = keys_of(start, 100)
            reads = [ObjectKey(b"%064x" % rng.randrange(start - num_objects // 40, start))
                     for _ in range(100)]
            started = time.perf_counter()
            core.put_start(CLIENT, chunk, sizes, OPTIONS, now)
            put_s = time.perf_counter()
            core.put_end(CLIENT, chunk, now)
            end_s = time.perf_counter()
            core.get_replicas(reads, now)
            get_s = time.perf_counter()
            putting_s[(start - num_objects) // num_objects] += end_s - started
            if (start + 100 - num_objects) % num_objects == 0:   # a turnover done
                per_object_bytes.append((rss_bytes() - base_bytes) / len(core._objects))
            for name, elapsed in (("put_start", put_s - started), ("put_end", end_s - put_s),
                                  ("get_replicas", get_s - end_s)):
                longest[name] = max(longest[name], elapsed)
            core.take_events()
    finally:
        gc.enable()
        mutations.Mutations._evict_pass = evict_pass  # type: ignore[method-assign]
    passes.sort()
    print(f"\nchurn of a full pool of {num_objects:,} objects ({num_puts:,} puts in "
          f"100-key batches): longest put_start {longest['put_start'] * 1e3:.1f} ms, "
          f"put_end {longest['put_end'] * 1e3:.1f} ms, get_replicas "
          f"{longest['get_replicas'] * 1e3:.1f} ms; {len(passes):,} eviction passes, p50 / p99 "
          f"/ longest {passes[len(passes) // 2] * 1e3:.1f} / "
          f"{passes[int(len(passes) * 0.99)] * 1e3:.1f} / {passes[-1] * 1e3:.1f} ms")
    rates = [min(num_objects, num_puts - k * num_objects) / elapsed_s / 1e3
             for k, elapsed_s in enumerate(putting_s)]
    print("  puts and commits (evictions included) per turnover of the pool: "
          + ", ".join(f"{rate:.0f}" for rate in rates) + " k keys/s")
    print("  memory per object (process RSS over the table's objects) after the fill, then "
          "after each turnover: " + ", ".join(f"{b:.0f}" for b in per_object_bytes) + " B")


def bench_evicting_steps(num_objects: int) -> None:
    """The longest steps of a master serving 1,000-key put batches into a full pool of
    ``num_objects`` 4 KiB objects (each batch evicting about as much as it puts), as a server
    cuts a batch into steps: with the watermark passes run inside the put steps and 1,024-key
    steps, inside and 512-key steps, and deferred to steps of their own (``upkeep``, between
    requests) with 512-key steps (the server now). A client's call waits behind at most one
    such step. Collector off, as in ``bench_churn_steps``."""
    from kvpool_master.rpc.servicer import STEP_KEYS

    print(f"\nsteps of 1,000-key put batches into a full pool of {num_objects:,} objects, "
          f"{num_objects:,} puts (ms, p50 / p99 / p99.9 / longest; then µs a put key, all "
          "steps together, and µs an evicted object, deferred passes alone):")
    for deferred, step_keys in ((False, 1024), (False, 512), (True, STEP_KEYS)):
        steps, evicted = _evicting_steps(num_objects, deferred, step_keys)
        total_s = sum(sum(times) for times in steps.values())
        print(f"  passes {'deferred' if deferred else 'inside puts'}, {step_keys:,}-key steps: "
              + "; ".join(f"{kind} {_p(times, 0.5)} / {_p(times, 0.99)} / {_p(times, 0.999)}"
                          f" / {_p(times, 1.0)}" for kind, times in steps.items() if times)
              + f"; {evicted:,} objects evicted; {total_s / num_objects * 1e6:.2f} µs a put key"
              + (f", {sum(steps['pass']) / evicted * 1e6:.2f} µs an evicted object"
                 if steps["pass"] and evicted else ""))


def _evicting_steps(num_objects: int, deferred: bool, step_keys: int
                    ) -> tuple[dict[str, list[float]], int]:
    """Fill a pool of ``num_objects``, then put as many again; the seconds of each step of
    the second half by kind, and the objects evicted in it."""
    gc.collect()
    core = MasterCore(CoreConfig())
    core.register_client(CLIENT, "bench-host", b"k" * 32, 0.0)
    core.mount_segment(SegmentInfo(SegmentId("big"), CLIENT, num_objects * 4096), 0.0)
    core.skip_object_events()   # a master without --state-dir
    core.defer_upkeep = deferred
    steps: dict[str, list[float]] = {"put_start": [], "put_end": [], "pass": []}
    sizes = [4096] * step_keys
    gc.disable()
    try:
        evicted_before = 0
        for start in range(0, 2 * num_objects, 1000):
            chunk = keys_of(start, 1000)
            timed = start >= num_objects
            if start == num_objects:
                evicted_before = core.stats().evicted_objects_total
            for lo in range(0, len(chunk), step_keys):
                part = chunk[lo:lo + step_keys]
                started = time.perf_counter()
                core.put_start(CLIENT, part, sizes[:len(part)], OPTIONS, 1.0)
                if timed:
                    steps["put_start"].append(time.perf_counter() - started)
            for lo in range(0, len(chunk), step_keys):
                started = time.perf_counter()
                core.put_end(CLIENT, chunk[lo:lo + step_keys], 1.0)
                if timed:
                    steps["put_end"].append(time.perf_counter() - started)
            while core.relief_due:   # what upkeep would run
                started = time.perf_counter()
                core.relieve(1.0)
                if timed:
                    steps["pass"].append(time.perf_counter() - started)
            core.take_events()
    finally:
        gc.enable()
    return steps, core.stats().evicted_objects_total - evicted_before


def _p(times: list[float], q: float) -> str:
    """The ``q`` quantile of ``times`` (seconds), in ms."""
    ordered = sorted(times)
    return f"{ordered[min(len(ordered) - 1, int(len(ordered) * q))] * 1e3:.1f}"


def bench_restore_with_log(num_objects: int, log_objects: int, keep_state: str = "") -> None:
    """Restore ``num_objects``, the last ``log_objects`` of them put after the snapshot (in
    its log, as rows), in a process of its own."""
    print(f"restore with a log: {num_objects:,} objects, {log_objects:,} of them in the log")
    core = make_core(num_objects, 0.95)
    keys = keys_of(0, num_objects)
    fill(core, keys[:num_objects - log_objects], chain_length=32)
    with tempfile.TemporaryDirectory() as scratch:
        state_dir = keep_state or scratch
        store = StateStore(state_dir, fsync="never")
        store.load(MasterCore(CoreConfig()), 0.0)
        store.compact(core)
        appending_s = 0.0

        def append(events: list[Any]) -> None:
            nonlocal appending_s
            started = time.perf_counter()
            store.append(events)
            appending_s += time.perf_counter() - started
        fill(core, keys[num_objects - log_objects:], chain_length=32, on_events=append)
        store.close()
        print(f"  logging the commits: {appending_s / log_objects * 1e6:.2f} us a key "
              "(1,000-key batches)")
        snapshot_bytes = os.path.getsize(os.path.join(state_dir, "snapshot.kvp"))
        log_bytes = os.path.getsize(os.path.join(state_dir, "log.kvp"))
        print(f"  snapshot {snapshot_bytes / 2**20:,.0f} MiB, log {log_bytes / 2**20:,.0f} MiB "
              f"({log_bytes / snapshot_bytes:.0%} of it; a master compacts at 25 %)")
        del core
        subprocess.run([sys.executable, os.path.abspath(__file__), "--restore", state_dir],
                       check=True)


def bench_log_batches(num_objects: int = 200_000) -> None:
    """What logging commits costs, by the size of the call that made them: the time to append
    them, the log's bytes, and the time to restore an index from that log alone."""
    print(f"the log, by batch ({num_objects:,} objects committed in batches, chains of 32)")
    for batch in (8, 16, 32, 64, 512):
        core = make_core(num_objects, 0.95)
        batches: list[list[Any]] = []
        fill(core, keys_of(0, num_objects), batch=batch, chain_length=32,
             on_events=batches.append)
        with tempfile.TemporaryDirectory() as state_dir:
            store = StateStore(state_dir, fsync="never")
            store.load(MasterCore(CoreConfig()), 0.0)
            store.append(batches.pop(0))   # the client and its segments
            gc.collect()
            started = time.perf_counter()
            for events in batches:
                store.append(events)
            appending_s = time.perf_counter() - started
            store.close()
            log_bytes = os.path.getsize(os.path.join(state_dir, "log.kvp"))
            started = time.perf_counter()
            StateStore(state_dir).load(MasterCore(CoreConfig()), 0.0)
            restoring_s = time.perf_counter() - started
        per_key_us = 1e6 / num_objects
        print(f"  batch {batch:>4}: append {appending_s * per_key_us:5.2f} us a key, "
              f"{log_bytes / num_objects:4.0f} B a key; restore {restoring_s * per_key_us:5.2f} "
              "us a key")


def restore_alone(state_dir: str) -> None:
    """Restore ``state_dir`` into a fresh core of this fresh process; print the time and the
    process's memory after it and at its peak."""
    started = time.perf_counter()
    restored = MasterCore(CoreConfig())
    report = StateStore(state_dir).load(restored, 0.0)
    elapsed = time.perf_counter() - started
    peak_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"  restore (a process of its own): {elapsed:.2f} s for {report.num_objects:,} "
          f"objects; RSS after it {rss_bytes() / 2**20:,.0f} MiB, peak {peak_bytes / 2**20:,.0f} "
          "MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true",
                        help="memory, eviction and persistence at one million objects")
    parser.add_argument("--segments-only", action="store_true",
                        help="only the placement cost (8 to 50,000 segments, after removes)")
    parser.add_argument("--memory-objects", type=int, default=0, metavar="N",
                        help="only memory, eviction and persistence, at N objects (10 M: "
                             "about 5 minutes and 9 GiB of memory)")
    parser.add_argument("--churn-objects", type=int, default=0, metavar="N",
                        help="only the churn of a full pool of N objects")
    parser.add_argument("--churn-turnovers", type=float, default=1.5, metavar="T",
                        help="how many times the churn turns the pool over (--churn-objects)")
    parser.add_argument("--evicting-objects", type=int, default=0, metavar="N",
                        help="only the steps of put batches that evict, into a full pool of "
                             "N objects")
    parser.add_argument("--keep-state", metavar="DIR", default="",
                        help="with --memory-objects: write the snapshot into DIR (empty or "
                             "new) and keep it, to restore it again with --restore")
    parser.add_argument("--control-seconds", type=float, default=0.0, metavar="S",
                        help="with --memory-objects: after the sweep, walk the table read-only "
                             "for S seconds in steps of equal work (how long the host makes a "
                             "step that does nothing more)")
    parser.add_argument("--slow-steps", metavar="FILE", default="",
                        help="with --memory-objects: write the CLOCK_MONOTONIC start and end "
                             "of the sweep (with its count of steps), then of each of its steps "
                             "over 10 ms, to FILE (for benchmarks/perf_windows.py)")
    parser.add_argument("--log-objects", type=int, default=0, metavar="M",
                        help="with --memory-objects N: only restore N objects of which the "
                             "last M were put after the snapshot (its log holds them)")
    parser.add_argument("--log-batches", action="store_true",
                        help="only the cost of logging commits and of restoring them from "
                             "the log, by the size of the batch that made them")
    parser.add_argument("--restore", metavar="DIR",
                        help="only restore the state directory DIR in this process, and print "
                             "the time and memory it took")
    args = parser.parse_args()
    if args.restore:
        restore_alone(args.restore)
        return
    if args.log_batches:
        bench_log_batches()
        return
    if args.churn_objects:
        bench_churn_steps(args.churn_objects, args.churn_turnovers)
        return
    if args.evicting_objects:
        bench_evicting_steps(args.evicting_objects)
        return
    if args.memory_objects and args.log_objects:
        bench_restore_with_log(args.memory_objects, args.log_objects, args.keep_state)
        return
    if args.memory_objects:
        bench_memory_and_eviction(args.memory_objects, args.keep_state,
                                  args.control_seconds, args.slow_steps)
        return
    if args.segments_only:
        bench_many_segments()
        bench_put_after_removes()
        return
    bench_ops(200_000)
    bench_memory_and_eviction(1_000_000 if args.full else 200_000)
    bench_fragmentation()
    bench_many_segments()
    bench_put_after_removes()
    bench_gc_pauses(1_000_000 if args.full else 200_000)
    bench_table_churn(2_000_000 if args.full else 200_000)
    bench_churn_steps(2_000_000 if args.full else 200_000)


if __name__ == "__main__":
    main()
