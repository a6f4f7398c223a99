"""Which SDPA kernel the dry run traces for a GPU (tune/fake.py): the order a CUDA build of
torch tries its kernels in, by architecture, torch release and the cuDNN its wheel bundles, and
the kernel that order gives each call (head dimension, dtype, mask)."""

from __future__ import annotations

import pytest
import torch

from flopwise.tune.fake import SDPA_KERNELS, cuda_sdpa_choice, sdpa_order


@pytest.mark.parametrize(("capability", "version", "first"), [
    ((9, 0), "2.13.0+cpu", True),    # H100/H200 on a CUDA 13 wheel (cuDNN 9.19+)
    ((10, 0), "2.11.0", True),       # B200
    ((10, 3), "2.14.1", True),       # B300: any minor of 10 on a CUDA 13 build
    ((9, 0), "2.10.0", False),       # CUDA 12.8 wheel, cuDNN 9.10: below 9.16
    ((9, 0), "2.9.1+cu128", False),
    ((9, 0), "2.8.0", False),        # before PyTorch 2.9 flash came first everywhere
    ((8, 0), "2.13.0", False), ((8, 9), "2.13.0", False), ((12, 0), "2.13.0", False),
])
def test_cudnn_goes_first_only_on_sm90_and_sm100_with_a_new_enough_wheel(capability, version, first):
    cudnn_first, why = sdpa_order(capability, version, {})
    assert cudnn_first is first, why
    assert why.startswith("cuDNN first" if first else "flash first")


def test_the_environment_variable_that_deprioritises_cudnn_is_honoured():
    assert sdpa_order((9, 0), "2.13.0", {"TORCH_CUDNN_SDPA_DEPRIORITIZED": "1"}) == (
        False, "flash first: TORCH_CUDNN_SDPA_DEPRIORITIZED is set")
    assert sdpa_order((9, 0), "2.13.0", {"TORCH_CUDNN_SDPA_DEPRIORITIZED": "0"})[0]


def _q(heads: int, hd: int, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.empty(2, heads, 64, hd, device="meta", dtype=dtype)


@pytest.mark.parametrize(("hd", "heads_kv", "mask", "cudnn_first", "kernel"), [
    (128, 8, False, True, "cudnn"),
    (64, 2, False, True, "cudnn"),     # GQA: cuDNN takes it
    (64, 8, True, True, "cudnn"),      # a mask: cuDNN takes it as a bias
    (256, 8, False, True, "flash"),    # above 128: the wheels' cuDNN does not, flash does
    (128, 8, False, False, "flash"),
    (64, 8, True, False, "efficient"),  # flash takes no mask
    (64, 2, True, False, "math"),      # no mask-and-GQA kernel but math
])
def test_each_call_gets_the_kernel_of_the_order(hd, heads_kv, mask, cudnn_first, kernel):
    q, k = _q(8, hd), _q(heads_kv, hd)
    attn_mask = torch.empty(64, 64, device="meta", dtype=torch.bool) if mask else None
    assert SDPA_KERNELS[cuda_sdpa_choice(q, k, attn_mask, (9, 0), cudnn_first)] == kernel


def test_fp32_never_takes_a_fused_half_precision_kernel():
    q = _q(8, 64, torch.float32)
    assert SDPA_KERNELS[cuda_sdpa_choice(q, q, None, (9, 0), True)] == "efficient"
