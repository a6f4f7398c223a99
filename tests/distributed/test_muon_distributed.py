"""Muon's Newton-Schulz work split over the data-parallel ranks, in spawned gloo processes.

Every rank holds the same averaged gradients (DDP made them so) and the same momentum; matrix i
of a fixed order is orthogonalised by rank i mod N alone and the results are all-gathered, so
each rank applies the update a one-rank Muon makes: the same bits (``torch.equal``), checked on
weights and momentum at 2 and 4 ranks, for more matrices than ranks and fewer, of uneven
shapes, over good steps and a skipped one, and within each of two sub-groups (a DiLoCo worker
group). A 2-rank DDP step with Muon is then checked against one process on the same batch
(the tolerance of tests/helpers.py: the all-reduce sums in another order).
"""

from __future__ import annotations

import copy
import os
import traceback
from pathlib import Path

import pytest
import torch
from helpers import assert_weights_close, spawn_ranks

from flopwise.tune.trial import free_port

pytestmark = pytest.mark.slow  # every test spawns gloo processes (a few seconds each)

# DDP + Muon against one process, relative to each tensor's norm: Newton-Schulz runs in bf16, where
# the all-reduce's other order of sums flips roundings, and its steep slope at 0 amplifies what lies
# in small singular directions. Measured on the 2-core development machine after 3 steps: 2.1e-2 at
# most (7e-4 with Newton-Schulz in float32; AdamW in the same steps 2e-6); a missed gradient sync
# (each rank on its own half of the batch) moves them by 0.46 ... 0.50. 0.1: 5x from either.
MUON_WEIGHT_REL = 0.1

# Weight shapes (rows, cols) of the cases: more matrices than 2 and 4 ranks, in uneven shapes
# (wide, tall, square, two alike); 3 (more than 2 ranks, fewer than 4); one (fewer than any);
# and weights of other dtypes than float32 (DTYPES), whose results travel in float32, not bf16.
CASES = {
    "seven": [(16, 8), (8, 16), (12, 12), (5, 7), (32, 4), (3, 9), (16, 8)],
    "three": [(6, 10), (9, 4), (7, 7)],
    "one": [(10, 6)],
    "dtypes": [(8, 6), (6, 8), (5, 5)],
}
DTYPES = {"dtypes": [torch.float16, torch.float64, torch.float32]}
# (found_inf, NaN gradient): no flag, then the device's verdict -- good, bad (skipped), good.
STEPS = [(None, False), (0.0, False), (1.0, True), (0.0, False), (None, False)]


def _worker(rank: int, world: int, port: int, out_dir: str, fn_name: str) -> None:
    """This process as rank ``rank`` of ``world`` (gloo, one thread); ``fn_name``'s result saved."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    try:
        from flopwise.parallel.distributed import init_distributed

        # one minute: a rank left out of a collective fails the test then, rather than hanging it
        env, device = init_distributed("ddp", "cpu", timeout_min=1)
        try:
            result = globals()[fn_name](env, device)
            env.barrier()
        finally:
            env.close()
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    except Exception:  # noqa: BLE001 - reported by the parent
        (Path(out_dir) / f"rank{rank}.err").write_text(traceback.format_exc())


def spawn(fn_name: str, world: int, tmp_path: Path) -> list:
    spawn_ranks(_worker, (world, free_port(), str(tmp_path), fn_name), world)
    errors = [p.read_text() for p in sorted(tmp_path.glob("rank*.err"))]
    assert not errors, "\n".join(errors)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]


# ------------------------------------------------------------------ the update, bit for bit

def _matrices(shapes: list[tuple[int, int]], dtypes: list[torch.dtype] | None = None) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    dtypes = dtypes or [torch.float32] * len(shapes)
    return [torch.nn.Parameter((torch.randn(s, generator=gen) * 0.1).to(d)) for s, d in zip(shapes, dtypes)]


def _two_groups(ps: list[torch.nn.Parameter]) -> list[dict]:
    """Two parameter groups with their own rate and decay: each matrix must get its own group's."""
    return [{"params": ps[::2]}, {"params": ps[1::2], "lr": 0.05, "weight_decay": 0.1}]


def _compare(group, shapes: list[tuple[int, int]], dtypes: list[torch.dtype] | None = None) -> dict:
    """Muon split over ``group`` against a one-rank Muon on the same gradients, step by step:
    whether weights and momentum are the same bits, how many Newton-Schulz calls this rank made
    for the split one, and its final weights (the parent compares them across ranks)."""
    import flopwise.train.optim as optim

    ref_ps, dist_ps = _matrices(shapes, dtypes), _matrices(shapes, dtypes)
    ref = optim.Muon(_two_groups(ref_ps), lr=0.02, weight_decay=0.01)
    split = optim.Muon(_two_groups(dist_ps), lr=0.02, weight_decay=0.01, group=group)
    real, calls = optim.newton_schulz, [0]

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    equal, counts = [], []
    for i, (flag, nan) in enumerate(STEPS):
        gen = torch.Generator().manual_seed(100 + i)  # the same gradients on every rank, as DDP leaves them
        grads = [torch.randn(s, generator=gen).to(p.dtype) for s, p in zip(shapes, ref_ps)]
        if nan:
            grads[-1][0, 0] = float("nan")
        for opt, ps in ((ref, ref_ps), (split, dist_ps)):
            for p, g in zip(ps, grads):
                p.grad = g.clone()
            if flag is None:
                if opt is split:
                    optim.newton_schulz, calls[0] = counted, 0
                opt.step()
            else:
                with optim.skipped_if(opt, torch.tensor(flag)):
                    if opt is split:
                        optim.newton_schulz, calls[0] = counted, 0
                    opt.step()
            optim.newton_schulz = real
        counts.append(calls[0])
        equal.append(all(torch.equal(a, b) for a, b in zip(ref_ps, dist_ps))
                     and all(torch.equal(ref.state[a]["momentum_buffer"], split.state[b]["momentum_buffer"])
                             for a, b in zip(ref_ps, dist_ps)))
    moved = not all(torch.equal(a, b) for a, b in zip(_matrices(shapes, dtypes), dist_ps))
    finite = all(torch.isfinite(p).all() for p in dist_ps)
    same_dict = ref.state_dict()["param_groups"] == split.state_dict()["param_groups"]
    # A resume: the split optimizer's state dict loaded at one rank and split again, one more step
    # each, against the split optimizer going on.
    saved = copy.deepcopy(split.state_dict())
    grads = [torch.randn(s, generator=torch.Generator().manual_seed(999)).to(p.dtype) for s, p in zip(shapes, ref_ps)]
    runs = []
    for g in (None, group):
        ps = [torch.nn.Parameter(p.detach().clone()) for p in dist_ps]
        opt = optim.Muon(_two_groups(ps), lr=0.5, group=g)  # the saved rates replace 0.5
        opt.load_state_dict(copy.deepcopy(saved))
        runs.append((opt, ps))
    for opt, ps in [*runs, (split, dist_ps)]:
        for p, grad in zip(ps, grads):
            p.grad = grad.clone()
        opt.step()
    resumes = all(torch.equal(a, b) for _, ps in runs for a, b in zip(ps, dist_ps))
    return {"equal": equal, "counts": counts, "moved": moved, "finite": finite, "state_dict": same_dict,
            "resumes": resumes, "ranks": split.ranks, "weights": [p.detach().clone() for p in dist_ps]}


def _bitwise(env, device) -> dict:
    import torch.distributed as dist

    out = {name: _compare(dist.group.WORLD, shapes, DTYPES.get(name)) for name, shapes in CASES.items()}
    if env.world_size == 4:  # DiLoCo's inner groups: ranks {0, 1} and {2, 3}, each split within its own
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        out["sub-group"] = _compare(groups[env.rank // 2], CASES["seven"])
    return out


def _check_bitwise(results: list[dict], world: int) -> None:
    for name, shapes in CASES.items():
        for rank, r in enumerate(results):
            case = r[name]
            assert case["ranks"] == world, (name, rank)
            assert all(case["equal"]), (name, rank, case["equal"])
            assert case["moved"] and case["finite"] and case["state_dict"] and case["resumes"], (name, rank)
            # this rank orthogonalised its round-robin share (matrix i on rank i mod world), each step
            assert case["counts"] == [len(range(rank, len(shapes), world))] * len(STEPS), (name, rank, case["counts"])
        for r in results[1:]:
            assert all(torch.equal(a, b) for a, b in zip(results[0][name]["weights"], r[name]["weights"])), name


@pytest.mark.parametrize("world", [2, 4])
def test_the_split_update_is_bitwise_the_one_rank_update(world, tmp_path):
    results = spawn("_bitwise", world, tmp_path)
    _check_bitwise(results, world)
    if world == 4:
        n = len(CASES["seven"])
        for rank, r in enumerate(results):
            case = r["sub-group"]
            assert case["ranks"] == 2 and all(case["equal"]) and case["resumes"], (rank, case["equal"])
            assert case["counts"] == [len(range(rank % 2, n, 2))] * len(STEPS), (rank, case["counts"])


# ------------------------------------------------------------------ a DDP step with Muon

def _config(micro_batch: int):
    from flopwise.config import build_config

    return build_config(overrides=[
        "model.vocab_size=64", "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
        "model.ffn_hidden=48", "model.max_seq_len=16", "train.seq_len=16", f"train.micro_batch_size={micro_batch}",
        "train.global_batch_size=4", "train.precision=float32", "data.builtin_vocab_size=64", "train.compile=off",
        "optim.name=muon", "optim.warmup_steps=0"])


class _Batches:
    """Rank ``rank``'s share (2 sequences) of each global batch of 4, or all 4 (``rank=None``)."""

    def __init__(self, rank: int | None):
        self.rank, self.step = rank, 0

    def next_batch(self):
        seq = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(self.step))
        self.step += 1
        if self.rank is not None:
            seq = seq[2 * self.rank:2 * self.rank + 2]
        return seq[:, :-1], seq[:, 1:]

    def state_dict(self):
        return {}


def _ddp_vs_one_process(env, device) -> dict:
    """Three steps of the run's own step: DDP at 2 ranks with Muon split (as runs build it), the
    same with Muon unsplit (every rank orthogonalises every matrix, as before), and one process
    on the whole batch."""
    import flopwise.train.setup as setup
    from flopwise.parallel.distributed import DistEnv
    from flopwise.train.optim import describe_optimizer
    from flopwise.train.precision import resolve
    from flopwise.train.train_step import StepOnly, train_step

    prec = resolve("float32", device)
    split = setup.replica_group
    out = {}
    for name, cfg, strategy, rank_env, batches in (
            ("ddp", _config(2), "ddp", env, _Batches(env.rank)),
            ("ddp-unsplit", _config(2), "ddp", env, _Batches(env.rank)),
            ("single", _config(4), "single", DistEnv(), _Batches(None))):
        setup.replica_group = (lambda strategy, env: None) if name == "ddp-unsplit" else split
        torch.manual_seed(0)
        parts = setup.build_step(cfg, strategy, rank_env, device, prec)
        setup.replica_group = split
        step = StepOnly.of(cfg, parts, rank_env, device, prec, strategy, batches)
        for i in range(3):
            train_step(step, i, 1, 4 * 16, cfg.optim.lr).read()
        out[name] = {"weights": {k: v.detach().clone() for k, v in parts.model.state_dict().items()},
                     "described": describe_optimizer(parts.optimizer)}
    out["nan"] = _a_nan_gradient_on_rank_1(env, device, prec)
    return out


def _a_nan_gradient_on_rank_1(env, device, prec) -> tuple[list[str], bool, bool]:
    """Three DDP steps with Muon split; the second one's gradients turn NaN in the backward on
    rank 1 only. The device's verdicts, whether that step left the weights as they were (bitwise),
    whether the next one moved them."""
    from flopwise.train.setup import build_step
    from flopwise.train.train_step import StepOnly, train_step

    cfg = _config(2)
    torch.manual_seed(0)
    parts = build_step(cfg, "ddp", env, device, prec)
    step = StepOnly.of(cfg, parts, env, device, prec, "ddp", _Batches(env.rank))
    poisoned = {"on": False}
    wo = parts.model.layers[0].attn.wo

    def poison(module, inputs, output):  # NaN made in the backward: the loss stays finite
        if poisoned["on"] and env.rank == 1:
            output.register_hook(lambda g: g * float("nan"))

    wo.register_forward_hook(poison)

    def weights():
        return [p.detach().clone() for p in parts.model.parameters()]

    verdicts = [train_step(step, 0, 1, 4 * 16, cfg.optim.lr).read().bad]
    before, poisoned["on"] = weights(), True
    verdicts.append(train_step(step, 1, 1, 4 * 16, cfg.optim.lr).read().bad)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, weights()))
    poisoned["on"] = False
    verdicts.append(train_step(step, 2, 1, 4 * 16, cfg.optim.lr).read().bad)
    moved = all(torch.isfinite(p).all() for p in weights()) and not all(
        torch.equal(a, b) for a, b in zip(before, weights()))
    return verdicts, unchanged, moved


def test_a_two_rank_ddp_step_with_muon_trains_what_one_process_trains(tmp_path):
    """Split or not, the same bits, on both ranks; against one process within MUON_WEIGHT_REL."""
    ranks = spawn("_ddp_vs_one_process", 2, tmp_path)
    for rank, r in enumerate(ranks):
        assert "Newton-Schulz split over 2 ranks" in r["ddp"]["described"], r["ddp"]["described"]
        assert "split over" not in r["ddp-unsplit"]["described"] + r["single"]["described"]
        for k, w in r["ddp-unsplit"]["weights"].items():
            assert torch.equal(r["ddp"]["weights"][k], w), (rank, k)
        assert_weights_close(r["ddp"]["weights"], r["single"]["weights"], rel=MUON_WEIGHT_REL,
                             what=f"rank {rank}: ddp+muon vs 1 process")
    assert all(torch.equal(ranks[0]["ddp"]["weights"][k], w) for k, w in ranks[1]["ddp"]["weights"].items())
    for rank, r in enumerate(ranks):  # the non-finite skip, on the device, through the split
        verdicts, unchanged, moved = r["nan"]
        assert verdicts == ["", "nonfinite", ""] and unchanged and moved, (rank, r["nan"])
