"""Block-hash chains: native determinism, MindIE and vLLM compatibility (golden vectors).

Every engine chain is checked two ways: against a second, independent implementation written
here, and against literal constants. The MindIE literals come from compiling MindIE's own
``HashCombine`` template (``src/include/math_utils.h``) with ``std::hash<long>``; the vLLM
``NONE_HASH`` literals for ``PYTHONHASHSEED=0`` and the ``sha256_cbor`` block digests with
non-None extra keys also appear, computed with ``cbor2``, in third-party routers that index
vLLM's KV events.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest

from kvpool_client.hashing import (
    VLLM_HASH_FUNCTIONS,
    BlockHasher,
    HashNamespace,
    mindie_block_hash,
    mindie_block_hashes,
    mindie_hash_combine,
    mindie_key,
    vllm_block_hash,
    vllm_block_hashes,
    vllm_none_hash,
    vllm_sha256,
    vllm_sha256_cbor,
)

NS = HashNamespace(model="qwen2-test", dtype="bfloat16", layout="kv-split", block_size=4)


# --- native chain ---------------------------------------------------------------------------


def test_native_chain_literals_are_stable() -> None:
    # Pool keys must not change between releases: these are frozen on purpose.
    hasher = BlockHasher(NS)
    assert NS.seed().hex() == "20d931224c5b846ef534018918186cc7"
    hashes = hasher.hash_blocks(list(range(10)))
    assert [h.hex() for h in hashes] == [
        "7db072909d16c67868a9fa16ea2cb4d0",
        "cacb2f73ec73b9e50cf6fb73a1090e45",
    ]
    assert hasher.key(hashes[0]) == "kv:qwen2-test:0:7db072909d16c67868a9fa16ea2cb4d0"


def test_two_stages_and_two_extras_never_share_a_chain() -> None:
    tokens = list(range(8))
    chains = {BlockHasher(HashNamespace("m", "bfloat16", "kv-split", 4, pp_rank=r, pp_size=2,
                                        extra=e)).hash_blocks(tokens)[0]
              for r in (0, 1) for e in ("", "lora-a", "lora-b")}
    assert len(chains) == 6


def test_native_chain_matches_straightforward_definition() -> None:
    hasher = BlockHasher(NS)
    tokens = [151643, 0, 7, 2**40, -5, 3, 9, 11, 4]
    text = "qwen2-test\x00bfloat16\x00kv-split\x004\x000\x001"
    parent = hashlib.blake2b(text.encode(), digest_size=16, person=b"kvpool.ns.v1").digest()
    expected = []
    for start in (0, 4):
        block = np.asarray(tokens[start:start + 4], dtype="<i8").tobytes()
        parent = hashlib.blake2b(parent + block, digest_size=16, person=b"kvpool.blk.v1").digest()
        expected.append(parent)
    assert hasher.hash_blocks(tokens) == expected


def test_native_chain_is_the_same_in_another_process_with_another_hash_seed() -> None:
    code = (
        "from kvpool_client.hashing import BlockHasher, HashNamespace\n"
        "h = BlockHasher(HashNamespace('m', 'float16', 'kv-split', 2, 1, 2))\n"
        "print(','.join(x.hex() for x in h.hash_blocks([5, 6, 7, 8, 9])))\n"
    )
    outputs = set()
    for seed in ("1", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              text=True, timeout=60, check=True)
        outputs.add(done.stdout.strip())
    here = BlockHasher(HashNamespace("m", "float16", "kv-split", 2, 1, 2))
    outputs.add(",".join(x.hex() for x in here.hash_blocks([5, 6, 7, 8, 9])))
    assert len(outputs) == 1


def test_native_chain_prefix_property_and_partial_block() -> None:
    hasher = BlockHasher(NS)
    a = hasher.hash_blocks(list(range(11)))  # 2 whole blocks + 3 tokens
    b = hasher.hash_blocks(list(range(8)) + [99, 98, 97, 96])
    assert len(a) == 2
    assert b[:2] == a and len(b) == 3
    c = hasher.hash_blocks([1] + list(range(1, 8)))
    assert c[0] != a[0] and c[1] != a[1]  # a changed first block changes every later hash
    assert hasher.hash_blocks([1, 2, 3]) == []
    assert hasher.hash_blocks(list(range(4, 8)), parent=a[0]) == [a[1]]


@pytest.mark.parametrize(
    "other",
    [
        HashNamespace("qwen2-other", "bfloat16", "kv-split", 4),
        HashNamespace("qwen2-test", "float16", "kv-split", 4),
        HashNamespace("qwen2-test", "bfloat16", "kv-fused", 4),
        HashNamespace("qwen2-test", "bfloat16", "kv-split", 4, tp_rank=1, tp_size=2),
        HashNamespace("qwen2-test", "bfloat16", "kv-split", 4, tp_rank=0, tp_size=2),
        HashNamespace("qwen2-test", "bfloat16", "kv-split", 4, pp_rank=0, pp_size=2),
        HashNamespace("qwen2-test", "bfloat16", "kv-split", 4, pp_rank=1, pp_size=2),
        HashNamespace("qwen2-test", "bfloat16", "kv-split", 4, extra="lora:sql-adapter"),
    ],
)
def test_every_namespace_field_changes_the_chain(other: HashNamespace) -> None:
    tokens = list(range(8))
    assert BlockHasher(other).hash_blocks(tokens)[0] != BlockHasher(NS).hash_blocks(tokens)[0]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"model": ""},
        {"model": "a\x00b"},
        {"dtype": ""},
        {"block_size": 0},
        {"block_size": True},
        {"block_size": 4.0},
        {"tp_rank": 2, "tp_size": 2},
        {"tp_rank": -1},
        {"pp_rank": 2, "pp_size": 2},
        {"extra": "a\x00b"},
    ],
)
def test_bad_namespace_is_refused(kwargs: dict[str, object]) -> None:
    fields: dict[str, object] = {"model": "m", "dtype": "float16", "layout": "kv-split",
                                 "block_size": 4}
    fields.update(kwargs)
    with pytest.raises(ValueError):
        HashNamespace(**fields)  # type: ignore[arg-type]


def test_bad_tokens_are_refused() -> None:
    hasher = BlockHasher(NS)
    with pytest.raises(ValueError):
        hasher.hash_blocks([0, 1, 2, 2**63])
    with pytest.raises(ValueError):
        hasher.hash_block(None, [1, 2, 3])


# --- MindIE ---------------------------------------------------------------------------------


def _mindie_reference(tokens: list[int], block_size: int, extra: int = 0) -> list[int]:
    """Second implementation: numpy uint64 arithmetic, which wraps like C++."""
    golden = np.uint64(0x9E3779B97F4A7C15)

    def combine(seed: np.uint64, value: int) -> np.uint64:
        v = np.int64(value).view(np.uint64)  # std::hash<long> is the identity, sign-extended
        with np.errstate(over="ignore"):
            seed = seed ^ (v + golden + (seed << np.uint64(6)) + (seed >> np.uint64(2)))
        return seed if seed != 0 else np.uint64(1)

    out: list[int] = []
    parent: np.uint64 | None = None
    for start in range(0, len(tokens) - block_size + 1, block_size):
        seed = np.uint64(0)
        if parent is not None:
            seed = combine(seed, int(parent.view(np.int64)))
        for token in tokens[start:start + block_size]:
            seed = combine(seed, token)
        parent = combine(seed, extra)
        out.append(int(parent))
    return out


def test_mindie_chain_golden_literals_from_its_cpp() -> None:
    tokens = [i * 1000 + 7 for i in range(12)]
    assert mindie_block_hashes(tokens, 4) == [
        9379597081435528616,
        16599014395534391224,
        13338899975345692195,
    ]
    assert mindie_block_hash(None, [-1, 151643, 0, 2147483647]) == 9379602261962107984
    assert mindie_block_hash(None, [0]) == 14813675350809533519
    assert mindie_block_hash(12345, [-1, 151643, 0, 2147483647], 42) == 14676710360006145055
    assert mindie_hash_combine(0, 0) == 0x9E3779B97F4A7C15


def test_mindie_chain_matches_numpy_reference() -> None:
    rng = np.random.default_rng(5)
    tokens = [int(t) for t in rng.integers(-3, 152_000, size=130)]
    assert mindie_block_hashes(tokens, 16) == _mindie_reference(tokens, 16)
    assert mindie_block_hashes(tokens, 16, extra_hash=7) == _mindie_reference(tokens, 16, 7)
    assert len(mindie_block_hashes(tokens, 16)) == 8


def test_mindie_zero_result_becomes_one() -> None:
    # seed ^ (v + K + (seed << 6) + (seed >> 2)) == 0 when v is chosen to cancel it.
    seed = 12345
    v = (seed - 0x9E3779B97F4A7C15 - (seed << 6) - (seed >> 2)) % 2**64
    assert mindie_hash_combine(seed, v) == 1


def test_mindie_key_format() -> None:
    assert mindie_key(9379597081435528616, 1, 8, "qwen2") == "9379597081435528616_1_8_qwen2"
    with pytest.raises(ValueError):
        mindie_key(-1, 0, 1, "m")
    with pytest.raises(ValueError):
        mindie_block_hash(None, [2**63])


# --- vLLM -----------------------------------------------------------------------------------


def test_vllm_none_hash_literals() -> None:
    assert vllm_none_hash(vllm_sha256, "0").hex() == (
        "1973e23848344dc43a988a9b478663803cfffe1243480253f9a3cf004b14aa7c")
    assert vllm_none_hash(vllm_sha256_cbor, "0").hex() == (
        "4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e")
    with pytest.raises(ValueError):
        vllm_none_hash(vllm_sha256, 0)  # type: ignore[arg-type]


def test_vllm_sha256_cbor_block_literals() -> None:
    fn = vllm_sha256_cbor
    none_hash = vllm_none_hash(fn, "0")
    assert vllm_block_hash(fn, none_hash, None, [1, 2, 3], ()).hex() == (
        "8850135ef1d7b33ac0b6e79034c039d9eb7beea6fc15fa9d826602f68aa4fb2d")
    assert vllm_block_hash(fn, none_hash, None, [1, 2, 3], ("image_hash:abc123",)).hex() == (
        "4186905812c6277a0d7d00e27740140ea7d60be1d75066097331b40dc144b40d")
    # vLLM passes extra_keys=None (CBOR null) when a block has none: a different digest.
    assert vllm_block_hash(fn, none_hash, None, [1, 2, 3]).hex() == (
        "cda40c7574ea461341f97ec2da7fd58b6a87bb2dec300b56459988ca24465813")


def test_vllm_sha256_pickle_matches_direct_definition() -> None:
    none_hash = hashlib.sha256(pickle.dumps("0", protocol=pickle.HIGHEST_PROTOCOL)).digest()
    tokens = list(range(100, 140))
    parent: bytes = none_hash
    expected = []
    for start in (0, 16):
        obj = (parent, tuple(tokens[start:start + 16]), None)
        parent = hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()
        expected.append(parent)
    assert vllm_block_hashes(tokens, 16, vllm_sha256, none_hash) == expected
    assert vllm_block_hash(vllm_sha256, none_hash, None, [1, 2, 3]).hex() == (
        "bb60f31e9f6a56c13d968d705160c17b5688adc51512c3e45ed537512280c0bd")


def test_vllm_cbor_encoder_matches_cbor2() -> None:
    cbor2 = pytest.importorskip("cbor2", reason="cbor2 (in the dev extra) is the reference")
    samples = [
        None, True, False, 0, 23, 24, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**64 - 1,
        -1, -24, -25, -256, -257, -(2**64), b"", b"\x00" * 32, "", "0", "lora-é",
        (b"\x01" * 32, tuple(range(300)), None),
        (b"\x02" * 32, (1, 2), ("salt", 7, ("mm", 3))),
        [1, [2, [3, []]]],
    ]
    for obj in samples:
        assert vllm_sha256_cbor(obj) == hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()
    fn = VLLM_HASH_FUNCTIONS["sha256_cbor"]
    none_hash = hashlib.sha256(cbor2.dumps("0", canonical=True)).digest()
    tokens = list(range(1000, 1050))
    parent = none_hash
    expected = []
    for start in (0, 16, 32):
        obj = (parent, tuple(tokens[start:start + 16]), None)
        parent = hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()
        expected.append(parent)
    assert vllm_block_hashes(tokens, 16, fn, none_hash) == expected


def test_vllm_cbor_refuses_types_it_cannot_encode_canonically() -> None:
    with pytest.raises(TypeError):
        vllm_sha256_cbor(1.5)
    with pytest.raises(TypeError):
        vllm_sha256_cbor(2**64)
    with pytest.raises(TypeError):
        vllm_sha256_cbor({"a": 1})
