"""Reliability end to end: exact resume in a new process, signals, max_hours, non-finite steps,
bad run directories and full disks. CPU, float32, the tiny model on the small corpus."""

import json
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from flopwise.checkpoints import latest_checkpoint, list_checkpoints
from flopwise.config import ConfigError, TrainConfig, build_config
from flopwise.data.datadir import open_data_dir
from flopwise.data.loader import LoaderOptions, make_loader
from flopwise.manifest import run_file_problem
from flopwise.train.stopping import Deadline, NonFiniteError, NonFiniteGuard
from flopwise.train.trainer import train

QUIET = ["eval.every=0", "eval.sample_tokens=0", "train.log_every=1"]


def losses(run_dir) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r.get("loss") is not None and "event" not in r}


def final_weights(run_dir) -> dict[str, torch.Tensor]:
    return torch.load(latest_checkpoint(run_dir) / "model.pt", weights_only=True)


def assert_same_weights(a, b):
    wa, wb = final_weights(a), final_weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


def steps_per_epoch(tiny_overrides, extra) -> int:
    cfg = build_config(overrides=tiny_overrides + extra + ["train.max_steps=1"])
    dd = open_data_dir(cfg.data, log=lambda s: None)
    t = cfg.train
    loader = make_loader("epoch", dd, "train", LoaderOptions(t.seq_len, t.micro_batch_size, seed=t.seed))
    return loader.batches_per_epoch // cfg.grad_accum_steps()


@pytest.mark.slow
@pytest.mark.parametrize("where", ["mid-run", "epoch-boundary"])
def test_resume_in_a_new_process_is_bitwise_exact(where, cli, tiny_overrides, tmp_path):
    extra = ["train.micro_batch_size=16", "train.global_batch_size=32"] + QUIET  # 2 micro-batches per step
    if where == "epoch-boundary":
        extra.append("data.loader=epoch")
        k = steps_per_epoch(tiny_overrides, extra)
        n = k + 4
    else:  # the random loader's per-rank streams: the exact-resume case the epoch loader does not cover
        extra.append("data.loader=random")
        k, n = 7, 15
    common = tiny_overrides + extra + [f"train.max_steps={n}", f"train.checkpoint_every={k}", "train.keep_checkpoints=0"]
    ref = tmp_path / "ref"
    proc = cli("train", *common, f"train.run_dir={ref}")
    assert proc.returncode == 0, proc.stderr
    # What a process that stopped after its step-k save leaves behind: drop everything after k.
    resumed = tmp_path / "resumed"
    shutil.copytree(ref, resumed)
    for p in list_checkpoints(resumed):
        if int(p.name[5:]) > k:
            shutil.rmtree(p)
    proc = cli("train", *common, f"train.run_dir={resumed}")
    assert proc.returncode == 0, proc.stderr
    assert f"resuming from {resumed / 'checkpoints' / f'step-{k:07d}'}" in proc.stdout
    a, b = losses(ref), losses(resumed)
    assert sorted(b) == list(range(1, n + 1))  # rows after k were truncated, then written again
    assert [a[s] for s in range(1, n + 1)] == [b[s] for s in range(1, n + 1)]  # bitwise: equal floats
    assert_same_weights(ref, resumed)


def _wait_for_step(run_dir, step, proc, timeout=120):
    t0 = time.time()
    while time.time() - t0 < timeout:
        assert proc.poll() is None, proc.communicate()
        m = run_dir / "metrics.jsonl"
        if m.is_file() and any(json.loads(line).get("step", 0) >= step for line in m.read_text().splitlines()
                               if line.strip()):
            return
        time.sleep(0.05)
    raise AssertionError("the run never reached the step")


@pytest.mark.slow
def test_sigterm_saves_exits_0_and_the_resumed_run_equals_an_uninterrupted_one(cli, tiny_overrides, tmp_path):
    common = tiny_overrides + QUIET + ["train.max_steps=40", "train.checkpoint_every=100"]
    ref = tmp_path / "ref"
    assert cli("train", *common, f"train.run_dir={ref}").returncode == 0
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "flopwise", "train", *common, f"train.run_dir={run}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_step(run, 5, proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "SIGTERM received: checkpoint at step" in out
    stopped_at = int(latest_checkpoint(run).name[5:])
    assert 5 <= stopped_at < 40
    proc = cli("train", *common, f"train.run_dir={run}")
    assert proc.returncode == 0 and f"step {stopped_at:,} of 40" in proc.stdout
    assert losses(run) == losses(ref)
    assert_same_weights(ref, run)


def test_a_second_signal_exits_at_once(monkeypatch):
    """The handler itself, in this process: the first signal only asks; the second exits
    (os._exit, replaced here so that the test process survives it)."""
    import os

    from flopwise.train import stopping

    exits = []
    monkeypatch.setattr(stopping.os, "_exit", lambda code: exits.append(code))
    # what this process had before: Python's default, or what an earlier test in this xdist worker
    # left (one clean-clone CI run found SIGINT ignored there)
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with stopping.SignalStop() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)  # Python runs handlers between bytecodes
        assert stop.requested and stop.name == "SIGINT" and exits == []
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
        assert exits == [128 + signal.SIGTERM]
    assert {s: signal.getsignal(s) for s in before} == before  # handlers restored


def test_deadline_accounts_for_the_step_and_the_save():
    d = Deadline(max_hours=1.0, start=0.0, state_bytes=0)
    d.record_step(10.0)
    d.record_save(30.0)
    assert not d.must_stop(now=3600 - 1.1 * 40 - 1)
    assert d.must_stop(now=3600 - 1.1 * 40 + 1)
    assert not Deadline(0.0, 0.0, 0).must_stop(now=1e12)  # no budget, never
    assert Deadline(1.0, 0.0, state_bytes=10**10).save_s > 100  # before a save is measured: from the bytes


@pytest.mark.slow
def test_max_hours_stops_in_time_with_a_final_checkpoint(tiny_overrides, tick_clock):
    cfg = build_config(overrides=tiny_overrides + QUIET + ["train.max_steps=2000", "train.max_hours=0.005"])
    lines = []
    result = train(cfg, log=lines.append, clock=tick_clock)  # 18 s of budget at 0.1 s a reading
    assert result.stopped == "train.max_hours=0.005 reached" and 0 < result.steps < 2000
    assert latest_checkpoint(result.run_dir).name == f"step-{result.steps:07d}"
    assert any("stop       train.max_hours" in line for line in lines)
    # Every progress line says how long the rest would take, and that it will not fit the budget.
    progress = [line for line in lines if line.startswith("step ")]
    assert progress and all("| ETA " in line and "stops early in the" in line for line in progress)


def test_nonfinite_stop_names_the_step_and_writes_diagnostics(tiny_overrides, monkeypatch, nan_at):
    nan_at({6})
    cfg = build_config(overrides=tiny_overrides + QUIET + ["train.max_steps=10", "train.checkpoint_every=4"])
    with pytest.raises(NonFiniteError, match=r"at step 6 .*step-0000004.*nonfinite=skip or rollback"):
        train(cfg, log=lambda s: None)
    run = __import__("pathlib").Path(cfg.train.run_dir)
    diag = json.loads((run / "nonfinite-step-0000006.json").read_text())
    assert diag["step"] == 6 and diag["last_checkpoint"].endswith("step-0000004")
    assert latest_checkpoint(run).name == "step-0000004"  # nothing of the bad step was saved


def test_nonfinite_skip_skips_the_update_and_stops_after_patience(tiny_overrides, monkeypatch, tmp_path, nan_at):
    nan_at({3})
    cfg = build_config(overrides=tiny_overrides + QUIET + ["train.max_steps=8", "train.nonfinite=skip"])
    result = train(cfg, log=lambda s: None)
    assert result.steps == 8 and json.loads((result.run_dir / "run.json").read_text())["result"]["steps"] == 8
    events = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e.get("event") == "nonfinite"] == [3]
    assert events[-1]["skipped_steps"] == 1
    monkeypatch.undo()
    nan_at({2, 3, 4, 5})
    cfg = build_config(overrides=tiny_overrides + QUIET + ["train.max_steps=8", "train.nonfinite=skip",
                                                           "train.nonfinite_patience=2", f"train.run_dir={tmp_path / 'b'}"])
    with pytest.raises(NonFiniteError, match="3 in a row exceeds train.nonfinite_patience=2"):
        train(cfg, log=lambda s: None)


def test_nonfinite_rollback_reloads_the_checkpoint_and_skips_the_bad_data(tiny_overrides, monkeypatch, nan_at):
    nan_at({6})
    cfg = build_config(overrides=tiny_overrides + QUIET + ["train.max_steps=8", "train.checkpoint_every=4",
                                                           "train.nonfinite=rollback"])
    lines = []
    result = train(cfg, log=lines.append)
    assert result.steps == 8 and any("rolled back to step-0000004" in line for line in lines)
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["rollbacks"] == 1
    # Steps 5 and 6 were trained again from the checkpoint on later data: the loader moved past the bad window.
    state = json.loads((latest_checkpoint(result.run_dir) / "state.json").read_text())
    assert state["loader"]["batches"] == (8 + 2) * 2  # 2 micro-batches per step, 2 steps' data skipped


def test_spike_events():
    g = NonFiniteGuard(TrainConfig(nonfinite="stop", nonfinite_patience=3, spike_factor=3.0), warmup=3)
    assert [g.spike(x) for x in (2.0, 2.0, 2.0, 2.0)] == [None] * 4
    assert g.spike(9.0) == pytest.approx(4.5)


def test_unwritable_run_directory_is_refused_before_any_work(tiny_overrides, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    cfg = build_config(overrides=tiny_overrides + ["train.max_steps=2", f"train.run_dir={blocker / 'run'}"])
    with pytest.raises(ConfigError, match="is not writable"):
        train(cfg, log=lambda s: None)


@pytest.mark.slow
def test_fresh_starts_over_and_keeps_the_old_run(tiny_overrides):
    overrides = tiny_overrides + QUIET + ["train.max_steps=2"]
    first = train(build_config(overrides=overrides), log=lambda s: None)
    with pytest.raises(ConfigError, match="model.n_layers is 1 in this configuration but 2 in the checkpoint"):
        train(build_config(overrides=overrides + ["model.n_layers=1"]), log=lambda s: None)
    train(build_config(overrides=overrides + ["model.n_layers=1"]), log=lambda s: None, fresh=True)
    aside = list(first.run_dir.parent.glob("run.replaced-*"))
    assert len(aside) == 1 and latest_checkpoint(aside[0]).name == "step-0000002"


def test_a_token_id_beyond_the_vocabulary_stops_the_run_before_any_update(small_builtin, tiny_overrides, tmp_path):
    import numpy as np

    from flopwise.data.datadir import DataDirError
    from flopwise.data.shards import HEADER_SIZE

    _, path = small_builtin
    data = tmp_path / "data"
    shutil.copytree(path, data)
    shard = sorted(data.glob("train-*.bin"))[0]
    raw = bytearray(shard.read_bytes())
    ids = np.frombuffer(bytes(raw[HEADER_SIZE:]), dtype=np.uint16).copy()
    ids[:] = 60_000  # every window now holds an id far beyond the 512-token vocabulary
    shard.write_bytes(bytes(raw[:HEADER_SIZE]) + ids.tobytes())
    cfg = build_config(overrides=tiny_overrides + QUIET + ["train.max_steps=3", f"data.path={data}"])
    with pytest.raises(DataDirError, match=rf"{shard.name}: token id 60000 at position .* vocabulary size 512"):
        train(cfg, log=lambda s: None)
    assert latest_checkpoint(cfg.train.run_dir) is None


def test_a_run_config_changed_by_hand_is_not_trusted_on_resume(cli, tiny_overrides, tmp_path):
    """config.yaml is listed with its checksum in the run's manifest.json; a resume that finds it
    edited decides by the latest checkpoint's own copy, and says so."""
    common = [*tiny_overrides, "train.max_steps=4", "train.checkpoint_every=2", "eval.every=0"]
    assert cli("train", *common).returncode == 0
    run = tmp_path / "run"  # tiny_overrides' run directory
    text = (run / "config.yaml").read_text()
    assert run_file_problem(run, "config.yaml") == ""  # as the run wrote it, by its manifest
    (run / "config.yaml").write_text(text.replace("seq_len: 64", "seq_len: 32", 1))  # an edit by hand
    again = cli("train", *common, "train.max_steps=6")
    assert again.returncode == 0, again.stderr[-2000:]
    assert "changed since the run wrote it" in again.stdout + again.stderr and "resuming from" in again.stdout
