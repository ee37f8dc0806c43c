"""Small helpers shared by the bench scripts (run as `python bench/NAME.py`, so this directory is
on sys.path)."""

from __future__ import annotations

import json
from pathlib import Path


def write_json(path: str | None, result: dict) -> None:
    """Write a benchmark's result file (if a path was given) and say where."""
    if not path:
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
