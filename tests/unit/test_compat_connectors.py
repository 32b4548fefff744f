"""Connector helpers that need no master: tensor ranges and the configs engines hand over."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from kvpool_client.config import ConfigError
from kvpool_client.connectors._tensors import flatten, pointer_range, pointer_ranges
from kvpool_client.connectors.sglang import client_config as sglang_config
from kvpool_client.connectors.vllm_ascend import backend_config
from kvpool_wire.status import KVPoolError, Status


def test_pointer_ranges_of_tensors_and_arrays() -> None:
    cache = torch.zeros(4, 16, 2, 8, dtype=torch.float16)
    assert pointer_range(cache[2]) == (cache.data_ptr() + 2 * 16 * 2 * 8 * 2, 512)
    array = np.zeros((3, 5), dtype=np.float32)
    assert pointer_range(array) == (array.ctypes.data, 60)
    for bad in (cache[:, 0], array[:, 1], b"bytes", [1, 2]):
        with pytest.raises(KVPoolError) as info:
            pointer_range(bad)
        assert info.value.status == Status.INVALID_ARGUMENT
    k, v = torch.zeros(2, 4), torch.ones(2, 4)
    nested = [[k[0], v[0]], [k[1], v[1]]]  # MindIE: [[L0.K, L0.V], [L1.K, L1.V]]
    flat = flatten(nested)
    assert len(flat) == 4 and all(a is b for a, b in zip(flat, [nested[0][0], nested[0][1],
                                                                nested[1][0], nested[1][1]],
                                                         strict=True))
    assert [r[0] for r in pointer_ranges(nested)] == [k.data_ptr(), v.data_ptr(),
                                                      k.data_ptr() + 16, v.data_ptr() + 16]


def write(path: Path, values: dict) -> str:
    path.write_text(json.dumps(values))
    return str(path)


def test_vllm_ascend_mooncake_json_is_read_with_its_own_meanings(tmp_path: Path) -> None:
    path = write(tmp_path / "mooncake.json", {
        "metadata_server": "P2PHANDSHAKE", "protocol": "ascend", "device_name": "",
        "global_segment_size": "1GB", "local_buffer_size": 0,
        "master_server_address": "10.0.0.1:50051", "preferred_segment": True,
        "prefer_alloc_in_same_node": True, "enable_ssd_offload": False,
        "ssd_offload_path": ""})
    config, prefer_own = backend_config({"MOONCAKE_CONFIG_PATH": path,
                                         "MOONCAKE_MASTER": "10.0.0.2:50051"})
    assert prefer_own is True
    assert config.global_segment_size == 1 << 30
    assert config.master_server_address == "10.0.0.2:50051"  # vllm-ascend's env override
    assert config.preferred_segment == ""
    named = write(tmp_path / "named.json", {"master_server_address": "10.0.0.1:1",
                                            "preferred_segment": "seg-7"})
    config, prefer_own = backend_config({"MOONCAKE_CONFIG_PATH": named})
    assert (config.preferred_segment, prefer_own) == ("seg-7", False)


@pytest.mark.parametrize("values,fragment", [
    ({"master_server_address": "h:1", "enable_ssd_offload": True}, "enable_ssd_offload"),
    ({"master_server_address": "h:1", "protocl": "tcp"}, "protocl"),
    ([1, 2], "JSON object"),
])
def test_bad_vllm_ascend_configs_name_the_problem(tmp_path: Path, values: object,
                                                   fragment: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(values))
    with pytest.raises(ConfigError) as info:
        backend_config({"MOONCAKE_CONFIG_PATH": str(path)})
    assert fragment in str(info.value)
    with pytest.raises(ConfigError):
        backend_config({})


def test_sglang_extra_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("KVPOOL_CONFIG_PATH", "MOONCAKE_CONFIG_PATH", "MOONCAKE_MASTER"):
        monkeypatch.delenv(name, raising=False)
    config = sglang_config({"backend_name": "kvpool", "interface_v1": 1,
                            "kvpool": {"master_server_address": "10.0.0.1:50051",
                                       "global_segment_size": "4gb"}})
    assert config.master_server_address == "10.0.0.1:50051"
    assert config.global_segment_size == 4 << 30
    with pytest.raises(ConfigError):
        sglang_config({"backend_name": "kvpool"})  # nothing names a master
    monkeypatch.setenv("KVPOOL_CONFIG_PATH", write(tmp_path / "k.json",
                                                   {"master_server_address": "10.0.0.9:1"}))
    assert sglang_config({"kvpool": {"transport": "tcp"}}).master_server_address == "10.0.0.9:1"


#: vllm-ascend's pool backend module on main (``kv_pool/ascend_store/backend/base.py``, read at
#: commit 1913307 of vllm-project/vllm-ascend): an abstract ``Backend`` with
#: ``requires_exists_before_put``. Up to 0.23 the same class lived in ``backend/backend.py``
#: (tests/integration/test_connector_vllm_ascend.py runs 0.23.0's own code). vllm-ascend needs
#: an NPU to import, so this stand-in has the interface of that file and nothing else.
_BASE_PY = '''
from abc import ABC, abstractmethod

class Backend(ABC):
    store = None
    requires_exists_before_put = True

    @abstractmethod
    def __init__(self, parallel_config, lazy_init=False): ...
    @abstractmethod
    def set_device(self): ...
    @abstractmethod
    def register_buffer(self, ptrs, lengths): ...
    @abstractmethod
    def exists(self, keys): ...
    @abstractmethod
    def put(self, keys, addrs, sizes): ...
    @abstractmethod
    def get(self, keys, addrs, sizes): ...
'''


@pytest.mark.parametrize("module_file", ["base.py", "backend.py", None])
def test_vllm_ascend_backend_base_is_found_on_main_and_on_releases(
        tmp_path: Path, module_file: str | None) -> None:
    import subprocess
    import sys
    import textwrap

    package = tmp_path / "vllm_ascend/distributed/kv_transfer/kv_pool/ascend_store/backend"
    package.mkdir(parents=True)
    for folder in [package, *package.parents][:6]:
        (folder / "__init__.py").touch()
    (package / "__init__.py").write_text("backend_map = {}\n")
    if module_file:
        (package / module_file).write_text(_BASE_PY)
    script = textwrap.dedent("""
        import inspect
        from kvpool_client.connectors import vllm_ascend as connector
        base = connector.KVPoolBackend.__mro__[1]
        print(base.__module__.rsplit(".", 1)[-1], inspect.isabstract(connector.KVPoolBackend),
              connector.KVPoolBackend.requires_exists_before_put)
        connector.register()
        import vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.backend as b
        print(b.backend_map["kvpool"]["name"])
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60, env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stderr
    first, second = run.stdout.split("\n")[:2]
    expected = {"base.py": "base", "backend.py": "backend", None: "builtins"}[module_file]
    assert first == f"{expected} False False"  # every abstract method is implemented
    assert second == "KVPoolBackend"
    if module_file is None:
        assert "found in neither" in run.stderr
