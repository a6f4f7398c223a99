"""tests/helpers.py: the weight and grad-norm comparisons pass on summation-order noise and
fail, with the sizes, on a real mismatch."""

import pytest
import torch
from helpers import WEIGHT_REL, assert_grad_norms_close, assert_weights_close, weight_differences


def _weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"emb.weight": torch.randn(97, 32, generator=g), "layer.weight": 0.02 * torch.randn(32, 32, generator=g),
            "norm.weight": torch.ones(32), "layer.bias": torch.zeros(32)}


def test_summation_order_noise_passes_where_an_absolute_tolerance_failed():
    want = _weights()
    got = {k: v.clone() for k, v in want.items()}
    # what an AMD EPYC showed: a few elements 4e-6 ... 9e-6 away (AdamW on near-zero gradients)
    got["emb.weight"][3, :4] += torch.tensor([9e-6, -4e-6, 6e-6, -8e-6])
    got["layer.weight"] += 1e-7 * torch.randn(32, 32, generator=torch.Generator().manual_seed(1))
    with pytest.raises(AssertionError):
        torch.testing.assert_close(got["emb.weight"], want["emb.weight"], rtol=1e-5, atol=1e-6)
    assert_weights_close(got, want)
    assert max(r["rel"] for r in weight_differences(got, want)) < WEIGHT_REL / 10


def test_a_real_mismatch_fails_naming_every_tensor_with_its_sizes():
    want = _weights()
    got = {k: v.clone() for k, v in want.items()}
    w = want["layer.weight"]
    d = torch.randn(32, 32, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    got["layer.weight"] = (w.double() + 1e-3 * w.norm().double() * d / d.norm()).float()  # 1e-3 of its norm
    got["layer.bias"] = torch.full((32,), 1e-3)  # a zero tensor that moved: its absolute norm counts
    with pytest.raises(AssertionError) as e:
        assert_weights_close(got, want, what="two ranks vs one")
    msg = str(e.value)
    assert msg.startswith("two ranks vs one: 2 of 4 tensors differ by more than 1e-04 of their norm")
    assert "layer.bias: rel 5.66e+09  max|diff| 1.00e-03  ||want|| 0" in msg  # worst first
    line = next(x for x in msg.splitlines() if "layer.weight" in x)
    assert "rel 1.00e-03" in line and "max|diff| " in line and f"||want|| {float(w.norm()):.3g}" in line
    assert msg.index("layer.bias") < msg.index("layer.weight")
    assert "emb.weight" not in msg and "norm.weight" not in msg


def test_missing_names_shapes_and_non_finite_values_fail():
    want = _weights()
    with pytest.raises(AssertionError, match=r"missing \['norm.weight'\], unexpected \[\]"):
        assert_weights_close({k: v for k, v in want.items() if k != "norm.weight"}, want)
    with pytest.raises(AssertionError, match=r"layer.bias: rel inf .* shapes got \(31,\) want \(32,\)"):
        assert_weights_close({**want, "layer.bias": torch.zeros(31)}, want)
    with pytest.raises(AssertionError, match="norm.weight: rel inf"):
        assert_weights_close({**want, "norm.weight": torch.full((32,), float("nan"))}, want)
    assert_weights_close(want, want, rel=0)  # rel=0: bit-exact


def test_grad_norms_compare_relatively_and_show_both_values():
    want = {1: 1.25, 2: 0.98, 3: 0.75}
    assert_grad_norms_close({1: 1.25 * (1 + 6e-7), 2: 0.98, 3: 0.75 * (1 - 6e-7)}, want)
    with pytest.raises(AssertionError, match=r"at 1 of 3 steps:\n  step 2: 1.96 vs 0.98 \(rel 1.00e\+00\)"):
        assert_grad_norms_close({1: 1.25, 2: 1.96, 3: 0.75}, want)  # a sum where a mean belongs
    with pytest.raises(AssertionError, match="steps with a grad norm differ"):
        assert_grad_norms_close({1: 1.25, 2: 0.98}, want)
