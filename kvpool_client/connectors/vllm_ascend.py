"""vllm-ascend's AscendStoreConnector backend ``kvpool``, and the vLLM plugin that registers it.

Rules of this file:
- vllm-ascend picks its pool backend by name from ``backend_map`` in
  ``vllm_ascend/distributed/kv_transfer/kv_pool/ascend_store/backend/__init__.py``. The
  ``vllm.general_plugins`` entry point ``kvpool`` (see pyproject.toml) runs :func:`register` in
  every vLLM process, which adds ``"kvpool"`` to that map; then
  ``kv_connector_extra_config: {"backend": "kvpool"}`` selects :class:`KVPoolBackend`.
- The backend has vllm-ascend's shape: ``__init__(parallel_config)``, ``set_device()``,
  ``register_buffer(ptrs, lengths)``, ``exists(keys) -> [1/0]``, ``put(keys, addrs, sizes)``,
  ``get(keys, addrs, sizes) -> [0 ok / <0]``. Its base class is vllm-ascend's ``Backend`` when
  importable (``backend/base.py`` on main, ``backend/backend.py`` up to 0.23); vllm and
  vllm-ascend are imported only when they are already there. It needs no lookup before a put
  (``requires_exists_before_put = False``): kvpool answers a put of an existing key at once.
- The client config comes from ``KVPOOL_CONFIG_PATH`` (kvpool's JSON) or else the
  ``mooncake.json`` vllm-ascend already uses (``MOONCAKE_CONFIG_PATH``), read with
  vllm-ascend's meanings: ``preferred_segment: true`` puts into this worker's own segment,
  SSD-offload keys are refused when enabled and otherwise ignored.
- The pointers vllm-ascend passes are block addresses inside the KV-cache tensors it
  registered; anything else fails that key alone.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from kvpool_client.compat.memory import RegionRegistry, staged
from kvpool_client.config import ClientConfig, ConfigError, env_overrides
from kvpool_wire.status import KVPoolError, Status
from kvpool_wire.types import PutOptions

logger = logging.getLogger(__name__)

BACKEND_NAME = "kvpool"
_BACKEND_PACKAGE = "vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.backend"


def register() -> None:
    """vLLM general plugin: add the ``kvpool`` backend to vllm-ascend's backend map.

    Does nothing (and imports nothing new) when vllm-ascend is not installed.
    """
    try:
        package = importlib.import_module(_BACKEND_PACKAGE)
    except ImportError:
        logger.debug("vllm-ascend not importable; kvpool backend not registered")
        return
    package.backend_map.setdefault(BACKEND_NAME, {"name": KVPoolBackend.__name__,
                                                  "path": __name__})


def _backend_base() -> type:
    """vllm-ascend's ``Backend``: in ``backend/base.py`` on main, in ``backend/backend.py`` up
    to 0.23; ``object`` without vllm-ascend."""
    for module_name in ("base", "backend"):
        try:
            module = importlib.import_module(f"{_BACKEND_PACKAGE}.{module_name}")
        except ImportError:
            continue
        base = getattr(module, "Backend", None)
        if isinstance(base, type):
            return base
    if importlib.util.find_spec(_BACKEND_PACKAGE.split(".")[0]) is not None:
        logger.warning("vllm-ascend is installed but its pool Backend class was found in neither "
                       "%s.base nor %s.backend; kvpool's backend stands alone",
                       _BACKEND_PACKAGE, _BACKEND_PACKAGE)
    return object


class KVPoolBackend(_backend_base()):  # type: ignore[misc]
    """A vllm-ascend pool backend whose objects live in a kvpool cluster."""

    store: Any = None  # vllm-ascend's GVA (memcache) paths use .store; kvpool has none
    # A put of an existing key answers at once without moving bytes: no lookup needed first.
    requires_exists_before_put = False

    def __init__(self, parallel_config: Any, lazy_init: bool = False,
                 contribute_memory: bool = True) -> None:
        from kvpool_client.client import KVPoolClient

        config, self._prefer_own_segment = backend_config()
        if not contribute_memory:
            config = config.replace(global_segment_size=0, local_buffer_size=0)
        self.parallel_config = parallel_config
        self._registry = RegionRegistry()
        self._client = KVPoolClient(config)
        own = self._client.segment_ids
        self._options = PutOptions(preferred_segment=own[0],
                                   prefer_same_host=config.prefer_alloc_in_same_node,
                                   replica_num=config.replica_num) \
            if self._prefer_own_segment and own else None

    @classmethod
    def create_scheduler_client(cls, parallel_config: Any) -> KVPoolBackend:
        """The scheduler's client: looks keys up, contributes no memory."""
        return cls(parallel_config, contribute_memory=False)

    def set_device(self) -> None:
        """Make this worker's NPU current on the calling thread (nothing to do on CPU)."""
        if "torch_npu" not in sys.modules:
            return
        torch = sys.modules["torch"]
        parallel_state = importlib.import_module("vllm.distributed.parallel_state")
        torch.npu.set_device(torch.device(f"npu:{parallel_state.get_world_group().local_rank}"))

    def register_buffer(self, ptrs: Sequence[int], lengths: Sequence[int]) -> None:
        """Register the KV-cache regions; raises ``KVPoolError`` when one cannot be used."""
        if len(ptrs) != len(lengths):
            raise KVPoolError(Status.INVALID_ARGUMENT, "one length per pointer")
        for ptr, length in zip(ptrs, lengths, strict=True):
            self._registry.register(int(ptr), int(length))

    def exists(self, keys: list[str]) -> list[int]:
        """1 / 0 per key (all 0 when the lookup fails)."""
        try:
            return [1 if found else 0 for found in self._client.batch_exists(list(keys))]
        except KVPoolError as exc:
            logger.error("kvpool exists of %d keys failed: %s", len(keys), exc)
            return [0] * len(keys)

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        """Same as :meth:`exists` (vllm-ascend calls both names)."""
        return self.exists(keys)

    @staged
    def put(self, keys: list[str], addrs: list[list[int]], sizes: list[list[int]]) -> list[int]:
        """Store each key's regions as one object; 0 / negative status per key (also logged)."""
        results = [int(Status.INVALID_ARGUMENT)] * len(keys)
        names, regions, positions = [], [], []
        for i, (key, key_addrs, key_sizes) in enumerate(_triples(keys, addrs, sizes)):
            try:
                regions.append(self._registry.sources(list(zip(key_addrs, key_sizes,
                                                               strict=True))))
            except (KVPoolError, ValueError) as exc:
                logger.error("kvpool put of %s: %s", key, exc)
                continue
            names.append(key)
            positions.append(i)
        if names:
            try:
                statuses = self._client.batch_put_regions(names, regions, options=self._options)
            except KVPoolError as exc:
                logger.error("kvpool put of %d keys failed: %s", len(names), exc)
                statuses = [exc.status] * len(names)
            for i, status in zip(positions, statuses, strict=True):
                results[i] = 0 if status in (Status.OK, Status.ALREADY_EXISTS) else int(status)
        failed = [code for code in results if code != 0]
        if failed:
            logger.error("kvpool put: %d of %d keys failed, statuses %s", len(failed), len(keys),
                         sorted(set(failed)))
        return results

    @staged
    def get(self, keys: list[str], addrs: list[list[int]], sizes: list[list[int]]) -> list[int]:
        """Fill each key's regions; 0 when every region was filled, else a negative status."""
        results = [int(Status.INVALID_ARGUMENT)] * len(keys)
        names, dests, positions = [], [], []
        for i, (key, key_addrs, key_sizes) in enumerate(_triples(keys, addrs, sizes)):
            try:
                dests.append(self._registry.destination(list(zip(key_addrs, key_sizes,
                                                                 strict=True))))
            except (KVPoolError, ValueError) as exc:
                logger.error("kvpool get of %s: %s", key, exc)
                continue
            names.append(key)
            positions.append(i)
        if names:
            try:
                read = self._client.batch_get_regions(names, [d.views for d in dests])
            except KVPoolError as exc:
                logger.error("kvpool get of %d keys failed: %s", len(names), exc)
                read = [int(exc.status)] * len(names)
            for i, dest, nbytes in zip(positions, dests, read, strict=True):
                results[i] = self._finish(dest, int(nbytes))
        return results

    @staticmethod
    def _finish(dest: Any, nbytes: int) -> int:
        if nbytes < 0:
            return nbytes
        if nbytes != sum(v.nbytes for v in dest.views):
            return int(Status.TRANSFER_FAILED)
        try:
            dest.finish(nbytes)
        except KVPoolError as exc:
            return int(exc.status)
        return 0

    def close(self) -> None:
        """Leave the pool (idempotent)."""
        self._client.close()
        self._registry.clear()


def backend_config(environ: Mapping[str, str] | None = None) -> tuple[ClientConfig, bool]:
    """Return the client config and whether puts prefer this worker's own segment.

    Raises :class:`ConfigError` when no file is named or one of its values is bad.
    """
    env = os.environ if environ is None else environ
    if env.get("KVPOOL_CONFIG_PATH"):
        return ClientConfig.from_file(env["KVPOOL_CONFIG_PATH"], environ=env), False
    path = env.get("MOONCAKE_CONFIG_PATH", "")
    if not path:
        raise ConfigError("set KVPOOL_CONFIG_PATH or MOONCAKE_CONFIG_PATH to the pool's JSON")
    try:
        with open(path, encoding="utf-8") as f:
            values = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: cannot read the Mooncake config: {exc}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    prefer_own = values.pop("preferred_segment", False)
    if not isinstance(prefer_own, bool):  # a segment name, as kvpool's own key means it
        values["preferred_segment"], prefer_own = prefer_own, False
    if values.pop("enable_ssd_offload", False):
        raise ConfigError(f"{path}: enable_ssd_offload is not supported by kvpool")
    values.pop("ssd_offload_path", None)
    config = ClientConfig.from_dict(values, source=path)
    overrides = env_overrides(env)
    return (config.replace(**overrides) if overrides else config), prefer_own


def _triples(keys: Sequence[str], addrs: Sequence[Sequence[int]],
             sizes: Sequence[Sequence[int]]) -> list[tuple[str, Sequence[int], Sequence[int]]]:
    if len(keys) != len(addrs) or len(keys) != len(sizes):
        logger.error("kvpool: %d keys but %d address lists and %d size lists", len(keys),
                     len(addrs), len(sizes))
        return []
    return list(zip(keys, addrs, sizes, strict=True))
