"""Download one wheel from PyPI for a test, unpack chosen files, and say why when it cannot.

``python wheels.py REQUIREMENT DEST PREFIX...`` downloads ``REQUIREMENT`` (``--no-deps``) into
a temporary folder and unpacks the archive members starting with any ``PREFIX`` into ``DEST``.
Exit status 0: done; 3: PyPI is unreachable (the reason is printed, the caller skips); anything
else: a real failure. Wheels are never kept.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

UNREACHABLE = 3


def pypi_unreachable() -> str:
    """Return why PyPI cannot be reached, or "" when it can."""
    for host in ("pypi.org", "files.pythonhosted.org"):
        try:
            socket.create_connection((host, 443), timeout=10).close()
        except OSError as exc:
            return f"{host}:443 unreachable ({exc})"
    return ""


def main() -> int:
    requirement, dest, prefixes = sys.argv[1], Path(sys.argv[2]), tuple(sys.argv[3:])
    with tempfile.TemporaryDirectory() as download:
        proc = subprocess.run([sys.executable, "-m", "pip", "download", requirement,
                               "--no-deps", "--disable-pip-version-check", "-q", "-d", download],
                              capture_output=True, text=True, timeout=600,
                              stdin=subprocess.DEVNULL)
        if proc.returncode != 0:
            reason = pypi_unreachable()
            if reason:
                print(f"cannot download {requirement} from PyPI: {reason}")
                return UNREACHABLE
            print(f"pip download {requirement} failed although PyPI is reachable:\n"
                  f"{proc.stderr}")
            return 1
        (wheel,) = Path(download).glob("*.whl")
        with zipfile.ZipFile(wheel) as archive:
            names = [n for n in archive.namelist() if n.startswith(prefixes)]
            archive.extractall(dest, names)
    print(f"unpacked {len(names)} files of {wheel.name}")
    return 0 if names else 1


if __name__ == "__main__":
    raise SystemExit(main())
