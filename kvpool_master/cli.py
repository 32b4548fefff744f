"""`kvpool-master` command line: parse settings, set up logging, run the server on uvloop.

Exit codes: 0 after SIGTERM/SIGINT, 2 for an unusable setting (one line naming it), 1 when the
server cannot start (for example a port already in use).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from kvpool_master.config import ENV_PREFIX, OPTIONS, ConfigError, MasterConfig, resolve
from kvpool_master.partition import StateLayoutError

PROG = "kvpool-master"
EPILOG = f"""\
Every option may also be given as a {ENV_PREFIX}<NAME> environment variable (e.g.
{ENV_PREFIX}EVICTION_RATIO=0.1) or as a key of the --config file; precedence is
flag > environment > file > default. Options accept --dash-case and Mooncake's --snake_case.
Units: --default-kv-lease-ttl is in milliseconds (as Mooncake's flag); --client-ttl,
--put-start-discard-timeout and --restore-grace are in seconds.
"""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # One clear line, not a usage dump: operators read this in a service log.
        self.exit(2, f"{PROG}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser; every option defaults to 'not given' so precedence can apply."""
    parser = _Parser(prog=PROG, allow_abbrev=False, epilog=EPILOG,
                     formatter_class=argparse.RawDescriptionHelpFormatter,
                     description="kvpool master: where every object of the KV-cache pool "
                                 "lives (gRPC + lean framing, Prometheus metrics).")
    for option in OPTIONS:
        spellings = [f"--{option.name.replace('_', '-')}"]
        for extra in (option.name, *option.aliases):
            if f"--{extra}" not in spellings:
                spellings.append(f"--{extra}")
        parser.add_argument(*spellings, dest=option.name, metavar=option.metavar,
                            help=option.help, default=argparse.SUPPRESS)
    return parser


def parse_config(argv: Sequence[str] | None = None,
                 environ: dict[str, str] | None = None) -> MasterConfig:
    """Settings from argv + environment + config file; raises ConfigError or exits 2."""
    flags: dict[str, Any] = vars(build_parser().parse_args(argv))
    return resolve(flags, os.environ if environ is None else environ)


def setup_logging(level: str, partition: int | None = None) -> None:
    """Log to stderr at ``level``, one line per record with time and logger (and, for a
    partition of a partitioned master, its index: the partitions share the stream)."""
    where = "" if partition is None else f"[p{partition}]"
    logging.basicConfig(level=getattr(logging, level.upper()), stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s %(name)s{where}: %(message)s")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `kvpool-master` console script; returns the exit code."""
    try:
        config = parse_config(argv)
    except ConfigError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    setup_logging(config.log_level, 0 if config.partitions > 1 else None)
    os.umask(0o077)   # the state directory holds every client's capability key: this user's
    if config.host in ("0.0.0.0", "::", "") and not (config.auth_token_file or config.tls_cert):
        logging.getLogger("kvpool.master").warning(
            "serving on every interface (%s) with neither an auth token nor TLS: anyone who "
            "reaches the port can register and remove objects (set auth_token_file, or bind "
            "127.0.0.1)", config.host or "*")
    if config.rpc_thread_num:
        logging.getLogger("kvpool.master").info(
            "--rpc_thread_num %d ignored: the master serves every request on one event loop",
            config.rpc_thread_num)
    from kvpool_master.server import run  # heavy imports only once the settings are good

    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        runner: Any = asyncio.run
    else:
        runner = uvloop.run
    try:
        return int(runner(run(config)))
    except (OSError, RuntimeError) as exc:  # grpc reports a port it cannot bind as RuntimeError
        print(f"{PROG}: error: cannot start: {exc}", file=sys.stderr)
        return 1
    except StateLayoutError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2

if __name__ == "__main__":
    sys.exit(main())
