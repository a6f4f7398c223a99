"""HSDP (``parallel.strategy=hsdp``) as users launch it: ``torchrun --nproc-per-node=4`` with
``parallel.group_size=2`` -- 4 gloo processes as 2 groups of 2 (what 2 nodes of 2 GPUs would
be), FSDP2 within a group over a 2-D device mesh, each group a replica of the other.

It must train what FSDP2 over all 4 ranks and one process train on the same global batch (the
same losses and weights up to the order of floating-point sums; tests/helpers.py), save a
sharded checkpoint, resume from it exactly, and resume at another number of groups (torch's
distributed checkpoint re-shards): 2 groups of 2 -> 1 group of 2, and -> one process.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_data_parallel import (
    assert_same_curve,
    assert_same_grad_norms,
    assert_same_training,
    ok,
    one_process,
    torchrun,
)

pytestmark = pytest.mark.slow  # torchrun processes

STEPS = 8


@pytest.fixture(scope="module")
def runs(small_builtin, tmp_path_factory):
    """The same 8 steps (global batch 16, micro-batch 2): one process (x 8 accumulation), FSDP2 at
    4 ranks and HSDP at 4 ranks as 2 groups of 2 (x 2 accumulation each)."""
    _, data = small_builtin
    root = tmp_path_factory.mktemp("hsdp")
    common = [
        f"data.path={data}", "data.loader=epoch", "model.vocab_size=512", "model.d_model=64", "model.n_layers=2",
        "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=192", "model.max_seq_len=64",
        "train.seq_len=64", "train.global_batch_size=16", "train.micro_batch_size=2", f"train.max_steps={STEPS}",
        "train.checkpoint_every=4", "train.log_every=1", "eval.every=4", "eval.windows=16", "eval.sample_tokens=8",
        "optim.warmup_steps=2", "tracking.tensorboard=false",
    ]
    out = {"common": common, "root": root}
    out["single"] = root / "single"
    ok(one_process(common + [f"train.run_dir={out['single']}"]))
    out["fsdp2"] = root / "fsdp2"
    ok(torchrun(4, common + ["parallel.strategy=fsdp2", f"train.run_dir={out['fsdp2']}"]))
    out["hsdp"] = root / "hsdp"
    out["hsdp_proc"] = ok(torchrun(4, common + ["parallel.strategy=hsdp", "parallel.group_size=2",
                                                f"train.run_dir={out['hsdp']}"]))
    return out


def test_hsdp_as_two_groups_of_two_trains_what_fsdp2_and_one_process_train(runs):
    hsdp, proc = runs["hsdp"], runs["hsdp_proc"]
    assert_same_curve(runs["fsdp2"], hsdp, steps=range(1, STEPS + 1))
    assert_same_training(hsdp, runs["fsdp2"], what="hsdp 2x2 vs fsdp2 at 4 ranks")
    assert_same_training(hsdp, runs["single"], what="hsdp 2x2 vs one process")
    assert "parallel   hsdp · 4 rank(s)" in proc.stdout, proc.stdout[-2000:]
    assert "sharded within 2 group(s) of 2 rank(s), each group a replica" in proc.stdout
    record = json.loads((hsdp / "run.json").read_text())
    assert record["parallel"]["strategy"] == "hsdp" and record["parallel"]["world_size"] == 4
    assert (hsdp / "checkpoints" / f"step-{STEPS:07d}" / "sharded" / ".metadata").is_file()


def _from_step_4(run: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(run, out)
    shutil.rmtree(out / "checkpoints" / f"step-{STEPS:07d}")
    return out


def test_hsdp_resumes_exactly_from_its_own_checkpoint(runs, tmp_path):
    run = _from_step_4(runs["hsdp"], tmp_path)
    proc = ok(torchrun(4, runs["common"] + ["parallel.strategy=hsdp", "parallel.group_size=2",
                                            f"train.run_dir={run}"]))
    assert "resuming from" in proc.stdout and "step-0000004" in proc.stdout
    assert_same_curve(runs["hsdp"], run, steps=range(1, STEPS + 1))
    assert_same_training(run, runs["hsdp"], what="hsdp resumed vs uninterrupted")


@pytest.mark.parametrize("how", ["one group of 2", "one process"])
def test_an_hsdp_checkpoint_resumes_at_another_number_of_groups(how, runs, tmp_path):
    """2 groups of 2 -> 1 group of 2 (half the nodes) or one process: re-sharded as it loads."""
    run = _from_step_4(runs["hsdp"], tmp_path)
    if how == "one process":
        ok(one_process(runs["common"] + ["parallel.strategy=fsdp2", f"train.run_dir={run}"]))
    else:
        ok(torchrun(2, runs["common"] + ["parallel.strategy=hsdp", "parallel.group_size=2", f"train.run_dir={run}"]))
    assert_same_curve(runs["hsdp"], run, steps=range(1, STEPS + 1))
    assert_same_grad_norms(run, runs["hsdp"], f"hsdp 2x2 resumed as {how}")


def test_a_group_size_that_does_not_divide_the_ranks_is_refused_before_any_work(runs, tmp_path):
    proc = torchrun(4, runs["common"] + ["parallel.strategy=hsdp", "parallel.group_size=3",
                                         f"train.run_dir={tmp_path / 'r'}"])
    assert proc.returncode != 0
    assert ("parallel.strategy=hsdp: parallel.group_size=3 does not divide the 4 ranks into whole shard groups"
            in proc.stdout + proc.stderr), proc.stderr[-2000:]
    assert not (tmp_path / "r" / "checkpoints").exists()
