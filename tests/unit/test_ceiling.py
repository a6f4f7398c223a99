"""The measured GEMM ceiling: the shapes are exactly the matmuls MFU counts, and the ceiling
is their FLOPs over their summed time (a scripted clock stands in for the device's speed)."""

import pytest
import torch

from flopwise.config import build_config
from flopwise.measure.ceiling import Gemm, measure_ceiling, step_gemms
from flopwise.plan.flops import param_counts


@pytest.mark.parametrize("preset", ["tiny", "gpt2-124m", "qwen3-moe-500m-a330m"])
def test_the_step_gemms_are_the_six_n_matmul_flops(preset):
    cfg = build_config(preset=preset).model
    tokens = 4 * 512
    gemms = step_gemms(cfg, tokens)
    flops = sum(g.flops for g in gemms)
    want = 6 * param_counts(cfg)["matmul"] * tokens
    # exact for dense models; experts see tokens x top_k / n_experts each, rounded
    assert flops == pytest.approx(want, rel=1e-3 if cfg.is_moe else 0), (flops, want)
    assert {g.name.split()[-1] for g in gemms} == {"fwd", "dX", "dW"}


def test_the_ceiling_weights_each_shape_by_its_flops(monkeypatch):
    """Two shapes, one running at twice the other's rate: the ceiling is their FLOPs over
    their summed time, not the mean of the rates. A scripted clock advances by each call's
    time (1 s for the small shape, 0.5 s for the big one: 16x the FLOPs at 32x the rate)."""
    small, big = Gemm("small", 4, 4, 4), Gemm("big", 8, 8, 8)
    seconds_per_call = {small.flops: 1.0, big.flops: 0.5}
    now = {"t": 0.0}
    real = torch.matmul

    def timed_matmul(a, b):
        now["t"] += seconds_per_call[2 * a.shape[0] * a.shape[1] * b.shape[1]]
        return real(a, b)

    monkeypatch.setattr(torch, "matmul", timed_matmul)
    ceiling = measure_ceiling([small, big], torch.device("cpu"), torch.float32, min_seconds=2.0,
                              clock=lambda: now["t"])
    assert [s["tflops"] * 1e12 for s in ceiling.shapes] == pytest.approx([small.flops / 1.0, big.flops / 0.5])
    assert ceiling.seconds_per_step == pytest.approx(1.0 + 0.5)
    assert ceiling.flops_per_s == pytest.approx((small.flops + big.flops) / 1.5)


def test_a_real_ceiling_on_this_cpu_is_a_positive_rate():
    cfg = build_config(preset="tiny").model
    ceiling = measure_ceiling(step_gemms(cfg, 256), torch.device("cpu"), torch.float32, min_seconds=0.005)
    assert ceiling.flops_per_s > 0 and ceiling.seconds_per_step > 0
    assert len(ceiling.shapes) == len(step_gemms(cfg, 256)) and ceiling.dtype == "float32"
