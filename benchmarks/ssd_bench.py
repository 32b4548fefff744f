"""The SSD tier against the disk it sits on, measured in one run.

Rows (all on the directory given, on the same disk, in the same run):

- raw device: sequential ``O_DIRECT`` writes and reads of --block-size blocks by one thread and
  by four threads at once, straight to a file (no kvpool);
- tier writes: objects put into a DRAM segment whose demotion window holds all of them; the
  time from the first put until every one has been copied to the SSD segment (the master
  plans, the owner's copier writes with its threads; the puts' own time is counted too);
- tier reads: the same objects, evicted from DRAM (SSD only), read back with ``get_batch`` by
  a second client on this host (from the file) and by one forced onto TCP (through the
  owner's data server); promotion is off so every read comes from SSD;
- time to first byte: one small object read from SSD against one read from DRAM (median);
- puts under demotion: the latency of single puts while demotions run, against the same puts
  into a pool without an SSD tier (eviction drops instead), p50 / p99.

    python benchmarks/ssd_bench.py [--dir DIR] [--total 512MiB] [--block-size 2MiB]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import mmap
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from kvpool_client.client import KVPoolClient
from kvpool_client.config import ClientConfig
from kvpool_client.replay import spawned_master
from kvpool_client.ssd import open_direct
from kvpool_wire.types import parse_size_bytes


def raw_device(directory: Path, total_bytes: int, block_bytes: int,
               threads: int) -> tuple[float, float]:
    """(write GB/s, read GB/s) of O_DIRECT sequential I/O by ``threads`` threads."""
    path = directory / f"raw-{threads}.bin"
    fd, direct = open_direct(str(path), os.O_RDWR | os.O_CREAT)
    if not direct:
        print(f"note: {directory} does not take O_DIRECT; the raw rows use the page cache")
    try:
        os.posix_fallocate(fd, 0, total_bytes)
        num_blocks = total_bytes // block_bytes
        buffers = [mmap.mmap(-1, block_bytes) for _ in range(threads)]
        for buf in buffers:
            buf.write(os.urandom(1024) * (block_bytes // 1024))

        def run(writing: bool) -> float:
            def worker(index: int) -> None:
                view = memoryview(buffers[index])
                for block in range(index, num_blocks, threads):
                    if writing:
                        os.pwritev(fd, [view], block * block_bytes)
                    else:
                        os.preadv(fd, [view], block * block_bytes)
            started = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(threads) as pool:
                list(pool.map(worker, range(threads)))
            if writing:
                os.fsync(fd)
            return total_bytes / (time.perf_counter() - started) / 1e9

        return run(True), run(False)
    finally:
        os.close(fd)
        path.unlink()


def _config(address: str, **values: Any) -> ClientConfig:
    return ClientConfig.from_dict({"master_server_address": address, "checksum": False,
                                   **values})


def _demoted_bytes(client: KVPoolClient) -> int:
    return int(client.metrics.transfer_bytes.get(("ssd", "demote"), 0))


def tier_rows(directory: Path, total_bytes: int, block_bytes: int) -> dict[str, float]:
    count = total_bytes // block_bytes
    values = [os.urandom(4096) * (block_bytes // 4096) for _ in range(4)]
    keys = [f"obj-{i}" for i in range(count)]
    rows: dict[str, float] = {}
    flags = ["--eviction-high-watermark-ratio", "0.95", "--eviction-ratio", "0.3",
             "--ssd-promote-after-hits", "0"]
    with tempfile.TemporaryDirectory() as tmp, spawned_master(Path(tmp), flags) as address:
        owner = KVPoolClient(_config(address, global_segment_size=2 * total_bytes,
                                     ssd_path=str(directory / "tier"),
                                     ssd_segment_size=3 * total_bytes))
        try:
            # writes: DRAM at 50 % is past the start of demotions (35 %), and the window
            # (90 % of DRAM) holds every object
            smalls = [f"small-{i}" for i in range(32)]
            owner.put_batch(smalls, [b"s" * 4096] * len(smalls))
            started = time.perf_counter()  # the copies start while the puts still run
            for i in range(0, count, 8):
                owner.put_batch(keys[i:i + 8], [values[(i + j) % 4] for j in range(8)][
                    :len(keys[i:i + 8])])
            deadline = started + 120
            while _demoted_bytes(owner) < count * block_bytes + len(smalls) * 4096:
                if time.perf_counter() > deadline:
                    raise RuntimeError("demotions did not finish in 120 s")
                time.sleep(0.005)
            rows["tier write (demotion)"] = total_bytes / (time.perf_counter() - started) / 1e9
            # reads from SSD only: push the objects out of DRAM with as many again
            fillers = [f"fill-{i}" for i in range(2 * count)]
            for i in range(0, len(fillers), 8):
                owner.put_batch(fillers[i:i + 8], [values[0]] * len(fillers[i:i + 8]))
            tiers = owner.batch_tiers(keys)
            on_ssd = [k for k, t in zip(keys, tiers, strict=True) if t == "SSD"]
            if len(on_ssd) < count // 2:
                raise RuntimeError(f"only {len(on_ssd)} of {count} objects are on SSD")
            for name, extra in (("tier read, same host (file)", {}),
                                ("tier read, via data server (tcp)", {"transport": "tcp"})):
                with KVPoolClient(_config(address, **extra)) as reader:
                    # into a registered, page-aligned buffer, as engines read
                    buf = mmap.mmap(-1, 8 * block_bytes)
                    reader.register_buffer(buf)
                    offsets = [j * block_bytes for j in range(8)]
                    reader.get_batch(on_ssd[:2])  # connections, descriptors
                    started = time.perf_counter()
                    got = 0
                    for i in range(0, len(on_ssd) - 7, 8):
                        sizes = reader.batch_get_into(on_ssd[i:i + 8], buf, offsets,
                                                      [block_bytes] * 8)
                        got += sum(n for n in sizes if n > 0)
                    rows[name] = got / (time.perf_counter() - started) / 1e9
                    reader.unregister_buffer(buf)
            # time to first byte: one 4 KiB object on SSD only against one in DRAM
            owner.put("small-dram", b"d" * 4096)
            small_tiers = owner.batch_tiers(smalls)
            if "SSD" not in small_tiers:
                raise RuntimeError("no small object is on SSD only")
            ssd_small = smalls[small_tiers.index("SSD")]
            with KVPoolClient(_config(address)) as reader:
                for name, key in (("DRAM", "small-dram"), ("SSD", ssd_small)):
                    samples = []
                    for _ in range(200):
                        started = time.perf_counter()
                        reader.get(key)
                        samples.append(time.perf_counter() - started)
                    rows[f"ttfb {name} us"] = statistics.median(samples) * 1e6
        finally:
            owner.close()
    return rows


def put_latency(directory: Path, with_ssd: bool, num_puts: int,
                block_bytes: int) -> tuple[float, float]:
    """(p50 ms, p99 ms) of single puts into a DRAM pool a quarter as large as the puts."""
    flags = ["--eviction-high-watermark-ratio", "0.9", "--eviction-ratio", "0.1"]
    dram_bytes = num_puts * block_bytes // 4
    extra: dict[str, Any] = {"ssd_path": str(directory / "lat"),
                             "ssd_segment_size": 2 * num_puts * block_bytes} if with_ssd else {}
    value = os.urandom(4096) * (block_bytes // 4096)
    samples = []
    with tempfile.TemporaryDirectory() as tmp, spawned_master(Path(tmp), flags) as address, \
            KVPoolClient(_config(address, global_segment_size=dram_bytes, **extra)) as owner:
        for i in range(num_puts):
            started = time.perf_counter()
            owner.put(f"lat-{i}", value)
            samples.append(time.perf_counter() - started)
            time.sleep(0.002)
        demoted = _demoted_bytes(owner) // block_bytes
    samples.sort()
    if with_ssd:
        print(f"  ({demoted} of {num_puts} objects demoted while putting)")
    return samples[len(samples) // 2] * 1e3, samples[int(len(samples) * 0.99)] * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="", help="directory on the disk to measure "
                        "(default: a temporary directory)")
    parser.add_argument("--total", default="512MiB", help="bytes per throughput row")
    parser.add_argument("--block-size", default="2MiB", help="object and I/O size")
    parser.add_argument("--puts", type=int, default=400, help="puts per latency row")
    args = parser.parse_args()
    total_bytes, block_bytes = parse_size_bytes(args.total), parse_size_bytes(args.block_size)
    with tempfile.TemporaryDirectory(dir=args.dir or None) as tmp:
        directory = Path(tmp)
        raw1 = raw_device(directory, total_bytes, block_bytes, 1)
        raw4 = raw_device(directory, total_bytes, block_bytes, 4)
        print(f"raw O_DIRECT, {block_bytes >> 20} MiB blocks: 1 thread write {raw1[0]:.2f} "
              f"read {raw1[1]:.2f} GB/s; 4 threads write {raw4[0]:.2f} read {raw4[1]:.2f} GB/s")
        rows = tier_rows(directory, total_bytes, block_bytes)
        for name, value in rows.items():
            if name.startswith("ttfb"):
                continue
            one, four = (raw1[0], raw4[0]) if "write" in name else (raw1[1], raw4[1])
            print(f"{name}: {value:.2f} GB/s = {value / one:.0%} of raw sequential, "
                  f"{value / four:.0%} of raw 4-way")
        print(f"time to first byte (median of 200 gets of 4 KiB, same host): DRAM "
              f"{rows['ttfb DRAM us']:.0f} us, SSD {rows['ttfb SSD us']:.0f} us "
              f"({rows['ttfb SSD us'] / rows['ttfb DRAM us']:.1f}x)")
        small = min(block_bytes, 256 << 10)
        without = put_latency(directory, False, args.puts, small)
        with_ssd = put_latency(directory, True, args.puts, small)
        print(f"puts of {small >> 10} KiB into a pool a quarter their size: without SSD p50 "
              f"{without[0]:.3f} p99 {without[1]:.3f} ms; with demotions p50 {with_ssd[0]:.3f} "
              f"p99 {with_ssd[1]:.3f} ms (p99 ratio {with_ssd[1] / without[1]:.2f})")


if __name__ == "__main__":
    main()
