"""Mooncake 0.3.13's tensor calls through the drop-in, against a real master: every dtype Mooncake
numbers, shapes from zero dimensions to eight, empty tensors, non-contiguous input, batches,
``ReplicateConfig``, upserts, reads into registered memory, tensor-parallel shards, Mooncake's
own object layout, and bad input that stores nothing. Real torch on the CPU."""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Iterator
from typing import Any

import pytest
from helpers import drop_in_store

torch = pytest.importorskip("torch")

from kvpool_client.compat.mooncake import (  # noqa: E402
    MooncakeDistributedStore,
    ReplicateConfig,
    SoftPinAction,
)
from kvpool_client.compat.tensor_format import (  # noqa: E402
    DTYPES,
    HEADER_BYTES,
    Shard,
    TensorHeader,
    decode,
    encode,
)

MiB = 1 << 20


@pytest.fixture
def store(start_master: Any) -> Iterator[MooncakeDistributedStore]:
    master = start_master(default_kv_lease_ttl=500)
    with drop_in_store(master.address, 64 * MiB, 16 * MiB) as s:
        yield s


def _same(expected: Any, got: Any) -> bool:
    return got is not None and got.dtype == expected.dtype and \
        tuple(got.shape) == tuple(expected.shape) and torch.equal(got, expected)


def _sample(name: str) -> Any:
    dtype = getattr(torch, name)
    values = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4) - 7
    if name == "bool":
        return values > 0
    if name.startswith("uint"):
        values = values.abs()
    return values.to(dtype)


@pytest.mark.parametrize("name", [name for name, _ in DTYPES])
def test_every_mooncake_dtype_round_trips(store: MooncakeDistributedStore, name: str) -> None:
    tensor = _sample(name)
    assert store.put_tensor(f"dtype-{name}", tensor) == 0
    assert store.get_size(f"dtype-{name}") == HEADER_BYTES + tensor.numel() * tensor.itemsize
    assert _same(tensor, store.get_tensor(f"dtype-{name}"))


def test_shapes_empty_tensors_and_non_contiguous_input(store: MooncakeDistributedStore) -> None:
    tensors = {
        "scalar": torch.tensor(3.5),
        "empty": torch.empty((2, 0, 3), dtype=torch.bfloat16),
        "eight-dims": torch.arange(256, dtype=torch.int16).reshape((2,) * 8),
        "transposed": torch.arange(12, dtype=torch.float64).reshape(3, 4).t(),
        "random": torch.rand(1000),
    }
    for key, tensor in tensors.items():
        assert store.put_tensor(key, tensor) == 0, key
    for key, tensor in tensors.items():
        assert _same(tensor, store.get_tensor(key)), key
    got = store.batch_get_tensor([*tensors, "missing"])
    assert [_same(t, g) for t, g in zip(tensors.values(), got[:-1], strict=True)] == \
        [True] * len(tensors)
    assert got[-1] is None and store.get_tensor("missing") is None
    got = store.get_tensor("random")
    got += 1  # the tensor owns its memory: the next read is unchanged
    assert _same(tensors["random"], store.get_tensor("random"))


def test_bad_input_stores_nothing(store: MooncakeDistributedStore) -> None:
    assert store.put_tensor("list", [1, 2]) == -600
    assert store.put_tensor("complex", torch.ones(2, dtype=torch.complex64)) == -600
    assert store.put_tensor("nine-dims", torch.ones((1,) * 9)) == -600
    assert store.batch_put_tensor(["a", "b"], [torch.ones(1)]) == [-600, -600]
    assert [store.is_exist(k) for k in ("list", "complex", "nine-dims", "a", "b")] == [0] * 5
    assert store.put("raw", b"x" * 400) == 0
    assert store.get_tensor("raw") is None  # bytes that are not a tensor object
    big = torch.zeros(17 * MiB, dtype=torch.uint8)  # more than local_buffer_size, as Mooncake
    assert store.put_tensor("big", big) == -600 and store.is_exist("big") == 0


def test_batches_config_existing_keys_and_upserts(store: MooncakeDistributedStore) -> None:
    first = [torch.arange(16, dtype=torch.float32).reshape(4, 4),
             torch.arange(24, dtype=torch.int64).reshape(2, 3, 4)]
    assert store.batch_put_tensor(["b0", "b1"], first) == [0, 0]
    assert store.put_tensor("b0", torch.zeros(1)) == 0  # write-once: the first value stays
    assert _same(first[0], store.get_tensor("b0"))
    assert store.batch_upsert_tensor(["b0", "b2"], [torch.ones(3), torch.ones(2)]) == [0, 0]
    assert _same(torch.ones(3), store.get_tensor("b0"))
    assert _same(torch.ones(2), store.get_tensor("b2"))
    config = ReplicateConfig()
    config.replica_num = 1
    assert store.pub_tensor("p0", torch.ones(4), config) == 0
    assert store.batch_pub_tensor(["p1"], [torch.zeros(4)], config) == [0]
    assert store.upsert_pub_tensor("p0", torch.full((2,), 7.0), config) == 0
    assert store.batch_upsert_pub_tensor(["p1"], [torch.full((2,), 8.0)], config) == [0]
    assert _same(torch.full((2,), 7.0), store.get_tensor("p0"))
    assert _same(torch.full((2,), 8.0), store.get_tensor("p1"))
    config.soft_pin_action = SoftPinAction.DISABLE
    config.soft_pin_ttl_ms = 1000  # a pin time without a soft pin: refused, nothing stored
    assert store.pub_tensor("p2", torch.ones(1), config) < 0 and store.is_exist("p2") == 0


def test_reads_into_registered_memory_share_its_bytes(store: MooncakeDistributedStore) -> None:
    tensor = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    assert store.put_tensor("t", tensor) == 0
    size = store.get_size("t")
    buffer = (ctypes.c_ubyte * 4096)()
    ptr = ctypes.addressof(buffer)
    assert store.register_buffer(ptr, 4096) == 0
    got = store.get_tensor_into("t", ptr, 4096)
    assert _same(tensor, got) and got.data_ptr() == ptr + HEADER_BYTES
    buffer[HEADER_BYTES] ^= 0xFF  # the tensor is a view of the buffer
    assert not torch.equal(got, tensor)
    buffer[HEADER_BYTES] ^= 0xFF
    assert store.get_tensor_into("t", ptr, size - 1) is None  # too small
    assert store.get_tensor_into("missing", ptr, 4096) is None
    got = store.batch_get_tensor_into(["t", "missing"], [ptr, ptr + 2048], [2048, 2048])
    assert _same(tensor, got[0]) and got[1] is None
    assert store.batch_get_tensor_into(["t"], [ptr, ptr], [1, 1]) == [-600]

    # put_tensor_from takes the object as get_tensor_into left it; anything else is -600
    assert store.put_tensor_from("copy", ptr, size) == 0
    assert _same(tensor, store.get_tensor("copy"))
    assert store.put_tensor_from("off-by-one", ptr + 1, size - 1) == -600
    assert store.put_tensor_from("short", ptr, size - 4) == -600
    assert store.batch_put_tensor_from(["c1", "c2"], [ptr, ptr + 1], [size, 40]) == [0, -600]
    assert store.upsert_tensor_from("copy", ptr, size) == 0
    assert store.batch_upsert_tensor_from(["c1"], [ptr], [size]) == [0]
    unregistered = (ctypes.c_ubyte * 4096)()
    ctypes.memmove(unregistered, buffer, size)
    assert store.put_tensor_from("unregistered", ctypes.addressof(unregistered), size) == -600
    assert [store.is_exist(k) for k in ("off-by-one", "short", "c2", "unregistered")] == [0] * 4
    store.unregister_buffer(ptr)


def test_tensor_parallel_shards(store: MooncakeDistributedStore) -> None:
    tensor = torch.arange(24).reshape(4, 6)
    assert store.put_tensor_with_tp("w", tensor, tp_size=2, split_dim=1) == 0
    assert store.is_exist("w") == 0 and store.is_exist("w_tp_0") == 1
    for rank in range(2):
        expected = tensor.narrow(1, rank * 3, 3)
        assert _same(expected, store.get_tensor_with_tp("w", tp_rank=rank, tp_size=2))
    raw = store.get("w_tp_1")
    header = decode(raw, len(raw))
    assert header == TensorHeader("int64", (4, 3), (4, 6), Shard(1, 2, 1))

    assert store.put_tensor_with_tp("whole", tensor, tp_size=1) == 0  # one rank: the key itself
    assert store.is_exist("whole") == 1 and store.is_exist("whole_tp_0") == 0
    assert _same(tensor, store.get_tensor_with_tp("whole"))

    assert store.put_tensor_with_tp("uneven", torch.arange(6).reshape(3, 2), tp_size=2) == -600
    assert store.put_tensor_with_tp("bad-dim", tensor, tp_size=2, split_dim=2) == -600
    assert store.is_exist("uneven_tp_0") == 0 and store.is_exist("bad-dim_tp_0") == 0
    assert store.batch_put_tensor_with_tp(["z", "u"], [torch.empty((2, 0, 3)),
                                                       torch.arange(3)], tp_size=2) == [0, -600]
    got = store.batch_get_tensor_with_tp(["z", "u"], tp_rank=1, tp_size=2)
    assert tuple(got[0].shape) == (1, 0, 3) and got[1] is None
    assert store.pub_tensor_with_tp("pw", tensor, ReplicateConfig(), tp_size=2) == 0
    assert store.batch_pub_tensor_with_tp(["pw2"], [tensor], None, tp_size=3, split_dim=1) == [0]
    assert _same(tensor.narrow(0, 2, 2), store.get_tensor_with_tp("pw", tp_rank=1, tp_size=2))

    buffer = (ctypes.c_ubyte * 8192)()
    ptr = ctypes.addressof(buffer)
    assert store.register_buffer(ptr, 8192) == 0
    got = store.get_tensor_with_tp_into("w", ptr, 4096, tp_rank=0, tp_size=2)
    assert _same(tensor.narrow(1, 0, 3), got)
    got = store.batch_get_tensor_with_tp_into(["w", "pw"], [ptr, ptr + 4096], [4096, 4096],
                                              tp_rank=1, tp_size=2)
    assert _same(tensor.narrow(1, 3, 3), got[0]) and _same(tensor.narrow(0, 2, 2), got[1])
    assert store.put_tensor("src", tensor) == 0
    size = store.get_size("src")
    assert store.get_into("src", ptr, 8192) == size
    assert store.put_tensor_with_tp_from("from", ptr, size, tp_size=2, split_dim=0) == 0
    assert store.batch_put_tensor_with_tp_from(["from2", "bad"], [ptr, ptr + 1], [size, size],
                                               tp_size=2) == [0, -600]
    assert _same(tensor.narrow(0, 2, 2), store.get_tensor_with_tp("from2", 1, 2))
    store.unregister_buffer(ptr)


def test_object_layout_is_mooncakes() -> None:
    header = TensorHeader("float32", (2, 3), (2, 3))
    raw = encode(header) + bytes(24)
    assert len(encode(header)) == HEADER_BYTES == 304
    assert struct.unpack_from("<IHHiiIIQQ", raw, 0) == (0x4D4F4F4E, 1, 304, 0, 2, 0, 0, 304, 24)
    assert struct.unpack_from("<3q", raw, 40) == (2, 3, -1)
    assert decode(raw, len(raw)) == header
    for corrupt_at in (0, 4, 12, 16, 24, 32, 40, 104):  # magic .. shapes: each refuses
        broken = bytearray(raw)
        broken[corrupt_at] ^= 0x7F
        assert decode(broken, len(broken)) is None, corrupt_at
    assert decode(raw, len(raw) + 1) is None and decode(raw[:300], 300) is None
