"""Issue 52, item 1: a predicted step for every tensor-core GPU of ``plan --list-gpus``, or one
line naming the constant that is missing; every constant taken from another part says so."""

from __future__ import annotations

import pytest
from helpers import matmul_result

from flopwise.config import build_config
from flopwise.plan import hardware, steptime
from flopwise.tune.predict import predicted, render

ISSUE_GPUS = ("B200", "GB200", "RTX PRO 6000 Blackwell Workstation", "RTX PRO 6000 Blackwell Max-Q",
              "RTX PRO 6000 Blackwell Server", "RTX 5090", "RTX 4090", "RTX 3090", "RTX 6000 Ada", "RTX A6000",
              "L40S", "L4", "A10", "A10G", "RTX 4070", "RTX 3060 12GB")


@pytest.mark.parametrize("spec", hardware.DEVICES, ids=lambda s: s.name)
def test_every_gpu_with_a_bf16_tensor_rate_is_predicted_or_names_what_is_missing(spec):
    if spec.bf16 is None:  # V100, T4: fp16 tensor cores only
        with pytest.raises(steptime.Unpredictable, match=f"{spec.name} has no dense bf16 peak"):
            steptime.gpu(spec.name)
        return
    g = steptime.gpu(spec.name)
    assert g.gemm_fraction > 0 and g.sms > 0 and g.hbm > 0 and g.arch in steptime.ATTENTION_TFLOPS, g


def test_the_issues_gpus_are_all_in_the_table():
    assert all(hardware.find(name) is not None for name in ISSUE_GPUS)
    pro = {hardware.find(n).name for n in ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition",
                                          "NVIDIA RTX PRO 6000 Blackwell Max-Q Workstation Edition",
                                          "NVIDIA RTX PRO 6000 Blackwell Server Edition")}
    assert len(pro) == 3, pro  # "workstation" and "server" are no longer noise words


def test_geforce_bf16_is_the_fp32_accumulate_rate_and_pro_parts_are_not_halved():
    assert hardware.find("rtx 4090").bf16 == 165.2 and hardware.find("rtx 4090").fp8 == 330.3
    assert hardware.find("rtx 5090").bf16 == 209.5 and hardware.find("rtx 3090").bf16 == 71.0
    assert hardware.find("l40s").bf16 == 362.05 and hardware.find("rtx pro 6000").bf16 == 503.8


def test_a_prediction_that_uses_a_derived_constant_says_derived():
    cfg = build_config("tiny")
    p = predicted(matmul_result("RTX 4070"), cfg)
    assert p["predicted"] and p["derived"], p
    text = "\n".join(render(p))
    assert "derived constants (RTX 4070): dense bf16 peak 58.3" in text and "the RTX 4090's share" in text, text
    measured = predicted(matmul_result("H100 SXM"), cfg)  # every constant measured on the part itself
    assert measured["predicted"] and "derived" not in measured and "derived" not in "\n".join(render(measured))


def test_the_matmul_rate_follows_the_measured_square_gemm_sweeps():
    """The sustained share: each part's measured burst rate over its peak, times the H200's
    MSMF / MAMF (745 / 846.5), as GH200's is carried."""
    msmf = 745 / 846.5
    for name, burst, peak in (("RTX 4090", 169.5, 165.2), ("L40S", 269.15, 362.05), ("L4", 70.89, 121.0),
                              ("RTX A6000", 123.34, 154.8), ("B200", 1745.0, 2250.0)):
        assert steptime.GEMM_FRACTION[name] == pytest.approx(burst / peak * msmf, abs=0.002), name
