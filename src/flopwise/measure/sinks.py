"""Where metrics go: ``metrics.jsonl`` (one JSON object per logged step) and the console."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from flopwise.fsio import AppendFile

# metrics.jsonl's event of a DiLoCo outer step (train/hooks.py writes it; run.json and the report read it)
OUTER_SYNC = "outer_sync"


class JsonlSink:
    """Appends one JSON object per line, each in one unbuffered write, so a crash loses at most
    one row. A row that does not fit (a full disk) is cut off again -- the file never ends in a
    torn line that would break its readers -- and raises a :class:`~flopwise.fsio.WriteError`
    naming the file."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._f = AppendFile(self.path, "the metrics")

    def write(self, row: dict[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
        self._f.write(json.dumps(clean) + "\n")

    def close(self) -> None:
        self._f.close()


def human(n: float, unit: str = "") -> str:
    """1234567 -> '1.23M'."""
    for threshold, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= threshold:
            return f"{n / threshold:.2f}{suffix}{unit}"
    return f"{n:.0f}{unit}" if float(n).is_integer() else f"{n:.2f}{unit}"


def format_mfu(mfu: float | None) -> str:
    return "n/a" if mfu is None else f"{100 * mfu:.1f}%"
