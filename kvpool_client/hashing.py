"""Chained block hashes: the identity of a KV block, and so the name of its pool object.

Rules of this file:
- A block hash depends only on the tokens of its block, the hash of the block before it and a
  namespace (model, dtype, layout, block size, rank). Never on a per-process random value:
  pool keys must be the same on every host and after every restart, or nothing is ever shared.
- Only whole blocks are hashed. A trailing partial block has no hash and is never reused.
- Besides the native chain, this file reproduces the two chains inference engines already use,
  so that kvpool keys can be made bit-identical to theirs:
  * MindIE (``mindie_llm`` ``PrefixCachingBlockObj::PrefixHash``): 64-bit ``HashCombine`` of
    the parent hash, each token and an extra hash (LoRA), starting from 0;
  * vLLM v1 (``vllm/v1/core/kv_cache_utils.py`` ``hash_block_tokens``):
    ``hash_fn((parent or NONE_HASH, tuple(tokens), extra_keys))`` with ``hash_fn`` one of
    ``sha256`` (pickle) or ``sha256_cbor`` (canonical CBOR), and
    ``NONE_HASH = hash_fn(PYTHONHASHSEED)``.
"""

from __future__ import annotations

import hashlib
import pickle
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NewType

BlockHash = NewType("BlockHash", bytes)

#: digest size of the native chain, in bytes (128 bits: collisions are not a practical concern)
NATIVE_DIGEST_BYTES = 16
_NAMESPACE_PERSON = b"kvpool.ns.v1"
_BLOCK_PERSON = b"kvpool.blk.v1"
_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1


@dataclass(frozen=True, slots=True)
class HashNamespace:
    """Everything that makes two blocks with the same tokens hold different bytes.

    ``layout`` names the paged layout of the saved object (for example ``"kv-split"``); a rank
    is part of the namespace because each tensor-parallel rank holds a different slice of the
    heads, and a pipeline stage because each holds different layers. ``extra`` names anything
    else that changes a block's bytes for the same tokens (a LoRA adapter, a cache salt). The
    stage and ``extra`` enter the digest only when set, so chains of one stage and no extra
    keep the hashes they always had.
    """

    model: str
    dtype: str
    layout: str
    block_size: int
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    extra: str = ""

    def __post_init__(self) -> None:
        for name in ("model", "dtype", "layout"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value or "\x00" in value:
                raise ValueError(f"{name} must be a non-empty string without NUL, got {value!r}")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int):
            raise ValueError(f"block_size must be an int, got {self.block_size!r}")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {self.block_size}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"need 0 <= tp_rank < tp_size, got {self.tp_rank}/{self.tp_size}")
        if not 0 <= self.pp_rank < self.pp_size:
            raise ValueError(f"need 0 <= pp_rank < pp_size, got {self.pp_rank}/{self.pp_size}")
        if not isinstance(self.extra, str) or "\x00" in self.extra:
            raise ValueError(f"extra must be a string without NUL, got {self.extra!r}")

    def seed(self) -> BlockHash:
        """The parent hash of a chain's first block: a digest of every namespace field."""
        fields = [self.model, self.dtype, self.layout, str(self.block_size), str(self.tp_rank),
                  str(self.tp_size)]
        if self.pp_size != 1 or self.extra:
            fields += [f"pp{self.pp_rank}of{self.pp_size}", self.extra]
        text = "\x00".join(fields)
        digest = hashlib.blake2b(
            text.encode(), digest_size=NATIVE_DIGEST_BYTES, person=_NAMESPACE_PERSON
        ).digest()
        return BlockHash(digest)


def _whole_blocks(tokens: Sequence[int], block_size: int) -> list[Sequence[int]]:
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    num_blocks = len(tokens) // block_size
    return [tokens[i * block_size:(i + 1) * block_size] for i in range(num_blocks)]


def _pack_tokens(tokens: Sequence[int]) -> bytes:
    # Fixed little-endian int64 so the bytes hashed never depend on the platform.
    try:
        return struct.pack(f"<{len(tokens)}q", *tokens)
    except struct.error as exc:
        raise ValueError(f"tokens must be ints in the int64 range: {exc}") from None


class BlockHasher:
    """The native chain: ``h_i = blake2b(h_{i-1} || tokens_i as little-endian int64)``.

    ``h_{-1}`` is the namespace seed. Keys name the model and rank in clear text so that an
    operator can remove one model's blocks with a regex.
    """

    def __init__(self, namespace: HashNamespace) -> None:
        self.namespace = namespace
        self._seed = namespace.seed()

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self.namespace.block_size

    def hash_block(self, parent: BlockHash | None, tokens: Sequence[int]) -> BlockHash:
        """The hash of one whole block after ``parent`` (None for the first block).

        Raises ``ValueError`` when ``tokens`` is not exactly one block of int64 values.
        """
        if len(tokens) != self.block_size:
            raise ValueError(f"a block holds {self.block_size} tokens, got {len(tokens)}")
        h = hashlib.blake2b(digest_size=NATIVE_DIGEST_BYTES, person=_BLOCK_PERSON)
        h.update(self._seed if parent is None else parent)
        h.update(_pack_tokens(tokens))
        return BlockHash(h.digest())

    def hash_blocks(
        self, tokens: Sequence[int], parent: BlockHash | None = None
    ) -> list[BlockHash]:
        """Hashes of every whole block of ``tokens`` (a trailing partial block has none)."""
        hashes: list[BlockHash] = []
        for block in _whole_blocks(tokens, self.block_size):
            parent = self.hash_block(parent, block)
            hashes.append(parent)
        return hashes

    def key(self, block_hash: BlockHash) -> str:
        """The pool key of a block: ``kv:{model}:{tp_rank}:{hash hex}``."""
        return f"kv:{self.namespace.model}:{self.namespace.tp_rank}:{block_hash.hex()}"


# --- MindIE ---------------------------------------------------------------------------------

_MASK64 = 2**64 - 1
_GOLDEN_64 = 0x9E3779B97F4A7C15


def mindie_hash_combine(seed: int, value: int) -> int:
    """One step of MindIE's ``HashCombine``: the new 64-bit seed.

    ``seed ^= v + 0x9E3779B97F4A7C15 + (seed << 6) + (seed >> 2)`` in uint64 arithmetic, where
    ``v = std::hash<long>(value)`` is the value itself (sign-extended to 64 bits); a result of
    0 (MindIE's invalid hash) becomes 1, as MindIE does.
    """
    seed &= _MASK64
    v = value & _MASK64
    seed ^= (v + _GOLDEN_64 + (seed << 6) + (seed >> 2)) & _MASK64
    return seed if seed != 0 else 1


def mindie_block_hash(parent: int | None, tokens: Sequence[int], extra_hash: int = 0) -> int:
    """MindIE's hash of one full block: start at 0, combine the parent (if any), each token,
    then the extra hash (0 unless LoRA)."""
    seed = 0
    if parent is not None:
        seed = mindie_hash_combine(seed, parent)
    for token in tokens:
        if not _INT64_MIN <= token <= _INT64_MAX:
            raise ValueError(f"token {token} is outside the int64 range")
        seed = mindie_hash_combine(seed, token)
    return mindie_hash_combine(seed, extra_hash)


def mindie_block_hashes(tokens: Sequence[int], block_size: int, extra_hash: int = 0) -> list[int]:
    """MindIE's chained 64-bit hashes of every whole block of ``tokens``."""
    hashes: list[int] = []
    parent: int | None = None
    for block in _whole_blocks(tokens, block_size):
        parent = mindie_block_hash(parent, block, extra_hash)
        hashes.append(parent)
    return hashes


def mindie_key(hash64: int, tp_rank: int, tp_size: int, model_name: str) -> str:
    """MindIE's pool key of a block: ``f"{hash64}_{tp_rank}_{tp_size}_{model_name}"``."""
    if not 0 <= hash64 <= _MASK64:
        raise ValueError(f"not a 64-bit hash: {hash64}")
    return f"{hash64}_{tp_rank}_{tp_size}_{model_name}"


# --- vLLM -----------------------------------------------------------------------------------


def vllm_sha256(obj: Any) -> bytes:
    """vLLM's ``sha256``: SHA-256 of ``pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)``."""
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def vllm_sha256_cbor(obj: Any) -> bytes:
    """vLLM's ``sha256_cbor``: SHA-256 of ``cbor2.dumps(obj, canonical=True)``.

    The canonical CBOR is written here (ints, bytes, str, bool, None, tuples and lists: what
    block-hash inputs hold), so no CBOR package is needed. Raises ``TypeError`` for other types.
    """
    out = bytearray()
    _cbor_encode(obj, out)
    return hashlib.sha256(bytes(out)).digest()


def _cbor_head(major: int, value: int, out: bytearray) -> None:
    if value < 24:
        out.append(major << 5 | value)
    elif value < 2**8:
        out += bytes((major << 5 | 24, value))
    elif value < 2**16:
        out.append(major << 5 | 25)
        out += value.to_bytes(2, "big")
    elif value < 2**32:
        out.append(major << 5 | 26)
        out += value.to_bytes(4, "big")
    else:
        out.append(major << 5 | 27)
        out += value.to_bytes(8, "big")


def _cbor_encode(obj: Any, out: bytearray) -> None:
    if obj is None:
        out.append(0xF6)
    elif obj is True:
        out.append(0xF5)
    elif obj is False:
        out.append(0xF4)
    elif isinstance(obj, int):
        if not -(2**64) <= obj < 2**64:
            raise TypeError(f"integer {obj} needs a CBOR bignum, which block hashes never use")
        if obj >= 0:
            _cbor_head(0, obj, out)
        else:
            _cbor_head(1, -1 - obj, out)
    elif isinstance(obj, (bytes, bytearray, memoryview)):
        data = bytes(obj)
        _cbor_head(2, len(data), out)
        out += data
    elif isinstance(obj, str):
        data = obj.encode("utf-8")
        _cbor_head(3, len(data), out)
        out += data
    elif isinstance(obj, (tuple, list)):
        _cbor_head(4, len(obj), out)
        for item in obj:
            _cbor_encode(item, out)
    else:
        raise TypeError(f"cannot CBOR-encode {type(obj).__name__} for a block hash")


#: vLLM's hash functions by their ``--prefix-caching-hash-algo`` names
VLLM_HASH_FUNCTIONS: dict[str, Callable[[Any], bytes]] = {
    "sha256": vllm_sha256,
    "sha256_cbor": vllm_sha256_cbor,
}


def vllm_none_hash(hash_fn: Callable[[Any], bytes], python_hash_seed: str) -> bytes:
    """vLLM's ``NONE_HASH`` (the parent of a first block) for a given ``PYTHONHASHSEED``.

    vLLM uses ``hash_fn(os.getenv("PYTHONHASHSEED"))`` and 32 random bytes when the variable is
    unset; a pool shared across instances needs the variable set, so it is a required argument.
    """
    if not isinstance(python_hash_seed, str):
        raise ValueError("python_hash_seed is the PYTHONHASHSEED string, e.g. '0'")
    return hash_fn(python_hash_seed)


def vllm_block_hash(
    hash_fn: Callable[[Any], bytes],
    none_hash: bytes,
    parent: bytes | None,
    tokens: Sequence[int],
    extra_keys: tuple[Any, ...] | None = None,
) -> bytes:
    """vLLM's ``hash_block_tokens``: ``hash_fn((parent or NONE_HASH, tuple(tokens), extra))``."""
    return hash_fn((parent if parent else none_hash, tuple(tokens), extra_keys))


def vllm_block_hashes(
    tokens: Sequence[int],
    block_size: int,
    hash_fn: Callable[[Any], bytes],
    none_hash: bytes,
    extra_keys: tuple[Any, ...] | None = None,
) -> list[bytes]:
    """vLLM's chained hashes of every whole block of ``tokens`` (same extra keys each block)."""
    hashes: list[bytes] = []
    parent: bytes | None = None
    for block in _whole_blocks(tokens, block_size):
        parent = vllm_block_hash(hash_fn, none_hash, parent, block, extra_keys)
        hashes.append(parent)
    return hashes
