"""DDP, ZeRO-1 and FSDP2 as users launch them: ``torchrun --nproc-per-node=2 -m flopwise train``,
2 gloo processes on CPU, a tiny model in float32.

Every strategy must train what one process trains on the same global batch -- the same
losses, gradient norms and weights up to the order of floating-point sums (tests/helpers.py
says how close that is): 2 ranks x micro-batch 4 (x 2 accumulation) against 1 process x
micro-batch 8 (x 2), on the epoch loader (whose ranks split each global batch, so both see
the same samples per step).
Checkpoints written at 2 ranks resume at 1 and the reverse, continuing the same curve.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import assert_grad_norms_close, assert_weights_close, grad_norms, run_flopwise, torchrun_children

STEPS = 8
STRATEGIES = ("ddp", "zero1", "fsdp2")
pytestmark = pytest.mark.slow  # every test launches torchrun or a training process (3 ... 50 s)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def torchrun(nproc: int, overrides: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "flopwise", "train", *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=timeout)


def one_process(overrides: list[str]) -> subprocess.CompletedProcess:
    return run_flopwise(["train", *overrides], env=_env(), timeout=300)


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def curve(run: Path) -> dict[int, tuple[float | None, float | None]]:
    """step -> (train loss, validation loss) from metrics.jsonl."""
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "step" in row and ("loss" in row or "val_loss" in row):
            out[row["step"]] = (row.get("loss"), row.get("val_loss"))
    return out


def assert_same_curve(a: Path, b: Path, steps=range(1, STEPS + 1)) -> None:
    ca, cb = curve(a), curve(b)
    for s in steps:
        for x, y in zip(ca[s], cb[s]):
            assert (x is None) == (y is None), (s, ca[s], cb[s])
            if x is not None:
                assert y == pytest.approx(x, rel=2e-6, abs=2e-6), (s, ca[s], cb[s])


def assert_same_training(got: Path, want: Path, what: str = "") -> None:
    """The same final weights (relative to each tensor's norm: the ranks sum in another order,
    see tests/helpers.py) and the same logged gradient norm at every step."""
    assert_weights_close(final_weights(got), final_weights(want), what=what)
    assert_same_grad_norms(got, want, what)


def assert_same_grad_norms(got: Path, want: Path, what: str = "") -> None:
    def logged(run: Path) -> dict[int, float]:
        return grad_norms(json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines())

    assert_grad_norms_close(logged(got), logged(want), what=what)


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    import flopwise

    model, _ = flopwise.load(run)
    return model.state_dict()


@pytest.fixture(scope="module")
def base(small_builtin, tmp_path_factory):
    _, data = small_builtin
    root = tmp_path_factory.mktemp("dp")
    common = [
        f"data.path={data}", "data.loader=epoch", "model.vocab_size=512", "model.d_model=64", "model.n_layers=2",
        "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=192", "model.max_seq_len=64",
        "train.seq_len=64", "train.global_batch_size=16", f"train.max_steps={STEPS}", "train.checkpoint_every=4",
        "train.log_every=1", "eval.every=4", "eval.windows=16", "eval.sample_tokens=8", "optim.warmup_steps=2",
        "tracking.tensorboard=false",
    ]
    return root, common


@pytest.fixture(scope="module")
def reference(base):
    """One process, micro-batch 8 x 2 accumulation."""
    root, common = base
    run = root / "single"
    ok(one_process(common + ["train.micro_batch_size=8", f"train.run_dir={run}"]))
    return run


@pytest.fixture(scope="module")
def two_ranks(base):
    """Each strategy at 2 ranks x micro-batch 4 x 2 accumulation."""
    root, common = base
    runs = {}
    for s in STRATEGIES:
        run = root / f"two-{s}"
        proc = ok(torchrun(2, common + ["train.micro_batch_size=4",  # the same 16 val windows at any micro-batch
                                        f"parallel.strategy={s}", f"train.run_dir={run}"]))
        runs[s] = (run, proc)
    return runs


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_ranks_train_what_one_process_trains(strategy, reference, two_ranks):
    run, proc = two_ranks[strategy]
    assert_same_curve(reference, run)
    assert_same_training(run, reference, what=f"{strategy} at 2 ranks vs 1 process")
    # rank 0 alone logs and writes the run's files; the accounting is world-size aware
    assert proc.stdout.count("flopwise train · preset") == 1
    assert f"parallel   {strategy} · 2 rank(s)" in proc.stdout
    assert "micro-batch 4 × accumulation 2 × 2 ranks" in proc.stdout
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r.get("tok_per_s")]
    assert steps and all(r["world_size"] == 2 and r["tok_per_s_per_gpu"] == pytest.approx(r["tok_per_s"] / 2)
                         for r in steps)
    record = json.loads((run / "run.json").read_text())
    assert record["parallel"]["strategy"] == strategy and record["parallel"]["world_size"] == 2
    assert (run / "samples.txt").read_text().count("--- prompt") == 1
    fmt = "sharded" if strategy == "fsdp2" else "model.pt"
    assert (run / "checkpoints" / f"step-{STEPS:07d}" / fmt).exists()


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_per_op_checkpointing_trains_what_one_process_trains(strategy, base, reference, tmp_path):
    """train.activation_checkpointing=selective_op under DDP and FSDP2: the checkpointed region is
    the block's forward, inside DDP's hooks and FSDP2's per-block all-gather (its recompute runs in
    the block's backward, with the parameters gathered again), and its gradients are the plain
    ones -- the same curve and weights as one process without checkpointing."""
    root, common = base
    run = tmp_path / "run"
    proc = ok(torchrun(2, common + ["train.micro_batch_size=4", f"parallel.strategy={strategy}",
                                    "train.activation_checkpointing=selective_op", f"train.run_dir={run}"]))
    assert "activation checkpointing selective_op" in proc.stdout
    assert_same_curve(reference, run)
    assert_same_training(run, reference, what=f"{strategy} + selective_op at 2 ranks vs 1 process")


def test_zero1_and_fsdp2_reach_the_parameters_of_ddp(two_ranks):
    for strategy in ("zero1", "fsdp2"):
        assert_same_training(two_ranks[strategy][0], two_ranks["ddp"][0], what=f"{strategy} vs ddp")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_saved_at_two_ranks_resumes_in_one_process(strategy, base, reference, two_ranks, tmp_path):
    """Keeping micro-batch 4: one process takes 4 micro-batches per step where each of two
    ranks took 2 -- the same samples per step, so the curve continues exactly."""
    _, common = base
    run = tmp_path / "run"
    shutil.copytree(two_ranks[strategy][0], run)
    shutil.rmtree(run / "checkpoints" / f"step-{STEPS:07d}")
    proc = ok(one_process(common + ["train.micro_batch_size=4", f"parallel.strategy={strategy}",
                                    f"train.run_dir={run}"]))
    assert "resuming from" in proc.stdout and "step-0000004" in proc.stdout
    assert_same_curve(reference, run)
    assert_same_training(run, reference, what=f"{strategy}: 2 ranks resumed in 1 process vs 1 process")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_saved_in_one_process_resumes_at_two_ranks(strategy, base, reference, tmp_path):
    """The one-process reference's step-4 checkpoint (model.pt / optimizer.pt) continued by 2
    ranks under each strategy -- FSDP2 shards the full checkpoint as it loads it."""
    _, common = base
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    shutil.rmtree(run / "checkpoints" / f"step-{STEPS:07d}")
    proc = ok(torchrun(2, common + ["train.micro_batch_size=4", f"parallel.strategy={strategy}",
                                    f"train.run_dir={run}"]))
    assert "resuming from" in proc.stdout
    assert_same_curve(reference, run)
    assert_same_training(run, reference, what=f"{strategy}: 1 process resumed at 2 ranks vs 1 process")


def test_a_sharded_checkpoint_resumes_at_another_world_size_under_fsdp2(base, two_ranks, tmp_path):
    """2 FSDP2 ranks' shards -> an FSDP2 group of one (torch.distributed.checkpoint re-shards)."""
    _, common = base
    run = tmp_path / "run"
    shutil.copytree(two_ranks["fsdp2"][0], run)
    shutil.rmtree(run / "checkpoints" / f"step-{STEPS:07d}")
    ok(one_process(common + ["train.micro_batch_size=8", "parallel.strategy=fsdp2", f"train.run_dir={run}"]))
    assert_same_curve(two_ranks["fsdp2"][0], run)
    assert_same_grad_norms(run, two_ranks["fsdp2"][0], "fsdp2: 2 ranks resumed in a group of 1")
    assert (run / "checkpoints" / f"step-{STEPS:07d}" / "sharded" / ".metadata").is_file()


def test_a_batch_ramp_under_ddp_trains_what_one_process_trains(base, tmp_path):
    """Steps of 1, then 2 micro-batches per rank (train.batch_ramp_tokens): the gradients are
    reduced on each step's own last micro-batch, not on the last of a full-size step."""
    _, common = base
    ramp = [o for o in common if not o.startswith("train.max_steps")] + [
        "train.max_tokens=8192", "train.batch_ramp_tokens=4096", "train.batch_ramp_start=1"]
    one, two = tmp_path / "one", tmp_path / "two"
    ok(one_process(ramp + ["train.micro_batch_size=8", f"train.run_dir={one}"]))
    proc = ok(torchrun(2, ramp + ["train.micro_batch_size=4", "parallel.strategy=ddp",
                                  f"train.run_dir={two}"]))
    assert "batch ramp 1 -> 2 micro-batches per step" in proc.stdout
    steps = sorted(curve(one))
    assert len(steps) > STEPS and sorted(curve(two)) == steps
    assert_same_curve(one, two, steps)
    assert_same_training(two, one, what="batch ramp: ddp at 2 ranks vs 1 process")


def test_a_global_batch_that_does_not_split_over_the_ranks_is_refused_once(base, tmp_path):
    _, common = base
    proc = torchrun(2, common + ["train.micro_batch_size=16", f"train.run_dir={tmp_path / 'run'}"])
    assert proc.returncode != 0
    assert proc.stderr.count("must be a multiple of train.micro_batch_size (16) x 2 ranks = 32") == 1
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc to find the rank processes")
def test_a_signal_to_one_rank_stops_every_rank_at_the_same_step(base, tmp_path):
    _, common = base
    run = tmp_path / "run"
    overrides = [o for o in common if not o.startswith("train.max_steps")] + [
        "train.max_steps=100000", "train.micro_batch_size=4", "parallel.strategy=ddp", "eval.every=0",
        f"train.run_dir={run}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "flopwise",
           "train", *overrides]
    launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            if (run / "metrics.jsonl").is_file() and len((run / "metrics.jsonl").read_text().splitlines()) >= 4:
                break
            time.sleep(0.2)
        ranks = torchrun_children(launcher.pid)
        assert set(ranks) == {0, 1}, ranks
        os.kill(ranks[1], signal.SIGTERM)  # only rank 1 hears it (a preemption notice to one node)
        out, err = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0, out[-2000:] + err[-3000:]
    assert "stop       a signal received by another rank" in out  # rank 0's log: it did not get the signal
    saved = sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step-"))
    last = int(saved[-1][5:])
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in rows) == last  # both ranks stopped after the same step, and it was saved


def test_a_refusal_on_rank_0_stops_every_rank_with_its_message(base, tmp_path):
    """start_run runs on rank 0 only; its ConfigError travels to rank 1 (pickled) instead of
    leaving it waiting at the next collective."""
    _, common = base
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    proc = torchrun(2, common + ["train.micro_batch_size=4", f"train.run_dir={blocker / 'run'}"], timeout=120)
    assert proc.returncode != 0
    assert proc.stderr.count("is not writable") == 1


def test_export_consolidates_a_sharded_checkpoint(two_ranks, tmp_path, cli):
    run = two_ranks["fsdp2"][0]
    proc = cli("export", str(run), str(tmp_path / "pt"), "--format", "pt")
    assert proc.returncode == 0, proc.stderr
    weights = torch.load(tmp_path / "pt" / "model.pt", weights_only=True)  # one file, whole tensors
    assert_weights_close(weights, final_weights(run), rel=0, what="export vs the sharded checkpoint it consolidates")
    assert_weights_close(weights, final_weights(two_ranks["ddp"][0]), what="fsdp2's export vs ddp")
    proc = cli("export", str(run), str(tmp_path / "hf"))
    assert proc.returncode == 0, proc.stderr
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    import flopwise

    ours, _ = flopwise.load(tmp_path / "pt")
    x = torch.randint(0, 512, (2, 16))
    torch.testing.assert_close(hf(x).logits, ours(x), rtol=1e-4, atol=1e-4)


def test_the_report_names_the_ranks_and_strategy(two_ranks, tmp_path, cli):
    out = tmp_path / "report.html"
    proc = cli("report", str(two_ranks["zero1"][0]), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "× 2 ranks · zero1 (gloo)" in out.read_text()


def test_two_nodes_of_one_process_each_train_what_one_process_trains(base, reference, tmp_path):
    """--nnodes=2 with a c10d rendezvous, as on a cluster (both 'nodes' on this machine):
    LOCAL_RANK is 0 on both, RANK 0 and 1."""
    import socket

    _, common = base
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=flopwise-test",
           "-m", "flopwise", "train", *common, "train.micro_batch_size=8", "train.global_batch_size=16",
           "parallel.strategy=ddp", f"train.run_dir={run}"]
    nodes = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
             for _ in range(2)]
    outs = [n.communicate(timeout=300) for n in nodes]
    assert all(n.returncode == 0 for n in nodes), [o[1][-3000:] for o in outs]
    log = next(o[0] for o in outs if "flopwise train · preset" in o[0])
    assert "2 rank(s), 2 processes on 2 nodes" in log
    assert_same_curve(reference, run)
    assert_same_training(run, reference, what="2 nodes vs 1 process")


def test_the_random_loader_refuses_another_world_size_by_name(base, tmp_path):
    _, common = base
    run = tmp_path / "run"
    random_loader = [o for o in common if o != "data.loader=epoch"] + ["data.loader=random", "train.max_steps=4"]
    ok(torchrun(2, random_loader + ["train.micro_batch_size=4", f"train.run_dir={run}"]))
    proc = one_process(random_loader + ["train.micro_batch_size=8", "train.max_steps=6", f"train.run_dir={run}"])
    assert proc.returncode == 2
    assert "cannot continue the data position of step-0000004 with 1 rank(s)" in proc.stderr
    assert "use mode 'epoch'" in proc.stderr
