"""SGLang HiCache keys, page regions and the hit policies of its v2 interface. Pure: no SGLang,
no torch, no pool calls.

Rules of this file:
- A key is ``{model}#{form}@{tag}@{page hash}`` for the KV pool and ``...@{page hash}.{pool}``
  for any other pool (Mamba states, sliding-window KV, indexers, draft KV), so pools never
  collide. The model name is percent-encoded (``org/m`` and ``org-m`` differ) and required.
- The form names how a page's bytes are laid out in that pool: the host pool's layout
  (``layer_first``, ``page_first``, ...) and its dtype, learnt when the pool is registered
  (``with_form``). The per-value interface's flat page (K of every layer, then V) is the
  zero-copy interface's object in the ``page_first`` layout and shares its key; in any other
  layout it is ordered otherwise and adds ``.flat``. Two deployments of one model whose host
  pools differ in layout or dtype never read each other's pages as their own.
- The tag names every rank that makes a rank's bytes differ for the same page:
  - KV of a model with per-rank heads (MHA): ``tp{rank}of{size}``; with ``should_split_heads``
    one object per head slice of the ``tp_lcm_size`` grid, ``h{slice}of{lcm}``, so instances of
    different TP sizes share pages (as SGLang's Mooncake backend does);
  - MLA KV (the same on every TP rank): ``mla``, and with decode context parallelism
    ``dcp{rank}of{size}`` plus the topology that shards it (``tp``, logical page size);
  - attention context parallelism ``cp{rank}of{size}`` when its size is above 1 (ranks hold
    different tokens of a page); pipeline stage ``pp{rank}of{size}`` always (stages of different
    sizes hold different layers);
  - the data-parallel rank is not in any key: DP groups compute the same KV for the same tokens,
    so they share pages.
  Pools other than KV take the per-rank tag unless their name says they are MLA-shaped
  (indexers, DeepSeek V4 compressed pools): a shared tag on a rank-sharded pool would serve
  another rank's bytes; a per-rank tag on a shared pool only stores a page once per rank.
- Hit policies (``batch_exists_v2``), as SGLang defines them: the KV prefix first (every page
  from the first must exist); then each other pool narrows the set of prefix lengths that can
  be restored: ``all_pages`` (every page up to the length exists), ``trailing_pages`` (the
  last ``len(keys)`` pages before the length exist; the set may have holes), ``block_groups``
  (whole groups of ``group_pages`` pages from the start; a verdict of its own that never narrows
  the KV hit).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

KV_POOL = "kv"
_SHARED_POOL_PREFIXES = ("indexer", "draft_indexer", "deepseek_v4_")


@dataclass(frozen=True)
class KeyScheme:
    """The key prefixes of one SGLang rank (see the module rules)."""

    model: str
    rank_tag: str
    shared_tag: str
    kv_tags: tuple[str, ...]  # KV objects per page: one, or one per head slice
    split_heads: int = 0  # head slices per rank with ``should_split_heads`` (0: not split)
    forms: tuple[tuple[str, str], ...] = ()  # (pool, the form of its pages) as registered

    @classmethod
    def of(cls, config: Any) -> KeyScheme:
        """Build from SGLang's ``HiCacheStorageConfig`` (fields it lacks take their defaults)."""
        def field(name: str, default: int) -> int:
            value = getattr(config, name, default)
            return default if value is None else int(value)

        name = getattr(config, "model_name", None)
        if not isinstance(name, str) or not name:
            raise ValueError("the storage config names no model (model_name): pages of "
                             "different models would share keys")
        model = quote(name, safe="")
        tp_rank, tp_size = field("tp_rank", 0), field("tp_size", 1)
        cp_rank, cp_size = field("attn_cp_rank", 0), field("attn_cp_size", 1)
        dcp_rank, dcp_size = field("dcp_rank", 0), field("dcp_size", 1)
        stage = f"pp{field('pp_rank', 0)}of{field('pp_size', 1)}"
        cp = f"@cp{cp_rank}of{cp_size}" if cp_size > 1 else ""
        rank_tag = f"tp{tp_rank}of{tp_size}{cp}@{stage}"
        shared_tag = "mla"
        if dcp_size > 1:
            shared_tag += (f"@dcp{dcp_rank}of{dcp_size}@tp{tp_size}"
                           f"@page{field('logical_page_size', 0)}")
        shared_tag += f"{cp}@{stage}"
        if getattr(config, "is_mla_model", False):
            kv_tags: tuple[str, ...] = (shared_tag,)
        elif getattr(config, "should_split_heads", False):
            lcm = field("tp_lcm_size", 0)
            if lcm < tp_size or lcm % tp_size:
                raise ValueError(f"tp_lcm_size {lcm} is not a multiple of tp_size {tp_size}")
            split = lcm // tp_size
            kv_tags = tuple(f"h{tp_rank * split + i}of{lcm}{cp}@{stage}" for i in range(split))
            return cls(model, rank_tag, shared_tag, kv_tags, split)
        else:
            kv_tags = (rank_tag,)
        return cls(model, rank_tag, shared_tag, kv_tags)

    def with_form(self, pool: str, layout: str, dtype: str) -> KeyScheme:
        """This scheme once ``pool``'s pages are known to be laid out as ``layout`` in
        ``dtype`` (a host pool registered)."""
        form = quote(f"{layout}.{dtype}", safe="")
        forms = tuple((p, f) for p, f in self.forms if p != pool) + ((pool, form),)
        return dataclasses.replace(self, forms=forms)

    def _named(self, pool: str, flat: bool = False) -> str:
        """The model and the form of ``pool``'s pages, as keys begin."""
        form = dict(self.forms).get(pool, "")
        return f"{self.model}#{form}{'.flat' if flat else ''}"

    def pool_tag(self, pool: str) -> str:
        """The tag of a pool other than KV."""
        return self.shared_tag if pool.startswith(_SHARED_POOL_PREFIXES) else self.rank_tag

    def keys(self, pool: str, page_keys: Sequence[str]) -> list[str]:
        """The object keys of ``page_keys`` in ``pool``, page by page (KV with split heads:
        one per head slice of each page)."""
        named = self._named(pool)
        if pool == KV_POOL:
            return [f"{named}@{tag}@{page}" for page in page_keys for tag in self.kv_tags]
        tag = self.pool_tag(pool)
        return [f"{named}@{tag}@{page}.{pool}" for page in page_keys]

    def value_keys(self, page_keys: Sequence[str]) -> list[str]:
        """Keys of whole-page values (the per-value interface: one flat object per page,
        never split by heads)."""
        tag = self.kv_tags[0] if len(self.kv_tags) == 1 else self.rank_tag
        page_first = dict(self.forms).get(KV_POOL, "").startswith("page_first.")
        named = self._named(KV_POOL, flat=not page_first)
        return [f"{named}@{tag}@{page}" for page in page_keys]

    def clear_pattern(self) -> str:
        """An RE2 pattern of every key this rank writes, whatever its forms (for ``clear``)."""
        tags = dict.fromkeys([*self.kv_tags, self.rank_tag, self.shared_tag])
        return (f"^{re.escape(self.model)}#[^@]*@(?:"
                + "|".join(re.escape(tag) for tag in tags) + ")@")


def objects_of_pages(ptrs: Sequence[Any], sizes: Sequence[Any], num_objects: int,
                     ) -> list[list[tuple[int, int]]]:
    """Split a host pool's ``get_page_buffer_meta`` answer into ``num_objects`` objects, in
    order, each the (pointer, size) regions it concatenates. The pool answers flat lists (a
    whole multiple of the objects) or one list of buffers per object."""
    if len(ptrs) != len(sizes) or not num_objects or len(ptrs) % num_objects:
        raise ValueError(f"{num_objects} objects but {len(ptrs)} buffers from the host pool")
    if ptrs and isinstance(ptrs[0], list | tuple):
        if len(ptrs) != num_objects:
            raise ValueError(f"{num_objects} objects but {len(ptrs)} buffer lists")
        return [list(zip(p, s, strict=True)) for p, s in zip(ptrs, sizes, strict=True)]
    per = len(ptrs) // num_objects
    return [list(zip(ptrs[i:i + per], sizes[i:i + per], strict=True))
            for i in range(0, len(ptrs), per)]


@dataclass
class HitResult:
    """What ``batch_exists_v2`` answers, with the fields of SGLang's ``PoolTransferResult``
    (pool names as the caller gave them: SGLang keys its results by its ``PoolName``)."""

    kv_hit_pages: int
    extra_pool_hit_pages: dict[Any, int]
    restorable_prefix_pages: list[int]


def policy_name(policy: Any) -> str:
    """A hit policy as its value (SGLang's enum is a ``str`` enum; plain strings work too)."""
    return str(getattr(policy, "value", policy))


def hits(kv_pages: int, transfers: Sequence[Any], present: Callable[[Any, int], bool], *,
         kv_name: Any = KV_POOL) -> HitResult:
    """Apply each transfer's hit policy to the KV prefix of ``kv_pages`` pages;
    ``present(transfer, page)``: whether that pool holds that page. Pools are named in the
    answer by ``transfer.name`` as given, the KV pool by ``kv_name``."""
    pool_hits: dict[Any, int] = {kv_name: kv_pages} if kv_pages else {}
    restorable = list(range(1, kv_pages + 1))
    for transfer in transfers:
        if not restorable:
            break
        name = transfer.name
        exists = [present(transfer, page) for page in range(kv_pages)]
        policy = policy_name(transfer.hit_policy)
        if policy == "all_pages":
            boundary = exists.index(False) if False in exists else kv_pages
            allowed = set(range(1, boundary + 1))
        elif policy == "trailing_pages":
            window = max(1, len(transfer.keys or ()))
            allowed = {length for length in range(1, kv_pages + 1)
                       if all(exists[max(0, length - window):length])}
            boundary = max(allowed, default=0)
        elif policy == "block_groups":
            group = max(1, int(getattr(transfer, "group_pages", 0) or 1))
            whole = 0
            while whole + group <= kv_pages and all(exists[whole:whole + group]):
                whole += group
            if whole:
                pool_hits[name] = whole
            continue  # its own verdict: it never narrows the KV hit
        else:
            raise ValueError(f"unknown hit policy {policy!r} for pool {name!r}")
        if boundary:
            pool_hits[name] = boundary
        restorable = [length for length in restorable if length in allowed]
    return HitResult(restorable[-1] if restorable else 0, pool_hits, restorable)
