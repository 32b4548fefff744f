"""Write deploy/grafana/kvpool-dashboard.json (run: python deploy/grafana/make_dashboard.py).

The dashboard is generated so that its panels stay in step with the metric names; the JSON is
committed for operators who import it directly.
"""

from __future__ import annotations

import json
from pathlib import Path

PANELS: list[tuple[str, str, list[tuple[str, str]]]] = [
    # (title, unit, [(expr, legend)])
    ("Pool hit rate (leading blocks found / looked up)", "percentunit", [
        ("sum(rate(kvpool_lookup_hit_blocks_total[5m]))"
         " / sum(rate(kvpool_lookup_blocks_total[5m]))",
         "hit rate")]),
    ("Usage per tier", "bytes", [
        ("sum by (tier) (kvpool_used_bytes)", "used {{tier}}"),
        ("sum by (tier) (kvpool_capacity_bytes)", "capacity {{tier}}")]),
    ("Objects", "short", [("sum by (state) (kvpool_objects)", "{{state}}")]),
    # every partition of a partitioned master knows every client and every segment: the most
    # any partition reports (one master process: its own figure)
    ("Clients and segments", "short", [
        ("max(kvpool_clients)", "clients"),
        ("max by (state) (kvpool_segments)", "segments {{state}}")]),
    ("Master calls per second", "reqps", [
        ("sum by (method) (rate(kvpool_rpc_requests_total[1m]))", "{{method}}")]),
    ("Master call latency p99", "s", [
        ("histogram_quantile(0.99, sum by (le, method) "
         "(rate(kvpool_rpc_duration_seconds_bucket[5m])))",
         "{{method}}")]),
    ("Eviction", "Bps", [("rate(kvpool_evicted_bytes_total[5m])", "evicted bytes/s")]),
    ("Put outcomes", "ops", [
        ("rate(kvpool_puts_committed_total[5m])", "committed"),
        ("rate(kvpool_puts_no_space_total[5m])", "no space"),
        ("rate(kvpool_puts_revoked_total[5m])", "revoked"),
        ("rate(kvpool_pending_reclaimed_total[5m])", "reclaimed pending")]),
    ("Segment fill", "percentunit", [
        ("kvpool_segment_used_bytes / kvpool_segment_capacity_bytes", "{{segment}}")]),
    ("SSD tier: copies and hits", "ops", [
        ("sum by (kind, result) (rate(kvpool_tier_copies_total[5m]))", "{{kind}} {{result}}"),
        ("rate(kvpool_ssd_read_hit_keys_total[5m])", "reads from SSD"),
        ("rate(kvpool_evicted_replicas_total[5m])", "evicted from DRAM, kept on SSD")]),
    ("Refusals and expiries", "short", [
        ("sum by (reason) (increase(kvpool_refusals_total[5m]))", "refused {{reason}}"),
        ("increase(kvpool_clients_expired_total[5m])", "clients expired")]),
    ("Master loop lag (how late due work ran)", "s", [
        ("histogram_quantile(0.99, sum by (le) (rate(kvpool_master_loop_lag_seconds_bucket[5m])))",
         "p99"),
        ("histogram_quantile(0.999, sum by (le) "
         "(rate(kvpool_master_loop_lag_seconds_bucket[5m])))", "p99.9"),
        ("kvpool_master_loop_lag_max_seconds", "longest since start")]),
    ("Work between calls: sweeps and removals", "short", [
        ("kvpool_sweep_backlog_keys", "table entries still to walk"),
        ("kvpool_removal_held_extents", "extents removed, not yet freed")]),
    ("State log: compactions, restore", "s", [
        ("kvpool_state_last_compaction_seconds", "last compaction, start to swap"),
        ("kvpool_state_last_compaction_longest_step_seconds", "its longest step"),
        ("kvpool_restore_seconds", "restore at the master's last start")]),
    ("State log: compactions in the last hour", "short", [
        ("increase(kvpool_state_compactions_total[1h])", "compactions")]),
]


def dashboard() -> dict[str, object]:
    """The Grafana dashboard model."""
    panels = []
    for index, (title, unit, targets) in enumerate(PANELS):
        panels.append({
            "id": index + 1,
            "type": "timeseries",
            "title": title,
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "gridPos": {"h": 8, "w": 12, "x": 12 * (index % 2), "y": 8 * (index // 2)},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "targets": [{"expr": expr, "legendFormat": legend, "refId": chr(ord("A") + i)}
                        for i, (expr, legend) in enumerate(targets)],
        })
    return {
        "title": "kvpool",
        "uid": "kvpool-master",
        "schemaVersion": 39,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "30s",
        "templating": {"list": [{"name": "datasource", "type": "datasource",
                                 "query": "prometheus"}]},
        "panels": panels,
    }


if __name__ == "__main__":
    out = Path(__file__).with_name("kvpool-dashboard.json")
    out.write_text(json.dumps(dashboard(), indent=2) + "\n")
    print(out)
