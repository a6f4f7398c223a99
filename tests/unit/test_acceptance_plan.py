"""benchmarks/gpu/acceptance.py, on CPU: its step list is valid data (every override set builds a
config, the timeouts fit the device's limits) and without CUDA it skips every step and exits 0.
Also the ladder benchmark's summary and benchmarks/_run.py, the runner both (and every benchmark) use."""

import importlib.util
import json
import signal
import subprocess
import sys
import time
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
    assert acceptance.main(["--only", "no-such-step", "--out", str(a), "--work", str(tmp_path / "w")]) == 2
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


@pytest.fixture(scope="module")
def bench_run():
    """benchmarks/_run.py, the subprocess runner every benchmark (acceptance and ladder too) uses."""
    spec = importlib.util.spec_from_file_location("_run", ROOT / "benchmarks" / "_run.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["_run"] = mod  # dataclasses resolve their module's annotations through sys.modules
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop("_run", None)


def test_the_runner_keeps_stdout_apart_streams_a_log_and_changes_the_env(bench_run, tmp_path, monkeypatch):
    monkeypatch.setenv("FLOPWISE_BENCH_GONE", "x")
    code = ("import os, sys; print(os.environ.get('FLOPWISE_BENCH_SET'), os.environ.get('FLOPWISE_BENCH_GONE'));"
            "print('to stderr', file=sys.stderr)")
    ran = bench_run.run([sys.executable, "-c", code], env={"FLOPWISE_BENCH_SET": "1", "FLOPWISE_BENCH_GONE": None},
                        log=tmp_path / "logs" / "child.log")
    assert ran.ok and ran.rc == 0 and ran.failure == "" and ran.elapsed_s > 0
    assert ran.stdout == "1 None\n" and ran.stderr == "to stderr\n"
    assert sorted((tmp_path / "logs" / "child.log").read_text().splitlines()) == ["1 None", "to stderr"]


def test_the_runner_says_in_one_line_why_a_command_failed(bench_run):
    ran = bench_run.run([sys.executable, "-c", "import sys; print('working'); sys.exit('boom: bad config')"])
    assert ran.rc == 1 and ran.reason == "exit 1" and not ran.timed_out
    assert ran.failure.endswith(": exit 1: boom: bad config") and "\n" not in ran.failure
    with pytest.raises(bench_run.RunFailed) as e:
        ran.check(lines=5)
    first, *tail = str(e.value).splitlines()  # the line, then the last lines of output (two pipes: either order)
    assert first == ran.failure and sorted(tail) == ["boom: bad config", "working"]


def test_a_timeout_kills_the_commands_whole_process_group(bench_run, tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    ran = bench_run.run(["bash", "-c", f"sleep 60 & echo $! > {pid_file}; echo started; wait"], timeout_s=1)
    assert ran.timed_out and ran.rc is None and ran.stdout == "started\n"
    assert ran.reason == "timed out after 1s" and ran.failure.endswith(": timed out after 1s")
    assert ran.elapsed_s < 30
    assert _gone(int(pid_file.read_text()))  # the background sleep went with it


def test_a_sigterm_to_the_benchmark_ends_the_command_it_runs(tmp_path):
    """The command has a session of its own: ``timeout``'s SIGTERM to our group would not reach it."""
    pid_file = tmp_path / "grandchild.pid"
    script = (f"import sys; sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); from _run import run; "
              f"run(['bash', '-c', 'sleep 60 & echo $! > {pid_file}; wait'])")
    bench = subprocess.Popen([sys.executable, "-c", script])
    deadline = time.monotonic() + 60
    while not (pid_file.exists() and pid_file.read_text().strip()):
        assert bench.poll() is None and time.monotonic() < deadline, "the command never started"
        time.sleep(0.05)
    bench.send_signal(signal.SIGTERM)
    assert bench.wait(timeout=60) == 128 + signal.SIGTERM
    assert _gone(int(pid_file.read_text()))


def test_a_timeout_also_ends_a_command_that_its_command_ran_through_the_runner(bench_run, tmp_path):
    """acceptance runs vs_hf.py, which runs its contenders: each in a session of its own."""
    pid_file = tmp_path / "grandchild.pid"
    script = (f"import sys; sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); from _run import run; "
              f"run(['bash', '-c', 'sleep 60 & echo $! > {pid_file}; wait'])")
    deadline = time.monotonic() + 60
    ran = None
    while not (pid_file.exists() and pid_file.read_text().strip()) and time.monotonic() < deadline:
        ran = bench_run.run([sys.executable, "-c", script], timeout_s=3)  # a loaded machine may need a retry
    assert ran is not None and ran.timed_out
    assert _gone(int(pid_file.read_text()))


def _gone(pid: int, within_s: float = 60.0) -> bool:
    """Whether ``pid`` has ended (gone, or a zombie), waiting for it up to ``within_s``: SIGKILL is
    delivered when the process is next scheduled, so on a loaded machine it can still be listed as
    running just after ``killpg`` returned. A process that outlives the wait fails the test."""
    deadline = time.monotonic() + within_s
    while True:
        stat = Path(f"/proc/{pid}/stat")
        try:
            if stat.read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                return True
        except FileNotFoundError:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
