"""The committed generated modules must match proto/kvpool.proto (run `make proto`)."""

from __future__ import annotations

from pathlib import Path

from kvpool_wire._pb import generate


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    fresh = generate.generate(tmp_path)
    for path in fresh:
        committed = generate.OUT_DIR / path.name
        assert committed.read_text() == path.read_text(), f"{path.name} is stale: run `make proto`"
