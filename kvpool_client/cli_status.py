"""`kvpool status`: the master's clients, segments, capacity, usage and objects, pretty-printed.

The document is the master's GetStats answer (the same JSON as its HTTP ``/status``); ``--json``
prints it raw. Sections this printer does not know are printed as JSON rather than dropped.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import Any

from kvpool_client.config import ClientConfig, ConfigError
from kvpool_client.liveness import MasterAddress
from kvpool_wire.status import KVPoolError

DEFAULT_MASTER = "127.0.0.1:50051"


def add_master_arguments(parser: argparse.ArgumentParser) -> None:
    """Options naming the master (shared by `kvpool status` and `kvpool bench`)."""
    parser.add_argument("--master", metavar="HOST:PORT",
                        help="master address (default: MOONCAKE_MASTER, else the client config "
                             f"named by KVPOOL_CONFIG_PATH / MOONCAKE_CONFIG_PATH, else "
                             f"{DEFAULT_MASTER})")
    parser.add_argument("--config", metavar="FILE", help="client config JSON to take the master "
                        "address, token and TLS settings from")
    parser.add_argument("--timeout", type=float, default=5.0, metavar="SECONDS",
                        help="deadline of each call to the master (default 5)")
    parser.add_argument("--auth-token", default=None, help="shared-secret token of the master")
    parser.add_argument("--tls-ca", default=None, metavar="FILE")
    parser.add_argument("--tls-cert", default=None, metavar="FILE")
    parser.add_argument("--tls-key", default=None, metavar="FILE")


def client_config_from_args(args: argparse.Namespace, **overrides: Any) -> ClientConfig:
    """The client config the CLI options describe (config file, env, then flags).

    Raises ConfigError naming the bad option.
    """
    if args.config:
        base = ClientConfig.from_file(args.config)
    elif any(os.environ.get(name) for name in ("KVPOOL_CONFIG_PATH", "MOONCAKE_CONFIG_PATH",
                                               "MOONCAKE_MASTER")):
        base = ClientConfig.from_env()
    else:
        base = ClientConfig(master_server_address=DEFAULT_MASTER)
    changes: dict[str, Any] = {"rpc_timeout_s": args.timeout, **overrides}
    for flag, key in (("master", "master_server_address"), ("auth_token", "auth_token"),
                      ("tls_ca", "tls_ca"), ("tls_cert", "tls_cert"), ("tls_key", "tls_key")):
        value = getattr(args, flag)
        if value is not None:
            changes[key] = value
    return base.replace(**changes)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `kvpool status`."""
    add_master_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print the raw JSON document")


async def fetch_stats(master: MasterAddress) -> dict[str, Any]:
    """The master's status document. Raises KVPoolError when it cannot be fetched."""
    rpc = master.stub()
    try:
        return await rpc.get_stats()
    finally:
        await rpc.close()


def run(args: argparse.Namespace) -> int:
    """Print the master's status; returns 0, or 2 when the master cannot be asked."""
    try:
        config = client_config_from_args(args)
        document = asyncio.run(fetch_stats(MasterAddress.of(config)))
    except (ConfigError, KVPoolError) as exc:
        print(f"kvpool status: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(document, indent=2, sort_keys=True))
    else:
        print(render(document, config.master_server_address))
    return 0


def render(document: dict[str, Any], address: str) -> str:
    """The status document as text for a terminal."""
    doc = dict(document)
    partitions = doc.pop("partitions", 1)
    lines = [f"kvpool master {address}" + (f" ({partitions} partitions, summed)"
                                           if partitions > 1 else "")]
    segments = doc.pop("segments", {}) or {}
    lines.append(f"clients: {doc.pop('clients', '?')}   segments: "
                 f"{segments.get('mounted', '?')} mounted, {segments.get('restored', 0)} restored")
    capacity = doc.pop("capacity_bytes", {}) or {}
    used = doc.pop("used_bytes", {}) or {}
    for tier in sorted(set(capacity) | set(used)):
        cap, use = capacity.get(tier, 0), used.get(tier, 0)
        share = f" ({100 * use / cap:.1f}%)" if cap else ""
        lines.append(f"{tier}: {format_bytes(use)} used of {format_bytes(cap)}{share}")
    objects = doc.pop("objects", None)
    if isinstance(objects, dict):
        lines.append(f"objects: {objects.get('ready', 0)} ready "
                     f"({format_bytes(objects.get('ready_bytes', 0))}), "
                     f"{objects.get('pending', 0)} pending")
        if objects.get("sweep_backlog_keys"):
            lines.append(f"sweeping: about {objects['sweep_backlog_keys']} table entries left "
                         "(lost segments, removals)")
    rows_of_partitions = doc.pop("partition_list", None)
    if isinstance(rows_of_partitions, list) and rows_of_partitions:
        lines.append("")
        lines.extend(_table(("PARTITION", "READY", "PENDING", "READY BYTES", "SWEEP BACKLOG",
                             "STALLED"),
                            [(str(row.get("index", "?")), str(row.get("ready", 0)),
                              str(row.get("pending", 0)),
                              format_bytes(int(row.get("ready_bytes", 0))),
                              str(row.get("sweep_backlog_keys", 0)),
                              f"{float(row.get('stalled_s', 0.0)):.1f} s")
                             for row in rows_of_partitions]))
    copies = doc.pop("tier_copies", None)
    if isinstance(copies, dict) and any(copies.values()):
        lines.append("tier copies: " + ", ".join(
            f"{kind} {copies.get(f'{kind}s_done_total', 0)} done / "
            f"{copies.get(f'{kind}s_failed_total', 0)} failed"
            for kind in ("demotion", "promotion")) + f", {copies.get('in_flight', 0)} in flight")
    rows = segments.get("list") or []
    if rows:
        lines.append("")
        table = []
        for s in rows:
            cap = int(s.get("capacity_bytes", 0))
            use = int(s.get("used_bytes", 0))
            table.append((str(s.get("segment_id", "")), str(s.get("client_id", "")),
                          str(s.get("tier", "")), "yes" if s.get("mounted", True) else "no",
                          format_bytes(cap), format_bytes(use),
                          f"{100 * use / cap:.1f}" if cap else "-",
                          format_bytes(int(s.get("largest_free_bytes", 0)))))
        lines.extend(_table(("SEGMENT", "CLIENT", "TIER", "MOUNTED", "CAPACITY", "USED",
                             "USED%", "LARGEST FREE"), table))
    totals = doc.pop("totals", None)
    if isinstance(totals, dict) and totals:
        lines.append("")
        lines.append("totals:")
        width = max(len(name) for name in totals)
        for name, value in sorted(totals.items()):
            lines.append(f"  {name.ljust(width)}  {value}")
    for name, value in sorted(doc.items()):
        if isinstance(value, dict) and value:
            lines.append(f"{name}:")
            width = max(len(str(k)) for k in value)
            lines.extend(f"  {str(k).ljust(width)}  {json.dumps(v)}" for k, v in
                         sorted(value.items()))
        else:
            lines.append(f"{name}: {json.dumps(value, sort_keys=True)}")
    return "\n".join(lines)


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    """``rows`` under ``header``, columns padded to their widest cell, indented."""
    table = [header, *rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    return ["  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True))
            for row in table]


def format_bytes(num_bytes: float) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"  # pragma: no cover
