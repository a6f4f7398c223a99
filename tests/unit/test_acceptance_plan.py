"""benchmarks/gpu/acceptance.py, on CPU: its step list is valid data (every override set builds a
config, the timeouts fit the device's limits) and without CUDA it skips every step and exits 0."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from flopwise.config import build_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def acceptance():
    spec = importlib.util.spec_from_file_location("acceptance", ROOT / "benchmarks" / "gpu" / "acceptance.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["acceptance"] = mod  # dataclasses resolve their module's annotations through sys.modules
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop("acceptance", None)


def test_every_step_override_set_builds_a_config(acceptance, tmp_path):
    plan = acceptance.steps(tmp_path)
    checked = 0
    for s in plan:
        if s.preset or s.overrides:
            build_config(preset=s.preset or None, overrides=list(s.overrides))  # raises ConfigError on a bad key
            checked += 1
    assert checked >= 12
    assert acceptance.validate(plan) == []


def test_timeouts_fit_the_device_limits(acceptance, tmp_path):
    plan = acceptance.steps(tmp_path)
    assert sum(s.timeout_s for s in plan) <= 25 * 60
    assert all(0 < s.timeout_s <= 9 * 60 for s in plan)
    assert len({s.name for s in plan}) == len(plan)
    assert {s.group for s in plan} == set(range(1, 8))  # every item of the acceptance list has a step


def test_a_typo_is_caught_before_any_step_runs(acceptance, tmp_path):
    plan = acceptance.steps(tmp_path)
    plan[1].overrides.append("train.seq_lenn=2048")
    problems = acceptance.validate(plan)
    assert len(problems) == 1 and "seq_lenn" in problems[0]


def test_without_cuda_every_step_is_skipped_and_written(acceptance, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rc = acceptance.main(["--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")])
    assert rc == 0
    [js] = (tmp_path / "out").glob("gpu-acceptance-cpu-*.json")
    [md] = (tmp_path / "out").glob("gpu-acceptance-cpu-*.md")
    doc = json.loads(js.read_text())
    assert doc["cuda"] is False
    assert len(doc["steps"]) == len(acceptance.steps(tmp_path))
    assert all(r["status"] == "skipped" and r["reason"] == "no CUDA" for r in doc["steps"])
    assert "no CUDA" in md.read_text()
    assert not (tmp_path / "work" / "runs").exists()  # nothing ran


def test_only_selects_steps_and_merge_joins_them(acceptance, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    a, b = tmp_path / "a", tmp_path / "b"
    assert acceptance.main(["--only", "gpu-tests,2", "--out", str(a), "--work", str(tmp_path / "w")]) == 0
    assert acceptance.main(["--only", "7", "--out", str(b), "--work", str(tmp_path / "w")]) == 0
    first = json.loads(next(a.glob("*.json")).read_text())
    assert [r["name"] for r in first["steps"]] == ["gpu-tests"] + [f"train-{p}" for p in acceptance.MODEL_PRESETS]
    assert acceptance.main(["--only", "no-such-step", "--out", str(a)]) == 2
    merged = tmp_path / "m"
    assert acceptance.main(["--merge", str(next(a.glob("*.json"))), str(next(b.glob("*.json"))),
                            "--out", str(merged)]) == 0
    doc = json.loads(next(merged.glob("*.json")).read_text())
    assert len(doc["steps"]) == 5 + 6


def test_without_cuda_and_without_out_nothing_is_written(acceptance, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(acceptance, "RESULTS", tmp_path / "results")
    assert acceptance.main(["--only", "1", "--work", str(tmp_path / "w")]) == 0
    assert not (tmp_path / "results").exists()


def test_the_ladder_benchmark_reports_the_issues_figures_from_its_three_parts():
    """benchmarks/gpu/ladder.py's summary: ladder / defaults, run-after / ladder and the goals."""
    spec = importlib.util.spec_from_file_location("ladder_bench", ROOT / "benchmarks" / "gpu" / "ladder.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    ladder = {"start": {"tok_per_s": 40_000.0}, "final": {"tok_per_s": 60_000.0, "mfu": 0.42},
              "chosen": {"train.compile": "model"}, "spent_minutes": 12.5, "budget_minutes": 15,
              "rungs": [{"rung": "compile", "change": "train.compile=model", "kept": True},
                        {"rung": "loss", "change": "train.loss=plain", "kept": False}]}
    s = mod.summarize(ladder, {"tok_per_s": 50_000.0}, {"tok_per_s": 56_000.0})
    assert s["ladder_over_defaults"] == pytest.approx(1.2) and s["after_over_ladder"] == pytest.approx(56 / 60)
    assert s["goal_within_5pct"] is False and s["goal_within_15_min"] is True  # 6.7% below the ladder
    assert s["kept"] == ["compile: train.compile=model"]
    assert mod.summarize({**ladder, "spent_minutes": 16}, {}, {"tok_per_s": 59_000.0})["goal_within_15_min"] is False
