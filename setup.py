"""Builds the one optional C extension (``kvpool_client.transfer._ntcopy``); everything else is
declared in pyproject.toml. Where no C compiler is at hand the build goes on without it and
copies fall back to numpy (see ``kvpool_client/transfer/copy.py``)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvpool_client.transfer._ntcopy",
                             ["kvpool_client/transfer/_ntcopy.c"], optional=True)])
