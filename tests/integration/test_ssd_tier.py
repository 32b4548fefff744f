"""The SSD tier in real processes: a real master, clients in their own processes with SSD
segments in files under a temporary directory.

What must hold: objects pushed out of DRAM come back byte-exact from SSD (read from the file
on the same host, through the owner's data server from another host id), and go back to DRAM
on a hit; a reader racing demotions never sees another object's bytes; a full SSD tier evicts
its own least recently used objects; a truncated or unreadable file and a crash in the middle
of demotions give errors or misses, never wrong bytes; a master restart with ``--state-dir``
keeps the SSD index; the drop-in's ``enable_ssd_offload`` turns the tier on.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from helpers import client_worker

cw = client_worker()
SIZE = 256 << 10            # one object
DRAM_BYTES = 4 << 20        # 16 objects
SSD_BYTES = 64 << 20
OTHER_HOST = {"KVPOOL_HOST_ID": "another-host"}
DROP_IN = Path(__file__).parents[2] / "compat" / "mooncake"


def _config(master: Any, ssd_dir: Path | None, **extra: Any) -> dict[str, Any]:
    config: dict[str, Any] = {"master_server_address": master.address,
                              "global_segment_size": DRAM_BYTES if ssd_dir else 0,
                              "checksum": True}
    if ssd_dir is not None:
        config.update(ssd_path=str(ssd_dir), ssd_segment_size=SSD_BYTES)
    config.update(extra)
    return config


def _status(master: Any) -> dict[str, Any]:
    with urllib.request.urlopen(f"{master.metrics_url}/status", timeout=5) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]


def _fill(owner: Any, prefix: str, count: int, pause_s: float = 0.02) -> list[str]:
    """Put ``count`` objects one at a time, slowly enough for demotions to keep up."""
    keys = [f"{prefix}-{i}" for i in range(count)]
    for key in keys:
        assert owner.call("put", keys=[key], size=SIZE)["statuses"] == ["OK"]
        time.sleep(pause_s)
    return keys


def _wait_demoted(master: Any, min_bytes: int, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while _status(master)["used_bytes"]["SSD"] < min_bytes:
        assert time.monotonic() < deadline, _status(master)
        time.sleep(0.1)


@pytest.fixture
def tier_master(start_master: Any) -> Any:
    # eviction starts at 80 % of DRAM; demotions at 80 - 2 x 20 = 40 %
    return start_master(eviction_high_watermark_ratio=0.8, eviction_ratio=0.2)


def test_objects_pushed_out_of_dram_come_back_byte_exact_from_ssd(
        tier_master: Any, tmp_path: Path) -> None:
    owner = cw.Worker(_config(tier_master, tmp_path / "ssd"))
    same_host = cw.Worker(_config(tier_master, None))
    other_host = cw.Worker(_config(tier_master, None), env=OTHER_HOST)
    try:
        keys = _fill(owner, "a", 60)                   # almost four times DRAM
        status = _status(tier_master)
        assert status["used_bytes"]["SSD"] >= 40 * SIZE, status
        assert status["objects"]["ready"] >= 56         # a few may not have made it in time
        tiers = owner.call("tiers", keys=keys)["tiers"]
        on_ssd = [k for k, t in zip(keys, tiers, strict=True) if t == "SSD"]
        assert len(on_ssd) >= 40 and set(tiers) <= {"SSD", "DRAM", None}
        kept = [k for k, t in zip(keys, tiers, strict=True) if t is not None]
        # another process on this host reads the files; one on another host, the data server
        for reader in (same_host, other_host):
            assert set(reader.call("check", keys=kept, size=SIZE)["results"]) == {"ok"}
        assert "file:read" in same_host.call("transports")["used"]
        assert "tcp:read" in other_host.call("transports")["used"]
        # a hit brings an object back to DRAM, on its owner's host (those bulk reads above
        # promoted more than DRAM holds: settle first, then read two that are on SSD now)
        time.sleep(1)
        tiers = owner.call("tiers", keys=kept)["tiers"]
        hot = [k for k, t in zip(kept, tiers, strict=True) if t == "SSD"][-2:]
        assert len(hot) == 2
        assert other_host.call("check", keys=hot, size=SIZE)["results"] == ["ok", "ok"]
        deadline = time.monotonic() + 10
        while owner.call("tiers", keys=hot)["tiers"] != ["DRAM", "DRAM"]:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert same_host.call("check", keys=hot, size=SIZE)["results"] == ["ok", "ok"]
        metrics = urllib.request.urlopen(f"{tier_master.metrics_url}/metrics").read().decode()
        assert 'kvpool_tier_copies_total{kind="demote",result="done"}' in metrics
        assert owner.call("ssd")["failed"] == 0
    finally:
        for worker in (owner, same_host, other_host):
            worker.stop()


def test_readers_racing_demotions_never_see_wrong_bytes(tier_master: Any, tmp_path: Path) -> None:
    owner = cw.Worker(_config(tier_master, tmp_path / "ssd"))
    readers = [cw.Worker(_config(tier_master, None)),
               cw.Worker(_config(tier_master, None), env=OTHER_HOST)]
    try:
        first = _fill(owner, "r", 12, 0)
        for reader in readers:
            reader.send("check_loop", keys=first, size=SIZE, seconds=6)
            assert reader.read()["looping"]
        for n in range(30):                            # demotions and evictions meanwhile
            assert owner.call("put", keys=[f"w{n}-{i}" for i in range(2)],
                              size=SIZE)["statuses"] == ["OK", "OK"]
            time.sleep(0.05)
        for reader in readers:
            counts = reader.read(timeout_s=30)["counts"]
            assert "mismatch" not in counts and counts.get("ok", 0) > 0, counts
    finally:
        owner.stop()
        for reader in readers:
            reader.stop()


def test_a_full_ssd_tier_evicts_its_least_recently_used(start_master: Any,
                                                        tmp_path: Path) -> None:
    master = start_master(eviction_high_watermark_ratio=0.8, eviction_ratio=0.2)
    owner = cw.Worker(_config(master, tmp_path / "ssd", ssd_segment_size=8 * SIZE))
    try:
        keys = _fill(owner, "f", 60)
        status = _status(master)
        assert status["used_bytes"]["SSD"] <= 8 * SIZE
        results = owner.call("check", keys=keys, size=SIZE)["results"]
        assert set(results) <= {"ok", "missing"} and results[-1] == "ok"
        assert results[:10].count("missing") >= 8       # the oldest went first
    finally:
        owner.stop()


def test_a_truncated_or_unreadable_file_gives_errors_never_bytes(tier_master: Any,
                                                                 tmp_path: Path) -> None:
    # no checksums: what a reader gets back is what the file gave it
    owner = cw.Worker(_config(tier_master, tmp_path / "ssd", checksum=False))
    same_host = cw.Worker(_config(tier_master, None, checksum=False))
    other_host = cw.Worker(_config(tier_master, None, checksum=False), env=OTHER_HOST)
    try:
        keys = _fill(owner, "t", 40)
        tiers = owner.call("tiers", keys=keys)["tiers"]
        on_ssd = [k for k, t in zip(keys, tiers, strict=True) if t == "SSD"][:8]
        assert len(on_ssd) == 8
        [path] = owner.call("ssd")["paths"]
        os.rename(path, path + ".away")                     # others cannot open it now
        first = same_host.call("check", keys=on_ssd[:1], size=SIZE)["results"]
        assert first in (["ok"], ["status -704"], ["missing"]), first  # an error at worst
        assert same_host.call("check", keys=on_ssd[:2], size=SIZE)["results"] == ["ok", "ok"]
        assert "tcp:read" in same_host.call("transports")["used"]  # ... so its data server
        os.rename(path + ".away", path)
        os.truncate(path, 0)                                 # every SSD byte gone
        for reader in (owner, same_host, other_host):
            results = reader.call("check", keys=on_ssd[2:], size=SIZE)["results"]
            assert "ok" not in results and "mismatch" not in results, results
        # more demotions after the cut would write the file long again, over holes that
        # read back as zeros: the owner takes the file as lost instead
        _fill(owner, "u", 20)
        for reader in (owner, same_host, other_host):
            results = reader.call("check", keys=on_ssd[2:], size=SIZE)["results"]
            assert "ok" not in results and "mismatch" not in results, results
        assert os.stat(path).st_size == 0
    finally:
        for worker in (owner, same_host, other_host):
            worker.stop()


def test_a_crash_during_demotions_serves_nothing_corrupt_and_a_restart_starts_clean(
        start_master: Any, tmp_path: Path) -> None:
    master = start_master(eviction_high_watermark_ratio=0.8, eviction_ratio=0.2, client_ttl=2)
    ssd_dir = tmp_path / "ssd"
    owner = cw.Worker(_config(master, ssd_dir))
    reader = cw.Worker(_config(master, None))
    try:
        keys = _fill(owner, "c", 30, 0.01)
        [old_file] = owner.call("ssd")["paths"]
        owner.kill()                                          # in the middle of demotions
        owner.stop()                                          # (closes its pipes)
        results = reader.call("check", keys=keys, size=SIZE)["results"]
        assert "mismatch" not in results
        time.sleep(3)                                         # expired by now
        assert set(reader.call("check", keys=keys, size=SIZE)["results"]) == {"missing"}
        owner = cw.Worker(_config(master, ssd_dir))            # same directory
        assert not os.path.exists(old_file)                   # the old file was removed
        [new_file] = owner.call("ssd")["paths"]
        assert new_file != old_file and os.stat(new_file).st_mode & 0o777 == 0o600
        assert set(reader.call("check", keys=keys, size=SIZE)["results"]) == {"missing"}
        again = _fill(owner, "d", 30)
        assert "mismatch" not in reader.call("check", keys=again, size=SIZE)["results"]
    finally:
        owner.stop()
        reader.stop()


def test_a_master_restart_keeps_the_ssd_index(start_master: Any, tmp_path: Path) -> None:
    flags = {"host": "127.0.0.1", "port": _free_port(), "fast_port": 0, "metrics_port": 0,
             "eviction_high_watermark_ratio": 0.8, "eviction_ratio": 0.2,
             "state_dir": str(tmp_path / "state"), "restore_grace": 30}
    master = start_master(default_ports=False, **flags)
    owner = cw.Worker(_config(master, tmp_path / "ssd"))
    try:
        keys = _fill(owner, "p", 40)
        tiers = owner.call("tiers", keys=keys)["tiers"]
        on_ssd = [k for k, t in zip(keys, tiers, strict=True) if t == "SSD"]
        assert len(on_ssd) >= 16
        master.stop()
        master = start_master(default_ports=False, **flags)
        deadline = time.monotonic() + 30
        while True:                                   # the client re-registers and remounts
            results = owner.call("check", keys=on_ssd, size=SIZE)["results"]
            if set(results) == {"ok"}:
                break
            assert "mismatch" not in results and time.monotonic() < deadline, results
            time.sleep(0.5)
    finally:
        owner.stop()


def test_the_drop_in_enable_ssd_offload(tier_master: Any, tmp_path: Path) -> None:
    script = f"""
import sys
from mooncake.store import MooncakeDistributedStore
store = MooncakeDistributedStore()
rc = store.setup("127.0.0.1", "P2PHANDSHAKE", {DRAM_BYTES}, {SIZE}, "tcp", "",
                 "{tier_master.address}", enable_ssd_offload=True,
                 ssd_offload_path="{tmp_path / 'ssd'}")
assert rc == 0, rc
import time
values = {{f"m{{i}}": bytes([i]) * {SIZE} for i in range(48)}}
for key, value in values.items():
    rc = store.put(key, value)
    assert rc == 0, rc
    time.sleep(0.04)
kept = [key for key, value in values.items() if store.get(key) == value]
bad = [key for key, value in values.items() if store.get(key) not in (value, b"")]
print(len(kept), len(bad))
store.close()
"""
    site = tmp_path / "site"                          # kvpool's drop-in ``mooncake`` package
    build = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation",
         "--disable-pip-version-check", "--no-index", "-q", "--target", str(site),
         str(DROP_IN)], capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert build.returncode == 0, build.stdout + build.stderr
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": str(site)},
                         stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr[-3000:]
    kept, bad = map(int, out.stdout.split())
    # DRAM holds 16: the rest were kept on SSD (the first few may be evicted before the
    # copier, asking every 0.5 s by default, got to them)
    assert bad == 0 and kept >= 32, (kept, bad)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_objects_of_odd_sizes_share_pages_on_ssd_and_come_back_exact(
        tier_master: Any, tmp_path: Path) -> None:
    size = 6000                                 # extents 64-byte aligned: they share pages
    owner = cw.Worker(_config(tier_master, tmp_path / "ssd", global_segment_size=512 << 10,
                              ssd_segment_size=8 << 20))
    other_host = cw.Worker(_config(tier_master, None), env=OTHER_HOST)
    try:
        keys = [f"odd-{i}" for i in range(300)]  # three times DRAM
        for i in range(0, len(keys), 10):
            assert owner.call("put", keys=keys[i:i + 10], size=size)["statuses"] == ["OK"] * 10
            time.sleep(0.05)
        tiers = owner.call("tiers", keys=keys)["tiers"]
        assert tiers.count("SSD") >= 150, tiers
        for reader in (owner, other_host):
            results = reader.call("check", keys=keys, size=size)["results"]
            assert "mismatch" not in results and results.count("ok") >= 250, results
        assert owner.call("ssd")["failed"] == 0
    finally:
        owner.stop()
        other_host.stop()


def test_the_copier_waits_at_the_master_and_is_answered_when_copies_wait(
        start_master: Any, tmp_path: Path) -> None:
    """A copier whose call waits 8 s at the master and whose heartbeats come 20 s apart still
    starts demoting as soon as DRAM crosses the line: the master answers the waiting call when
    it makes tasks. Closing the client ends that wait at once."""
    master = start_master(eviction_high_watermark_ratio=0.8, eviction_ratio=0.2, client_ttl=60)
    owner = cw.Worker(_config(master, tmp_path / "ssd", ssd_poll_interval_s=8.0,
                              rpc_timeout_s=20.0))
    try:
        time.sleep(1.0)                                # the copier's call is waiting now
        started = time.monotonic()
        _fill(owner, "w", 8, 0)                        # 50 % of DRAM: past the 40 % line
        while owner.call("ssd")["done"] < 2:           # copies made
            assert time.monotonic() - started < 3.0     # well within one 8 s wait
            time.sleep(0.05)
        time.sleep(1.0)                                # a fresh wait at the master
        closing = time.monotonic()
        assert owner.call("close", timeout_s=20)["closed"]
        assert time.monotonic() - closing < 4.0
    finally:
        owner.stop()
