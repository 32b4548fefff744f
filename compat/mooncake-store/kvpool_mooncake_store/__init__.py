"""Serve ``mooncake.store`` from kvpool in an environment that keeps Mooncake's own wheel.

Installed with ``kvpool_mooncake_store.pth``, which Python reads at start-up, so the hook is in
place before anything imports ``mooncake``. The hook is one finder at the front of
``sys.meta_path`` that answers for exactly ``mooncake.store``: that module is kvpool's store
surface (``kvpool_client.compat.store_surface``). Everything else, the ``mooncake`` package
itself, ``mooncake.engine`` (the real TransferEngine), the connectors and the pure-Python
modules of the wheel (``structured_object_store``, ``async_store``, ...), stays Mooncake's, and
those of them that import ``mooncake.store`` get kvpool's.

``KVPOOL_MOONCAKE_STORE=mooncake`` in the environment turns the hook off for a process (the
wheel's own store then loads). Without Mooncake's wheel, install ``kvpool-mooncake`` instead,
which provides the whole ``mooncake`` package.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import os
import sys
from types import ModuleType

TARGET = "mooncake.store"
SURFACE = "kvpool_client.compat.store_surface"


class _StoreLoader(importlib.abc.Loader):
    """Fills ``mooncake.store`` with the names of kvpool's store surface."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None  # the default module object

    def exec_module(self, module: ModuleType) -> None:
        surface = importlib.import_module(SURFACE)
        names = list(surface.__all__)
        module.__dict__.update({name: getattr(surface, name) for name in names})
        module.__dict__["__all__"] = names
        module.__dict__["BACKEND"] = surface.BACKEND


class StoreFinder(importlib.abc.MetaPathFinder):
    """Answers for ``mooncake.store`` only; see the module docstring."""

    def find_spec(self, fullname: str, path: object = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != TARGET or os.environ.get("KVPOOL_MOONCAKE_STORE") == "mooncake":
            return None
        return importlib.machinery.ModuleSpec(fullname, _StoreLoader(), origin=SURFACE)


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (idempotent)."""
    if not any(isinstance(finder, StoreFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, StoreFinder())


install()
