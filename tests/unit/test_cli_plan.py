"""`kvpool plan`: the HCCL link sizing rule of MindIE's pooling guide, through the real CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvpool_client.cli_plan import plan


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvpool_client.cli", "plan", *args],
                          capture_output=True, text=True, timeout=60)


def test_the_guides_example_four_plus_four_a3_servers() -> None:
    # 8 Atlas 800I A3 servers x 16 dies: (128 - 1) x 4 MB = 508 MB, under the 600 MB that
    # 0.01 frees: 0.92 -> 0.91
    result = plan(8, 16)
    assert (result.devices, result.link_mb_per_device) == (128, 508)
    assert (result.reduction, result.factor, result.fits) == (0.01, 0.91, True)
    assert result.warnings == []
    proc = cli("--nodes", "8", "--devices-per-node", "16", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["factor"] == 0.91


def test_scale_out_reserves_the_whole_reduction_and_joining_nodes_are_sized_in() -> None:
    assert plan(2, 8, scale_out=True).factor == 0.88  # the guide: 0.92 -> 0.88
    assert plan(2, 8, joining_nodes=2).devices == 32
    assert plan(1, 1).link_mb_per_device == 0 and plan(1, 1).factor == 0.92


def test_past_512_devices_warns_and_past_what_0_04_frees_fails() -> None:
    many = plan(33, 16)  # 528 devices: 527 x 4 = 2108 MB, still within 0.04 (2400 MB)
    assert many.fits and many.reduction == 0.04
    assert any("512" in w for w in many.warnings)
    too_many = cli("--nodes", "40", "--devices-per-node", "16")  # 639 x 4 = 2556 MB
    assert too_many.returncode == 1
    assert "more than the 2400 MB" in too_many.stdout


@pytest.mark.parametrize("args", [("--nodes", "0", "--devices-per-node", "8"),
                                  ("--nodes", "2", "--devices-per-node", "8", "--factor", "1.5"),
                                  ("--nodes", "2", "--devices-per-node", "8",
                                   "--joining-nodes", "-1")])
def test_bad_input_is_refused_with_a_reason(args: tuple[str, ...]) -> None:
    proc = cli(*args)
    assert proc.returncode == 2 and proc.stdout.startswith("kvpool plan: ")
