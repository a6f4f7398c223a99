"""The range a prediction is likely in (plan/accuracy.py): the held-out errors of its regime."""

from __future__ import annotations

import pytest

from flopwise.plan import accuracy
from flopwise.plan.accuracy import Evidence

ROWS = (
    Evidence("a", "sm90", 1.0e9, 8, 1, 0.95), Evidence("b", "sm90", 1.3e9, 8, 1, 1.10),
    Evidence("c", "sm90", 0.8e9, 8, 1, 1.02), Evidence("d", "sm90", 8e9, 8, 1, 1.28),
    Evidence("e", "sm90", 8e9, 128, 16, 1.17), Evidence("f", "sm80", 0.1e9, 8, 1, 0.90),
    Evidence("g", "sm80", 13e9, 64, 8, 0.84),
)


def test_the_band_is_the_range_of_its_regimes_held_out_errors():
    b = accuracy.band("sm90", 1.2e9, 8, 1, ROWS)
    assert b is not None and (b["low"], b["high"]) == (0.95, 1.10) and b["cases"] == ["a", "b", "c"]
    assert b["regime"] == "H100-class (sm90), 0.5-3B, one node"


def test_a_regime_with_too_few_runs_is_widened_and_says_so():
    # 8B on H100: two runs, one per node count -> any node count still 2 -> the architecture's 5
    b = accuracy.band("sm90", 8e9, 8, 1, ROWS)
    assert b is not None and b["regime"] == "H100-class (sm90), any size", b
    assert (b["low"], b["high"]) == (0.95, 1.28) and len(b["cases"]) == 5
    everything = accuracy.band("sm100", 1e9, 8, 1, ROWS)
    assert everything is not None and everything["regime"] == "every GPU and size" and len(everything["cases"]) == 7
    assert accuracy.band("sm90", 1e9, 8, 1, ()) is None


def test_the_band_text_names_its_evidence_and_that_flopwise_never_ran_on_a_gpu():
    b = accuracy.band("sm90", 1.2e9, 8, 1, ROWS)
    assert b is not None
    text = accuracy.band_text(b)
    assert "3 held-out public runs (H100-class (sm90), 0.5-3B, one node)" in text and "0.95-1.10" in text
    assert "never measured on a GPU" in text


def test_the_shipped_evidence_is_the_benchmarks_held_out_set():
    assert len(accuracy.HELD_OUT) >= 20 and len({e.case for e in accuracy.HELD_OUT}) == len(accuracy.HELD_OUT)
    assert all(0.5 < e.ratio < 2 and e.arch in accuracy.ARCH_NAMES for e in accuracy.HELD_OUT)
    assert accuracy.size_class(0.36e9) == "under 0.5B" and accuracy.size_class(8e9) == "over 3B"
    assert accuracy.SOURCE.startswith("benchmarks/results/predict-vs-public")


def test_the_shipped_rows_are_the_committed_benchmarks_held_out_rows():
    """HELD_OUT is what benchmarks/predict_vs_public.py --holdout last wrote (SOURCE): re-running it
    and not updating the table (or the other way round) fails here."""
    import json
    from pathlib import Path

    doc = json.loads((Path(__file__).parents[2] / accuracy.SOURCE).read_text())
    held = {c["id"]: round(c["ratio"], 3) for c in doc["cases"] if c["set"] == "held out" and c.get("ratio")}
    assert {e.case: e.ratio for e in accuracy.HELD_OUT} == held
