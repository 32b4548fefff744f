"""Trace replay, shared by the live and the simulated run: trace, routing, counters, a model pool.

Rules of this file:
- A trace line is one request: ``{"hash_ids": [...], ...}``, each id naming one chained
  512-token block (ids are prefix-closed: equal ids mean equal prefixes). A block's pool key is
  ``trace:{id}`` and its ``BlockHash`` the id's 8 big-endian bytes.
- Requests are routed to workers deterministically (``round-robin`` by request index, or
  ``prefix-hash``: by a stable hash of the first two block ids, which keeps a conversation on
  one worker) and
  processed one at a time across all workers, so a live run and a simulated run see the same
  sequence of pool operations.
- Level 1 is the real ``TieredPrefixCache`` in both runs; only the pool differs. The simulated
  pool reproduces the master's eviction (``kvpool_master/core/mutations.py``): byte-based, LRU
  over committed objects by last read or commit, in ``put_start`` — when an allocation does not
  fit, a pass frees ``max(size, eviction_ratio x capacity)``; when usage passes
  ``high_watermark x capacity`` after an allocation, a pass frees ``eviction_ratio x
  capacity``; a pass that frees too little stops eviction for the rest of that call. Read leases
  are not modelled: with leases much shorter than the time a block takes to reach the LRU end,
  they never protect a victim.
- An SSD tier (``ssd_capacity_bytes``, the workers' SSD space summed: one LRU, as if every
  worker's disk took an even share of the demotions) catches what DRAM evicts: a DRAM victim is
  demoted instead of lost, the SSD's own least recently used objects go when it is full. A read
  of an object on SSD is a hit, and promotes it back to DRAM (room made as a put makes it, its
  victims demoted in turn); a lookup (``query_prefix``) finds it without moving it.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvpool_client.hashing import BlockHash
from kvpool_client.prefix import PrefixMatch, TieredPrefixCache

ROUTINGS = ("round-robin", "prefix-hash")
#: ``prefix-hash`` routes by the first this-many block ids (the first alone is often a system
#: prompt every request shares; the second starts the conversation)
ROUTE_PREFIX_BLOCKS = 2
ALIGN_BYTES = 64  # the master allocator's extent alignment


def aligned(size_bytes: int) -> int:
    """``size_bytes`` rounded up to the master's allocation alignment."""
    return (size_bytes + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


def block_hash(block_id: int) -> BlockHash:
    """The ``BlockHash`` of a trace block id."""
    return BlockHash(block_id.to_bytes(8, "big"))


def block_key(block_hash_: BlockHash) -> str:
    """The pool key of a trace block."""
    return f"trace:{int.from_bytes(block_hash_, 'big')}"


def load_trace(path: str | Path, *, start: int = 0, limit: int | None = None,
               whole_blocks_only: bool = False, block_tokens: int = 512) -> list[list[int]]:
    """The block ids of each request in ``path`` (lines ``start`` .. ``start + limit``).

    With ``whole_blocks_only`` a request's last id is dropped when ``input_length`` does not
    fill it. Raises ``ValueError`` naming the line for a malformed one.
    """
    requests: list[list[int]] = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if number <= start:
                continue
            if limit is not None and len(requests) >= limit:
                break
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                ids = record["hash_ids"]
                if not isinstance(ids, list) or not all(
                        type(i) is int and i >= 0 for i in ids):
                    raise ValueError("hash_ids must be a list of non-negative ints")
                if whole_blocks_only:
                    ids = ids[:int(record["input_length"]) // block_tokens]
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{number}: not a trace line ({exc})") from None
            requests.append(ids)
    return requests


def route(requests: Sequence[Sequence[int]], num_workers: int, routing: str) -> list[int]:
    """The worker of each request."""
    if num_workers <= 0:
        raise ValueError(f"need at least one worker, got {num_workers}")
    if routing == "round-robin":
        return [i % num_workers for i in range(len(requests))]
    if routing == "prefix-hash":
        out = []
        for ids in requests:
            head = b"".join(i.to_bytes(8, "big") for i in ids[:ROUTE_PREFIX_BLOCKS])
            digest = hashlib.blake2b(head, digest_size=8).digest()
            out.append(int.from_bytes(digest, "big") % num_workers)
        return out
    raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")


@dataclass(slots=True)
class HitCounts:
    """Blocks seen and where they were found, for one worker or all."""

    requests: int = 0
    blocks: int = 0
    device_hits: int = 0
    pool_hits: int = 0
    verify_failures: int = 0

    def add(self, blocks: int, device_hits: int, pool_hits: int, verify_failures: int = 0) -> None:
        """Count one request."""
        self.requests += 1
        self.blocks += blocks
        self.device_hits += device_hits
        self.pool_hits += pool_hits
        self.verify_failures += verify_failures

    def ratios(self) -> dict[str, float]:
        """Level-1, pool and combined hit ratios (fractions of all blocks)."""
        total = self.blocks or 1
        return {"device": self.device_hits / total, "pool": self.pool_hits / total,
                "combined": (self.device_hits + self.pool_hits) / total}


@dataclass(slots=True)
class ReplayResult:
    """Per-worker and overall counts of one run."""

    workers: list[HitCounts]
    overall: HitCounts = field(default_factory=HitCounts)

    def to_dict(self) -> dict[str, object]:
        """JSON-ready counts and ratios."""
        def one(c: HitCounts) -> dict[str, object]:
            return {"requests": c.requests, "blocks": c.blocks, "device_hits": c.device_hits,
                    "pool_hits": c.pool_hits, "verify_failures": c.verify_failures,
                    **{f"{k}_hit_ratio": round(v, 6) for k, v in c.ratios().items()}}
        return {"overall": one(self.overall), "workers": [one(w) for w in self.workers]}


class SimulatedPool:
    """The master's object table reduced to what decides hits: keys in LRU order and bytes."""

    def __init__(self, capacity_bytes: int, object_bytes: int, *,
                 high_watermark_ratio: float = 0.95, eviction_ratio: float = 0.05,
                 ssd_capacity_bytes: int = 0) -> None:
        if capacity_bytes <= 0 or object_bytes <= 0 or ssd_capacity_bytes < 0:
            raise ValueError("capacity and object size must be positive, SSD capacity >= 0")
        self.capacity_bytes = capacity_bytes
        self.object_bytes = aligned(object_bytes)
        self.high_watermark_ratio = high_watermark_ratio
        self.eviction_ratio = eviction_ratio
        self.ready_keys: OrderedDict[str, None] = OrderedDict()  # least recently used first
        self.used_bytes = 0
        self.evicted_objects = 0  # out of DRAM (demoted ones included)
        self.ssd_capacity_bytes = ssd_capacity_bytes
        self.ssd_keys: OrderedDict[str, None] = OrderedDict()  # on SSD only, LRU first
        self.demoted_objects = 0
        self.promoted_objects = 0
        self.ssd_evicted_objects = 0
        self.dram_hit_objects = 0
        self.ssd_hit_objects = 0

    def query_prefix(self, keys: Sequence[str]) -> int:
        """Leading keys present, touching each (as the master's lease grant does)."""
        count = 0
        for key in keys:
            if key in self.ready_keys:
                self.ready_keys.move_to_end(key)
            elif key in self.ssd_keys:
                self.ssd_keys.move_to_end(key)
            else:
                break
            count += 1
        return count

    def get(self, keys: Sequence[str]) -> list[bool]:
        """A read: touches every key present; one on SSD is promoted back to DRAM."""
        out = []
        for key in keys:
            if key in self.ready_keys:
                self.ready_keys.move_to_end(key)
                self.dram_hit_objects += 1
                out.append(True)
            elif key in self.ssd_keys:
                self.ssd_hit_objects += 1
                del self.ssd_keys[key]
                if self.put([key]) == [True]:
                    self.promoted_objects += 1
                else:  # DRAM has no room: it stays on SSD
                    self.ssd_keys[key] = None
                out.append(True)
            else:
                out.append(False)
        return out

    def put(self, keys: Sequence[str]) -> list[bool]:
        """put_start + put_end of a batch: True per key stored (or already present)."""
        pending: list[str] = []
        out: list[bool] = []
        size = self.object_bytes
        ratio_bytes = math.ceil(self.eviction_ratio * self.capacity_bytes)
        exhausted = False
        for key in keys:
            if key in self.ready_keys or key in pending or key in self.ssd_keys:
                out.append(True)  # ALREADY_EXISTS: success, and not a touch
                continue
            while self.used_bytes + size > self.capacity_bytes and not exhausted:
                wanted = max(size, ratio_bytes)
                if self._evict(wanted) < wanted:
                    exhausted = True
            if self.used_bytes + size > self.capacity_bytes:
                out.append(False)  # NO_SPACE
                continue
            self.used_bytes += size
            pending.append(key)
            out.append(True)
            above = self.used_bytes > self.high_watermark_ratio * self.capacity_bytes
            if above and not exhausted and self._evict(ratio_bytes) < ratio_bytes:
                exhausted = True
        for key in pending:  # put_end commits in order: each becomes most recently used
            self.ready_keys[key] = None
        return out

    def _evict(self, need_bytes: int) -> int:
        freed = 0
        while freed < need_bytes and self.ready_keys:
            key, _ = self.ready_keys.popitem(last=False)
            self.used_bytes -= self.object_bytes
            self.evicted_objects += 1
            freed += self.object_bytes
            self._demote(key)
        return freed

    def _demote(self, key: str) -> None:
        """Keep a DRAM victim on SSD, when there is one (its own LRU end goes when full)."""
        capacity_objects = self.ssd_capacity_bytes // self.object_bytes
        if not capacity_objects:
            return
        while len(self.ssd_keys) >= capacity_objects:
            self.ssd_keys.popitem(last=False)
            self.ssd_evicted_objects += 1
        self.ssd_keys[key] = None
        self.demoted_objects += 1


class SimulatedBlockIO:
    """``BlockIO`` onto a ``SimulatedPool``: no bytes, only the pool's bookkeeping."""

    def __init__(self, pool: SimulatedPool) -> None:
        self.pool = pool

    def put_blocks(self, keys: Sequence[str], block_ids: Sequence[int], *,
                   async_write: bool = False) -> list[bool]:
        """Store the keys in the model pool."""
        return self.pool.put(keys)

    def get_blocks(self, keys: Sequence[str], block_ids: Sequence[int]) -> list[bool]:
        """Read the keys from the model pool."""
        return self.pool.get(keys)

    def flush(self) -> None:
        """Model writes are synchronous: nothing to wait for."""


def begin(cache: TieredPrefixCache, ids: Sequence[int]) -> PrefixMatch:
    """Start one request on a worker's cache: match, load pool hits, allocate the rest.

    The new blocks are ``match.block_ids[match.num_reused:]``; fill them, then ``end``.
    """
    match = cache.match_hashes([block_hash(i) for i in ids])
    cache.load(match)
    cache.allocate(match)
    return match


def end(cache: TieredPrefixCache, match: PrefixMatch) -> None:
    """Save the request's computed blocks (level 1 and pool) and release its blocks."""
    cache.save(match)
    cache.release(match)


def simulate(requests: Sequence[Sequence[int]], workers_of: Sequence[int], num_workers: int,
             device_blocks: int, pool: SimulatedPool | None) -> ReplayResult:
    """Replay offline: one level-1 cache per worker, all sharing ``pool`` (None: local only)."""
    io = None if pool is None else SimulatedBlockIO(pool)
    caches = [TieredPrefixCache(device_blocks, key_fn=block_key, pool=pool, io=io)
              for _ in range(num_workers)]
    result = ReplayResult([HitCounts() for _ in range(num_workers)])
    for ids, worker in zip(requests, workers_of, strict=True):
        match = begin(caches[worker], ids)
        end(caches[worker], match)
        result.workers[worker].add(len(ids), match.num_device_hits, match.num_loaded)
        result.overall.add(len(ids), match.num_device_hits, match.num_loaded)
    return result


def iter_progress(items: Sequence[int], enabled: bool, desc: str) -> Iterator[int]:
    """``items`` with a tqdm progress bar on stderr when ``enabled``."""
    if not enabled:
        yield from items
        return
    from tqdm import tqdm

    yield from tqdm(items, desc=desc, unit="req", mininterval=0.5)
