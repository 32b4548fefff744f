"""Client configuration: one loader for a JSON file that is a superset of Mooncake's client config.

Rules of this file:
- Every key has one field in :class:`ClientConfig`, one parser and one default. Sizes accept an
  int or a ``"4gb"``-style string; durations carry ``_s``.
- Sources, lowest precedence first: defaults < the JSON file < environment overrides
  (``MOONCAKE_MASTER``, ``MOONCAKE_GLOBAL_SEGMENT_SIZE``, ``MOONCAKE_LOCAL_BUFFER_SIZE``,
  ``MOONCAKE_PROTOCOL``, ``MC_STORE_USE_HUGEPAGE``). The file is named by ``from_file(path)``,
  ``KVPOOL_CONFIG_PATH`` or ``MOONCAKE_CONFIG_PATH``.
- Keys Mooncake's own clients know but kvpool does not need are accepted and ignored, so an
  operator can point kvpool at the file they already have. Any other key is an error naming the
  key (and the closest known key): a typo must not silently fall back to a default, the same rule
  the master applies to its flags.
- A bad value is a :class:`ConfigError` naming the key and the problem; nothing is half-loaded.
"""

from __future__ import annotations

import dataclasses
import difflib
import ipaddress
import json
import logging
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvpool_wire.status import KVPoolError, Status
from kvpool_wire.types import parse_size_bytes

logger = logging.getLogger(__name__)

#: Mooncake's protocols; any but "tcp" and "ascend_no_transport" asks for the engine transport
PROTOCOLS = ("tcp", "rdma", "ascend", "ascend_no_transport", "nvlink", "efa", "hip", "cxl",
             "barex")
TRANSPORTS = ("auto", "shm", "tcp", "engine")

#: Keys some Mooncake client or integration reads that kvpool has no use for (accepted, ignored).
MOONCAKE_IGNORED_KEYS = frozenset(
    {
        "rdma_devices",  # device list of Mooncake's RDMA engine
        "master_metrics_port",  # SGLang's probe of Mooncake's master metrics
        "check_server",  # SGLang: wait for the master before setup
        "standalone_storage",  # SGLang: Mooncake's standalone storage mode
        "transfer_timeout",  # LMCache's Mooncake connector (seconds, engine-internal)
    }
)
#: Mooncake's spellings of kvpool keys (vllm-ascend's mooncake.json, Mooncake's own config).
KEY_ALIASES = {"ssd_offload_path": "ssd_path", "storage_root_dir": "ssd_path"}
#: SSD bytes per byte of DRAM when the SSD tier is switched on without a size.
DEFAULT_SSD_PER_DRAM = 4

#: Environment variables that override one key of the file, as Mooncake's clients read them.
ENV_OVERRIDES: dict[str, str] = {
    "MOONCAKE_MASTER": "master_server_address",
    # set per pod or node (Kubernetes: the pod IP from the downward API), where a file shared
    # by every worker cannot say it
    "MOONCAKE_LOCAL_HOSTNAME": "local_hostname",
    "MOONCAKE_TE_META_DATA_SERVER": "metadata_server",
    "MOONCAKE_DEVICE": "device_name",
    "MOONCAKE_GLOBAL_SEGMENT_SIZE": "global_segment_size",
    "MOONCAKE_LOCAL_BUFFER_SIZE": "local_buffer_size",
    "MOONCAKE_PROTOCOL": "protocol",
    "MC_STORE_USE_HUGEPAGE": "use_hugepage",
    "MOONCAKE_OFFLOAD_FILE_STORAGE_PATH": "ssd_path",
}
CONFIG_PATH_ENVS = ("KVPOOL_CONFIG_PATH", "MOONCAKE_CONFIG_PATH")


class ConfigError(KVPoolError, ValueError):
    """A config file or value that cannot be used; the message names the key and the problem."""

    def __init__(self, message: str) -> None:
        super().__init__(Status.INVALID_ARGUMENT, message)


@dataclass(frozen=True, slots=True)
class ClientConfig:
    """Everything a client needs to join a pool. Build with :meth:`from_file`, :meth:`from_dict`
    or :meth:`from_env`; the constructor does not validate."""

    # Mooncake keys
    local_hostname: str = "127.0.0.1"  # host (or "host:port") peers use to reach this client
    metadata_server: str = "P2PHANDSHAKE"  # accepted for compatibility; kvpool needs none
    global_segment_size: int = 0  # bytes of DRAM this client contributes; 0 = none
    local_buffer_size: int = 0  # bytes; kvpool copies from the caller's buffers, no staging
    protocol: str = "tcp"
    device_name: str = ""
    master_server_address: str = "127.0.0.1:50051"
    use_ascend_direct: bool = False
    preferred_segment: str = ""  # default PutOptions.preferred_segment
    prefer_alloc_in_same_node: bool = False  # default PutOptions.prefer_same_host
    replica_num: int = 1  # default PutOptions.replica_num
    # kvpool keys
    # auto: shm on the same host, else the transfer engine when ``protocol`` names one (and it
    # is installed), else kvpool's TCP; shm/tcp force one; engine: the transfer engine with
    # ``protocol`` (its own "tcp" included) wherever a peer has one, shm on the same host
    transport: str = "auto"
    heartbeat_interval_s: float = 0.0  # 0: a third of the master's client_ttl
    rpc_timeout_s: float = 5.0
    transfer_timeout_s: float = 10.0
    # this client's TCP data server: a connection idle this long between requests is closed,
    # and one IP address holds at most this many connections
    data_idle_timeout_s: float = 120.0
    data_max_connections_per_peer: int = 32
    # the port it listens on, as (lowest, highest): (0, 0) any free port; (N, N) exactly N; a
    # range: a free port in it (for firewalls; Mooncake's transfer engines use 12300-14300).
    # In a file: 0, N or "A-B".
    data_port: tuple[int, int] = (0, 0)
    # xxh3_64 of each object, committed with it and checked by every read: True for every
    # object, False for none, "auto" for objects up to CHECKSUM_AUTO_MAX_BYTES (where hashing
    # costs little beside the call; larger shared-memory copies would slow by a quarter or more)
    checksum: bool | str = "auto"
    metrics_port: int = -1  # -1: no metrics server; 0: any free port
    metrics_host: str = "127.0.0.1"
    cluster_id: str = "kvpool"  # namespaces shared-memory names
    client_id: str = ""  # "" = generated, unique per process
    auth_token: str = ""
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    use_fast_path: bool = True  # lean framing to the master when it offers one
    async_write_queue_size: int = 1024  # objects queued by async writes before put blocks
    max_segment_size: int = 0  # split global_segment_size into segments of at most this; 0 = one
    commit_nowait: bool = False  # True: put returns once its commit is sent (see _datapath)
    busy_poll_us: int = 500  # a call on the caller's thread polls this long for the answer (µs)
    copy_threads: int = 0  # threads copying one large shared-memory batch; 0 = auto
    # segments on 2 MiB pages where /dev/shm gives them, 4 KiB pages (and a warning) where not
    use_hugepage: bool = False
    # fill the page tables of a peer's segment on a background thread once this client writes
    # into it, so the first pass of puts does not fault on every 4 KiB page (transfer/shm.py)
    populate_peer_segments: bool = True
    # The SSD tier (README, "SSD tier"): a directory this client owns and the bytes of disk it
    # contributes there. ``enable_ssd_offload`` (Mooncake's switch) turns it on with
    # DEFAULT_SSD_PER_DRAM x global_segment_size when no size is given.
    ssd_path: str = ""
    ssd_segment_size: int = 0
    enable_ssd_offload: bool = False
    ssd_copy_threads: int = 4  # tier copies (demotions, promotions) in flight at once
    ssd_poll_interval_s: float = 2.0  # longest the copier's call waits at the master for copies

    @property
    def ssd_bytes(self) -> int:
        """Bytes of SSD this client contributes (0: no SSD tier)."""
        size = self.ssd_segment_size or (
            DEFAULT_SSD_PER_DRAM * self.global_segment_size if self.enable_ssd_offload else 0)
        return size & ~4095  # whole pages (direct I/O)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], *, source: str = "config") -> ClientConfig:
        """Return a validated config from a mapping of keys.

        Raises :class:`ConfigError` (``INVALID_ARGUMENT``) naming the first bad key.
        """
        if not isinstance(values, Mapping):
            raise ConfigError(f"{source}: expected a JSON object, got {type(values).__name__}")
        fields: dict[str, Any] = {}
        for key, raw in values.items():
            if not isinstance(key, str):
                raise ConfigError(f"{source}: key {key!r} is not a string")
            if key in MOONCAKE_IGNORED_KEYS:
                logger.debug("%s: ignoring Mooncake key %r (not used by kvpool)", source, key)
                continue
            key = KEY_ALIASES.get(key, key)
            parser = _PARSERS.get(key)
            if parser is None:
                hint = difflib.get_close_matches(key, list(_PARSERS), n=1)
                suggestion = f" (did you mean {hint[0]!r}?)" if hint else ""
                raise ConfigError(f"{source}: unknown key {key!r}{suggestion}")
            try:
                fields[key] = parser(raw)
            except ValueError as exc:
                raise ConfigError(f"{source}: key {key!r}: {exc}") from None
        config = cls(**fields)
        config._check_combination(source)
        return config

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], *,
                  environ: Mapping[str, str] | None = None) -> ClientConfig:
        """Return the config in the JSON file ``path`` with environment overrides applied.

        Raises :class:`ConfigError` when the file cannot be read or parsed, or a key is bad.
        """
        path_text = os.fspath(path)
        try:
            with open(path_text, encoding="utf-8") as f:
                text = f.read()
        except OSError as exc:
            raise ConfigError(f"{path_text}: cannot read config file: {exc.strerror}") from None
        try:
            values = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path_text}: not valid JSON: {exc.msg} at line {exc.lineno}, "
                              f"column {exc.colno}") from None
        if not isinstance(values, dict):
            raise ConfigError(f"{path_text}: expected a JSON object, got {type(values).__name__}")
        return cls.from_dict(_with_env_overrides(values, environ, path_text), source=path_text)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ClientConfig:
        """Return the config named by ``KVPOOL_CONFIG_PATH`` or else ``MOONCAKE_CONFIG_PATH``.

        Without either, a config built from defaults and the ``MOONCAKE_*`` overrides when
        ``MOONCAKE_MASTER`` is set. Raises :class:`ConfigError` when there is nothing to load.
        """
        env = os.environ if environ is None else environ
        for name in CONFIG_PATH_ENVS:
            path = env.get(name, "")
            if path:
                return cls.from_file(path, environ=env)
        if env.get("MOONCAKE_MASTER"):
            return cls.from_dict(_with_env_overrides({}, env, "environment"), source="environment")
        raise ConfigError("no client config: set KVPOOL_CONFIG_PATH or MOONCAKE_CONFIG_PATH to a "
                          "JSON file (or MOONCAKE_MASTER to the master's host:port)")

    @classmethod
    def from_env_with(cls, overrides: Mapping[str, Any], *, source: str) -> ClientConfig:
        """The environment's config (``from_env``) with ``overrides`` laid over it, or, where
        the environment names none, ``overrides`` alone (``source`` names them in errors).
        What an engine plugin does with the keys its engine's own config passes."""
        try:
            base = cls.from_env()
        except ConfigError:
            if not overrides:
                raise
            return cls.from_dict(overrides, source=source)
        return base.replace(**overrides) if overrides else base

    def replace(self, **changes: Any) -> ClientConfig:
        """Return a validated copy with ``changes`` applied (values parsed like file values)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        values.update(changes)
        return ClientConfig.from_dict(values, source="config")

    @property
    def data_host(self) -> str:
        """The host part of ``local_hostname`` (MindIE passes ``"ip:port"``)."""
        host, _, port = self.local_hostname.rpartition(":")
        if host and port.isdigit() and not host.endswith(":"):
            return host.strip("[]")
        return self.local_hostname.strip("[]")

    def unreachable_by_peers(self) -> str:
        """Why workers on other hosts could not reach this worker's segments ("" when they
        can, as far as the config tells): ``local_hostname`` names this host only (a loopback
        or the unspecified address) while the master is not on this host. The data server
        binds to that address and the master hands it out as this worker's endpoint."""
        master_host = self.master_server_address.rpartition(":")[0].strip("[]")
        if _loopback(self.data_host) and master_host and not _loopback(master_host):
            return (f"local_hostname {self.local_hostname!r} names this host only while the "
                    f"master is at {self.master_server_address}: workers on other hosts cannot "
                    "reach this worker's segments over TCP; set local_hostname (or "
                    "MOONCAKE_LOCAL_HOSTNAME) to an address they can reach")
        return ""

    def _check_combination(self, source: str) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError(f"{source}: keys 'tls_cert' and 'tls_key' must be given together "
                              "(mutual TLS needs both)")
        if self.protocol == "ascend_no_transport" and self.global_segment_size:
            raise ConfigError(f"{source}: key 'global_segment_size': must be 0 with protocol "
                              "'ascend_no_transport' (a process that moves no bytes)")
        if self.max_segment_size and self.global_segment_size and \
                -(-self.global_segment_size // self.max_segment_size) > 1024:
            raise ConfigError(f"{source}: key 'max_segment_size': splits global_segment_size "
                              "into more than 1024 segments")
        if self.ssd_bytes:
            if not self.ssd_path:
                raise ConfigError(f"{source}: the SSD tier needs 'ssd_path' (or "
                                  "'ssd_offload_path', MOONCAKE_OFFLOAD_FILE_STORAGE_PATH): a "
                                  "directory this client owns")
            if not self.global_segment_size:
                raise ConfigError(f"{source}: the SSD tier needs 'global_segment_size' > 0 "
                                  "(objects reach SSD by demotion from this client's DRAM)")
            if self.ssd_bytes < 1 << 20:
                raise ConfigError(f"{source}: key 'ssd_segment_size': at least 1 MiB, got "
                                  f"{self.ssd_bytes}")


# --- value parsers: each returns the parsed value or raises ValueError saying what is wrong ---

def _str(raw: Any) -> str:
    if not isinstance(raw, str):
        raise ValueError(f"expected a string, got {_describe(raw)}")
    return raw


def _segment_or_flag(raw: Any) -> str:
    # vllm-ascend's mooncake.json writes `"preferred_segment": true` ("my own segment"); its
    # backend names the segment per put, so the boolean form leaves the default to the master.
    if isinstance(raw, bool):
        return ""
    return _str(raw)


def _nonempty_str(raw: Any) -> str:
    text = _str(raw).strip()
    if not text:
        raise ValueError("must not be empty")
    return text


def _checksum(raw: Any) -> bool | str:
    if isinstance(raw, str) and raw.strip().lower() == "auto":
        return "auto"
    try:
        return parse_bool(raw)
    except ValueError:
        raise ValueError(f"expected true, false or \"auto\", got {_describe(raw)}") from None


def parse_bool(raw: Any) -> bool:
    """A flag given as a bool or as text (``true``/``false``/``1``/``0``, any case)."""
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, str) and raw.strip().lower() in ("true", "false", "1", "0"):
        return raw.strip().lower() in ("true", "1")
    raise ValueError(f"expected true or false, got {_describe(raw)}")


def _size(raw: Any) -> int:
    if isinstance(raw, float) and raw.is_integer():
        raw = int(raw)
    if isinstance(raw, str) and raw.strip().isdigit():
        raw = int(raw.strip())
    return parse_size_bytes(raw)


def _int_range(low: int, high: int) -> Callable[[Any], int]:
    def parse(raw: Any) -> int:
        if isinstance(raw, str) and raw.strip().lstrip("-").isdigit():
            raw = int(raw.strip())
        if isinstance(raw, bool) or not isinstance(raw, int):
            raise ValueError(f"expected an integer, got {_describe(raw)}")
        if not low <= raw <= high:
            raise ValueError(f"must be between {low} and {high}, got {raw}")
        return raw
    return parse


def _seconds(*, allow_zero: bool) -> Callable[[Any], float]:
    def parse(raw: Any) -> float:
        if isinstance(raw, str):
            try:
                raw = float(raw)
            except ValueError:
                raise ValueError(f"expected seconds, got {raw!r}") from None
        if isinstance(raw, bool) or not isinstance(raw, int | float):
            raise ValueError(f"expected seconds (a number), got {_describe(raw)}")
        value = float(raw)
        if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
            raise ValueError(f"must be {'>= 0' if allow_zero else '> 0'} seconds, got {raw}")
        return value
    return parse


def _choice(choices: tuple[str, ...]) -> Callable[[Any], str]:
    def parse(raw: Any) -> str:
        text = _str(raw).strip().lower()
        if text not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}; got {raw!r}")
        return text
    return parse


def _port_range(raw: Any) -> tuple[int, int]:
    if isinstance(raw, list | tuple) and len(raw) == 2:
        low, high = (_int_range(0, 65535)(part) for part in raw)
    elif isinstance(raw, str) and "-" in raw.strip().lstrip("-"):
        first, _, last = raw.strip().partition("-")
        low, high = _int_range(1, 65535)(first), _int_range(1, 65535)(last)
    else:
        low = high = _int_range(0, 65535)(raw)
    if low > high or (low == 0) != (high == 0):
        raise ValueError(f"expected 0, a port or \"low-high\" with low <= high, got {raw!r}")
    return low, high


def _address(raw: Any) -> str:
    text = _nonempty_str(raw)
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected 'host:port', got {raw!r}")
    return text


def _file(raw: Any) -> str:
    path = _str(raw)
    if path and not os.path.isfile(path):
        raise ValueError(f"file {path!r} does not exist")
    return path


def _identifier(raw: Any) -> str:
    text = _str(raw)
    if not all(c.isalnum() or c in "-_." for c in text) or len(text) > 64:
        raise ValueError(f"use at most 64 letters, digits, '-', '_' or '.', got {raw!r}")
    return text


def _describe(raw: Any) -> str:
    return f"{type(raw).__name__} {raw!r}" if raw is not None else "null"


_PARSERS: dict[str, Callable[[Any], Any]] = {
    "local_hostname": _nonempty_str,
    "metadata_server": _str,
    "global_segment_size": _size,
    "local_buffer_size": _size,
    "protocol": _choice(PROTOCOLS),
    "device_name": _str,
    "master_server_address": _address,
    "use_ascend_direct": parse_bool,
    "preferred_segment": _segment_or_flag,
    "prefer_alloc_in_same_node": parse_bool,
    "replica_num": _int_range(1, 16),
    "transport": _choice(TRANSPORTS),
    "heartbeat_interval_s": _seconds(allow_zero=True),
    "rpc_timeout_s": _seconds(allow_zero=False),
    "transfer_timeout_s": _seconds(allow_zero=False),
    "data_idle_timeout_s": _seconds(allow_zero=False),
    "data_max_connections_per_peer": _int_range(1, 1 << 16),
    "data_port": _port_range,
    "checksum": _checksum,
    "metrics_port": _int_range(-1, 65535),
    "metrics_host": _nonempty_str,
    "cluster_id": lambda raw: _identifier(_nonempty_str(raw)),
    "client_id": _identifier,
    "auth_token": _str,
    "tls_ca": _file,
    "tls_cert": _file,
    "tls_key": _file,
    "use_fast_path": parse_bool,
    "async_write_queue_size": _int_range(1, 1 << 20),
    "max_segment_size": _size,
    "commit_nowait": parse_bool,
    "busy_poll_us": _int_range(0, 100_000),
    "copy_threads": _int_range(0, 64),
    "use_hugepage": parse_bool,
    "populate_peer_segments": parse_bool,
    "ssd_path": _str,
    "ssd_segment_size": _size,
    "enable_ssd_offload": parse_bool,
    "ssd_copy_threads": _int_range(1, 64),
    "ssd_poll_interval_s": _seconds(allow_zero=False),
}


def env_overrides(environ: Mapping[str, str] | None = None,
                  names: Sequence[str] = tuple(ENV_OVERRIDES)) -> dict[str, Any]:
    """The keys the environment variables ``names`` (of ``ENV_OVERRIDES``) set, parsed.

    Raises :class:`ConfigError` naming the variable and its key for a bad value.
    """
    env = os.environ if environ is None else environ
    overrides: dict[str, Any] = {}
    for name in names:
        key = ENV_OVERRIDES[name]
        if env.get(name):
            try:
                overrides[key] = _PARSERS[key](env[name])
            except ValueError as exc:
                raise ConfigError(f"environment variable {name} (overrides key {key!r}): "
                                  f"{exc}") from None
    return overrides


def _loopback(host: str) -> bool:
    """``host`` reaches this machine only from itself: ``localhost``, a loopback address, or
    the unspecified one (``0.0.0.0``, ``::``: bound, it serves every address, but handed to a
    peer it names the peer's own machine)."""
    if host.lower() in ("localhost", "localhost.localdomain"):
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False   # a name: it may well resolve to an address peers reach
    return address.is_loopback or address.is_unspecified


def _with_env_overrides(values: dict[str, Any], environ: Mapping[str, str] | None,
                        source: str) -> dict[str, Any]:
    overrides = env_overrides(environ)
    for key in overrides:
        logger.debug("%s: the environment overrides key %r", source, key)
    return {**values, **overrides}
