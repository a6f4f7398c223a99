"""DiLoCo as users launch it: ``torchrun --nproc-per-node=N -m flopwise train
parallel.strategy=diloco ...``, gloo processes on CPU, the tiny model in float32.

- 4 processes as 2 groups of 2 (DDP inside each group): the groups' weights are the same bit
  for bit right after every outer sync and apart between them; the metrics say so.
- One group with outer lr 1 and no momentum is plain data parallelism: it trains what ddp
  trains.
- A SIGKILL of every rank mid-run, with a fragment's all-reduce in flight (streaming), then
  the same command: the run ends bit-identical to one never interrupted.
- Layouts that cannot be cut into groups are refused in one line before any work.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import assert_weights_close, torchrun_children
from test_data_parallel import _env, curve, final_weights, ok, torchrun

from flopwise.checkpoints import latest_checkpoint, list_checkpoints

pytestmark = pytest.mark.slow  # every test launches torchrun


@pytest.fixture(scope="module")
def common(small_builtin):
    _, data = small_builtin
    return [
        f"data.path={data}", "data.loader=epoch", "model.vocab_size=512", "model.d_model=64", "model.n_layers=2",
        "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=192", "model.max_seq_len=64",
        "train.seq_len=64", "train.global_batch_size=16", "train.micro_batch_size=4", "train.log_every=1",
        "eval.every=0", "eval.windows=16", "eval.sample_tokens=0", "optim.warmup_steps=2",
        "tracking.tensorboard=false", "parallel.strategy=diloco",
    ]


def group_weights(checkpoint: Path, group: int) -> dict[str, torch.Tensor]:
    if group == 0:
        return torch.load(checkpoint / "model.pt", weights_only=True)
    return torch.load(checkpoint / "diloco" / f"group-{group}.pt", weights_only=True)["model"]


def test_groups_agree_right_after_each_sync_and_drift_apart_between(common, tmp_path):
    run = tmp_path / "run"
    proc = ok(torchrun(4, common + ["parallel.group_size=2", "parallel.inner_steps=3", "train.max_steps=7",
                                    "train.checkpoint_every=1", "train.keep_checkpoints=0", f"train.run_dir={run}"]))
    assert "2 group(s) of 2 rank(s) (ddp inside), outer sync every 3 steps" in proc.stdout
    assert "| outer 3 · " in proc.stdout  # the log line of the last step
    saved = {int(p.name[5:]): p for p in list_checkpoints(run)}
    assert sorted(saved) == list(range(1, 8))
    for step in range(1, 8):
        a, b = group_weights(saved[step], 0), group_weights(saved[step], 1)
        same = all(torch.equal(a[k], b[k]) for k in a)
        # synced after steps 3 and 6, and after the last (7) however far it is from the previous sync
        assert same == (step in (3, 6, 7)), f"step {step}: groups {'equal' if same else 'differ'}"
    rows = rows_by_step(run)
    n_params = sum(t.numel() for t in group_weights(saved[7], 0).values())
    assert [rows[s]["outer_steps"] for s in range(1, 8)] == [0, 0, 1, 1, 1, 2, 3]
    assert rows[7]["outer_bytes"] == 4 * n_params  # one fp32 pseudo-gradient per group and outer step
    # every rank sends half of it (its slice), three times
    assert rows[7]["outer_bytes_total"] == 3 * 4 * 4 * n_params // 2
    assert rows[7]["outer_bytes_per_token"] == pytest.approx(rows[7]["outer_bytes_total"] / rows[7]["tokens"])
    assert rows[3]["drift"] > 0 and rows[3]["pseudo_grad_norm"] > 0
    # every outer step a row of its own (issue 53): the outer lr, the norm and the drift of its round
    syncs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"outer_sync"' in x]
    assert [(r["step"], r["outer_step"], r["outer_lr"]) for r in syncs] == [(3, 1, 0.7), (6, 2, 0.7), (7, 3, 0.7)]
    assert syncs[0]["pseudo_grad_norm"] == rows[3]["pseudo_grad_norm"] and syncs[1]["drift"] == rows[6]["drift"]
    assert all(r["drift"] > 0 and r["pseudo_grad_norm"] > 0 for r in syncs)
    assert json.loads((run / "run.json").read_text())["outer_syncs"] == [
        {k: v for k, v in r.items() if k != "event"} for r in syncs]
    assert rows[7]["outer_lr"] == 0.7 and "| outer 3 · lr 0.7 · " in proc.stdout


def test_every_outer_step_is_recorded_when_the_log_is_sparser_than_the_syncs(common, tmp_path):
    """Outer syncs after steps 2, 4 and 6 with a log row only at steps 5 and 6: three outer_sync
    rows, each with its own round's norms (the first two told apart)."""
    run = tmp_path / "run"
    ok(torchrun(2, common + ["parallel.group_size=1", "parallel.inner_steps=2", "train.max_steps=6",
                             "train.log_every=5", f"train.run_dir={run}"]))
    syncs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"outer_sync"' in x]
    assert [(r["step"], r["outer_step"]) for r in syncs] == [(2, 1), (4, 2), (6, 3)]
    assert len({r["pseudo_grad_norm"] for r in syncs}) == 3 and all(r["drift"] > 0 for r in syncs)


def test_a_time_budget_alone_ends_with_the_groups_merged_as_a_last_step_does(common, tmp_path):
    """Issue 54, item 5: a run whose only limit is train.max_hours has no last step; its end (the
    fitted schedule's) merges the groups as a last step would. The outer sync is due only every
    1,000 steps here, so the groups are equal at the end only through that merge."""
    run = tmp_path / "run"
    proc = ok(torchrun(2, common + ["parallel.group_size=1", "parallel.inner_steps=1000", "train.max_steps=0",
                                    "train.max_tokens=0", "train.max_hours=0.003", f"train.run_dir={run}"]))
    assert "  finished: train.max_hours=0.003" in proc.stdout, proc.stdout[-2000:]
    last = latest_checkpoint(run)
    assert last is not None and int(last.name[5:]) > 1, last
    a, b = group_weights(last, 0), group_weights(last, 1)
    assert all(torch.equal(a[k], b[k]) for k in a), "the groups were not merged at the end of the time budget"


def test_one_group_with_outer_lr_1_and_no_momentum_trains_what_ddp_trains(common, tmp_path):
    plain = [c for c in common if c != "parallel.strategy=diloco"]
    ok(torchrun(2, plain + ["train.max_steps=6", "parallel.strategy=ddp", f"train.run_dir={tmp_path / 'ddp'}"]))
    proc = ok(torchrun(2, common + ["train.max_steps=6", "parallel.group_size=2", "parallel.inner_steps=2",
                                    "parallel.outer_lr=1", "parallel.outer_momentum=0",
                                    f"train.run_dir={tmp_path / 'diloco'}"]))
    assert "1 group(s) of 2 rank(s) (ddp inside)" in proc.stdout
    # anchor - 1 * (anchor - weights) is the weights up to rounding, every second step
    assert_weights_close(final_weights(tmp_path / "diloco"), final_weights(tmp_path / "ddp"), what="diloco vs ddp")
    got, want = curve(tmp_path / "diloco"), curve(tmp_path / "ddp")
    for step in range(1, 7):
        assert got[step][0] == pytest.approx(want[step][0], rel=1e-5), (step, got[step], want[step])


def streaming_args(common: list[str], inner: str) -> list[str]:
    # streaming: 2 fragments over H = 4 (sent after steps 2 and 4 of each 4, landing a step later);
    # a constant rate, so the killed run (asked for many steps) and the resumed one (asked for
    # 12) take every step at the same rate as the reference
    return common + [f"parallel.inner_strategy={inner}", "parallel.group_size=2", "parallel.inner_steps=4",
                     "parallel.fragments=2", "parallel.overlap_steps=1", "optim.schedule=constant",
                     "train.checkpoint_every=3", "train.keep_checkpoints=0"]


@pytest.fixture(scope="module")
def streamed(common, tmp_path_factory):
    """The uninterrupted 12-step streaming run with ddp or fsdp2 inside the groups, run once each
    and shared: the SIGKILL tests' reference, and the two sides of the fsdp2-vs-ddp comparison."""
    done: dict[str, tuple[Path, str]] = {}

    def get(inner: str) -> tuple[Path, str]:
        if inner not in done:
            run = tmp_path_factory.mktemp(f"streamed-{inner}") / "run"
            proc = ok(torchrun(4, streaming_args(common, inner) + ["train.max_steps=12", f"train.run_dir={run}"]))
            done[inner] = (run, proc.stdout)
        return done[inner]

    return get


@pytest.mark.parametrize("inner", ["ddp", "fsdp2"])
def test_a_sigkill_mid_run_resumes_bit_identically_with_a_fragment_in_flight(common, streamed, inner, tmp_path):
    args = streaming_args(common, inner)
    ref_dir, _ = streamed(inner)
    run = tmp_path / "killed"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", "-m", "flopwise",
           "train", *args, "train.max_steps=100000", f"train.run_dir={run}"]
    launcher = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=_env())
    try:
        for _ in range(6000):  # until the checkpoint of step 6 exists (fragment 0 sent at 6 is in flight)
            if (latest_checkpoint(run) and int(latest_checkpoint(run).name[5:]) >= 6) or launcher.poll() is not None:
                break
            time.sleep(0.05)
        assert launcher.poll() is None, launcher.stderr.read() if launcher.stderr else ""
    finally:
        ranks = torchrun_children(launcher.pid)
        for pid in [*ranks.values(), launcher.pid]:  # every rank and the launcher at once, as a lost node would
            os.kill(pid, signal.SIGKILL)
        launcher.wait()
        for pid in ranks.values():  # gone before the resume takes the run directory's lock
            while Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text():
                time.sleep(0.05)
        if launcher.stderr:
            launcher.stderr.close()
    killed_at = int(latest_checkpoint(run).name[5:])
    assert 6 <= killed_at < 12, killed_at
    tag = "-0" if inner == "fsdp2" else ""  # FSDP2 inside: every rank's own file
    in_flight = torch.load(list_checkpoints(run)[1] / "diloco" / f"group-0{tag}.pt", weights_only=True)["inflight"]
    assert [f["fragment"] for f in in_flight] == [0]  # step 6's checkpoint: fragment 0's all-reduce in flight
    proc = ok(torchrun(4, args + ["train.max_steps=12", f"train.run_dir={run}"]))
    assert "resuming from" in proc.stdout
    ref, got = latest_checkpoint(ref_dir), latest_checkpoint(run)
    assert ref.name == got.name == "step-0000012"
    names = (["diloco/outer-0.pt", "diloco/outer-1.pt", "diloco/group-1-1.pt"] if inner == "fsdp2" else
             ["model.pt", "optimizer.pt", "diloco/outer.pt", "diloco/group-1.pt"])
    for name in names:
        a, b = torch.load(ref / name, weights_only=True), torch.load(got / name, weights_only=True)
        assert _equal(a, b), f"{name} differs after the resume"
    want, have = final_weights(ref_dir), final_weights(run)  # group 0's, consolidated (DCP under FSDP2)
    assert all(torch.equal(want[k], have[k]) for k in want)
    keys = ("loss", "grad_norm", "outer_steps", "outer_bytes_total", "pseudo_grad_norm", "drift")
    ref_rows, got_rows = rows_by_step(ref_dir), rows_by_step(run)
    for step in range(killed_at + 1, 13):  # the outer loop's measures too, not only the weights
        want_row, got_row = ({k: r.get(k) for k in keys} for r in (ref_rows[step], got_rows[step]))
        assert got_row == want_row, (step, got_row, want_row)


def rows_by_step(run: Path) -> dict[int, dict]:
    """The training rows of metrics.jsonl by step (the last row of a step: a resumed run's)."""
    return {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r}


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def test_fsdp2_inside_the_groups_trains_what_ddp_inside_trains(streamed):
    # the SIGKILL tests' references: streaming, two fragments, one in flight at a time
    (ddp, _), (fsdp2, out) = streamed("ddp"), streamed("fsdp2")
    assert "2 group(s) of 2 rank(s) (fsdp2 inside)" in out
    assert (latest_checkpoint(fsdp2) / "diloco" / "group-1").is_dir()  # group 1's own DCP shards
    assert_weights_close(final_weights(fsdp2), final_weights(ddp), what="fsdp2 vs ddp inside")


def test_groups_that_do_not_divide_the_ranks_are_refused_before_any_work(common, tmp_path):
    run = tmp_path / "run"
    proc = torchrun(2, common + ["parallel.group_size=3", "train.max_steps=2", f"train.run_dir={run}"])
    assert proc.returncode != 0
    assert proc.stderr.count("parallel.group_size=3 does not divide the 2 ranks into whole groups") == 1, proc.stderr
    assert not run.exists()
