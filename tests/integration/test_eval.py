"""Evaluation end to end: tasks during training, `flopwise eval` (once and --watch), bits per
byte, `flopwise generate`, and the TensorBoard mirror of metrics.jsonl."""

import json
import threading

import pytest

from flopwise.checkpoints import list_checkpoints
from flopwise.cli import main as cli_main
from flopwise.config import build_config
from flopwise.evaluate import runner
from flopwise.evaluate.loss import bits_per_byte
from flopwise.train.trainer import train

ARC = [
    {"id": f"q{i}", "question": q, "choices": {"text": c, "label": ["A", "B", "C"]}, "answerKey": "ABC"[i % 3]}
    for i, (q, c) in enumerate([
        ("What does def start?", ["a function", "a loop", "a class"]),
        ("What does import do?", ["nothing", "loads a module", "prints"]),
        ("What ends a block?", ["a brace", "a colon", "dedent"]),
        ("What is None?", ["a value", "a type error", "a file"]),
    ])
]


@pytest.fixture
def arc_file(tmp_path):
    path = tmp_path / "tasks" / "arc_easy.jsonl"
    path.parent.mkdir()
    path.write_text("".join(json.dumps(r) + "\n" for r in ARC))
    return path


@pytest.fixture
def run(tiny_overrides, arc_file):
    cfg = build_config(overrides=tiny_overrides + [
        "train.max_steps=6", "train.checkpoint_every=3", "train.keep_checkpoints=0", "eval.every=3",
        "eval.tasks=arc_easy", f"eval.task_dir={arc_file.parent}", "eval.tasks_every=3", "eval.sample_tokens=0"])
    lines = []
    result = train(cfg, log=lines.append)
    return result, lines


def test_tasks_and_bits_per_byte_during_training(run):
    result, lines = run
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval" in r]
    assert [r["step"] for r in evals] == [3, 6]
    arc = evals[-1]["eval"]["arc_easy"]
    assert arc["n"] == 4 and 0 <= arc["acc"] <= 1 and arc["random"] == pytest.approx(1 / 3)
    assert all(r["val_bpb"] > 0 for r in rows if "val_loss" in r)
    assert any("| bpb " in line for line in lines) and any("eval step      6 | arc_easy acc" in line for line in lines)


def test_eval_command_and_watch(run, arc_file, capsys):
    result, _ = run
    assert cli_main(["eval", str(result.run_dir), "--tasks", "arc_easy", "--task-data", f"arc_easy={arc_file}"]) == 0
    out = capsys.readouterr().out
    assert "val        loss" in out and "arc_easy" in out
    rows = [json.loads(line) for line in (result.run_dir / runner.EVALS_FILE).read_text().splitlines()]
    assert rows[-1]["step"] == 6 and rows[-1]["eval"]["arc_easy"]["n"] == 4
    # The same weights give the same validation loss as the trainer's final validation.
    final = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()][-1]
    assert rows[-1]["val_loss"] == pytest.approx(final["val_loss"], rel=1e-6)
    assert rows[-1]["val_bpb"] == pytest.approx(final["val_bpb"], rel=1e-6)
    # --watch on the finished run: only step 3 is left to evaluate, then it returns.
    assert runner.watch(result.run_dir, poll_s=0.01, log=lambda s: None) == 1
    assert runner.evaluated_steps(result.run_dir) == {3, 6}
    assert runner.watch(result.run_dir, poll_s=0.01, log=lambda s: None) == 0


def test_watch_evaluates_checkpoints_as_they_land(tiny_overrides, tmp_path):
    cfg = build_config(overrides=tiny_overrides + ["train.max_steps=4", "train.checkpoint_every=2",
                                                   "train.keep_checkpoints=0", "eval.sample_tokens=0"])
    done = {}
    t = threading.Thread(target=lambda: done.setdefault(
        "n", runner.watch(cfg.train.run_dir, poll_s=0.05, timeout_s=120, log=lambda s: None)))
    t.start()  # watching before the run even exists
    train(cfg, log=lambda s: None)
    t.join(timeout=120)
    assert done["n"] == 2 and runner.evaluated_steps(tmp_path / "run") == {2, 4}
    assert len(list_checkpoints(tmp_path / "run")) == 2


def test_bits_per_byte_formula():
    assert bits_per_byte(0.6931471805599453, n_tokens=100, n_bytes=400) == pytest.approx(0.25)


def test_generate_command_is_deterministic_and_the_cache_changes_nothing(run, capsys):
    result, _ = run
    args = ["generate", str(result.run_dir), "--prompt", "def ", "--max-tokens", "20", "--seed", "3"]
    assert cli_main(args) == 0
    a = capsys.readouterr().out
    assert cli_main(args) == 0 and capsys.readouterr().out == a and a.startswith("def")
    assert cli_main(args + ["--temperature", "0"]) == 0
    greedy = capsys.readouterr().out
    assert cli_main(args + ["--temperature", "0", "--no-cache"]) == 0
    assert capsys.readouterr().out == greedy
    hf_spelling = [a.replace("--max-tokens", "--max-new-tokens") for a in args]  # as transformers spells it
    assert cli_main(hf_spelling) == 0 and capsys.readouterr().out == a


def test_tensorboard_mirrors_the_metrics(run):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    result, _ = run
    acc = EventAccumulator(str(result.run_dir / "tensorboard"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert {"loss", "lr", "val_loss", "val_bpb", "eval/arc_easy/acc"} <= set(tags)
    assert [e.step for e in acc.Scalars("eval/arc_easy/acc")] == [3, 6]


def test_report_command(run, tmp_path, capsys):
    result, _ = run
    assert cli_main(["eval", str(result.run_dir)]) == 0  # an evals.jsonl for the report to show
    out = tmp_path / "r.html"
    assert cli_main(["report", str(result.run_dir), "--out", str(out), "--no-png"]) == 0
    html = out.read_text()
    assert "<svg" in html and "arc_easy" in html and "<script" not in html
    assert not any(f'{attr}="http' in html for attr in ("src", "href"))  # offline: nothing fetched
    assert cli_main(["report", str(tmp_path / "nope")]) == 2
    assert "no such run directory" in capsys.readouterr().err
