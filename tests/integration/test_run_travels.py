"""A run directory travels: trained in one directory with relative paths, it is evaluated,
resumed, exported, sampled and reported from another with no flag; with its data moved, one
flag re-points it, and a different corpus is refused by its fingerprint."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
from helpers import run_flopwise

SMALL = ["model.vocab_size=512", "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1",
         "model.ffn_hidden=64", "model.max_seq_len=32", "train.seq_len=32", "train.micro_batch_size=2",
         "train.global_batch_size=2", "train.checkpoint_every=2", "eval.every=0", "eval.windows=2",
         "eval.sample_tokens=0"]


def flopwise(*args, cwd):
    return run_flopwise([str(a) for a in args], cwd=cwd, env={**os.environ, "PYTHONUNBUFFERED": "1"}, timeout=600)


@pytest.fixture(scope="module")
def trained(small_builtin, tmp_path_factory):
    """``flopwise train data.path=data_cl train.run_dir=runs/cl`` run in a directory ``here``."""
    _, data = small_builtin
    here = tmp_path_factory.mktemp("here")
    shutil.copytree(data, here / "data_cl")
    done = flopwise("train", "data.path=data_cl", "train.run_dir=runs/cl", "train.max_steps=2", *SMALL, cwd=here)
    assert done.returncode == 0, done.stderr[-2000:]
    return here


@pytest.mark.slow
def test_a_run_is_evaluated_resumed_exported_sampled_and_reported_from_another_directory(trained, tmp_path):
    run = trained / "runs" / "cl"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    config = (run / "config.yaml").read_text()
    assert f"path: {trained / 'data_cl'}" in config  # recorded resolved
    record = json.loads((run / "run.json").read_text())
    assert record["paths"]["data.path"] == {"typed": "data_cl", "resolved": str(trained / "data_cl")}
    assert record["cwd"] == str(trained)

    ev = flopwise("eval", run, cwd=elsewhere)
    assert ev.returncode == 0 and "val        loss" in ev.stdout, ev.stderr[-2000:]
    resumed = flopwise("train", "--config", run / "config.yaml", "train.max_steps=4", cwd=elsewhere)
    assert resumed.returncode == 0 and "resuming from" in resumed.stdout, resumed.stderr[-2000:]
    exported = flopwise("export", run, elsewhere / "hf", cwd=elsewhere)
    assert exported.returncode == 0 and (elsewhere / "hf" / "config.json").is_file(), exported.stderr[-2000:]
    sampled = flopwise("generate", run, "--max-tokens", "4", cwd=elsewhere)
    assert sampled.returncode == 0, sampled.stderr[-2000:]
    reported = flopwise("report", run, "--no-png", cwd=elsewhere)
    assert reported.returncode == 0 and (run / "report.html").is_file(), reported.stderr[-2000:]


@pytest.mark.slow
def test_moved_data_is_re_pointed_by_one_flag_and_a_different_corpus_is_refused(small_builtin, tmp_path):
    from flopwise.data.builtin import prepare_builtin

    _, data = small_builtin
    origin = tmp_path / "origin"
    shutil.copytree(data, origin / "data_cl")
    done = flopwise("train", "data.path=data_cl", "train.run_dir=runs/cl", "train.max_steps=2", *SMALL, cwd=origin)
    assert done.returncode == 0, done.stderr[-2000:]
    run = origin / "runs" / "cl"
    moved = tmp_path / "mounted-elsewhere" / "data"  # the data moved (or: this is another machine's mount)
    moved.parent.mkdir()
    shutil.move(origin / "data_cl", moved)
    lost = flopwise("eval", run, cwd=tmp_path)
    assert lost.returncode == 2 and "Traceback" not in lost.stderr, lost.stderr[-2000:]
    assert f"the run's data directory {origin / 'data_cl'} (typed as 'data_cl') is not here: give --data DIR" \
        in lost.stderr, lost.stderr
    ok = flopwise("eval", run, "--data", moved, cwd=tmp_path)
    assert ok.returncode == 0 and "val        loss" in ok.stdout, ok.stderr[-2000:]
    resumed = flopwise("train", "--config", run / "config.yaml", f"train.run_dir={run}", "train.max_steps=4",
                       cwd=tmp_path)
    assert resumed.returncode == 2 and "give data.path=DIR where it is now" in resumed.stderr, resumed.stderr
    resumed = flopwise("train", "--config", run / "config.yaml", f"train.run_dir={run}", f"data.path={moved}",
                       "train.max_steps=4", cwd=tmp_path)
    assert resumed.returncode == 0 and "resuming from" in resumed.stdout, resumed.stderr[-2000:]

    cache = tmp_path / "other-cache"  # another corpus, the same tokenizer size: only the fingerprint differs
    other = prepare_builtin(cache, vocab_size=512, max_mb=0.3, log=lambda s: None)
    refused = flopwise("eval", run, "--data", other, cwd=tmp_path)
    assert refused.returncode == 2 and "not the data the run trained on" in refused.stderr, refused.stderr
    asked = flopwise("eval", run, "--data", other, "--other-data", cwd=tmp_path)
    assert asked.returncode == 0 and "is not the data the run was validated on" not in asked.stderr
    wrong = flopwise("train", "--config", run / "config.yaml", f"train.run_dir={run}", f"data.path={other}",
                     "train.max_steps=6", cwd=tmp_path)
    assert wrong.returncode == 2 and "the data changed since the checkpoint" in wrong.stderr, wrong.stderr


def test_a_killed_prepares_lock_is_gone_after_the_next_prepare(tmp_path):
    """A prepare SIGKILLed while it held ``.OUT.lock`` left the directory behind for good."""
    texts = tmp_path / "texts"
    texts.mkdir()
    for i in range(20):
        (texts / f"{i}.txt").write_text(f"document {i} " + "some words to tokenize " * 80)
    out = tmp_path / "data"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                               "from flopwise.data.prepare import output_lock; output_lock(Path(sys.argv[1])).acquire(); "
                               "print('held', flush=True); time.sleep(600)", str(out)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        busy = flopwise("prepare", texts, "--out", out, "--vocab-size", "300", cwd=tmp_path)
        assert busy.returncode == 2 and "in use by another process" in busy.stderr, busy.stderr
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert (tmp_path / ".data.lock").is_dir()  # what the kill left
    done = flopwise("prepare", texts, "--out", out, "--vocab-size", "300", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not (tmp_path / ".data.lock").exists() and (out / "meta.json").is_file()


def test_the_lock_is_taken_on_the_file_at_its_path(tmp_path):
    """A holder that removes its dedicated lock on release: a process whose flock landed on
    the removed file opens the path again instead of holding a lock nobody else can see."""
    from flopwise.fsio import DirLock

    first = DirLock(tmp_path / ".x.lock", "test", dedicated=True).acquire()
    first.release()
    assert not (tmp_path / ".x.lock").exists()
    a = DirLock(tmp_path / ".x.lock", "test", dedicated=True).acquire()
    b = DirLock(tmp_path / ".x.lock", "test", dedicated=True)
    from flopwise.fsio import LockedError

    with pytest.raises(LockedError):
        b.acquire()
    a.release()
    b.acquire()
    b.release()
    assert not (tmp_path / ".x.lock").exists()
