"""Writes that fail for a reason of the machine -- a full disk, a read-only folder -- end in one
line naming the file (``flopwise CMD: cannot write ... PATH: no space left on the device``),
leave nothing half-written and damage nothing written before: ``export`` (--format hf and pt,
with and without --overwrite), ``eval`` appending to evals.jsonl, ``report``, ``prepare`` and
the metrics of ``train``.

Every fault is real: a tmpfs mounted by ``small_fs`` (filled with ``fill_fs``, or remounted
read-only: chmod means nothing to root), each command run as a user runs it
(``python -m flopwise``). They skip where mounting is not permitted. One tiny run, trained once
in this process, is copied into each test's filesystem."""

from __future__ import annotations

import errno
import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers import tiny_model_overrides

from flopwise.checkpoints import latest_checkpoint, verify_checkpoint
from flopwise.config import build_config
from flopwise.errors import FlopwiseError
from flopwise.fsio import AppendFile, WriteError
from flopwise.manifest import run_file_problem
from flopwise.model.io import export_hf
from flopwise.report import build_report
from flopwise.train.trainer import train

QUIET = ["eval.every=0", "eval.sample_tokens=0", "train.log_every=1", "train.checkpoint_every=1000"]


# --------------------------------------------------------------------------- fixtures and helpers

@pytest.fixture(scope="module")
def run_overrides(small_builtin):
    """The tiny model on the small corpus (``tiny_overrides`` without its per-test run directory)."""
    cache, _ = small_builtin
    return [*tiny_model_overrides(cache), *QUIET]


@pytest.fixture(scope="module")
def trained_run(run_overrides, tmp_path_factory) -> Path:
    """One run of 2 steps with its final checkpoint, shared by every test (copied, never written)."""
    run_dir = tmp_path_factory.mktemp("write-faults") / "run"
    train(build_config(overrides=run_overrides + ["train.max_steps=2", f"train.run_dir={run_dir}"]),
          log=lambda s: None)
    return run_dir


@pytest.fixture
def read_only():
    """``read_only(point)`` remounts the tmpfs ``small_fs`` mounted at ``point`` read-only (its
    teardown unmounts it); skips where remounting is not permitted."""
    def remount(point: Path) -> None:
        r = subprocess.run(["mount", "-o", "remount,ro", str(point)], capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            pytest.skip(f"cannot remount a tmpfs read-only here: {r.stderr.strip() or r.returncode}")
        with pytest.raises(OSError) as err:
            (point / ".probe").write_text("x")
        assert err.value.errno == errno.EROFS

    return remount


def sums(folder: Path) -> dict[str, str]:
    """sha256 of every file under ``folder``, by relative path: a byte comparison of before and after."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def hidden_leftovers(folder: Path) -> list[str]:
    """Temporary files and directories a write left (``.NAME.partial``, ``.NAME.PID.tmp``, ...);
    the locks flopwise keeps on purpose are not leftovers."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob(".*") if not p.name.endswith(".lock"))


def one_line_failure(proc, command: str, *words: str) -> str:
    """The command failed with one line, ``flopwise COMMAND: ...``, holding every one of ``words``."""
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"flopwise {command}"), proc.stderr
    for w in words:
        assert w in last, f"{w!r} not in {last!r}"
    return last


def copy_run(trained_run: Path, fs: Path) -> Path:
    run = fs / "run"
    shutil.copytree(trained_run, run)
    return run


# --------------------------------------------------------------------------- export

@pytest.mark.parametrize("fmt", ["hf", "pt"])
def test_export_onto_a_full_disk_leaves_nothing(fmt, trained_run, small_fs, cli):
    """safetensors' "No space left on device" (--format hf) and torch.save's zip-writer error
    (--format pt, no errno): the same line, and no half-written export beside it."""
    fs = small_fs("256k")  # the model alone is ~0.5 MB
    out = fs / "out"
    proc = cli("export", str(trained_run), str(out), "--format", fmt)
    one_line_failure(proc, "export", f"cannot write the export {out}", "no space left on the device",
                     f"nothing was left at {out}")
    assert list(fs.iterdir()) == []  # no out/, no .out.partial


def test_export_overwrite_onto_a_full_disk_keeps_the_earlier_export(trained_run, small_fs, fill_fs, cli):
    fs = small_fs("2m")
    out = fs / "out"
    export_hf(trained_run, out, log=lambda s: None)
    before = sums(out)
    fill_fs(fs, 64 << 10)  # no room for a second copy of the model
    proc = cli("export", str(trained_run), str(out), "--format", "pt", "--overwrite")
    one_line_failure(proc, "export", str(out), "no space left on the device", f"{out} was left as it was")
    assert sums(out) == before  # the earlier export, byte for byte
    assert sorted(p.name for p in fs.iterdir()) == ["ballast", "out"]

    (fs / "ballast").unlink()  # with room, --overwrite replaces it, and nothing of the old one stays
    proc = cli("export", str(trained_run), str(out), "--format", "pt", "--overwrite")
    assert proc.returncode == 0, proc.stderr
    assert (out / "model.pt").is_file() and not (out / "model.safetensors").exists()
    assert [p.name for p in fs.iterdir()] == ["out"]


# --------------------------------------------------------------------------- eval

def test_eval_of_a_run_on_a_read_only_folder(trained_run, small_fs, read_only, cli):
    fs = small_fs("4m")
    run = copy_run(trained_run, fs)
    (run / "evals.jsonl").write_text(json.dumps({"step": 1, "val_loss": 6.0}) + "\n")  # an earlier evaluation
    before = sums(run)
    read_only(fs)
    proc = cli("eval", str(run))
    one_line_failure(proc, "eval", f"{run / 'evals.jsonl'}", "read-only file system", "nothing was evaluated")
    assert "val " not in proc.stdout  # refused before the scores were computed (and lost)
    assert sums(run) == before


def test_eval_onto_a_full_disk_leaves_no_torn_line(trained_run, small_fs, fill_fs, cli):
    """evals.jsonl ends 40 bytes short of a page: the new line's first 40 bytes fit, the rest
    does not -- the write is cut short for real, and the part written must be taken back."""
    fs = small_fs("4m")
    run = copy_run(trained_run, fs)
    row = json.dumps({"step": 1, "val_loss": 6.0, "pad": ""})
    earlier = row.replace('"pad": ""', '"pad": "' + "x" * (4096 - 40 - len(row) - 1) + '"') + "\n"
    assert len(earlier) == 4096 - 40
    (run / "evals.jsonl").write_text(earlier)
    before = sums(run)
    fill_fs(fs, 0)
    proc = cli("eval", str(run))
    one_line_failure(proc, "eval", f"{run / 'evals.jsonl'}", "no space left on the device")
    assert (run / "evals.jsonl").read_text() == earlier  # no torn line after it
    assert sums(run) == before


# --------------------------------------------------------------------------- report

@pytest.mark.parametrize("fault", ["read-only", "full"])
def test_report_that_cannot_be_written_keeps_the_earlier_one(fault, trained_run, small_fs, fill_fs, read_only, cli):
    fs = small_fs("4m")
    run = copy_run(trained_run, fs)
    build_report([run])  # the earlier report: report.html and report_figures/*.png
    assert (run / "report.html").is_file() and list((run / "report_figures").glob("*.png"))
    before = sums(run)
    if fault == "read-only":
        read_only(fs)
    else:
        fill_fs(fs, 0)
    proc = cli("report", str(run))
    reason = "read-only file system" if fault == "read-only" else "no space left on the device"
    last = one_line_failure(proc, "report", "cannot write the report", reason)
    assert str(run) in last
    assert sums(run) == before  # every earlier file whole, byte for byte
    assert hidden_leftovers(run) == []


# --------------------------------------------------------------------------- prepare

def test_prepare_into_a_read_only_folder(small_fs, read_only, cli, tmp_path):
    source = tmp_path / "text.txt"
    source.write_text("".join(f"Line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(300)))
    fs = small_fs("1m")
    args = [str(source), "--vocab-size", "300", "--workers", "1"]
    assert cli("prepare", *args, "--out", str(fs / "data")).returncode == 0
    before = sums(fs / "data")
    read_only(fs)

    proc = cli("prepare", *args, "--out", str(fs / "new"))
    one_line_failure(proc, "prepare", str(fs / "new"), "read-only file system")
    assert not (fs / "new").exists()

    other = tmp_path / "other.txt"
    other.write_text(source.read_text().replace("fox", "cat"))
    proc = cli("prepare", str(other), *args[1:], "--out", str(fs / "data"), "--overwrite")  # other inputs
    one_line_failure(proc, "prepare", str(fs / "data"), "read-only file system")
    assert sums(fs / "data") == before

    proc = cli("prepare", *args, "--out", str(fs / "data"))  # the same inputs: already there, nothing to write
    assert proc.returncode == 0 and "nothing to do" in proc.stdout, proc.stderr


# --------------------------------------------------------------------------- train

def resume_on_a_full_disk(trained_run, args, leave: int, small_fs, fill_fs, cli):
    """A copy of the trained run on a 4 MB tmpfs with ``leave`` bytes free, resumed by ``flopwise
    train ARGS``: (the run, its latest checkpoint, that checkpoint's sums before, the process)."""
    fs = small_fs("4m")
    run = copy_run(trained_run, fs)
    ckpt = latest_checkpoint(run)
    before = sums(ckpt)
    fill_fs(fs, leave)
    return run, ckpt, before, cli("train", *args, f"train.run_dir={run}")


def test_a_full_disk_under_the_metrics_mid_run(trained_run, run_overrides, small_fs, fill_fs, cli):
    """The run resumes on a disk with room for its start-up files and a few dozen metrics rows,
    not for 150: the run stops with one line naming the file that did not fit -- metrics.jsonl,
    or TensorBoard's events when installed (its writer thread races the metrics) -- and the
    intact checkpoint, no thread's traceback, and metrics.jsonl ends in a whole line."""
    run, ckpt, before, proc = resume_on_a_full_disk(trained_run, [*run_overrides, "train.max_steps=150"], 32 << 10,
                                                    small_fs, fill_fs, cli)
    last = one_line_failure(proc, "train", "no space left on the device", f"{ckpt} is intact")
    assert str(run / "metrics.jsonl") in last or str(run / "tensorboard") in last, last
    text = (run / "metrics.jsonl").read_text()
    assert text.endswith("\n")
    steps = [json.loads(line)["step"] for line in text.splitlines()]
    assert 2 < max(steps) < 150  # it did log rows on this disk before it filled
    assert sums(ckpt) == before and latest_checkpoint(run) == ckpt
    verify_checkpoint(ckpt)
    assert hidden_leftovers(run) == []


def test_a_full_disk_as_a_resumed_run_writes_its_files_names_the_intact_checkpoint(trained_run, run_overrides,
                                                                                   small_fs, fill_fs, cli):
    """Room for the start's probe, not for the run's files (config.yaml, plan.json, run.json, the
    tokenizer): the error the trainer raises itself says which checkpoint is intact -- no handler
    of ``train``'s own adds it -- and nothing the run wrote before is changed."""
    run, ckpt, before, proc = resume_on_a_full_disk(trained_run, [*run_overrides, "train.max_steps=4"], 8 << 10,
                                                    small_fs, fill_fs, cli)
    last = one_line_failure(proc, "train", "no space left on the device",
                            f"the checkpoint {ckpt} is intact: the same command resumes from it once there is room")
    assert last.startswith(f"flopwise train: cannot write {run}"), last
    assert sums(ckpt) == before and latest_checkpoint(run) == ckpt
    # what was written before the disk filled is vouched for by the run's manifest, whatever it was
    assert [run_file_problem(run, name) for name in ("config.yaml", "plan.json", "run.json")] == ["", "", ""]
    assert hidden_leftovers(run) == []


def test_an_append_cut_short_by_a_full_disk_is_taken_back(small_fs, fill_fs):
    fs = small_fs("64k")
    fill_fs(fs, 8 << 10)
    f = AppendFile(fs / "rows.jsonl", "the rows")
    row = json.dumps({"step": 0, "pad": "y" * 300}) + "\n"
    with pytest.raises(WriteError) as err:
        for _ in range(100):  # 30 kB: more than the 8 kB left
            f.write(row)
    f.close()
    e = err.value
    assert isinstance(e, FlopwiseError) and isinstance(e, OSError) and e.errno == errno.ENOSPC
    assert str(e).startswith(f"cannot write the rows {fs / 'rows.jsonl'}: no space left on the device")
    text = (fs / "rows.jsonl").read_text()
    assert text and text.endswith("\n") and set(text.splitlines()) == {row[:-1]}
