"""Where every benchmark's JSON goes: ``benchmarks/results/<name>-<device tag>-<date>.json``,
and the header every record starts with (benchmark, date, device, versions)."""

from __future__ import annotations

import json
import os
import platform
import sys
from datetime import date
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def cores() -> int:
    """CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def cpu_label(extra: str = "") -> str:
    """``cpu (N cores, PROCESSOR[, extra])`` for a record's device."""
    return f"cpu ({cores()} cores, {platform.processor() or platform.machine()}{', ' + extra if extra else ''})"


def save_result(name: str, tag: str, device: str, result: dict[str, Any]) -> Path:
    """Write ``result`` after the common header and say where."""
    header = {"benchmark": name.replace("-", "_"), "date": date.today().isoformat(), "device": device,
              "python": platform.python_version()}
    if "torch" in sys.modules:  # the tokenization benchmark never imports it
        header["torch"] = sys.modules["torch"].__version__
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}-{tag}-{date.today().isoformat()}.json"
    path.write_text(json.dumps({**header, **result}, indent=2) + "\n")
    print(f"wrote {path}")
    return path
