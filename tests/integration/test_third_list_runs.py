"""Issue 44, a run's config and resume: a copied or moved run directory trains where it is,
a hand-edited ``config.yaml`` is checked against the checkpoint's own copy and the resume says
what trains, ``train.preflight`` takes only a preflight result, and a run stopped before its
first logged step says so instead of printing a loss it did not measure.

Through the real command (``flopwise.cli.main``, and ``python -m flopwise`` where the process
matters), on real copies made with ``cp -r`` and real moves with ``mv``."""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
from pathlib import Path

import pytest
from helpers import run_flopwise

from flopwise.checkpoints import latest_checkpoint
from flopwise.cli import main
from flopwise.config import CHECKSUM_MARK, build_config
from flopwise.train.trainer import train

QUIET = ["eval.every=0", "eval.sample_tokens=0", "train.checkpoint_every=2"]


def tree_digest(root: Path) -> dict[str, str]:
    """Every file under ``root``: its SHA-256, by its path relative to ``root``. Not the lock
    file, which says who last held the directory: a refused command holds it too."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != ".lock"}


def train_original(tiny_overrides, steps: int = 2) -> Path:
    """A real run of ``steps`` steps, made by ``flopwise train``; its directory."""
    assert main(["train", *tiny_overrides, *QUIET, f"train.max_steps={steps}"]) == 0
    run = Path(build_config(overrides=tiny_overrides).train.run_dir)
    assert latest_checkpoint(run).name == f"step-{steps:07d}"
    return run


def edit(config: Path, old: str, new: str, keep_checksum: bool = True) -> None:
    """A hand edit of a run's config.yaml: ``old`` replaced by ``new`` (once); with
    ``keep_checksum=False`` the checksum line goes too, as a user who tidies the file would do."""
    text = config.read_text()
    assert text.count(old) == 1, (old, text)
    text = text.replace(old, new)
    if not keep_checksum:
        text = "".join(line for line in text.splitlines(keepends=True) if not line.startswith(CHECKSUM_MARK))
    config.write_text(text)


# --------------------------------------------------------------------------- item 1: a copied or moved run

def test_a_copied_run_trains_the_copy_and_leaves_the_original_untouched(tiny_overrides, tmp_path, capsys):
    original = train_original(tiny_overrides)
    before = tree_digest(original)
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(original), str(copy)], check=True)
    edit(copy / "config.yaml", "max_steps: 2\n", "max_steps: 4\n")  # train the copy longer
    capsys.readouterr()

    assert main(["train", "--config", str(copy / "config.yaml")]) == 0
    out = capsys.readouterr()
    assert latest_checkpoint(copy) == copy / "checkpoints" / "step-0000004", out.out[-2000:]
    assert f"resuming from {copy / 'checkpoints' / 'step-0000002'}" in out.out
    assert (f"config.yaml records train.run_dir {original}; this run is at {copy} (copied or moved): "
            f"using {copy}") in out.err, out.err
    assert tree_digest(original) == before  # not a byte of the original changed
    assert json.loads((copy / "run.json").read_text())["result"]["steps"] == 4


def test_a_moved_run_resumes_from_its_last_step_where_it_now_is(tiny_overrides, tmp_path, capsys):
    original = train_original(tiny_overrides)
    moved = tmp_path / "elsewhere" / "moved"
    moved.parent.mkdir()
    subprocess.run(["mv", str(original), str(moved)], check=True)
    capsys.readouterr()

    assert main(["train", "--config", str(moved / "config.yaml"), "train.max_steps=4"]) == 0
    out = capsys.readouterr()
    assert f"resuming from {moved / 'checkpoints' / 'step-0000002'} (step 2 of 4" in out.out, out.out[-2000:]
    assert not original.exists()  # nothing was started at the old path
    assert latest_checkpoint(moved).name == "step-0000004"
    starts = json.loads((moved / "run.json").read_text())["starts"]
    assert [s["at_step"] for s in starts] == [0, 2]
    assert f"run_dir: {moved}\n" in (moved / "config.yaml").read_text()  # recorded where it is now


def test_a_run_dir_on_the_command_line_wins_over_the_config_files_directory(tiny_overrides, tmp_path):
    run = tmp_path / "a-run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("train:\n  run_dir: /somewhere/else\n")
    # another tool's checkpoints/ folder does not make a directory a run
    assert build_config(config_file=run / "config.yaml").train.run_dir == "/somewhere/else"
    (run / "run.json").write_text("{}")
    assert build_config(config_file=run / "config.yaml").train.run_dir == str(run)
    assert "copied or moved" in " ".join(build_config(config_file=run / "config.yaml").notes)
    other = tmp_path / "other"
    chosen = build_config(config_file=run / "config.yaml", overrides=[f"train.run_dir={other}"])
    assert chosen.train.run_dir == str(other) and not any("copied or moved" in n for n in chosen.notes)
    step = run / "checkpoints" / "step-0000002"  # a checkpoint's own copy is its run's
    step.mkdir()
    (step / "config.yaml").write_text("train:\n  run_dir: /somewhere/else\n")
    (run / "run.json").unlink()  # its checkpoint marks the directory a run
    assert build_config(config_file=step / "config.yaml").train.run_dir == str(run)
    assert build_config(config_file=run / "config.yaml").train.run_dir == str(run)
    # a config file of one's own, outside a run directory, is taken as written
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "config.yaml").write_text("train:\n  run_dir: /somewhere/else\n")
    assert build_config(config_file=tmp_path / "mine" / "config.yaml").train.run_dir == "/somewhere/else"


@pytest.mark.slow
def test_a_copied_run_is_trained_in_the_copy_by_a_separate_process(tiny_overrides, tmp_path):
    """The same as a user types it: ``python -m flopwise train --config COPY/config.yaml``."""
    original = train_original(tiny_overrides)
    before = tree_digest(original)
    copy = tmp_path / "copy-cli"
    subprocess.run(["cp", "-r", str(original), str(copy)], check=True)
    done = run_flopwise(["train", "--config", str(copy / "config.yaml"), "train.max_steps=4"], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "copied or moved" in done.stderr and latest_checkpoint(copy).name == "step-0000004"
    assert tree_digest(original) == before


# --------------------------------------------------------------------------- item 10: a hand-edited config.yaml

def test_an_architecture_edit_without_the_checksum_line_is_refused_by_the_checkpoints_copy(
        tiny_overrides, capsys):
    run = train_original(tiny_overrides)
    config = run / "config.yaml"
    edit(config, "d_model: 64\n", "d_model: 96\n", keep_checksum=False)
    edited = config.read_text()
    before = tree_digest(run)
    capsys.readouterr()

    assert main(["train", "--config", str(config), "train.max_steps=4"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert ("model.d_model is 96 in this configuration but 64 in the checkpoint "
            f"{run / 'checkpoints' / 'step-0000002'}") in err, err
    assert config.read_text() == edited and tree_digest(run) == before  # refused before anything was written


def test_the_resume_note_says_what_trains_after_a_hand_edit(tiny_overrides, capsys):
    run = train_original(tiny_overrides)
    config = run / "config.yaml"
    edit(config, "lr: 0.003\n", "lr: 0.002\n")  # the checksum line stays: it no longer matches
    capsys.readouterr()

    assert main(["train", "--config", str(config), "train.max_steps=4"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.strip().startswith("resume"))
    resume = " ".join(lines[at:at + 2])  # the resume line and the one under it
    assert f"{config} was changed since the run wrote it" in resume, resume
    assert "training this configuration" in resume and "optim.lr: 0.003 -> 0.002" in resume, resume
    assert "train.max_steps: 2 -> 4" in resume, resume
    assert "using" not in resume  # the checkpoint's copy is what it is checked against, not what trains
    assert "lr: 0.002\n" in config.read_text()  # and config.yaml records what trained


# --------------------------------------------------------------------------- item 19: train.preflight

@pytest.mark.parametrize("content", ["just some text\n", '{"a": 1}', "[1, 2]", '{"chosen": 1, "prediction": {}}'],
                         ids=["text", "other-json", "a-list", "wrong-shape"])
def test_train_preflight_takes_only_a_preflight_result(tiny_overrides, tmp_path, capsys, content):
    fake = tmp_path / "notes.txt"
    fake.write_text(content)
    run = Path(build_config(overrides=tiny_overrides).train.run_dir)
    assert main(["train", *tiny_overrides, *QUIET, "train.max_steps=1", f"train.preflight={fake}"]) == 2
    err = capsys.readouterr().err
    assert f"train.preflight {str(fake)!r}" in err and "not a preflight result" in err, err
    assert "Traceback" not in err
    assert not run.exists()  # refused before the run directory was made


def test_train_preflight_missing_is_refused(tiny_overrides, tmp_path, capsys):
    run = Path(build_config(overrides=tiny_overrides).train.run_dir)
    gone = tmp_path / "gone" / "preflight.json"
    assert main(["train", *tiny_overrides, *QUIET, "train.max_steps=1", f"train.preflight={gone}"]) == 2
    err = capsys.readouterr().err
    assert f"train.preflight {str(gone)!r}" in err and "no such file" in err, err
    assert not run.exists()


def test_a_preflight_result_is_copied_into_the_run(tiny_overrides, tmp_path):
    result = {"preset": "tiny", "device": "cpu", "chosen": {"micro_batch_size": 8, "activation_checkpointing": "none"},
              "prediction": {"tok_per_s": 1000.0, "mfu": None, "memory_gb": 0.1}}
    path = tmp_path / "pf" / "preflight.json"
    path.parent.mkdir()
    path.write_text(json.dumps(result))
    assert main(["train", *tiny_overrides, *QUIET, "train.max_steps=1", f"train.preflight={path}"]) == 0
    run = Path(build_config(overrides=tiny_overrides).train.run_dir)
    assert json.loads((run / "preflight.json").read_text()) == result


# --------------------------------------------------------------------------- also noticed: no loss measured

def test_a_run_stopped_before_its_first_logged_step_says_no_step_was_logged(tiny_overrides, tick_clock):
    # A stop logs the steps it trained (issue 45): a budget with no room for one step logs none.
    cfg = build_config(overrides=tiny_overrides + QUIET + ["train.log_every=1000", "train.max_steps=2000",
                                                           "train.max_hours=0.0001"])
    lines: list[str] = []
    result = train(cfg, log=lines.append, clock=tick_clock)  # 0.36 s of budget at 0.1 s a reading
    assert result.stopped and result.steps == 0 and math.isnan(result.final_loss)
    closing = next(line for line in lines if "val loss" in line and "uniform ln V" in line)
    assert "nan" not in closing and "no train step logged" in closing, closing
