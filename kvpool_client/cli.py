"""`kvpool` operator CLI: one subcommand per module, imported only when used.

Each subcommand module defines ``add_arguments(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

#: subcommand -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "status": ("kvpool_client.cli_status", "show the master's clients, segments, usage, objects"),
    "replay": ("kvpool_client.replay", "replay a request trace against a pool (or --simulate)"),
    "bench": ("kvpool_client.cli_bench", "quick put/get throughput check against a live pool"),
    "plan": ("kvpool_client.cli_plan", "size an Ascend pool's HCCL link memory and MindIE's "
                                       "device-memory factor"),
}


def build_parser() -> argparse.ArgumentParser:
    """The argparse tree; subcommand modules add their own arguments."""
    parser = argparse.ArgumentParser(prog="kvpool", description="kvpool operator tool")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sp = sub.add_parser(name, help=help_text)
        sp.set_defaults(_module=module_name)
        try:
            importlib.import_module(module_name).add_arguments(sp)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `kvpool` console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    module = importlib.import_module(args._module)
    return int(module.run(args))


if __name__ == "__main__":
    sys.exit(main())
