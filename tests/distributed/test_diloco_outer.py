"""DiLoCo's outer step against a reference computed by hand, over real gloo process groups.

2 processes (2 groups of 1) and 4 (2 groups of 2, DDP inside: each rank sends a slice of the
pseudo-gradient and the group all-gathers them). Each group moves its copy of the
parameters away from the common anchor by its own delta; after the sync every rank must hold
anchor - lr * (mean delta + momentum * buffer) -- torch's Nesterov SGD, written out here --
and the groups must hold the same values bit for bit.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from helpers import spawn_ranks

from flopwise.config import ParallelConfig
from flopwise.parallel.diloco import DiLoCo, fragments, make_groups
from flopwise.parallel.distributed import DistEnv

SHAPES = [(6, 5), (7,), (3, 4)]
LR, MU = 0.7, 0.9


def start(rank: int, world: int, store_file: str) -> DistEnv:
    store = dist.FileStore(store_file, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    return DistEnv(rank, rank, world, "gloo", "test")


def anchor() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=gen) for s in SHAPES]


def delta(group: int, round_: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * round_ + group + 1)
    return [0.1 * torch.randn(s, generator=gen) for s in SHAPES]


def _rounds(rank: int, world: int, store_file: str, size: int, out: str, dtype: str) -> None:
    torch.set_num_threads(1)
    env = start(rank, world, store_file)
    pc = ParallelConfig(strategy="diloco", group_size=size, inner_steps=3, outer_lr=LR, outer_momentum=MU,
                        outer_dtype=dtype)  # type: ignore[arg-type]
    groups = make_groups(env, pc)
    params = [torch.nn.Parameter(a.clone()) for a in anchor()]
    outer = DiLoCo(params, pc, groups, torch.device("cpu"))
    seen = []
    for r in (1, 2):  # two outer steps: the second uses the momentum the first left
        with torch.no_grad():
            for p, a, d in zip(params, outer.anchor, delta(groups.index, r)):
                p.copy_(a - d)
        outer.after_step(3 * r)
        seen.append([p.detach().clone() for p in params])
    torch.save({"seen": seen, "anchor": [a.clone() for a in outer.anchor], "group": groups.index,
                "outer_steps": outer.outer_steps, "bytes": outer.bytes_sent}, f"{out}/{rank}.pt")
    dist.destroy_process_group()


def hand_reference(groups: int, dtype: torch.dtype) -> list[list[torch.Tensor]]:
    """Nesterov SGD on the mean pseudo-gradient, as torch.optim.SGD(nesterov=True) defines it."""
    a, buf, out = anchor(), None, []
    for r in (1, 2):
        mean = [sum(delta(g, r)[i].to(dtype).float() for g in range(groups)) / groups for i in range(len(SHAPES))]
        buf = mean if buf is None else [MU * b + m for b, m in zip(buf, mean)]
        a = [x - LR * (m + MU * b) for x, m, b in zip(a, mean, buf)]
        out.append(a)
    return out


def run(world: int, size: int, dtype: str = "fp32") -> list[dict]:
    with tempfile.TemporaryDirectory() as d:
        spawn_ranks(_rounds, (world, os.path.join(d, "store"), size, d, dtype), world)
        return [torch.load(f"{d}/{r}.pt") for r in range(world)]


@pytest.mark.parametrize("world,size", [(2, 1), (4, 2)])
def test_the_outer_step_is_nesterov_on_the_mean_pseudo_gradient(world, size):
    results = run(world, size)
    want = hand_reference(world // size, torch.float32)
    for res in results:
        assert res["outer_steps"] == 2
        for r in range(2):
            for got, exp in zip(res["seen"][r], want[r]):
                err = (got - exp).abs().max().item()
                assert err <= 1e-6 * exp.abs().max().item(), f"round {r + 1}, group {res['group']}: off by {err:.3g}"
    first = results[0]["seen"]
    for res in results[1:]:  # every group holds the same parameters right after the sync, bit for bit
        for r in range(2):
            for got, ref in zip(res["seen"][r], first[r]):
                assert torch.equal(got, ref), f"rank differs from rank 0 after sync {r + 1}"
    n = sum(torch.Size(s).numel() for s in SHAPES)
    # each rank sends its slice of the model (padded to the group's ranks) once per outer step
    assert results[0]["bytes"] == 2 * 4 * -(-n // size)


def test_bf16_pseudo_gradients_are_averaged_in_bf16():
    results = run(2, 1, "bf16")
    want = hand_reference(2, torch.bfloat16)
    for res in results:
        for got, exp in zip(res["seen"][0], want[0]):
            # the sum of two bf16 values is rounded to bf16 once more by the all-reduce
            err = (got - exp).abs().max().item()
            assert err <= 2e-2 * LR * 0.3, f"off by {err:.3g}"
    assert results[0]["bytes"] == 2 * 2 * sum(torch.Size(s).numel() for s in SHAPES)


def _streaming(rank: int, world: int, store_file: str, out: str) -> None:
    torch.set_num_threads(1)
    env = start(rank, world, store_file)
    pc = ParallelConfig(strategy="diloco", group_size=1, inner_steps=4, outer_lr=LR, outer_momentum=0.0,
                        fragments=2, overlap_steps=1)
    groups = make_groups(env, pc)
    params = [torch.nn.Parameter(a.clone()) for a in anchor()]
    outer = DiLoCo(params, pc, groups, torch.device("cpu"))
    log = {"frags": outer.frags, "due": [outer.due(s) for s in range(1, 9)]}
    with torch.no_grad():
        for p, a, d in zip(params, outer.anchor, delta(groups.index, 1)):
            p.copy_(a - d)
    outer.after_step(2)  # fragment 0 is sent ...
    log["in_flight_after_2"] = [f.fragment for f in outer.inflight]
    log["unchanged_after_2"] = [p.detach().clone() for p in params]
    with torch.no_grad():  # ... the group trains on for a step ...
        for p in params:
            p.add_(0.01)
    outer.after_step(3)  # ... and it lands: the new anchor plus that step's progress
    log["after_3"] = [p.detach().clone() for p in params]
    log["anchor_3"] = [a.clone() for a in outer.anchor]
    torch.save(log, f"{out}/{rank}.pt")
    dist.destroy_process_group()


def test_streaming_sends_fragments_at_staggered_steps_and_keeps_the_progress_made_in_flight():
    with tempfile.TemporaryDirectory() as d:
        spawn_ranks(_streaming, (2, os.path.join(d, "store"), d), 2)
        logs = [torch.load(f"{d}/{r}.pt") for r in range(2)]
    log = logs[0]
    assert log["frags"] == [[0], [1, 2]]  # 30 | 7 + 12 values: contiguous, about even
    assert log["due"] == [[], [0], [], [1], [], [0], [], [1]]  # fragment f at (f + 1) H / F, mod H
    assert log["in_flight_after_2"] == [0]
    start_anchor, deltas = anchor(), [delta(g, 1) for g in range(2)]
    for res, g in zip(logs, range(2)):
        for i in range(3):  # nothing moved when it was sent
            assert torch.equal(res["unchanged_after_2"][i], start_anchor[i] - deltas[g][i])
        mean0 = (deltas[0][0] + deltas[1][0]) / 2
        new0 = start_anchor[0] - LR * mean0
        assert torch.allclose(res["anchor_3"][0], new0, rtol=0, atol=1e-6)
        assert torch.allclose(res["after_3"][0], new0 + 0.01, rtol=0, atol=1e-6)  # the step in flight kept
        for i in (1, 2):  # fragment 1 is not due yet: its anchor and the group's values are as they were
            assert torch.equal(res["anchor_3"][i], start_anchor[i])
            assert torch.allclose(res["after_3"][i], start_anchor[i] - deltas[g][i] + 0.01, rtol=0, atol=1e-7)


def test_fragments_are_contiguous_and_cover_every_tensor_once():
    for sizes, count in [([1] * 4, 2), ([10, 1, 1, 1, 1], 3), ([5] * 7, 7), ([1, 100, 1], 2), ([3, 3, 3], 1)]:
        parts = fragments(sizes, count)
        assert len(parts) == count and all(parts), (sizes, count, parts)
        assert [i for p in parts for i in p] == list(range(len(sizes)))
