"""CUDA KV blocks straight to another process's DRAM segment through a real transfer engine
(marker ``gpu``): Mooncake's CUDA ``TransferEngine`` (``mooncake-transfer-engine`` /
``-cuda13``) over its ``tcp`` protocol, the caller's device memory registered with it.

Through ``StagedBlockIO`` (the device staging buffer registered with the engine, no host
staging buffer of kvpool's) and through the drop-in (``register_buffer`` of CUDA K/V tensors,
block sub-ranges put and got). The owner of the segment is another process on another host id,
so no byte takes shared memory. Skipped where torch has no CUDA device or the CUDA engine wheel
is not importable.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

from helpers import client_worker  # noqa: E402

from kvpool_client.client import KVPoolClient  # noqa: E402
from kvpool_client.config import ClientConfig  # noqa: E402
from kvpool_client.staging import StagedBlockIO  # noqa: E402
from kvpool_client.tensors import PagedKVCache  # noqa: E402
from kvpool_client.transfer.engine import load_engine_class  # noqa: E402
from kvpool_wire.status import KVPoolError  # noqa: E402

HERE = Path(__file__).parent
GEOMETRY = {"num_layers": 4, "num_blocks": 40, "block_size": 16, "num_heads": 8,
            "head_dim": 128, "dtype": torch.bfloat16, "device": "cuda"}


cw = client_worker()


@pytest.fixture
def engine_pool(master: Any, monkeypatch: pytest.MonkeyPatch
                ) -> Iterator[tuple[Any, KVPoolClient]]:
    """(owner process with a DRAM segment, this process's client with no segment)."""
    try:
        load_engine_class()
    except KVPoolError as exc:
        pytest.skip(str(exc))
    engine = {"transport": "engine", "protocol": "tcp", "master_server_address": master.address}
    owner = cw.Worker({**engine, "global_segment_size": "256mb"},
                      env={"KVPOOL_HOST_ID": "gpu-owner", "GLOG_minloglevel": "2"})
    monkeypatch.setenv("KVPOOL_HOST_ID", "gpu-caller")
    try:
        client = KVPoolClient(ClientConfig.from_dict({**engine, "global_segment_size": 0}))
    except BaseException:
        owner.stop()
        raise
    try:
        yield owner, client
    finally:
        client.close()
        owner.stop()


def test_staged_block_io_moves_device_blocks_through_the_engine(
        engine_pool: tuple[Any, KVPoolClient]) -> None:
    _, client = engine_pool
    source = PagedKVCache.allocate(**GEOMETRY)
    for t in source.k_caches + source.v_caches:
        t.copy_(torch.randn_like(t, dtype=torch.float32).to(t.dtype))
    io = StagedBlockIO(source, client, chunk_blocks=8)  # several chunks per call
    assert io.engine and not io.direct and not io.staging
    keys = [f"gpu-engine-{b}" for b in range(20)]
    assert io.put_blocks(keys, list(range(20))) == [True] * 20
    target = PagedKVCache.allocate(**GEOMETRY)
    back = StagedBlockIO(target, client, chunk_blocks=8)
    ids = list(range(39, 19, -1))  # other blocks, reversed order
    assert back.get_blocks(keys + ["gpu-engine-missing"], ids + [0]) == [True] * 20 + [False]
    for b, t in zip(range(20), ids, strict=True):
        for s, d in zip(source.block_tensors(b), target.block_tensors(t), strict=True):
            assert torch.equal(s, d)
    assert torch.count_nonzero(target.k_caches[0][0]) == 0  # the missing block left alone
    used = {t for (t, _) in client.metrics.transfer_bytes}
    assert used == {"engine"}


def test_the_drop_in_puts_cuda_ranges_through_the_engine(
        engine_pool: tuple[Any, KVPoolClient], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, master: Any) -> None:
    from kvpool_client.compat.mooncake import MooncakeDistributedStore

    config = tmp_path / "kvpool.json"
    config.write_text(json.dumps({"transport": "engine"}))
    monkeypatch.setenv("KVPOOL_CONFIG_PATH", str(config))
    blocks, block_bytes = 8, 64 << 10
    caches = [torch.randint(0, 255, (blocks * block_bytes,), dtype=torch.uint8, device="cuda")
              for _ in range(4)]
    store = MooncakeDistributedStore()
    assert store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", master.address) == 0
    try:
        for cache in caches:
            assert store.register_buffer(cache.data_ptr(), cache.nbytes) == 0
        keys = [f"dropin-gpu-{b}" for b in range(blocks)]
        ptrs = [[c.data_ptr() + b * block_bytes for c in caches] for b in range(blocks)]
        sizes = [[block_bytes] * len(caches) for _ in range(blocks)]
        assert store.batch_put_from_multi_buffers(keys, ptrs, sizes) == [0] * blocks
        expected = [c.clone() for c in caches]
        for cache in caches:
            cache.zero_()
        assert store.batch_get_into_multi_buffers(keys, ptrs, sizes) == \
            [4 * block_bytes] * blocks
        for cache, want in zip(caches, expected, strict=True):
            assert torch.equal(cache, want)
        used = {t for (t, _) in store._client.metrics.transfer_bytes}  # noqa: SLF001
        assert used == {"engine"}
    finally:
        store.close()
