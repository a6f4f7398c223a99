"""MXFP8 (``train.fp8_recipe=mxfp8``) under DDP and FSDP2 at 2 gloo ranks: torchao's weight
wrappers go through DDP's broadcast and buckets and FSDP2's sharding and all-gathers (in bf16
or the weights' dtype: MXFP8 gathers in high precision), train what one process trains, save
checkpoints that hold plain tensors and resume from them. The GEMM is torchao's emulated one
(tests/distributed/fp8_emulated.py says what is swapped): this CPU has no sm100."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchao")
pytestmark = pytest.mark.slow  # torchrun processes

ENTRY = str(Path(__file__).with_name("fp8_emulated.py"))
STEPS = 6


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def run(nproc: int, overrides: list[str]) -> subprocess.CompletedProcess:
    launch = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", ENTRY]
              if nproc > 1 else [sys.executable, ENTRY])
    proc = subprocess.run([*launch, "train", *overrides], capture_output=True, text=True, env=_env(), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r.get("loss") is not None and "event" not in r}


def initial(run_dir: Path):
    """The run's weights before its first step (its seed's)."""
    from flopwise.config import build_config
    from flopwise.model import build_model

    cfg = build_config(config_file=run_dir / "config.yaml")
    return build_model(cfg.model, seed=cfg.train.seed).state_dict()


def weights(run_dir: Path):
    import flopwise

    model, _ = flopwise.load(run_dir)
    return model.state_dict()


@pytest.fixture(scope="module")
def common(small_builtin):
    _, data = small_builtin
    return [f"data.path={data}", "data.loader=epoch", "model.vocab_size=512", "model.d_model=64", "model.n_layers=2",
            "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=192", "model.max_seq_len=64",
            "train.seq_len=64", "train.global_batch_size=16", f"train.max_steps={STEPS}", "train.checkpoint_every=3",
            "train.log_every=1", "eval.every=0", "eval.sample_tokens=0", "optim.warmup_steps=2",
            "tracking.tensorboard=false", "train.fp8=true"]


NOTE = {"tensorwise": "linear layers in float8 (torchao, tensorwise", "rowwise": "linear layers in float8 (torchao, "
        "rowwise", "mxfp8": "linear layers in MXFP8"}


@pytest.fixture(scope="module")
def references(common, tmp_path_factory):
    """One process, micro-batch 4 x 4 accumulation, per recipe (made when first asked for): the
    same micro-batches the 2 ranks cast, 4 rows each."""
    root, made = tmp_path_factory.mktemp("fp8"), {}

    def reference(recipe: str) -> Path:
        if recipe not in made:
            made[recipe] = root / recipe
            proc = run(1, common + [f"train.fp8_recipe={recipe}", "train.micro_batch_size=4",
                                    f"train.run_dir={made[recipe]}"])
            assert NOTE[recipe] in proc.stdout, proc.stdout[-3000:]
        return made[recipe]

    return reference


@pytest.mark.parametrize("recipe,strategy", [("tensorwise", "ddp"), ("tensorwise", "zero1"), ("tensorwise", "fsdp2"),
                                             ("rowwise", "fsdp2"), ("mxfp8", "ddp"), ("mxfp8", "fsdp2")])
def test_two_ranks_of_fp8_train_what_one_process_trains_and_resume(recipe, strategy, common, references, tmp_path):
    reference = references(recipe)
    out = tmp_path / strategy
    proc = run(2, common + [f"train.fp8_recipe={recipe}", "train.micro_batch_size=4", f"parallel.strategy={strategy}",
                            f"train.run_dir={out}"])
    assert f"parallel   {strategy} · 2 rank(s)" in proc.stdout and NOTE[recipe] in proc.stdout, proc.stdout[-3000:]
    if recipe == "tensorwise" and strategy == "fsdp2":
        assert "weights all-gathered in fp8 under FSDP2" in proc.stdout
    want, got = losses(reference), losses(out)
    assert sorted(got) == list(range(1, STEPS + 1))
    # each micro-batch is cast as one process casts it (tensorwise scales by its amax, rowwise and
    # MXFP8 by each row's): only sums are reordered
    for s in got:
        assert got[s] == pytest.approx(want[s], rel=1e-4), (s, got[s], want[s])
    # fp8 rounds in steps of 1/16 of a value: a gradient summed in another order can move a weight
    # across a step, and AdamW's normalised update carries that on. So the weights are held to a
    # share of how far training moved them (a rank that trained alone would be as far off as the
    # move itself). Seen after 6 steps: 2e-6 tensorwise, 1e-5 rowwise, 0.013 MXFP8 (its weights
    # are cast in blocks of 32 with power-of-two scales, each block's rounding its own).
    got_w, want_w, start = weights(out), weights(reference), initial(reference)
    moved = {k: float((want_w[k] - start[k]).norm()) for k in want_w}
    off = {k: float((got_w[k] - want_w[k]).norm()) / moved[k] for k in want_w if moved[k] > 0}
    assert max(off.values()) < (0.05 if recipe == "mxfp8" else 1e-3), sorted(off.items(), key=lambda kv: -kv[1])[:4]
    # resumed from its step-3 checkpoint at one process: the same curve on
    resumed = tmp_path / f"{strategy}-resumed"
    shutil.copytree(out, resumed)
    shutil.rmtree(resumed / "checkpoints" / f"step-{STEPS:07d}")
    run(1, common + [f"train.fp8_recipe={recipe}", "train.micro_batch_size=4", f"train.run_dir={resumed}"])
    again = losses(resumed)
    for s in range(4, STEPS + 1):
        assert again[s] == pytest.approx(want[s], rel=1e-4), (s, again[s], want[s])


def test_zero1_with_mxfp8_is_refused_before_any_work(common, tmp_path):
    """ZeRO-1's broadcast of the updated weights goes into flat buckets the MXFP8 wrappers do not
    read: at 2 ranks the loss of step 2 was 6.2058 against one process's 6.1955 (the ranks had
    drifted apart after one update). Refused, naming what to use."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", ENTRY, "train",
           *common, "train.fp8_recipe=mxfp8", "train.micro_batch_size=4", "parallel.strategy=zero1",
           f"train.run_dir={tmp_path / 'z'}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=600)
    assert proc.returncode != 0
    assert ("parallel.strategy=zero1 with train.fp8_recipe=mxfp8: ZeRO-1 broadcasts each rank's updated weights"
            in proc.stdout + proc.stderr), proc.stderr[-3000:]
    assert not (tmp_path / "z" / "checkpoints").exists()
