"""Ships ``kvpool_mooncake_store.pth`` at the top of site-packages, where Python reads it at
start-up (``site``): it installs the import hook before any ``mooncake`` import."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "kvpool_mooncake_store.pth"


class BuildWithPth(build_py):
    def run(self) -> None:
        super().run()
        self.copy_file(str(Path(__file__).parent / PTH), str(Path(self.build_lib) / PTH))


setup(cmdclass={"build_py": BuildWithPth})
