"""SGLang HiCache keys and hit policies (``connectors.sglang_pools``), without SGLang: every rank
that makes a page's bytes differ is in its key, ranks that hold the same bytes share keys, and
the v2 hit policies give what SGLang 0.5.23's rules (``hicache_storage.py``) give."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from kvpool_client.connectors.sglang_pools import KeyScheme, hits, objects_of_pages


@dataclass
class Config:
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    attn_cp_rank: int = 0
    attn_cp_size: int = 1
    is_mla_model: bool = False
    model_name: str | None = "org/model"
    tp_lcm_size: int | None = None
    should_split_heads: bool = False
    dp_rank: int = 0
    dcp_size: int = 1
    dcp_rank: int = 0
    logical_page_size: int | None = None


def kv_keys(**fields: Any) -> list[str]:
    return KeyScheme.of(Config(**fields)).keys("kv", ["h"])


def test_every_rank_that_splits_the_kv_is_in_the_key() -> None:
    base = kv_keys(tp_rank=1, tp_size=2)
    assert base == ["org%2Fmodel#@tp1of2@pp0of1@h"]
    variants = [kv_keys(tp_rank=0, tp_size=2), kv_keys(tp_rank=1, tp_size=4),
                kv_keys(tp_rank=1, tp_size=2, pp_rank=1, pp_size=2),
                kv_keys(tp_rank=1, tp_size=2, pp_size=2),
                kv_keys(tp_rank=1, tp_size=2, attn_cp_rank=1, attn_cp_size=2)]
    assert len({base[0], *(v[0] for v in variants)}) == 6  # all distinct
    # data-parallel groups compute the same KV for the same tokens: they share pages
    assert kv_keys(tp_rank=1, tp_size=2, dp_rank=3) == base


def test_mla_pages_are_shared_across_tp_ranks_but_not_across_cp_or_dcp_shards() -> None:
    mla = [kv_keys(is_mla_model=True, tp_rank=r, tp_size=4) for r in range(4)]
    assert all(keys == mla[0] for keys in mla)
    assert kv_keys(is_mla_model=True, attn_cp_rank=1, attn_cp_size=2) != \
        kv_keys(is_mla_model=True, attn_cp_rank=0, attn_cp_size=2)
    dcp = [kv_keys(is_mla_model=True, tp_rank=r, tp_size=4, dcp_rank=r % 2, dcp_size=2,
                   logical_page_size=64) for r in range(4)]
    assert dcp[0] == dcp[2] and dcp[1] == dcp[3] and dcp[0] != dcp[1]
    assert dcp[0] != kv_keys(is_mla_model=True, tp_size=8, dcp_size=2, logical_page_size=64)


def test_split_heads_share_pages_between_tp_sizes() -> None:
    # tp 2 rank 1 with an lcm of 4 holds head slices 2 and 3; tp 4 ranks 2 and 3 hold one each
    two = kv_keys(tp_rank=1, tp_size=2, tp_lcm_size=4, should_split_heads=True)
    four = [kv_keys(tp_rank=r, tp_size=4, tp_lcm_size=4, should_split_heads=True)
            for r in (2, 3)]
    assert two == [four[0][0], four[1][0]] == ["org%2Fmodel#@h2of4@pp0of1@h",
                                               "org%2Fmodel#@h3of4@pp0of1@h"]


def test_side_pools_never_collide_with_kv_and_sharded_ones_stay_per_rank() -> None:
    ranks = [KeyScheme.of(Config(tp_rank=r, tp_size=2, is_mla_model=True)) for r in (0, 1)]
    assert ranks[0].keys("mamba", ["h"]) != ranks[1].keys("mamba", ["h"])  # rank-sharded
    assert ranks[0].keys("indexer", ["h"]) == ranks[1].keys("indexer", ["h"])  # MLA-shaped
    assert ranks[0].keys("mamba", ["h"])[0] != ranks[0].keys("kv", ["h"])[0]
    assert ranks[0].keys("mamba", ["h"])[0].endswith("@h.mamba")


@dataclass
class T:
    name: str
    hit_policy: str
    keys: list[str] | None = None
    group_pages: int = 0


def test_hit_policies() -> None:
    have = {"swa": {1, 4, 5}, "dsa": {0, 1, 2}, "grp": {0, 1, 2, 3, 5}}
    present = lambda t, page: page in have[t.name]  # noqa: E731
    trailing = T("swa", "trailing_pages", ["a", "b"])  # window of two pages
    # lengths whose last two pages exist: 2 (pages 0, 1)? no: 0 missing; 5 (3, 4)? no;
    # 6 (pages 4, 5): yes; 2: page 0 missing -> no; so only 6
    assert hits(6, [trailing], present).restorable_prefix_pages == [6]
    one = T("swa", "trailing_pages", ["a"])
    result = hits(6, [one], present)
    assert result.restorable_prefix_pages == [2, 5, 6] and result.kv_hit_pages == 6
    result = hits(6, [one, T("dsa", "all_pages")], present)
    assert (result.kv_hit_pages, result.restorable_prefix_pages) == (2, [2])
    assert result.extra_pool_hit_pages == {"kv": 6, "swa": 6, "dsa": 3}
    grouped = hits(6, [T("grp", "block_groups", group_pages=2)], present)
    assert grouped.extra_pool_hit_pages == {"kv": 6, "grp": 4}
    assert grouped.kv_hit_pages == 6  # a verdict of its own, never narrowing the KV hit
    assert hits(0, [one], present).kv_hit_pages == 0
    with pytest.raises(ValueError, match="unknown hit policy"):
        hits(3, [T("swa", "newest_pages")], present)


def test_page_regions_flat_or_per_object() -> None:
    assert objects_of_pages([1, 2, 3, 4], [10, 10, 10, 10], 2) == [[(1, 10), (2, 10)],
                                                                  [(3, 10), (4, 10)]]
    assert objects_of_pages([[1, 2], [3]], [[5, 5], [7]], 2) == [[(1, 5), (2, 5)], [(3, 7)]]
    for ptrs, sizes, n in (([1, 2, 3], [1, 1, 1], 2), ([1], [1, 1], 1), ([1], [1], 0)):
        with pytest.raises(ValueError):
            objects_of_pages(ptrs, sizes, n)


def test_the_model_name_is_kept_whole_and_required() -> None:
    assert kv_keys(model_name="org/model-7b") != kv_keys(model_name="org-model/7b")
    assert kv_keys(model_name="a@b") != kv_keys(model_name="a") \
        and "@b" not in kv_keys(model_name="a@b")[0]
    for missing in (None, ""):
        with pytest.raises(ValueError, match="model_name"):
            KeyScheme.of(Config(model_name=missing))


def test_pages_laid_out_or_typed_otherwise_have_keys_of_their_own() -> None:
    scheme = KeyScheme.of(Config(tp_rank=1, tp_size=2))
    forms = [scheme.with_form("kv", layout, dtype)
             for layout, dtype in (("page_first", "bfloat16"), ("layer_first", "bfloat16"),
                                   ("page_first", "float16"),
                                   ("page_first", "uint8-float8_e4m3fn"),
                                   ("page_first", "uint8-float8_e5m2"))]
    assert len({f.keys("kv", ["h"])[0] for f in forms}) == len(forms)
    page_first, layer_first = forms[0], forms[1]
    assert page_first.keys("kv", ["h"]) == ["org%2Fmodel#page_first.bfloat16@tp1of2@pp0of1@h"]
    # a flat page is the zero-copy object in page_first, ordered otherwise in layer_first
    assert page_first.value_keys(["h"]) == page_first.keys("kv", ["h"])
    assert layer_first.value_keys(["h"]) != layer_first.keys("kv", ["h"])
    # a side pool's form is its own; registering again replaces the form
    both = page_first.with_form("mamba", "layer_first", "float32")
    assert both.keys("kv", ["h"]) == page_first.keys("kv", ["h"])
    assert both.keys("mamba", ["h"]) != page_first.keys("mamba", ["h"])
    assert page_first.with_form("kv", "layer_first", "bfloat16").keys("kv", ["h"]) == \
        layer_first.keys("kv", ["h"])


def test_clear_takes_every_form_of_this_rank_and_nothing_else() -> None:
    import re
    scheme = KeyScheme.of(Config(tp_rank=1, tp_size=2))
    pattern = re.compile(scheme.clear_pattern())
    mine = [*scheme.keys("kv", ["h"]), *scheme.with_form("kv", "page_first", "x").keys(
        "kv", ["h"]), *scheme.with_form("kv", "layer_first", "y").value_keys(["h"]),
        *scheme.keys("mamba", ["h"])]
    others = [*KeyScheme.of(Config(tp_rank=0, tp_size=2)).keys("kv", ["h"]),
              *KeyScheme.of(Config(tp_rank=1, tp_size=2, model_name="org/model2")).keys(
                  "kv", ["h"])]
    assert all(pattern.search(k) for k in mine)
    assert not any(pattern.search(k) for k in others)


def test_a_head_grid_that_does_not_divide_is_refused() -> None:
    with pytest.raises(ValueError, match="not a multiple"):
        KeyScheme.of(Config(tp_size=4, tp_lcm_size=6, should_split_heads=True))
