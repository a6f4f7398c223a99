"""Device, precision and MFU-peak decisions, checked on CPU by standing in for CUDA queries."""

import pytest
import torch

from flopwise.config import ConfigError
from flopwise.parallel.distributed import resolve_device
from flopwise.train import defaults as train_device
from flopwise.train.precision import autocast_factory
from flopwise.train.precision import resolve as resolve_precision


def _names(name: str, device: torch.device) -> tuple[str, torch.dtype | None]:
    p = resolve_precision(name, device)
    return p.name, p.autocast_dtype


def test_auto_precision_is_float32_on_cpu():
    assert _names("auto", torch.device("cpu")) == ("float32", None)
    assert _names("bf16", torch.device("cpu")) == ("bf16", torch.bfloat16)


@pytest.mark.parametrize("bf16_ok, expected", [(True, ("bf16", torch.bfloat16)), (False, ("fp16", torch.float16))])
def test_auto_precision_on_cuda_follows_bf16_support(monkeypatch, bf16_ok, expected):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16_ok)
    assert _names("auto", torch.device("cuda")) == expected


def test_cuda_requested_without_cuda_is_a_config_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="CUDA is not available"):
        resolve_device("cuda")
    assert resolve_device("auto").type == "cpu"


def test_peak_comes_from_table_user_or_nowhere(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    peak, note = train_device.device_peak(torch.device("cuda"), "bf16", 0.0)
    assert peak == pytest.approx(989.4e12) and "H100 SXM" in note
    monkeypatch.setattr(train_device, "tf32_matmuls_allowed", lambda: False)
    peak, note = train_device.device_peak(torch.device("cuda"), "float32", 0.0)
    assert peak == pytest.approx(66.9e12) and "fp32" in note
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Mystery GPU")
    peak, note = train_device.device_peak(torch.device("cuda"), "bf16", 0.0)
    assert peak is None and "not in the hardware table" in note
    peak, _ = train_device.device_peak(torch.device("cuda"), "bf16", 123.0)  # the user's number wins
    assert peak == pytest.approx(123e12)
    peak, note = train_device.device_peak(torch.device("cpu"), "float32", 0.0)
    assert peak is None and "train.peak_tflops" in note


def test_autocast_factory_on_cpu_bf16_really_casts():
    ctx = autocast_factory(torch.device("cpu"), torch.bfloat16)
    with ctx():
        out = torch.nn.functional.linear(torch.randn(2, 4), torch.randn(3, 4))
    assert out.dtype == torch.bfloat16
    with autocast_factory(torch.device("cpu"), None)():
        assert torch.nn.functional.linear(torch.randn(2, 4), torch.randn(3, 4)).dtype == torch.float32


@pytest.mark.parametrize("native", [None, "AMX"])
def test_auto_stays_float32_on_a_cpu_with_native_bf16_and_the_run_says_bf16_is_there(
        monkeypatch, tiny_overrides, native):
    """Measured on an AMX CPU (docs/training.md): bf16 autocast trained the README's 1.8M-parameter
    demo no faster and to a worse validation loss (4.55 against 4.50), a 12.6M-parameter model
    1.5x faster. auto keeps float32; the start-up summary points at bf16 where the CPU has it."""
    from flopwise.config import build_config
    from flopwise.train.trainer import train

    monkeypatch.setattr("flopwise.train.describe.cpu_native_bf16", lambda: native)
    lines: list[str] = []
    train(build_config(overrides=tiny_overrides + ["train.max_steps=1", "eval.every=0"]), log=lines.append)
    assert any("· precision float32 ·" in line for line in lines)
    hint = [line for line in lines if "multiplies bf16 natively" in line]
    assert (hint and "(AMX)" in hint[0] and "train.precision=bf16" in hint[0]) if native else not hint, hint
