"""A new user's first evaluation (issue 19): a run and its Hugging Face export give the same
validation loss, every log line says which windows it measured and where they came from,
and a multiple-choice file of one's own is a task under any name."""

import json
import re

import pytest

from flopwise.cli import main as cli_main
from flopwise.config import build_config
from flopwise.train.trainer import train

pytest.importorskip("transformers")

VAL = re.compile(r"val +loss ([0-9.]+) .*\((\d+) windows x (\d+) tokens: (.*)\)")


@pytest.fixture
def run_and_export(tiny_overrides, tmp_path):
    cfg = build_config(overrides=tiny_overrides + ["train.max_steps=4", "eval.every=4", "eval.sample_tokens=0"])
    result = train(cfg, log=lambda s: None)
    out = tmp_path / "hf"
    assert cli_main(["export", str(result.run_dir), str(out)]) == 0
    return cfg, result.run_dir, out


def _val(out: str):
    m = VAL.search(out)
    assert m, out
    return float(m[1]), int(m[2]), int(m[3]), m[4]


def test_run_and_its_export_give_the_same_validation_loss(run_and_export, small_builtin, capsys, tmp_path,
                                                           monkeypatch):
    cfg, run, hf = run_and_export
    # eval of the export prepares the embedded corpus in the user's own cache (an export's record never
    # chooses the folder): a home of the test's, not the machine's
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    want = (cfg.eval.windows, cfg.train.seq_len)  # 16 x 64, the trainer's set
    assert cli_main(["eval", str(run)]) == 0
    loss_run, *geo_run, why_run = _val(capsys.readouterr().out)
    assert tuple(geo_run) == want and "the run's eval.windows and train.seq_len" in why_run
    assert cli_main(["eval", str(hf)]) == 0
    loss_hf, *geo_hf, why_hf = _val(capsys.readouterr().out)
    assert tuple(geo_hf) == want and "flopwise.json" in why_hf
    # the embedded corpus the run trained on is named by its fingerprint, as a data directory is
    builtin = json.loads((small_builtin[1] / "meta.json").read_text())["fingerprint"]
    assert json.loads((hf / "flopwise.json").read_text())["validation"]["data_fingerprint"] == builtin
    assert loss_hf == pytest.approx(loss_run, abs=2e-4)  # the log's 4 decimals
    final = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if "val_loss" in line][-1]
    assert loss_run == pytest.approx(final["val_loss"], abs=2e-4)

    # Flags still win, and say so; a directory from elsewhere (no flopwise.json) says it used defaults.
    assert cli_main(["eval", str(hf), "--windows", "4"]) == 0
    _, n, T, why = _val(capsys.readouterr().out)
    assert (n, T) == (4, want[1]) and "--windows given" in why
    (hf / "flopwise.json").unlink()
    assert cli_main(["eval", str(hf), "--data", str(small_builtin[1])]) == 0
    _, n, T, why = _val(capsys.readouterr().out)
    assert (n, T) == (64, 64) and "by default" in why


def test_custom_task_by_any_name_and_clear_errors(run_and_export, tmp_path, capsys):
    _, run, hf = run_and_export
    quiz = tmp_path / "quiz.jsonl"
    quiz.write_text("".join(json.dumps({"context": "def f(x):\n    return", "choices": [" x", " import"],
                                        "label": 0}) + "\n" for _ in range(3)))
    assert cli_main(["eval", str(hf), "--task-data", f"my_quiz={quiz}"]) == 0  # no --tasks needed
    assert re.search(r"my_quiz +acc .*n 3\)", capsys.readouterr().out)

    bad = tmp_path / "bad.jsonl"
    bad.write_text(quiz.read_text() + '{"context": "x", "choices": [" a", " b"]\n')
    assert cli_main(["eval", str(hf), "--task-data", f"my_quiz={bad}"]) == 2
    err = capsys.readouterr().err
    assert f"{bad} line 4" in err and "not valid JSON" in err
    assert cli_main(["eval", str(hf), "--task-data", f"my_quiz={tmp_path / 'missing.jsonl'}"]) == 2
    err = capsys.readouterr().err
    assert "missing.jsonl" in err and "no such file" in err
