"""Helpers the tests share: the client worker module, a master's metric, waiting for a
condition, pip into a directory, Mooncake's wheel with kvpool's ``mooncake.store`` hook beside
it, a set-up Mooncake drop-in store, snapshot rows as the columns a snapshot file holds, the
two clients of the state-directory tests coming back to a restored core, and batch commits as
the commits of their objects."""

from __future__ import annotations

import contextlib
import importlib.util
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from kvpool_wire.types import ClientId

INTEGRATION = Path(__file__).parent / "integration"
#: the real Mooncake wheel the tests run beside kvpool (PyPI, no CUDA)
MOONCAKE_WHEEL = "mooncake-transfer-engine-non-cuda==0.3.13.post1"
#: kvpool's import hook serving ``mooncake.store`` beside that wheel
STORE_HOOK = Path(__file__).parents[1] / "compat" / "mooncake-store"


def client_worker() -> ModuleType:
    """``tests/integration/client_worker.py`` as a module (tests/integration is no package)."""
    spec = importlib.util.spec_from_file_location("kvpool_test_client_worker",
                                                  INTEGRATION / "client_worker.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def metric_value(metrics_url: str, sample: str) -> float | None:
    """The value of one sample of a master's /metrics, named as the exposition writes it
    (``kvpool_restore_seconds``, ``kvpool_rpc_requests_total{method="Heartbeat",...}``); None
    when it is not there."""
    with urllib.request.urlopen(metrics_url + "/metrics", timeout=10) as answer:
        text = answer.read().decode()
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name == sample:
            return float(value)
    return None


def pip_install(*args: str) -> subprocess.CompletedProcess[str]:
    """``pip install -q --no-deps ARGS`` with this interpreter (output captured)."""
    return subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                           "--disable-pip-version-check", *args], capture_output=True,
                          text=True, timeout=600, stdin=subprocess.DEVNULL)


def install_mooncake_beside_kvpool(site: Path) -> None:
    """Install ``MOONCAKE_WHEEL`` and ``STORE_HOOK`` into ``site`` (a directory processes add
    to their path). Skips the test when the wheel cannot be had (PyPI unreachable)."""
    import pytest

    wheel = pip_install("--target", str(site), MOONCAKE_WHEEL)
    if wheel.returncode != 0:
        pytest.skip(f"cannot install {MOONCAKE_WHEEL}: {wheel.stderr.strip()[-300:]}")
    hook = pip_install("--no-build-isolation", "--no-index", "--target", str(site),
                       str(STORE_HOOK))
    assert hook.returncode == 0, hook.stdout + hook.stderr


@contextlib.contextmanager
def drop_in_store(address: str, segment_bytes: int, buffer_bytes: int, *,
                   remove_all: bool = False) -> Iterator[Any]:
    """A ``MooncakeDistributedStore`` set up over TCP on the master at ``address``, with a
    segment of ``segment_bytes`` and a local buffer of ``buffer_bytes``; closed on exit (after
    removing every object in the pool, with ``remove_all``)."""
    from kvpool_client.compat.mooncake import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    assert store.setup("127.0.0.1", "P2PHANDSHAKE", segment_bytes, buffer_bytes, "tcp", "",
                       address) == 0
    try:
        yield store
    finally:
        if remove_all:
            store.remove_all(True)
        store.close()


def columns_of_rows(rows: Sequence[Sequence[Any]]) -> Any:
    """The ``ObjectColumns`` a snapshot would write for well-formed ``rows`` with one replica
    each (built from the table entries they describe, as the writer does)."""
    from kvpool_master.core.objects import ObjectEntry
    from kvpool_master.core.snapshot import ObjectColumns

    return ObjectColumns.of_entries([ObjectEntry(key, size, flat[0], flat[1], None, pin, parent,
                                                 checksum)
                                     for key, size, flat, checksum, pin, parent in rows])


#: The clients of the state-directory tests, with the capability keys they registered with.
A, B = ClientId("client-a"), ClientId("client-b")
KEY_A, KEY_B = b"a" * 32, b"b" * 32


def come_back(core: Any, now: float, *segments: Any) -> None:
    """A and B register again with a restored ``core`` (which gives them their old keys) and
    mount ``segments`` again."""
    from kvpool_wire.capability import client_token
    from kvpool_wire.status import Status

    for client, key in ((A, KEY_A), (B, KEY_B)):
        assert core.heartbeat(client, now) == Status.UNKNOWN_CLIENT
        assert core.register_client(client, "h", b"new-key-ignored!", now,
                                    client_token(key)) == (Status.OK, key)
    for segment in segments:
        assert core.mount_segment(segment, now) == Status.OK


def each_commit(events: Sequence[Any]) -> list[Any]:
    """``events`` with each batch commit (``ObjectsCommitted``) as the commit of each of its
    objects, as the key-by-key loop announces them."""
    from kvpool_master.core.events import ObjectsCommitted
    return [each for event in events
            for each in (event.each() if isinstance(event, ObjectsCommitted) else [event])]


def free_ports(count: int) -> int:
    """The first of ``count`` consecutive ports that are free on 127.0.0.1 now."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            first = probe.getsockname()[1]
        if first + count > 65535:
            continue
        held = []
        try:
            for port in range(first, first + count):
                sock = socket.socket()
                held.append(sock)
                sock.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
        finally:
            for sock in held:
                sock.close()
    raise AssertionError("no run of free ports found")


def wait_until(check: Callable[[], bool], timeout_s: float) -> bool:
    """Whether ``check()`` came true within ``timeout_s`` (asked every 50 ms)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return bool(check())
