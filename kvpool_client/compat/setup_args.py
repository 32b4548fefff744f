"""``MooncakeDistributedStore.setup`` arguments, in every form engines pass them, as a ClientConfig.

Rules of this file:
- Two forms, as Mooncake's binding has: positional/keyword ``(local_hostname, metadata_server,
  global_segment_size, local_buffer_size, protocol, rdma_devices, master_server_addr,
  engine=None, ...)`` and one ``dict`` of the same keys. MindIE passes 7 or 8 positional values
  (the buffer size as the raw JSON value, so an int or a ``"1gb"`` string); vllm-ascend passes
  keywords; vLLM's store connector a dict of strings, with keys of its own beside them
  (``enable_offload``). As Mooncake does, the dict form reads the keys it knows, flags as
  ``"true"``/``"false"`` too, and ignores the others (each named in a warning); an unknown
  keyword is an error, as it is in Mooncake's binding.
- ``local_hostname`` may carry Mooncake's segment suffixes (``"ip:port"`` from a
  TransferEngine, ``"ip:port:npu_N"`` from MindIE's non-direct Ascend mode). kvpool only needs
  the host; the full string is kept as the segment name engines later use as
  ``ReplicateConfig.preferred_segment``.
- The file named by ``KVPOOL_CONFIG_PATH`` (kvpool keys such as ``auth_token``, TLS, transport)
  is the base when set; the setup arguments override its Mooncake keys. ``MC_STORE_USE_HUGEPAGE``
  (Mooncake's switch for huge pages, which its setup reads from the environment) sets
  ``use_hugepage``.
- A bad value raises :class:`ConfigError` (``INVALID_ARGUMENT``) naming it; nothing is set up.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvpool_client.config import ClientConfig, ConfigError, env_overrides, parse_bool

logger = logging.getLogger(__name__)

#: Mooncake's defaults for the optional arguments (16 MiB each, as its dict form documents).
DEFAULT_SEGMENT_SIZE = 16 * 1024 * 1024
DEFAULT_MASTER = "127.0.0.1:50051"

_POSITIONAL = ("local_hostname", "metadata_server", "global_segment_size", "local_buffer_size",
               "protocol", "rdma_devices", "master_server_addr", "engine")
#: accepted, and harmless to ignore (Mooncake features kvpool has no counterpart for)
_IGNORED = {"ipc_socket_path": "", "enable_client_http_server": False, "client_http_port": 9300}
#: Mooncake's tenants are key spaces of their own; a kvpool pool has one
_TENANT = "tenant_id"
_DEFAULT_TENANT = "default"
#: Mooncake's SSD offload arguments, kvpool's SSD tier (README, "SSD tier")
_SSD = ("enable_ssd_offload", "ssd_offload_path")
_ACCEPTED = {*_POSITIONAL, *_IGNORED, *_SSD, _TENANT}


@dataclass(frozen=True, slots=True)
class StoreSetup:
    """What one ``setup`` call asks for."""

    config: ClientConfig
    segment_name: str  # local_hostname exactly as given (Mooncake's name for this segment)
    engine: Any  # the handle from TransferEngine.get_engine(), or None


def parse_setup(args: tuple[Any, ...], kwargs: Mapping[str, Any],
                environ: Mapping[str, str] | None = None) -> StoreSetup:
    """Return the setup a ``setup(*args, **kwargs)`` call describes.

    Raises :class:`ConfigError` naming the bad argument.
    """
    if len(args) == 1 and not kwargs and isinstance(args[0], Mapping):
        values = _from_dict(args[0])
    else:
        values = _from_arguments(args, kwargs)
    ssd = {key: values.pop(key) for key in _SSD if key in values}
    tenant = values.pop(_TENANT, _DEFAULT_TENANT)
    if tenant != _DEFAULT_TENANT:
        raise ConfigError(f"setup: tenant_id {tenant!r} is not supported: a kvpool pool has one "
                          "key space, where tenants would read each other's objects under the "
                          "same keys; give each tenant a master of its own")
    for key, default in _IGNORED.items():
        value = values.pop(key, default)
        if value != default:
            logger.info("setup: ignoring %s=%r (no kvpool counterpart)", key, value)
    engine = values.pop("engine", None)
    segment_name = _text("local_hostname", values.get("local_hostname"))
    overrides = {
        "local_hostname": host_of(segment_name),
        "metadata_server": _text("metadata_server", values.get("metadata_server", "")),
        "global_segment_size": values.get("global_segment_size", DEFAULT_SEGMENT_SIZE),
        "local_buffer_size": values.get("local_buffer_size", DEFAULT_SEGMENT_SIZE),
        "protocol": values.get("protocol", "tcp"),
        "device_name": values.get("rdma_devices", "") or "",
        "master_server_address": values.get("master_server_addr", DEFAULT_MASTER),
    }
    if "enable_ssd_offload" in ssd:
        if not isinstance(ssd["enable_ssd_offload"], bool):
            raise ConfigError("setup: enable_ssd_offload must be a bool")
        overrides["enable_ssd_offload"] = ssd["enable_ssd_offload"]
    if ssd.get("ssd_offload_path"):
        overrides["ssd_path"] = _text("ssd_offload_path", ssd["ssd_offload_path"])
    env = os.environ if environ is None else environ
    overrides.update(env_overrides(env, ("MC_STORE_USE_HUGEPAGE",
                                         "MOONCAKE_OFFLOAD_FILE_STORAGE_PATH")))
    return StoreSetup(_base_config(env).replace(**overrides), segment_name, engine)


def host_of(local_hostname: str) -> str:
    """Return the host part of a Mooncake ``local_hostname``.

    ``"10.0.0.1"``, ``"10.0.0.1:17001"``, ``"10.0.0.1:8790:npu_0"`` and ``"[::1]:17001"`` give
    the address; a bare IPv6 address is returned as it is.
    """
    text = local_hostname.strip()
    if text.startswith("["):
        return text[1:text.index("]")] if "]" in text else text
    parts = text.split(":")
    if len(parts) == 1:
        return text
    suffix_ok = len(parts) == 2 or (len(parts) == 3 and parts[2].startswith("npu_"))
    if parts[1].isdigit() and suffix_ok and parts[0]:
        return parts[0]
    return text


def _from_arguments(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    if len(args) > len(_POSITIONAL):
        raise ConfigError(f"setup: takes at most {len(_POSITIONAL)} positional arguments, "
                          f"got {len(args)}")
    values = dict(zip(_POSITIONAL, args, strict=False))
    for key, value in kwargs.items():
        if key in values:
            raise ConfigError(f"setup: argument {key!r} given twice")
        if key not in _ACCEPTED:
            raise ConfigError(f"setup: unknown argument {key!r}")
        values[key] = value
    for key in ("local_hostname", "metadata_server"):
        if key not in values:
            raise ConfigError(f"setup: missing argument {key!r}")
    return values


#: the flags of the dict form, whose values may be text (Mooncake reads every value as text)
_FLAGS = ("enable_ssd_offload", "enable_client_http_server")


def _from_dict(config: Mapping[str, Any]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    aliases = {"master_server_address": "master_server_addr", "device_name": "rdma_devices"}
    for key, value in config.items():
        name = aliases.get(key, key)
        if name not in _ACCEPTED:
            logger.warning("setup: ignoring key %r of the config dict (not a Mooncake store "
                           "setting)", key)
            continue
        if name in _FLAGS and isinstance(value, str):
            try:
                value = parse_bool(value)
            except ValueError as exc:
                raise ConfigError(f"setup: {key}: {exc}") from None
        values[name] = value
    if "local_hostname" not in values or "metadata_server" not in values:
        raise ConfigError("setup: the config dict needs 'local_hostname' and 'metadata_server'")
    return values


def _text(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"setup: {name} must be a string, got {type(value).__name__}")
    return value


def _base_config(env: Mapping[str, str]) -> ClientConfig:
    path = env.get("KVPOOL_CONFIG_PATH", "")
    return ClientConfig.from_file(path, environ=env) if path else ClientConfig()
