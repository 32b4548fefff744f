"""Helpers the integration tests share: the client worker module, and pip into a directory."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

INTEGRATION = Path(__file__).parent / "integration"


def client_worker() -> ModuleType:
    """``tests/integration/client_worker.py`` as a module (tests/integration is no package)."""
    spec = importlib.util.spec_from_file_location("kvpool_test_client_worker",
                                                  INTEGRATION / "client_worker.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pip_install(*args: str) -> subprocess.CompletedProcess[str]:
    """``pip install -q --no-deps ARGS`` with this interpreter (output captured)."""
    return subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                           "--disable-pip-version-check", *args], capture_output=True,
                          text=True, timeout=600, stdin=subprocess.DEVNULL)
