"""LMCache remote storage plugin ``kvpool``: ``KVPoolConnectorAdapter``, ``KVPoolRemoteConnector``.

- ``test_lmcache_engine_with_mock_gpu_connector`` (marker ``slow``) runs LMCache 0.5.6's own
  engine through the plugin against a real master: store, drop the local copy, lookup served by
  the pool, retrieve byte-exact. LMCache pins ``numpy<=2.2.6``, ``grpcio==1.78.0`` and
  ``protobuf<7``, so it lives in its own environment (``make lmcache-env`` builds
  ``.venv-lmcache``; ``.ci/run`` does): the test runs in-process where ``lmcache`` imports, and
  otherwise re-runs itself with that environment's Python.
- ``test_remote_connector_protocol`` drives the connector's RemoteConnector protocol directly
  (async exists/get/put/list/close, exists_sync, batched forms, partial chunks, a missing key
  handing its buffer back) in this environment. LMCache's base classes are replaced by
  stand-ins with the same constructor and attributes as 0.5.6's
  (``lmcache/v1/storage_backend/connector``), and its CPU backend by a small allocator of
  torch tensors, so each branch of the connector can be reached and checked.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import subprocess
import sys
import time
import types
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
LMCACHE_PYTHON = Path(os.environ.get("KVPOOL_LMCACHE_PYTHON", ROOT / ".venv-lmcache/bin/python"))
# LMCache reports usage to its own server unless told not to; tests talk to 127.0.0.0/8 only.
NO_TELEMETRY = {"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1"}


# --- stand-ins for LMCache 0.5.6's base classes ---

class ConnectorAdapter:
    def __init__(self, schema: str = "") -> None:
        self.schema = schema

    def can_parse(self, url: str) -> bool:
        return self.schema != "" and url.startswith(self.schema)


@dataclass
class ConnectorContext:
    url: str
    loop: asyncio.AbstractEventLoop
    local_cpu_backend: Any
    config: Any
    metadata: Any
    plugin_name: str | None = None


class RemoteConnector:
    """The attributes LMCache's RemoteConnector.__init__ sets, and its partial-chunk reshape."""

    def __init__(self, config: Any, metadata: Any) -> None:
        self.meta_shapes = metadata.get_shapes()
        self.meta_dtypes = metadata.get_dtypes()
        self.meta_fmt = "KV_2LTD"
        self.full_chunk_size_bytes = sum(torch.Size(s).numel() * d.itemsize
                                         for s, d in zip(self.meta_shapes, self.meta_dtypes,
                                                         strict=True))
        self.single_token_size = self.full_chunk_size_bytes // metadata.chunk_size

    def reshape_partial_chunk(self, memory_obj: Any, bytes_read: int) -> Any:
        if bytes_read % self.single_token_size or bytes_read > self.full_chunk_size_bytes:
            raise ValueError(f"bytes_read: {bytes_read} is illegal")
        shape = list(memory_obj.shape)
        shape[2] = bytes_read // self.single_token_size
        memory_obj.shape = torch.Size(shape)
        memory_obj.raw_data = memory_obj.raw_data[:bytes_read]
        return memory_obj


class MemoryObj:
    def __init__(self, shape: torch.Size, dtype: torch.dtype) -> None:
        self.shape, self.dtype = shape, dtype
        self.raw_data = torch.zeros(shape, dtype=dtype).view(torch.uint8).flatten()
        self.refs = 1

    @property
    def byte_array(self) -> memoryview:
        return memoryview(self.raw_data.numpy())

    def ref_count_down(self) -> None:
        self.refs -= 1


class CpuBackend:
    def __init__(self, config: Any, metadata: Any) -> None:
        self.config, self.metadata = config, metadata
        self.allocated: list[MemoryObj] = []

    def allocate(self, shapes: list[torch.Size], dtypes: list[torch.dtype], fmt: Any) -> MemoryObj:
        assert fmt == "KV_2LTD"
        obj = MemoryObj(shapes[0], dtypes[0])
        self.allocated.append(obj)
        return obj


@dataclass
class Metadata:
    chunk_size: int = 16

    def get_shapes(self) -> list[torch.Size]:
        return [torch.Size([2, 3, self.chunk_size, 32])]  # [K/V, layers, tokens, hidden]

    def get_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16]


@dataclass
class Key:
    chunk_hash: int

    def to_string(self) -> str:
        return f"model@1@0@{self.chunk_hash:x}@bfloat16"


@pytest.fixture
def lmcache_module(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``kvpool_client.connectors.lmcache`` imported over the stand-ins."""
    connector_pkg = types.ModuleType("lmcache.v1.storage_backend.connector")
    connector_pkg.ConnectorAdapter = ConnectorAdapter  # type: ignore[attr-defined]
    connector_pkg.ConnectorContext = ConnectorContext  # type: ignore[attr-defined]
    base = types.ModuleType("lmcache.v1.storage_backend.connector.base_connector")
    base.RemoteConnector = RemoteConnector  # type: ignore[attr-defined]
    for name in ("lmcache", "lmcache.v1", "lmcache.v1.storage_backend"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, connector_pkg.__name__, connector_pkg)
    monkeypatch.setitem(sys.modules, base.__name__, base)
    monkeypatch.delitem(sys.modules, "kvpool_client.connectors.lmcache", raising=False)
    module = importlib.import_module("kvpool_client.connectors.lmcache")
    yield module
    sys.modules.pop("kvpool_client.connectors.lmcache", None)


def chunk(backend: CpuBackend, value: int, tokens: int = 16) -> MemoryObj:
    obj = MemoryObj(torch.Size([2, 3, tokens, 32]), torch.bfloat16)
    generator = torch.Generator().manual_seed(value)
    obj.raw_data[:] = torch.randint(0, 256, obj.raw_data.shape, generator=generator,
                                    dtype=torch.uint8)
    return obj


def test_remote_connector_protocol(lmcache_module: Any, master: Any) -> None:
    adapter = lmcache_module.KVPoolConnectorAdapter()
    assert adapter.can_parse("plugin://kvpool") and adapter.can_parse("plugin://kvpool.a")
    assert adapter.can_parse("kvpool://10.0.0.1:50051")
    assert not adapter.can_parse("plugin://fs") and not adapter.can_parse("plugin://kvpoolx")
    config = types.SimpleNamespace(use_layerwise=False, extra_config={
        "remote_storage_plugin.kvpool.module_path": "kvpool_client.connectors.lmcache",
        "remote_storage_plugin.kvpool.class_name": "KVPoolConnectorAdapter",
        "remote_storage_plugin.kvpool.master_server_address": master.address,
        "remote_storage_plugin.kvpool.global_segment_size": "16mb"})
    backend = CpuBackend(config, Metadata())

    async def scenario() -> dict[str, Any]:
        context = ConnectorContext("plugin://kvpool", asyncio.get_running_loop(), backend,
                                   config, backend.metadata, "kvpool")
        connector = adapter.create_connector(context)
        keys = [Key(h) for h in (0xA1, 0xA2, 0xA3, 0xA4)]
        objs = [chunk(backend, i) for i in range(3)] + [chunk(backend, 3, tokens=5)]
        out: dict[str, Any] = {}
        out["exists_before"] = [await connector.exists(keys[0]), connector.exists_sync(keys[0])]
        await connector.put(keys[0], objs[0])
        await connector.batched_put(keys[1:], objs[1:])
        await connector.put(keys[0], objs[1])  # an existing chunk keeps its first bytes
        out["exists_after"] = [await connector.exists(k) for k in keys]
        out["contains"] = [await connector.batched_async_contains("l1", keys + [Key(0xFF)]),
                           connector.batched_contains([keys[0], Key(0xFF), keys[1]])]
        got = await connector.get(keys[0])
        out["get_exact"] = bytes(got.byte_array) == bytes(objs[0].byte_array)
        batch = await connector.batched_get([keys[2], Key(0xFF), keys[3]])
        out["batched_none"] = batch[1] is None
        out["batched_exact"] = bytes(batch[0].byte_array) == bytes(objs[2].byte_array)
        out["partial_tokens"] = batch[2].shape[2]
        out["partial_exact"] = bytes(batch[2].byte_array) == bytes(objs[3].byte_array)
        out["released"] = sorted(o.refs for o in backend.allocated)
        out["missing"] = await connector.get(Key(0xEE))
        out["async_contains"] = connector.support_batched_async_contains()
        before = len(backend.allocated)
        prefix = await connector.batched_get_non_blocking("l2", [keys[0], keys[2], Key(0xFF),
                                                                 keys[3]])
        out["prefix"] = [bytes(o.byte_array) for o in prefix] == [bytes(objs[0].byte_array),
                                                                  bytes(objs[2].byte_array)]
        out["after_prefix_released"] = [o.refs for o in backend.allocated[before + 2:]]
        out["remove"] = [connector.remove_sync(keys[1]), connector.remove_sync(keys[1])]
        out["list"] = await connector.list()
        await connector.close()
        return out

    out = asyncio.run(scenario())
    assert out["exists_before"] == [False, False]
    assert out["exists_after"] == [True] * 4
    assert out["contains"] == [4, 1]
    assert out["get_exact"] and out["batched_none"] and out["batched_exact"]
    assert out["partial_tokens"] == 5 and out["partial_exact"]
    assert out["released"][0] == 0  # the buffer allocated for the missing chunk went back
    assert out["missing"] is None
    assert out["async_contains"] and out["prefix"]
    assert out["after_prefix_released"] == [0, 0]  # the missing chunk's and the one after it
    assert out["remove"] == [True, False]
    assert out["list"] == []


def test_a_key_twice_in_a_batch_gets_a_memory_object_at_each_position(
        lmcache_module: Any, master: Any) -> None:
    config = types.SimpleNamespace(use_layerwise=False, extra_config={
        "remote_storage_plugin.kvpool.master_server_address": master.address,
        "remote_storage_plugin.kvpool.global_segment_size": "16mb"})
    backend = CpuBackend(config, Metadata())

    async def scenario() -> None:
        context = ConnectorContext("plugin://kvpool", asyncio.get_running_loop(), backend,
                                   config, backend.metadata, "kvpool")
        connector = lmcache_module.KVPoolConnectorAdapter().create_connector(context)
        key, obj = Key(0xB1), chunk(backend, 1)
        await connector.put(key, obj)
        before = len(backend.allocated)
        got = await connector.batched_get([key, key])
        mine = backend.allocated[before:]
        assert len(mine) == 2 and got[0] is not got[1] and {id(g) for g in got} == \
            {id(o) for o in mine}   # each handed out once, none left behind
        assert all(bytes(g.byte_array) == bytes(obj.byte_array) for g in got)
        await connector.close()

    asyncio.run(scenario())


def test_a_read_lmcache_stopped_waiting_for_releases_what_it_read(lmcache_module: Any) -> None:
    """LMCache times its reads out (``asyncio.wait_for``); the read goes on in its thread:
    what it allocated is released when it ends, not left referenced forever."""
    class SlowPool:   # a pool read that takes longer than the caller waits
        def batch_get_regions(self, keys: list[str], regions: list[Any]) -> list[int]:
            time.sleep(0.3)
            return [sum(v.nbytes for v in r) for r in regions]

    config = types.SimpleNamespace(use_layerwise=False, extra_config={})
    backend = CpuBackend(config, Metadata())
    connector = lmcache_module.KVPoolRemoteConnector(None, backend, config, client=SlowPool())

    async def scenario() -> None:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(connector.batched_get_non_blocking("l", ["a", "b", "c"]),
                                   0.05)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(o.refs for o in backend.allocated):
            await asyncio.sleep(0.05)

    asyncio.run(scenario())
    assert len(backend.allocated) == 3 and [o.refs for o in backend.allocated] == [0, 0, 0]


def test_layerwise_mode_is_refused(lmcache_module: Any) -> None:
    config = types.SimpleNamespace(use_layerwise=True, extra_config={})
    with pytest.raises(ValueError, match="use_layerwise"):
        lmcache_module.KVPoolRemoteConnector(None, CpuBackend(config, Metadata()), config,
                                             client=object())


@pytest.mark.parametrize("serde", ["cachegen", "kivi"])
def test_a_compressing_serde_is_refused(lmcache_module: Any, serde: str) -> None:
    config = types.SimpleNamespace(use_layerwise=False, remote_serde=serde, extra_config={})
    with pytest.raises(ValueError, match="remote_serde"):
        lmcache_module.KVPoolRemoteConnector(None, CpuBackend(config, Metadata()), config,
                                             client=object())


def _run_in_lmcache_environment(tmp_path: Path) -> None:
    if not LMCACHE_PYTHON.exists():
        pytest.skip(f"LMCache 0.5.6 is not importable here and {LMCACHE_PYTHON} does not exist: "
                    "run `make lmcache-env` (its pins conflict with this environment's numpy)")
    test_id = f"{Path(__file__).relative_to(ROOT)}::test_lmcache_engine_with_mock_gpu_connector"
    proc = subprocess.run(
        [str(LMCACHE_PYTHON), "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "--basetemp", str(tmp_path / "inner"), test_id],
        cwd=ROOT, env={**os.environ, **NO_TELEMETRY}, capture_output=True, text=True,
        timeout=240)
    summary = (proc.stdout.strip().splitlines() or [""])[-1]
    print(f"LMCache environment ({LMCACHE_PYTHON}): {summary}")
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert "1 passed" in summary, proc.stdout[-3000:]


@pytest.mark.slow
def test_lmcache_engine_with_mock_gpu_connector(request: pytest.FixtureRequest, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Store through LMCache's engine, drop its local copy, look up and retrieve from kvpool.

    Runs in-process where LMCache imports, otherwise in the LMCache environment. The mock GPU
    connector moves no bytes, so a subclass fills each stored chunk with a pattern of its token
    range and records what retrieval hands back.
    """
    for name, value in NO_TELEMETRY.items():
        monkeypatch.setenv(name, value)
    try:
        importlib.import_module("lmcache")
    except ImportError:
        _run_in_lmcache_environment(tmp_path)
        return
    master = request.getfixturevalue("master")
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.gpu_connector.mock_gpu_connector import MockGPUConnector
    from lmcache.v1.metadata import LMCacheMetadata

    def pattern(start: int, end: int, like: torch.Tensor) -> torch.Tensor:
        values = torch.arange(like.numel(), dtype=torch.float32) % 251 + start
        return values.reshape(like.shape).to(like.dtype)

    class FillingGPUConnector(MockGPUConnector):  # type: ignore[misc]
        def __init__(self, kv_shape: tuple) -> None:
            super().__init__(kv_shape)
            self.retrieved: dict[tuple[int, int], torch.Tensor] = {}

        def batched_from_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kw: Any) -> None:
            for obj, start, end in zip(memory_objs, starts, ends, strict=True):
                obj.tensor.copy_(pattern(start, end, obj.tensor))

        def from_gpu(self, memory_obj: Any, start: int, end: int, **kw: Any) -> None:
            self.batched_from_gpu([memory_obj], [start], [end])

        def batched_to_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kw: Any) -> None:
            for obj, start, end in zip(memory_objs, starts, ends, strict=True):
                self.retrieved[(start, end)] = obj.tensor.clone()

        def to_gpu(self, memory_obj: Any, start: int, end: int, **kw: Any) -> None:
            self.batched_to_gpu([memory_obj], [start], [end])

    config_path = tmp_path / "lmcache.yaml"
    config_path.write_text(json.dumps({
        "chunk_size": 16, "local_cpu": True, "max_local_cpu_size": 0.05,
        "remote_storage_plugins": ["kvpool"],
        "extra_config": {
            "remote_storage_plugin.kvpool.module_path": "kvpool_client.connectors.lmcache",
            "remote_storage_plugin.kvpool.class_name": "KVPoolConnectorAdapter",
            "remote_storage_plugin.kvpool.master_server_address": master.address,
            "remote_storage_plugin.kvpool.global_segment_size": "64mb"}}))
    config = LMCacheEngineConfig.from_file(str(config_path))
    kv_shape = (2, 2, 16, 4, 32)
    metadata = LMCacheMetadata(model_name="kvpool-test", world_size=1, local_world_size=1,
                               worker_id=0, local_worker_id=0, kv_dtype=torch.bfloat16,
                               kv_shape=kv_shape)
    gpu = FillingGPUConnector(kv_shape)

    def status() -> dict[str, Any]:
        with urllib.request.urlopen(master.metrics_url + "/status", timeout=5) as reply:
            return json.loads(reply.read())

    engine = LMCacheEngineBuilder.get_or_create("kvpool-test", config, metadata, gpu,
                                                lambda t, r: None, lambda o, r: o)
    try:
        engine.post_init()  # what LMCache's vLLM/SGLang adapters call once the KV caches exist
        tokens = torch.arange(64)
        engine.store(tokens)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # remote puts are asynchronous
            if status()["objects"]["ready"] >= 4:
                break
            time.sleep(0.1)
        assert status()["objects"]["ready"] == 4  # one object per 16-token chunk
        engine.clear(locations=["LocalCPUBackend"])
        reads_before = status()["totals"]["read_hit_keys_total"]
        assert engine.lookup(tokens) == 64  # served by the pool
        mask = engine.retrieve(tokens)
        assert bool(mask.all())
        assert status()["totals"]["read_hit_keys_total"] >= reads_before + 4
        for start in range(0, 64, 16):
            got = gpu.retrieved[(start, start + 16)]
            assert torch.equal(got, pattern(start, start + 16, got))
    finally:
        LMCacheEngineBuilder.destroy("kvpool-test")
