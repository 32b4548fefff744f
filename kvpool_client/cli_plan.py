"""`kvpool plan`: size the device memory an Ascend pool's HCCL links take, and MindIE's factor.

The rule, from MindIE's KV-cache pooling guide for its HCCL one-sided backend:

- every device (or die) of the pool links to every other one; each HCCL link takes 4 MB of
  device memory, so a pool of N devices takes (N - 1) x 4 MB on each device;
- HCCL sets up at most 512 links: keep a pool at 512 devices or fewer;
- each 0.01 taken off MindIE's device-memory factor (``npuMemSize`` factor, 0.92 by default)
  frees about 600 MB for them, up to 0.04 in all (less context length in exchange);
- where nodes join later (scale-out), take the whole 0.04 off from the start, so that links to
  new devices never run a device out of memory.

``plan`` is pure; ``run`` prints it (``--json`` for machines). The exit code is 1 when the
pool cannot be planned within the rule (more links than 0.04 frees), else 0, also with warnings.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass, field

LINK_MB = 4
MAX_LINKS = 512
MB_PER_HUNDREDTH = 600
MAX_REDUCTION_HUNDREDTHS = 4
DEFAULT_FACTOR = 0.92


@dataclass(frozen=True)
class Plan:
    """What an operator sets, and why (see the module docstring)."""

    devices: int  # devices (or dies) the links are sized for, joining nodes included
    link_mb_per_device: int
    reduction: float  # taken off the device-memory factor
    factor: float  # the factor to set
    freed_mb_per_device: int
    fits: bool  # False: more link memory than the largest reduction frees
    warnings: list[str] = field(default_factory=list)


def plan(nodes: int, devices_per_node: int, *, joining_nodes: int = 0,
         scale_out: bool = False, factor: float = DEFAULT_FACTOR) -> Plan:
    """Plan a pool of ``nodes`` x ``devices_per_node`` devices (dies on A3), sized for
    ``joining_nodes`` more; ``scale_out``: nodes may join later in unknown number. Raises
    ValueError for counts below 1 (devices) or 0 (joining nodes) and a factor outside (0, 1]."""
    if nodes < 1 or devices_per_node < 1 or joining_nodes < 0:
        raise ValueError("nodes and devices per node must be at least 1, joining nodes at least 0")
    if not 0 < factor <= 1:
        raise ValueError(f"the device-memory factor must be in (0, 1], got {factor}")
    devices = (nodes + joining_nodes) * devices_per_node
    link_mb = (devices - 1) * LINK_MB
    needed = math.ceil(link_mb / MB_PER_HUNDREDTH) if link_mb else 0
    hundredths = MAX_REDUCTION_HUNDREDTHS if scale_out else min(needed,
                                                                MAX_REDUCTION_HUNDREDTHS)
    warnings = []
    if devices > MAX_LINKS:
        warnings.append(f"{devices} devices is more than the {MAX_LINKS} HCCL links a device "
                        f"can set up: split the pool into pools of {MAX_LINKS} or fewer")
    fits = needed <= MAX_REDUCTION_HUNDREDTHS
    if not fits:
        warnings.append(f"{link_mb} MB of links per device is more than the "
                        f"{MAX_REDUCTION_HUNDREDTHS * MB_PER_HUNDREDTH} MB that the largest "
                        "reduction (0.04) frees")
    if hundredths and factor - hundredths / 100 <= 0:
        raise ValueError(f"a factor of {factor} cannot give up {hundredths / 100}")
    if scale_out:
        warnings.append("scale-out: the whole 0.04 is reserved, so devices that join later can "
                        "link without running out of memory")
    return Plan(devices=devices, link_mb_per_device=link_mb, reduction=hundredths / 100,
                factor=round(factor - hundredths / 100, 2),
                freed_mb_per_device=hundredths * MB_PER_HUNDREDTH, fits=fits, warnings=warnings)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=int, required=True, help="nodes in the pool now")
    parser.add_argument("--devices-per-node", type=int, required=True,
                        help="devices per node taking part in pooling (dies on A3: 16 per "
                             "Atlas 800I A3)")
    parser.add_argument("--joining-nodes", type=int, default=0,
                        help="nodes known to join later (sized in now)")
    parser.add_argument("--scale-out", action="store_true",
                        help="nodes may join later in unknown number: reserve the whole 0.04")
    parser.add_argument("--factor", type=float, default=DEFAULT_FACTOR,
                        help=f"MindIE's device-memory factor today (default {DEFAULT_FACTOR})")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def run(args: argparse.Namespace) -> int:
    try:
        result = plan(args.nodes, args.devices_per_node, joining_nodes=args.joining_nodes,
                      scale_out=args.scale_out, factor=args.factor)
    except ValueError as exc:
        print(f"kvpool plan: {exc}")
        return 2
    if args.json:
        print(json.dumps(asdict(result), indent=2))
    else:
        print(f"devices in the pool:           {result.devices}")
        print(f"HCCL link memory per device:   {result.link_mb_per_device} MB "
              f"(({result.devices} - 1) x {LINK_MB} MB)")
        print(f"take off the memory factor:    {result.reduction:.2f} "
              f"(frees about {result.freed_mb_per_device} MB per device)")
        print(f"set MindIE's factor to:        {result.factor:.2f} (from {args.factor:.2f})")
        for warning in result.warnings:
            print(f"warning: {warning}")
    return 0 if result.fits else 1
