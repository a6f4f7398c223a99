"""``flopwise eval`` at two edges of earlier work (issue 43, item 4): a run it cannot record into
is refused before anything is computed, and a run whose config.yaml kept its paths as typed
(written before runs recorded them resolved) is read from the directory its run.json says it
started in.

One tiny run, trained once in this module in that old form: ``data.path=data_cl`` and
``train.run_dir=runs/old`` kept relative in its config.yaml, the directory it ran in in its
run.json's ``cwd`` (today's trainer resolves them; the test has it record them as typed)."""

from __future__ import annotations

import copy
import errno
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers import tiny_model_overrides

from flopwise.config import build_config, load_run_config
from flopwise.evaluate import runner
from flopwise.fsio import WriteError, read_json
from flopwise.train import setup
from flopwise.train.trainer import train

QUIET = ["eval.every=0", "eval.sample_tokens=0", "train.log_every=1", "train.checkpoint_every=1000",
         "train.max_steps=2"]


@pytest.fixture(scope="module")
def old_form_run(small_builtin, tmp_path_factory) -> Path:
    """A 2-step run trained in ``here`` with relative paths, recorded as typed."""
    cache, data = small_builtin
    here = tmp_path_factory.mktemp("here")
    shutil.copytree(data, here / "data_cl")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(here)
        mp.setattr(setup, "recorded_paths", lambda cfg: (copy.deepcopy(cfg), {}))  # before paths were resolved
        cfg = build_config(overrides=[*tiny_model_overrides(cache), *QUIET, "data.path=data_cl",
                                      "train.run_dir=runs/old"])
        train(cfg, log=lambda s: None)
    run = here / "runs" / "old"
    ckpt = runner.latest_checkpoint(run)
    assert ckpt is not None and load_run_config(ckpt / "config.yaml").data.path == "data_cl"  # the old form
    assert read_json(run / "run.json")["cwd"] == str(here)
    return run


@pytest.fixture
def read_only_copy(small_fs, tmp_path):
    """``read_only_copy(run)``: a copy of ``run`` that cannot be written to. Root writes through
    any permission bits, so for root it lies on a tmpfs remounted read-only (skipped where
    mounting is refused); for anyone else it is a folder without write permission."""
    locked: list[Path] = []

    def make(run: Path) -> Path:
        if os.geteuid() != 0:
            copy_ = tmp_path / "ro" / "run"
            shutil.copytree(run, copy_)
            for p in [copy_, *copy_.rglob("*")]:
                p.chmod(0o555 if p.is_dir() else 0o444)
            locked.append(copy_)
        else:
            fs = small_fs("16m")
            copy_ = fs / "run"
            shutil.copytree(run, copy_)
            r = subprocess.run(["mount", "-o", "remount,ro", str(fs)], capture_output=True, text=True, timeout=60)
            if r.returncode != 0:
                pytest.skip(f"cannot remount a tmpfs read-only here: {r.stderr.strip() or r.returncode}")
        with pytest.raises(OSError) as err:
            (copy_ / ".probe").write_text("x")
        assert err.value.errno in (errno.EROFS, errno.EACCES)
        return copy_

    try:
        yield make
    finally:
        for folder in locked:  # writable again, so tmp_path can be removed
            for p in [folder, *folder.rglob("*")]:
                p.chmod(0o755 if p.is_dir() else 0o644)


def test_eval_of_a_read_only_run_is_refused_before_anything_is_computed(old_form_run, read_only_copy,
                                                                         monkeypatch):
    run = read_only_copy(old_form_run)
    monkeypatch.chdir(old_form_run.parent.parent)  # where its data_cl is, whatever eval reads the paths against
    computed = []
    monkeypatch.setattr(runner, "load_model", lambda *a, **k: computed.append("model") or pytest.fail("loaded"))
    monkeypatch.setattr(runner, "evaluate_loss", lambda *a, **k: computed.append("loss") or pytest.fail("computed"))
    with pytest.raises(WriteError) as err:
        runner.evaluate(run, runner.EvalOptions(device="cpu"), log=lambda s: None)
    assert str(run / "evals.jsonl") in str(err.value) and "nothing was evaluated" in str(err.value)
    assert computed == []
    assert not (run / "evals.jsonl").exists()


def test_eval_command_on_a_read_only_run_exits_2_with_one_line_and_no_scores(old_form_run, read_only_copy, cli):
    run = read_only_copy(old_form_run)
    proc = cli("eval", str(run), cwd=old_form_run.parent.parent)  # where its data_cl is
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("flopwise eval: cannot write the evaluation results") and str(run / "evals.jsonl") in last
    assert "val " not in proc.stdout  # nothing was computed, so nothing was shown and lost


def test_check_can_record_leaves_no_file_behind(tmp_path):
    """The check opens evals.jsonl as the append will; one it had to make is removed again."""
    runner.check_can_record(tmp_path)
    assert list(tmp_path.iterdir()) == []
    (tmp_path / runner.EVALS_FILE).write_text('{"step": 1}\n')
    runner.check_can_record(tmp_path)
    assert (tmp_path / runner.EVALS_FILE).read_text() == '{"step": 1}\n'


def test_a_run_recorded_with_relative_paths_is_read_from_the_directory_it_ran_in(old_form_run, tmp_path,
                                                                                  monkeypatch):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # data_cl is not here: only the run's cwd says where it was
    lines: list[str] = []
    out = runner.evaluate(old_form_run, runner.EvalOptions(device="cpu"), log=lines.append)
    here = old_form_run.parent.parent
    assert out["val_data"]["path"] == str(here / "data_cl") and out["val_data"]["runs"] is True
    assert out["val_set"] == "run" and out["val_loss"] > 0
    assert any("val        loss" in line for line in lines), lines


def test_a_run_without_a_recorded_cwd_still_says_where_its_data_is_not(old_form_run, tmp_path, monkeypatch):
    """Without ``cwd`` (a run.json from before it was recorded) nothing says where the relative
    path was typed: the one-line refusal names it and the flag that re-points it."""
    run = tmp_path / "run"
    shutil.copytree(old_form_run, run)
    record = read_json(run / "run.json")
    del record["cwd"]
    (run / "run.json").write_text(json.dumps(record))
    (run / "manifest.json").unlink(missing_ok=True)  # a run that old had no manifest either
    monkeypatch.chdir(tmp_path)
    with pytest.raises(runner.DataDirError, match=r"data directory data_cl is not here: give --data DIR"):
        runner.evaluate(run, runner.EvalOptions(device="cpu"), log=lambda s: None)
