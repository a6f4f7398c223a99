"""Where every benchmark's JSON goes: ``benchmarks/results/<name>-<device tag>-<date>.json``."""

from __future__ import annotations

import json
from datetime import date
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def save_result(name: str, tag: str, result: dict[str, Any]) -> Path:
    """Write ``result`` (device, versions, date and rows inside) and say where."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}-{tag}-{date.today().isoformat()}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    return path
