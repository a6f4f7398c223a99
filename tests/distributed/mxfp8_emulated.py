"""``python tests/distributed/mxfp8_emulated.py train ...``: ``flopwise`` with MXFP8's GEMM
emulated, for torchrun on this CPU (tests/distributed/test_mxfp8_parallel.py). Two things are
swapped, and only these: the GPU check (``fp8_problem``: no sm100 here) and the block-scaled
GEMM, torchao's emulated one (the dequantized values multiplied) with the casts the dry run
traces. Everything else -- the weight wrappers, DDP, FSDP2, the checkpoints -- is flopwise's
and torchao's own."""

from __future__ import annotations

import sys

import torchao.prototype.moe_training.tensor as wrapper
from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

import flopwise.train.precision as precision
from flopwise.cli import main
from flopwise.tune.fake import mxfp8_linear_torch_casts


def emulated(input_hp, weight_hp, kernel_preference, scale_calculation_mode, wgrad_with_hp=False):
    return mxfp8_linear_torch_casts(input_hp, weight_hp, KernelPreference.EMULATED, scale_calculation_mode,
                                    wgrad_with_hp)


def install() -> None:
    precision.fp8_problem = lambda device, recipe="tensorwise": None
    wrapper._to_mxfp8_then_scaled_mm = emulated


if __name__ == "__main__":
    install()
    raise SystemExit(main(sys.argv[1:]))
