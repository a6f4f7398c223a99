"""``python tests/distributed/fp8_emulated.py train ...``: ``flopwise`` with fp8's GEMMs
emulated, for torchrun on this CPU (tests/distributed/test_fp8_parallel.py). Two things are
swapped, and only these: the GPU check (``fp8_problem``: no fp8 tensor cores here) and the
scaled GEMM -- torchao's own emulation (``Float8LinearConfig.emulate``: the fp8 values
multiplied in high precision) for tensorwise and rowwise, and MXFP8's emulated GEMM with the
casts the dry run traces. Everything else -- torchao's float8 linears and weight wrappers,
DDP, ZeRO-1, FSDP2 and its fp8 all-gather, the checkpoints -- is flopwise's and torchao's own."""

from __future__ import annotations

import dataclasses
import sys

import torchao.float8 as float8
import torchao.prototype.moe_training.tensor as wrapper
from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

import flopwise.train.precision as precision
from flopwise.cli import main
from flopwise.tune.fake import mxfp8_linear_torch_casts


def emulated(input_hp, weight_hp, kernel_preference, scale_calculation_mode, wgrad_with_hp=False):
    return mxfp8_linear_torch_casts(input_hp, weight_hp, KernelPreference.EMULATED, scale_calculation_mode,
                                    wgrad_with_hp)


def convert_emulated(module, *, config=None, module_filter_fn=None):
    config = dataclasses.replace(config or float8.Float8LinearConfig(), emulate=True)
    return CONVERT(module, config=config, module_filter_fn=module_filter_fn)


CONVERT = float8.convert_to_float8_training


def patches() -> list[tuple[object, str, object]]:
    """(module, attribute, value): what is swapped. apply_fp8 imports ``convert_to_float8_training``
    from torchao.float8 when it runs, so the swap there is seen."""
    return [(precision, "fp8_problem", lambda device, recipe="tensorwise": None),
            (wrapper, "_to_mxfp8_then_scaled_mm", emulated),
            (float8, "convert_to_float8_training", convert_emulated)]


if __name__ == "__main__":
    for module, name, value in patches():
        setattr(module, name, value)
    raise SystemExit(main(sys.argv[1:]))
