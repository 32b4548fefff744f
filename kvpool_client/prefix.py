"""A two-level prefix cache: the device block table (level 1) in front of the pool (level 2).

Rules of this file:
- Level 1 maps a block hash to the device block holding its KV (``hash_to_block_id``). Only
  whole blocks have a hash, so a shared prefix shorter than one block is never reused.
- Blocks a request uses are pinned (reference counted) until ``release``; unpinned blocks sit in
  ``free_block_ids`` in LRU order, and allocation takes the least recently used one, dropping its
  hash (a level-1 eviction). A request releases its blocks tails first, so the end of a chain is
  evicted before its beginning (a block is useless once its predecessor is gone).
- The pool is consulted only for the blocks after the level-1 hits, with one ``query_prefix``
  call, as MindIE's scheduler does; nothing is asked when level 1 covers the whole request.
- Only blocks this request computed are written to the pool; blocks found on the device or
  loaded from the pool are not written again.
- The cache does no I/O itself: ``BlockIO`` moves blocks between device memory and pool objects
  (``RegionBlockIO`` for memory Python can view; ``kvpool_client.staging`` for device caches).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvpool_client.hashing import BlockHash, BlockHasher
from kvpool_wire.status import KVPoolError, Status


class PrefixLookup(Protocol):
    """The lookup a prefix cache makes: how many leading keys the pool holds."""

    def query_prefix(self, keys: Sequence[str]) -> int:
        """Return how many leading keys are in the pool."""
        ...


class PrefixPool(PrefixLookup, Protocol):
    """The part of ``KVPoolClient`` a prefix cache and ``RegionBlockIO`` use (an in-memory
    pool satisfies it too)."""

    def batch_put_regions(
        self, keys: Sequence[str], regions: Sequence[Sequence[memoryview]], options: Any = None,
        async_write: bool = False,
    ) -> list[Status]:
        """Write each key's object as the concatenation of its regions; one status per key."""
        ...

    def batch_get_regions(
        self, keys: Sequence[str], regions: Sequence[Sequence[memoryview]]
    ) -> list[int]:
        """Read each key's object into its regions; bytes read per key, or a negative status."""
        ...

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait for async writes; raises when one failed."""
        ...


class BlockIO(Protocol):
    """Moves whole KV blocks between device block ids and pool objects."""

    def put_blocks(
        self, keys: Sequence[str], block_ids: Sequence[int], *, async_write: bool = False
    ) -> list[bool]:
        """Write device blocks to the pool under ``keys``; True per block written (or queued)."""
        ...

    def get_blocks(self, keys: Sequence[str], block_ids: Sequence[int]) -> list[bool]:
        """Read pool objects into device blocks; True per block whose bytes all arrived."""
        ...

    def flush(self) -> None:
        """Wait until every async write has left the device blocks it read."""
        ...


class RegionBlockIO:
    """``BlockIO`` for device memory Python can view directly (a CPU KV cache, host buffers).

    ``regions_of(block_id)`` returns the block's regions in object order (for a KV cache:
    ``[L0.K, L0.V, L1.K, ...]``); bytes move straight between them and the pool.
    """

    def __init__(self, pool: PrefixPool, regions_of: Callable[[int], Sequence[memoryview]]) -> None:
        self.pool = pool
        self.regions_of = regions_of

    def put_blocks(
        self, keys: Sequence[str], block_ids: Sequence[int], *, async_write: bool = False
    ) -> list[bool]:
        """Write the blocks; True where the pool answered OK (an existing key counts as OK)."""
        if not keys:
            return []
        regions = [self.regions_of(b) for b in block_ids]
        statuses = self.pool.batch_put_regions(keys, regions, async_write=async_write)
        return [s in (Status.OK, Status.ALREADY_EXISTS) for s in statuses]

    def get_blocks(self, keys: Sequence[str], block_ids: Sequence[int]) -> list[bool]:
        """Read the blocks; True where exactly the block's size arrived."""
        if not keys:
            return []
        regions = [self.regions_of(b) for b in block_ids]
        results = self.pool.batch_get_regions(keys, regions)
        return [n == sum(r.nbytes for r in rs) for n, rs in zip(results, regions, strict=True)]

    def flush(self) -> None:
        """Wait for the pool's async writes (they read the blocks in place)."""
        self.pool.flush()


@dataclass(slots=True)
class PrefixMatch:
    """One request's whole blocks and the device blocks it holds, in block order.

    ``block_ids[:num_device_hits]`` were found on the device; the next ``num_loaded`` came from
    the pool (``load``); the rest were allocated for blocks the request computes (``allocate``).
    """

    block_hashes: list[BlockHash]
    keys: list[str]
    block_ids: list[int]
    num_device_hits: int
    num_pool_hits: int
    num_loaded: int = 0
    saved: bool = False
    released: bool = False

    @property
    def num_blocks(self) -> int:
        """Whole blocks in the request."""
        return len(self.block_hashes)

    @property
    def num_reused(self) -> int:
        """Blocks the request does not compute: device hits plus blocks loaded from the pool."""
        return self.num_device_hits + self.num_loaded


@dataclass(slots=True)
class PrefixCacheStats:
    """Block counters since the cache was made (ratios are taken by the reader)."""

    requests: int = 0
    blocks: int = 0
    device_hit_blocks: int = 0
    pool_hit_blocks: int = 0
    loaded_blocks: int = 0
    saved_blocks: int = 0
    failed_saves: int = 0
    failed_loads: int = 0
    pool_queries: int = 0
    device_evictions: int = 0


class TieredPrefixCache:
    """Level-1 block table of ``num_blocks`` device blocks, backed by a pool (or none)."""

    def __init__(
        self,
        num_blocks: int,
        *,
        key_fn: Callable[[BlockHash], str],
        pool: PrefixLookup | None = None,
        io: BlockIO | None = None,
        hasher: BlockHasher | None = None,
    ) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        if (pool is None) != (io is None):
            raise ValueError("pool and io go together: give both or neither")
        self.num_blocks = num_blocks
        self.key_fn = key_fn
        self.pool = pool
        self.io = io
        self.hasher = hasher
        self.hash_to_block_id: dict[BlockHash, int] = {}
        self.block_id_to_hash: dict[int, BlockHash] = {}
        self.ref_counts = [0] * num_blocks
        # unpinned blocks, least recently used first; never-used blocks come first of all
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # blocks an async write still reads: pinned until flush()
        self.async_pinned_block_ids: list[int] = []
        self.stats = PrefixCacheStats()

    # --- lookups -------------------------------------------------------------------------

    def match(self, tokens: Sequence[int]) -> PrefixMatch:
        """Hash the whole blocks of ``tokens`` (with the cache's hasher) and ``match_hashes``."""
        if self.hasher is None:
            raise ValueError("this cache has no hasher: call match_hashes with block hashes")
        return self.match_hashes(self.hasher.hash_blocks(tokens))

    def match_hashes(self, block_hashes: Sequence[BlockHash]) -> PrefixMatch:
        """Return the request's on-chip hits (pinned) and the pool hits right after them.

        The pool is asked once, for the keys after the on-chip hits, and only when there are
        such keys. Raises ``KVPoolError`` when the pool cannot be reached.
        """
        hashes = list(block_hashes)
        keys = [self.key_fn(h) for h in hashes]
        hit_ids: list[int] = []
        for h in hashes:
            block_id = self.hash_to_block_id.get(h)
            if block_id is None:
                break
            hit_ids.append(block_id)
        num_pool_hits = 0
        if self.pool is not None and len(hit_ids) < len(keys):
            self.stats.pool_queries += 1   # asked before any pin: a failure leaves none
            num_pool_hits = self.pool.query_prefix(keys[len(hit_ids):])
        for block_id in hit_ids:
            self._pin(block_id)
        self.stats.requests += 1
        self.stats.blocks += len(hashes)
        self.stats.device_hit_blocks += len(hit_ids)
        self.stats.pool_hit_blocks += num_pool_hits
        return PrefixMatch(hashes, keys, hit_ids, len(hit_ids), num_pool_hits)

    @property
    def num_free_blocks(self) -> int:
        """Blocks not pinned by any request (cached or empty)."""
        return len(self.free_block_ids)

    # --- moving blocks -------------------------------------------------------------------

    def load(self, match: PrefixMatch) -> int:
        """Bring the pool hits of ``match`` into free device blocks; return how many arrived.

        Loads as many as free blocks allow; a block that fails to arrive ends the reused prefix
        (later blocks are useless without it) and its device block is given back.
        """
        self._check_open(match)
        if match.num_loaded or len(match.block_ids) != match.num_device_hits:
            raise ValueError("load comes once, right after match")
        want = min(match.num_pool_hits, len(self.free_block_ids))
        if want == 0 or self.io is None:
            return 0
        first = match.num_device_hits
        block_ids = [self._take_free_block() for _ in range(want)]
        ok = self.io.get_blocks(match.keys[first:first + want], block_ids)
        arrived = 0
        while arrived < want and ok[arrived]:
            arrived += 1
        for block_id in block_ids[arrived:]:
            self._give_back(block_id, front=True)
        for i, block_id in enumerate(block_ids[:arrived]):
            self._register(match.block_hashes[first + i], block_id)
        match.block_ids.extend(block_ids[:arrived])
        match.num_loaded = arrived
        self.stats.loaded_blocks += arrived
        self.stats.failed_loads += want - arrived
        return arrived

    def allocate(self, match: PrefixMatch) -> list[int]:
        """Pin fresh device blocks for every whole block the request still has to compute.

        Returns their ids (in block order) for the engine to write KV into. Raises
        ``KVPoolError(NO_SPACE)`` and changes nothing when too few blocks are unpinned.
        """
        self._check_open(match)
        need = match.num_blocks - len(match.block_ids)
        if need > len(self.free_block_ids):
            raise KVPoolError(Status.NO_SPACE,
                              f"need {need} device blocks, {len(self.free_block_ids)} unpinned")
        block_ids = [self._take_free_block() for _ in range(need)]
        match.block_ids.extend(block_ids)
        return block_ids

    def save(self, match: PrefixMatch, *, async_write: bool = False) -> int:
        """Publish the computed blocks of ``match`` on level 1 and write them to the pool.

        Call once the engine has written their KV. Returns how many blocks the pool accepted
        (0 without a pool; with ``async_write``, how many were queued); a block that fails to
        write stays usable on the device. With ``async_write`` the blocks stay pinned until
        ``flush()``, because the write reads them in place.
        """
        self._check_open(match)
        first = match.num_reused
        if len(match.block_ids) != match.num_blocks:
            raise ValueError("save needs every block allocated (call allocate first)")
        if match.saved:
            raise ValueError("this match was saved already")
        match.saved = True
        new_ids = match.block_ids[first:]
        for i, block_id in enumerate(new_ids):
            self._register(match.block_hashes[first + i], block_id)
        if self.io is None or not new_ids:
            return 0
        ok = self.io.put_blocks(match.keys[first:], new_ids, async_write=async_write)
        if async_write:
            for block_id in new_ids:
                self._pin(block_id)
            self.async_pinned_block_ids.extend(new_ids)
        written = sum(ok)
        self.stats.saved_blocks += written
        self.stats.failed_saves += len(new_ids) - written
        return written

    def flush(self) -> None:
        """Wait for async writes to finish, then unpin the blocks they were reading.

        Raises ``KVPoolError`` when an async write failed (the blocks are unpinned anyway).
        """
        if self.io is None:
            return
        try:
            self.io.flush()
        finally:
            block_ids, self.async_pinned_block_ids = self.async_pinned_block_ids, []
            for block_id in reversed(block_ids):
                self._unpin(block_id)

    def release(self, match: PrefixMatch) -> None:
        """Unpin the request's blocks, tails first; they stay cached until evicted."""
        self._check_open(match)
        for block_id in reversed(match.block_ids):
            self._unpin(block_id)
        match.released = True

    # --- the block table -----------------------------------------------------------------

    def _check_open(self, match: PrefixMatch) -> None:
        if match.released:
            raise ValueError("this match was released")

    def _pin(self, block_id: int) -> None:
        if self.ref_counts[block_id] == 0:
            del self.free_block_ids[block_id]
        self.ref_counts[block_id] += 1

    def _unpin(self, block_id: int) -> None:
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] == 0:
            self._give_back(block_id, front=block_id not in self.block_id_to_hash)

    def _take_free_block(self) -> int:
        block_id, _ = self.free_block_ids.popitem(last=False)
        old = self.block_id_to_hash.pop(block_id, None)
        if old is not None:
            del self.hash_to_block_id[old]
            self.stats.device_evictions += 1
        self.ref_counts[block_id] = 1
        return block_id

    def _give_back(self, block_id: int, *, front: bool) -> None:
        # An empty block goes to the front: it is the cheapest one to hand out next.
        self.ref_counts[block_id] = 0
        self.free_block_ids[block_id] = None
        if front:
            self.free_block_ids.move_to_end(block_id, last=False)

    def _register(self, block_hash: BlockHash, block_id: int) -> None:
        # A hash already on the device (another request computed it meanwhile) keeps its block;
        # this copy stays unnamed and is recycled first once released.
        if block_hash not in self.hash_to_block_id:
            self.hash_to_block_id[block_hash] = block_id
            self.block_id_to_hash[block_id] = block_hash
