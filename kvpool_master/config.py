"""Settings of `kvpool-master`: one table of options read from flags, env, a file and defaults.

Rules of this file:
- Every option has one canonical snake_case name. It is spelled on the command line as
  ``--dash-case`` and as Mooncake's ``--snake_case`` (plus a few Mooncake aliases), in the
  environment as ``KVPOOL_MASTER_<NAME>``, and in a ``--config`` file (YAML or JSON) under either
  spelling.
- Precedence: flag > environment > file > default.
- Kubernetes gives every pod variables named after the services of its namespace; a service
  called ``kvpool-master`` makes ``KVPOOL_MASTER_SERVICE_HOST``, ``KVPOOL_MASTER_PORT=tcp://...``
  and so on. Those (``_SERVICE_*``, ``_PORT_<n>_<proto>*``, and a ``_PORT`` holding a URL) are
  not settings and are passed over (``service_link``), never refused.
- A value is parsed and range-checked the same way whatever its source; anything unknown or out
  of range raises :class:`ConfigError` naming the option and where it came from. Nothing is ever
  silently defaulted.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from kvpool_wire.partitions import MAX_PARTITIONS
from kvpool_wire.types import MAX_KEY_BYTES, parse_size_bytes

ENV_PREFIX = "KVPOOL_MASTER_"


class ConfigError(ValueError):
    """A setting is unknown or its value is unusable; the message names it and its source."""


@dataclass(frozen=True, slots=True)
class MasterConfig:
    """Every setting of the master daemon, validated."""

    host: str = "0.0.0.0"
    port: int = 50051
    fast_port: int = 50052
    local_socket: bool = True
    busy_poll_us: int = 300
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 9003
    eviction_high_watermark_ratio: float = 0.95
    eviction_ratio: float = 0.05
    eviction_policy: str = "lru"
    default_kv_lease_ttl_ms: int = 5000
    client_ttl_s: float = 10.0
    put_start_discard_timeout_s: float = 30.0
    write_capability_ttl_s: float = 10.0
    max_segments_per_client: int = 1024
    max_batch_keys: int = 16_384
    engine_transport: str = "allow"
    ssd_promote_after_hits: int = 1
    copy_task_ttl_s: float = 30.0
    max_key_bytes: int = MAX_KEY_BYTES
    max_message_bytes: int = 256 * 2**20
    max_connections: int = 16384
    max_connections_per_peer: int = 256
    auth_timeout_s: float = 5.0
    max_inflight_requests: int = 4096
    frame_timeout_s: float = 30.0
    state_dir: str = ""
    state_fsync: str = "batch"
    state_compact_bytes: int = 64 * 2**20
    state_compact_ratio: float = 0.25
    restore_grace_s: float = 60.0
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    auth_token: str = field(default="", repr=False)
    auth_token_file: str = ""
    log_level: str = "info"
    ready_file: str = ""
    config: str = ""
    rpc_thread_num: int = 0
    partitions: int = 1
    partition_ports: int = 0

    @property
    def tls_enabled(self) -> bool:
        """True when the gRPC and lean ports serve TLS."""
        return bool(self.tls_cert)


# --- value parsers: each takes a str (flag/env) or a typed value (file) -------------------------

Parser = Callable[[Any], Any]


def _int(lo: int, hi: int) -> Parser:
    def parse(value: Any) -> int:
        if isinstance(value, bool | float):
            raise ValueError(f"expected an integer, got {value!r}")
        try:
            number = int(str(value).strip(), 10)
        except ValueError:
            raise ValueError(f"expected an integer, got {value!r}") from None
        if not lo <= number <= hi:
            raise ValueError(f"{number} is out of range [{lo}, {hi}]")
        return number
    return parse


def _switch(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("on", "true", "yes", "1"):
        return True
    if text in ("off", "false", "no", "0"):
        return False
    raise ValueError(f"expected on or off, got {value!r}")


def _float(lo: float, hi: float, *, lo_open: bool = False) -> Parser:
    def parse(value: Any) -> float:
        if isinstance(value, bool):
            raise ValueError(f"expected a number, got {value!r}")
        try:
            number = float(str(value).strip())
        except ValueError:
            raise ValueError(f"expected a number, got {value!r}") from None
        if math.isnan(number) or number > hi or number < lo or (lo_open and number == lo):
            bracket = "(" if lo_open else "["
            raise ValueError(f"{number:g} is out of range {bracket}{lo:g}, {hi:g}]")
        return number
    return parse


def _size(lo: int, hi: int) -> Parser:
    def parse(value: Any) -> int:
        number = parse_size_bytes(value if isinstance(value, int) else str(value))
        if not lo <= number <= hi:
            raise ValueError(f"{number} bytes is out of range [{lo}, {hi}]")
        return number
    return parse


def _choice(*choices: str) -> Parser:
    def parse(value: Any) -> str:
        text = str(value).strip().lower()
        if text not in choices:
            raise ValueError(f"{value!r} is not one of {', '.join(choices)}")
        return text
    return parse


def _text(value: Any) -> str:
    if not isinstance(value, str | int | float) or isinstance(value, bool):
        raise ValueError(f"expected a string, got {value!r}")
    return str(value)


def _port_or_off(value: Any) -> int:
    """A port; 0 picks a free one; -1 or "off" disables the listener."""
    if str(value).strip().lower() in ("off", "-1", "disabled", "none"):
        return -1
    return _int(0, 65535)(value)


@dataclass(frozen=True, slots=True)
class Option:
    """One setting: its field in MasterConfig, parser, help and extra spellings."""

    name: str          # command-line / file / env stem, snake_case
    field_name: str    # attribute of MasterConfig
    parse: Parser
    help: str
    metavar: str = "VALUE"
    aliases: tuple[str, ...] = ()


HOUR_S = 3600.0
OPTIONS: tuple[Option, ...] = (
    Option("config", "config", _text, "YAML or JSON file of settings (keys: any option name)",
           "FILE"),
    Option("host", "host", _text, "address the gRPC and lean ports bind (default 0.0.0.0)", "ADDR",
           aliases=("rpc_address",)),
    Option("port", "port", _int(0, 65535), "gRPC port (0 picks a free one; default 50051)", "PORT",
           aliases=("rpc_port",)),
    Option("fast_port", "fast_port", _port_or_off,
           "lean-framing port served beside gRPC; clients use it for every call when advertised "
           "(0 picks a free one, -1 or 'off' disables; default 50052)", "PORT"),
    Option("local_socket", "local_socket", _switch,
           "also serve the lean framing on an abstract Unix socket, used by clients on this "
           "host (a third to half cheaper per call than loopback TCP); never with TLS (default on)",
           "on|off"),
    Option("busy_poll_us", "busy_poll_us", _int(0, 10_000),
           "after serving lean calls, poll the lean connections this many MICROSECONDS before "
           "sleeping: a client's next call then skips a process wake-up (about 25 us on a VM); "
           "long enough to span a put's data transfer between its two calls; costs at most "
           "that much CPU per burst of calls (0 disables; default 300)", "US"),
    Option("metrics_host", "metrics_host", _text,
           "address of the HTTP /metrics, /healthz, /status endpoint (default 127.0.0.1)", "ADDR"),
    Option("metrics_port", "metrics_port", _port_or_off,
           "HTTP metrics port (0 picks a free one, -1 or 'off' disables; default 9003)", "PORT"),
    Option("eviction_high_watermark_ratio", "eviction_high_watermark_ratio",
           _float(0.0, 1.0, lo_open=True),
           "evict when used/capacity of a tier passes this ratio, in (0, 1] (default 0.95)",
           "RATIO"),
    Option("eviction_ratio", "eviction_ratio", _float(0.0, 1.0, lo_open=True),
           "fraction of capacity each eviction pass frees, in (0, 1] (default 0.05)", "RATIO"),
    Option("eviction_policy", "eviction_policy", _choice("lru", "prefix-lru"),
           "victim order: lru, or prefix-lru (chain tails first) (default lru)", "POLICY"),
    Option("default_kv_lease_ttl", "default_kv_lease_ttl_ms", _int(1, 86_400_000),
           "read lease granted by every lookup, in MILLISECONDS as Mooncake's flag "
           "(default 5000 = 5 s)", "MS"),
    Option("client_ttl", "client_ttl_s", _float(0.0, 24 * HOUR_S, lo_open=True),
           "seconds without a heartbeat before a client is expired (default 10)", "SECONDS"),
    Option("put_start_discard_timeout", "put_start_discard_timeout_s",
           _float(0.0, 24 * HOUR_S, lo_open=True),
           "seconds after which an uncommitted put is reclaimed (default 30)", "SECONDS",
           aliases=("put_start_discard_timeout_sec",)),
    Option("write_capability_ttl", "write_capability_ttl_s", _float(0.0, HOUR_S, lo_open=True),
           "seconds a writer may use the WRITE capabilities of one PutStart; space a revoked or "
           "reclaimed put held is reused only after them, and after a restart with --state-dir "
           "the free space of restored segments only after this long (default 10)", "SECONDS"),
    Option("max_segments_per_client", "max_segments_per_client", _int(1, 1_000_000),
           "most segments one client may mount; more answer RESOURCE_EXHAUSTED (default 1024)",
           "N"),
    Option("max_batch_keys", "max_batch_keys", _int(1, 10_000_000),
           "most keys in one call; longer batches answer INVALID_ARGUMENT. Clients learn it at "
           "registration and send longer batches as several calls; a call's request is decoded "
           "as one step, about 3 ms for 16384 keys with parent keys (default 16384)", "N"),
    Option("engine_transport", "engine_transport", _choice("allow", "refuse", "require"),
           "segments a transfer engine reaches one-sidedly (no capability check by the owner, "
           "see README 'Engine transport'): allow them, refuse them (their MountSegment answers "
           "PERMISSION_DENIED), or require them of every segment (default allow)", "POLICY"),
    Option("ssd_promote_after_hits", "ssd_promote_after_hits", _int(0, 1_000_000),
           "reads answered from SSD only before the object gets a DRAM copy again on its "
           "owner's host (1: on the first hit, 0: never; default 1)", "N"),
    Option("copy_task_ttl", "copy_task_ttl_s", _float(0.0, HOUR_S, lo_open=True),
           "seconds a client has to make a tier copy (demotion, promotion) it fetched; its "
           "target space is reused write_capability_ttl after that (default 30)", "SECONDS"),
    Option("max_key_bytes", "max_key_bytes", _int(1, MAX_KEY_BYTES),
           f"longest key in bytes; longer keys answer INVALID_KEY (default {MAX_KEY_BYTES})", "N"),
    Option("max_message_bytes", "max_message_bytes", _size(4096, 2**31 - 1),
           "largest request or answer on either port, e.g. 256mb (default 256 MiB: a batch of "
           "100k keys of 1 KiB fits)", "BYTES"),
    Option("max_connections", "max_connections", _int(1, 1_000_000),
           "most open lean-framing connections; more are refused (default 16384: a client "
           "keeps about three; the master raises its open-files limit to fit)", "N"),
    Option("max_connections_per_peer", "max_connections_per_peer", _int(1, 1_000_000),
           "most open lean-framing connections from one IP address; more are refused "
           "(the local Unix socket is not counted; default 256)", "N"),
    Option("auth_timeout", "auth_timeout_s", _float(0.0, HOUR_S, lo_open=True),
           "seconds a new lean connection has to send its first frame (METHOD_AUTH when a "
           "token is set) before it is closed; until then, at max_connections, the oldest such "
           "connection is closed to admit a new one (default 5)", "SECONDS"),
    Option("max_inflight_requests", "max_inflight_requests", _int(1, 1_000_000),
           "most gRPC calls served at once; more answer RESOURCE_EXHAUSTED (default 4096)", "N"),
    Option("frame_timeout", "frame_timeout_s", _float(0.0, HOUR_S, lo_open=True),
           "seconds a lean connection may hold an incomplete frame before it is closed "
           "(default 30)", "SECONDS"),
    Option("state_dir", "state_dir", _text,
           "persist the index here (snapshot + log) and restore it at start (default: none)",
           "DIR"),
    Option("state_fsync", "state_fsync", _choice("always", "batch", "never"),
           "when the state log is fsynced: always (every change), batch (at most 50 ms "
           "after a change; default), never (left to the OS; a killed master still loses "
           "nothing, a machine crash may)", "POLICY"),
    Option("state_compact_bytes", "state_compact_bytes", _size(4096, 2**40),
           "state log size that starts a compaction into a new snapshot, written a step at "
           "a time between requests while the master serves (default 64mb)", "BYTES"),
    Option("state_compact_ratio", "state_compact_ratio", _float(0.0, 100.0),
           "a compaction also waits until the state log is this many times the size of the "
           "last snapshot, so a big index is not rewritten every few MiB of change "
           "(default 0.25; 0: the size alone decides)", "RATIO"),
    Option("restore_grace", "restore_grace_s", _float(0.0, 24 * HOUR_S),
           "seconds restored segments have to be remounted before their objects are dropped, "
           "counted from the end of the restore (default 60)", "SECONDS"),
    Option("tls_cert", "tls_cert", _text, "PEM certificate: serve TLS on both ports", "FILE"),
    Option("tls_key", "tls_key", _text, "PEM private key of --tls-cert", "FILE"),
    Option("tls_ca", "tls_ca", _text, "PEM CA bundle: require client certificates (mutual TLS)",
           "FILE"),
    Option("auth_token", "auth_token", _text,
           "shared secret every client must present (prefer --auth-token-file)", "TOKEN"),
    Option("auth_token_file", "auth_token_file", _text, "file holding the shared secret", "FILE"),
    Option("log_level", "log_level", _choice("debug", "info", "warning", "error"),
           "debug, info, warning or error (default info)", "LEVEL"),
    Option("ready_file", "ready_file", _text,
           "once serving, write {grpc_port, fast_port, metrics_port, pid} as JSON here", "FILE"),
    Option("rpc_thread_num", "rpc_thread_num", _int(0, 1_000_000),
           "accepted for Mooncake compatibility and ignored: the master is one event loop, "
           "every request is served atomically on it", "N"),
    Option("partitions", "partitions", _int(1, MAX_PARTITIONS),
           "split the index by key across this many processes on this host, one core each: "
           "this one (partition 0, at --port) and others it starts on free ports, which "
           "clients learn when they register; metrics at --metrics-port + index, state in "
           "--state-dir/partition-<index> (README, 'Partitions'; default 1)", "N"),
    Option("partition_ports", "partition_ports", _int(0, 65535),
           "with --partitions: partition i >= 1 serves gRPC at PORT + 2(i-1) and the lean "
           "framing at the port after it, for firewalls and container port lists (0: free "
           "ports, which clients learn anyway; default 0)", "PORT"),
)
OPTION_BY_NAME: dict[str, Option] = {
    spelling: option for option in OPTIONS
    for spelling in (option.name, option.name.replace("_", "-"), *option.aliases)
}


def _apply(values: dict[str, Any], name: str, raw: Any, source: str) -> None:
    option = OPTION_BY_NAME.get(name)
    if option is None:
        raise ConfigError(f"unknown setting {name!r} in {source}")
    try:
        values[option.field_name] = option.parse(raw)
    except ValueError as exc:
        raise ConfigError(f"bad value for {option.name} in {source}: {exc}") from None


def read_file_settings(path: str) -> dict[str, Any]:
    """Return the mapping in a YAML or JSON settings file; ConfigError when unreadable."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    try:
        if path.endswith(".json"):
            data = json.loads(text)
        else:
            import yaml  # YAML is a superset of JSON: it reads both

            data = yaml.safe_load(text)
    except (ValueError, ImportError) as exc:
        first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"config file {path} is not valid YAML/JSON: {first_line}") from None
    except Exception as exc:  # yaml.YAMLError does not derive from ValueError
        first_line = " ".join(str(exc).split())[:200]
        raise ConfigError(f"config file {path} is not valid YAML/JSON: {first_line}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of settings")
    return data


def service_link(key: str, value: str) -> bool:
    """Whether ``key=value`` is a variable Kubernetes made for a service named like the
    master's variables (see the module rules), not a setting."""
    rest = key[len(ENV_PREFIX):]
    if rest.startswith("SERVICE_"):
        return True
    if rest == "PORT":
        return "://" in value
    parts = rest.split("_")   # PORT_<number>_<TCP|UDP|SCTP>[_PROTO|_PORT|_ADDR]
    return (len(parts) >= 3 and parts[0] == "PORT" and parts[1].isdigit()
            and parts[2] in ("TCP", "UDP", "SCTP"))


def resolve(flags: Mapping[str, Any], environ: Mapping[str, str]) -> MasterConfig:
    """Merge flag > env > file > default into a validated MasterConfig.

    ``flags`` maps canonical option names to the raw strings given on the command line (only
    those given). Raises ConfigError naming the first unusable setting.
    """
    env_settings: dict[str, str] = {}
    for key, raw in environ.items():
        if key.startswith(ENV_PREFIX) and not service_link(key, raw):
            name = key[len(ENV_PREFIX):].lower()
            if name not in OPTION_BY_NAME:
                raise ConfigError(f"unknown setting in environment variable {key}")
            env_settings[OPTION_BY_NAME[name].name] = raw
    config_path = flags.get("config") or env_settings.get("config") or ""
    values: dict[str, Any] = {}
    if config_path:
        for name, raw in read_file_settings(str(config_path)).items():
            if str(name).replace("-", "_") == "config":
                raise ConfigError(f"config file {config_path} may not name another config file")
            _apply(values, str(name), raw, f"config file {config_path}")
    for name, raw in env_settings.items():
        _apply(values, name, raw, f"environment variable {ENV_PREFIX}{name.upper()}")
    for name, raw in flags.items():
        _apply(values, name, raw, f"flag --{name.replace('_', '-')}")
    config = MasterConfig(**values)
    _check_combination(config)
    return config


def _check_combination(config: MasterConfig) -> None:
    if bool(config.tls_cert) != bool(config.tls_key):
        raise ConfigError("tls_cert and tls_key must be given together")
    if config.tls_ca and not config.tls_cert:
        raise ConfigError("tls_ca (mutual TLS) needs tls_cert and tls_key")
    for name in ("tls_cert", "tls_key", "tls_ca", "auth_token_file"):
        path = getattr(config, name)
        if path and not os.access(path, os.R_OK):
            raise ConfigError(f"{name}: cannot read file {path}")
    if config.auth_token and config.auth_token_file:
        raise ConfigError("give auth_token or auth_token_file, not both")
    if config.auth_token_file and not load_auth_token(config):
        raise ConfigError(f"auth_token_file {config.auth_token_file} is empty")
    ports = [p for p in (config.port, config.fast_port, config.metrics_port) if p > 0]
    if len(ports) != len(set(ports)):
        raise ConfigError("port, fast_port and metrics_port must differ")
    if config.partition_ports:
        count = config.partitions - 1
        taken = range(config.partition_ports, config.partition_ports + 2 * count)
        metrics = range(config.metrics_port + 1, config.metrics_port + 1 + count) \
            if config.metrics_port > 0 else range(0)
        if taken.stop - 1 > 65535 or any(p in taken for p in (*ports, *metrics)):
            raise ConfigError(f"partition_ports {config.partition_ports}: the "
                              f"{2 * count} ports from it must be free of port, fast_port and "
                              "the partitions' metrics ports (metrics_port + index), and "
                              "<= 65535")


def load_auth_token(config: MasterConfig) -> str:
    """Return the shared secret from --auth-token or --auth-token-file ("" when none)."""
    if config.auth_token_file:
        return Path(config.auth_token_file).read_text().strip()
    return config.auth_token


def public_settings(config: MasterConfig) -> dict[str, Any]:
    """Every setting except secrets, for /status (the token shows only as set or not)."""
    settings = {f.name: getattr(config, f.name) for f in fields(MasterConfig)}
    settings["auth_token"] = "<set>" if config.auth_token else ""
    return settings
