"""Generate kvpool_pb2.py / kvpool_pb2_grpc.py from proto/kvpool.proto.

Run with ``make proto``. The output is committed so that installing kvpool needs no protoc;
``tests/unit/test_proto_fresh.py`` regenerates into a temporary folder and fails when the
committed files differ.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "proto"
OUT_DIR = Path(__file__).resolve().parent


def generate(out_dir: Path = OUT_DIR) -> list[Path]:
    """Run grpc_tools.protoc into ``out_dir``; return the files written."""
    from grpc_tools import protoc  # dev dependency, imported only here

    out_dir.mkdir(parents=True, exist_ok=True)
    rc = protoc.main(
        [
            "protoc",
            f"-I{PROTO_DIR}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            str(PROTO_DIR / "kvpool.proto"),
        ]
    )
    if rc != 0:
        raise RuntimeError(f"protoc failed with exit code {rc}")
    grpc_file = out_dir / "kvpool_pb2_grpc.py"
    # protoc writes an absolute-style import; make it relative to this package.
    text = grpc_file.read_text()
    text = re.sub(r"^import kvpool_pb2 as", "from . import kvpool_pb2 as", text, flags=re.M)
    grpc_file.write_text(text)
    return [out_dir / n for n in ("kvpool_pb2.py", "kvpool_pb2.pyi", "kvpool_pb2_grpc.py")]


if __name__ == "__main__":
    for path in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT_DIR):
        print(path)
