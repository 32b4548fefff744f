"""deploy/ stays true: alert rules parse, every metric they and the dashboard use is served, and
the container recipe installs a master that starts."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
ALERTS = DEPLOY / "prometheus" / "kvpool-alerts.yaml"
DASHBOARD = DEPLOY / "grafana" / "kvpool-dashboard.json"
_METRIC = re.compile(r"\bkvpool_[a-z_]+")
_SUFFIXES = ("_bucket", "_count", "_sum")


def _served_names(metrics_url: str) -> set[str]:
    with urllib.request.urlopen(f"{metrics_url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    # Families are declared by `# TYPE` even before they have samples (labelled counters,
    # per-segment gauges); expand each into the sample names Prometheus will store.
    names: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, family, kind = line.split(" ", 3)
            names.add(family)
            if kind == "counter":
                names.add(family + "_total")
            if kind == "histogram":
                names.update(family + s for s in _SUFFIXES)
    return names


def _used_names() -> set[str]:
    exprs = [rule["expr"] for group in yaml.safe_load(ALERTS.read_text())["groups"]
             for rule in group["rules"]]
    exprs += [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"]]
    return {name for expr in exprs for name in _METRIC.findall(expr)}


def test_dashboard_json_is_generated_from_script(tmp_path: Path) -> None:
    script = DEPLOY / "grafana" / "make_dashboard.py"
    copy = tmp_path / "make_dashboard.py"
    shutil.copy(script, copy)
    subprocess.run([sys.executable, str(copy)], check=True, capture_output=True)
    assert (tmp_path / "kvpool-dashboard.json").read_text() == DASHBOARD.read_text(), \
        "run: python deploy/grafana/make_dashboard.py"


def test_alert_rules_pass_promtool() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package `prometheus`)")
    result = subprocess.run([promtool, "check", "rules", str(ALERTS)], capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    # the scrape config, with the rule file it names
    result = subprocess.run([promtool, "check", "config", "scrape.yaml"], capture_output=True,
                            text=True, cwd=DEPLOY / "prometheus")
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_metric_used_by_deploy_is_served(master: Any) -> None:
    served = _served_names(master.metrics_url)
    missing = sorted(name for name in _used_names() if name not in served)
    assert not missing, f"deploy/ uses metrics the master does not serve: {missing}"


def _copy_like_containerfile(containerfile: Path, into: Path) -> None:
    """Copy what the Containerfile's COPY lines copy (sources relative to the repository,
    destinations relative to its WORKDIR) into ``into``."""
    for line in containerfile.read_text().splitlines():
        if not line.startswith("COPY "):
            continue
        *sources, destination = line.split()[1:]
        for source in sources:
            target = into / destination
            if destination.endswith("/"):
                target = target / Path(source).name
            if (ROOT / source).is_dir():
                shutil.copytree(ROOT / source, target,
                                ignore=shutil.ignore_patterns("__pycache__", "*.so"))
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(ROOT / source, target)


def test_the_container_image_installs_a_master_that_starts(tmp_path: Path) -> None:
    """What the Containerfile copies is all that `pip install .` there gets: installed from
    exactly that (no network: the dependencies come from this environment), the master and
    the client import, the master without anything of this checkout on its path."""
    source = tmp_path / "src"
    _copy_like_containerfile(DEPLOY / "container" / "Containerfile", source)
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    "--no-build-isolation", "--target", str(site), str(source)],
                   check=True, capture_output=True, timeout=300)
    paths = sysconfig.get_paths()
    # -S: no site module, so no .pth file puts this checkout's editable install on the path
    env = {"PYTHONPATH": os.pathsep.join([str(site), paths["purelib"], paths["platlib"]]),
           "PATH": os.environ.get("PATH", "")}
    result = subprocess.run(
        [sys.executable, "-S", "-c",
         "import kvpool_master.cli, kvpool_client.client, kvpool_wire, sys;"
         "assert all(m.__file__.startswith(sys.argv[1]) for m in "
         "(kvpool_master.cli, kvpool_client.client, kvpool_wire))", str(site)],
        env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    result = subprocess.run([sys.executable, "-S", "-m", "kvpool_master.cli", "--help"],
                            env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 0 and "--state-dir" in result.stdout, result.stderr[-2000:]


def _manifest_documents(path: Path) -> list[Any]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def test_every_shipped_config_is_accepted_as_it_stands(tmp_path: Path) -> None:
    """The example master config, the master ConfigMap and the workers' client ConfigMap load
    through the loaders the master and the clients use; nothing in them waits for an
    expansion that no one does (Kubernetes expands nothing inside a ConfigMap)."""
    from kvpool_client.config import ClientConfig
    from kvpool_master.config import resolve

    master_files = [DEPLOY / "master.example.yaml"]
    for doc in _manifest_documents(DEPLOY / "kubernetes" / "kvpool-master.yaml"):
        if doc["kind"] == "ConfigMap":
            copy = tmp_path / "master.yaml"
            copy.write_text(doc["data"]["master.yaml"])
            master_files.append(copy)
    assert len(master_files) == 2
    for path in master_files:
        assert "${" not in path.read_text(), path
        config = resolve({"config": str(path)}, {})
        assert config.state_dir, path   # both keep the index across restarts
    [client_map] = _manifest_documents(DEPLOY / "kubernetes" / "worker-client-config.yaml")
    text = client_map["data"]["mooncake.json"]
    assert "${" not in text
    path = tmp_path / "mooncake.json"
    path.write_text(text)
    config = ClientConfig.from_file(path, environ={"MOONCAKE_LOCAL_HOSTNAME": "10.0.0.7"})
    assert config.master_server_address == "kvpool-master:50051"
    assert config.data_host == "10.0.0.7"
