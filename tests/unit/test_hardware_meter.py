"""Hardware peak table and the throughput/MFU meter."""

import pytest

from flopwise.measure.meter import ThroughputMeter, memory_stats
from flopwise.plan import hardware


@pytest.mark.parametrize("device_name, table_name, bf16", [
    ("NVIDIA H100 80GB HBM3", "H100 SXM", 989.4),
    ("NVIDIA H100 PCIe", "H100 PCIe", 756.5),
    ("NVIDIA H100 NVL", "H100 NVL", 835.0),
    ("NVIDIA H200", "H200", 989.4),
    ("NVIDIA A100-SXM4-80GB", "A100 SXM 80GB", 312.0),
    ("NVIDIA A100 80GB PCIe", "A100 PCIe 80GB", 312.0),
    ("NVIDIA A100-SXM4-40GB", "A100 SXM 40GB", 312.0),
    ("NVIDIA A100-PCIE-40GB", "A100 PCIe 40GB", 312.0),
    ("NVIDIA L4", "L4", 121.0),
    ("NVIDIA GeForce RTX 5090", "RTX 5090", 209.5),
    ("NVIDIA H200 NVL", "H200 NVL", 835.0),
    ("NVIDIA GH200 480GB", "GH200", 989.4),
    ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", "RTX PRO 6000 Blackwell Workstation", 503.8),
    ("NVIDIA RTX PRO 6000 Blackwell Max-Q Workstation Edition", "RTX PRO 6000 Blackwell Max-Q", 438.9),
    ("NVIDIA RTX PRO 6000 Blackwell Server Edition", "RTX PRO 6000 Blackwell Server", 503.8),
    ("NVIDIA GeForce RTX 4070", "RTX 4070", 58.3),
    ("NVIDIA GeForce RTX 3060", "RTX 3060 12GB", 25.5),
    ("NVIDIA GB200", "GB200", 2500.0),
    ("NVIDIA GeForce RTX 4090", "RTX 4090", 165.2),
    ("NVIDIA GeForce RTX 3090", "RTX 3090", 71.0),
    ("NVIDIA RTX A6000", "RTX A6000", 154.8),
    ("NVIDIA RTX 6000 Ada Generation", "RTX 6000 Ada", 364.2),
    ("NVIDIA L40S", "L40S", 362.05),
    ("NVIDIA B200", "B200", 2250.0),
])
def test_device_names_map_to_dense_peaks(device_name, table_name, bf16):
    spec = hardware.lookup(device_name)
    assert spec is not None and spec.name == table_name
    assert hardware.peak_tflops(device_name, "bf16") == bf16


@pytest.mark.parametrize("typed, table_name, memory_gb, bf16", [
    # issue 19: "a100-40gb" used to be taken for the 80 GB A100
    ("a100-40gb", "A100 SXM 40GB", 40, 312.0),
    ("a100 40gb", "A100 SXM 40GB", 40, 312.0),
    ("A100 40 GB", "A100 SXM 40GB", 40, 312.0),
    ("a100_sxm4_40GiB", "A100 SXM 40GB", 40, 312.0),
    ("a100 pcie 40gb", "A100 PCIe 40GB", 40, 312.0),
    ("a100", "A100 SXM 80GB", 80, 312.0),
    ("a100-80gb", "A100 SXM 80GB", 80, 312.0),
    ("A100 PCIe 80GB", "A100 PCIe 80GB", 80, 312.0),
    ("h100", "H100 SXM", 80, 989.4),
    ("H100-SXM5", "H100 SXM", 80, 989.4),
    ("h100 pcie", "H100 PCIe", 80, 756.5),
    ("h100-nvl", "H100 NVL", 94, 835.0),
    # issue 51: torchtitan's and torchao's H100s, the 96 GB HBM2e SXM part (run at 500 W)
    ("h100 96gb", "H100 SXM 96GB", 96, 989.4),
    ("H100 SXM 96GB", "H100 SXM 96GB", 96, 989.4),
    ("H100 96GB HBM2e", "H100 SXM 96GB", 96, 989.4),
    ("h200", "H200", 141, 989.4),
    ("l4", "L4", 24, 121.0),
    ("L40S", "L40S", 48, 362.05),
    ("rtx 3090", "RTX 3090", 24, 71.0),
    ("RTX4090", "RTX 4090", 24, 165.2),
    ("geforce rtx 5090", "RTX 5090", 32, 209.5),
])
def test_typed_names_map_to_the_right_card(typed, table_name, memory_gb, bf16):
    spec = hardware.find(typed)
    assert spec is not None and spec.name == table_name, typed
    assert spec.memory_gb == memory_gb and spec.bf16 == bf16


@pytest.mark.parametrize("name", ["a100x", "h100x", "a100 30gb", "l40", "rtx 4080", "h1000", "GH100", "A1000",
                                  "NVIDIA A100-SXM4-40GB MIG 1g.5gb", "NVIDIA GeForce RTX 4090 D", "NVIDIA H800"])
def test_names_not_in_the_table_are_unknown_not_a_similar_card(name):
    # No prefix or substring match: these used to become an A100, H100, L4, ... (or a full
    # GPU's peak for a MIG slice).
    assert hardware.find(name) is None and hardware.lookup(name) is None


def test_unknown_name_message_has_a_did_you_mean_and_the_known_names():
    msg = hardware.unknown_gpu_message("a100x")
    assert "--gpu 'a100x' is not in the hardware table" in msg and "did you mean 'a100'?" in msg
    for spec in hardware.DEVICES:
        assert spec.name in msg
    assert "did you mean 'h100'?" in hardware.unknown_gpu_message("h100x")


def test_every_alias_names_one_entry():
    seen = {}
    for spec in hardware.DEVICES:
        for alias in (spec.name, *spec.aliases):
            assert seen.setdefault(hardware.name_key(alias), spec.name) == spec.name, alias
            assert hardware.find(alias) is spec


def test_table_holds_dense_not_sparse_numbers():
    # The H100 SXM datasheet's 1,979 TFLOP/s bf16 is with 2:4 sparsity; dense is half.
    assert hardware.peak_tflops("NVIDIA H100 80GB HBM3", "bf16") < 1000
    for spec in hardware.DEVICES:
        if spec.bf16 is not None and spec.tf32 is not None:
            assert spec.tf32 <= spec.bf16


def test_unknown_device_and_dtype_give_none():
    assert hardware.lookup("Some Future Accelerator 9000") is None
    assert hardware.peak_tflops("Some Future Accelerator 9000", "bf16") is None
    assert hardware.peak_tflops("Tesla V100-SXM2-32GB", "bf16") is None  # no bf16 on Volta
    assert hardware.find("h100 sxm").name == "H100 SXM"


def test_meter_mfu_is_none_without_a_peak_and_excludes_warmup(monkeypatch):
    clock = iter([0.0, 10.0, 11.0, 13.0])
    monkeypatch.setattr("flopwise.measure.meter.time.perf_counter", lambda: next(clock))
    m = ThroughputMeter(flops_per_token=100.0, peak_flops=None, warmup_steps=2)  # clock 0.0
    for _ in range(2):
        m.step(1000)
    w = m.window()  # 10 s for 2 warm-up steps (slow: compile), excluded from the average
    assert w["tok_per_s"] == pytest.approx(200.0) and w["mfu"] is None
    m.pause()  # clock 11.0
    for _ in range(4):
        m.step(1000)
    w = m.window()  # clock 13.0: 4000 tokens in 2 s
    assert w["tok_per_s"] == pytest.approx(2000.0)
    assert w["step_time_s"] == pytest.approx(0.5)
    s = m.summary()
    assert s["tok_per_s"] == pytest.approx(2000.0) and s["steady_time_s"] == pytest.approx(2.0)


def test_meter_mfu_against_peak():
    m = ThroughputMeter(flops_per_token=6e9, peak_flops=1e15)
    assert m.mfu(50_000) == pytest.approx(0.3)


def test_cpu_memory_reports_rss():
    import torch
    mem = memory_stats(torch.device("cpu"))
    assert mem["mem_rss_gb"] > 0 and mem["mem_rss_peak_gb"] >= mem["mem_rss_gb"] * 0.5


def test_the_96gb_hbm2e_h100_is_its_own_entry_with_its_bandwidth_and_sms():
    """torchtitan's H100s: "96GB HBM2e with 2.4 TB/sec", an SXM part (132 SMs, NVLink), not the
    80 GB HBM3 H100 SXM (3.35 TB/s) nor the 94 GB H100 NVL."""
    spec = hardware.find("h100 96gb")
    assert spec is not None and spec.bandwidth_tbs == 2.4 and hardware.SMS[spec.name] == 132
    assert hardware.CAPABILITY[spec.name] == (9, 0) and hardware.default_link(spec) == "nvlink4"
    assert hardware.find("h100").bandwidth_tbs == 3.35 and hardware.find("h100 94gb").name == "H100 NVL"



def test_the_eta_pace_is_the_steady_average_not_the_last_window(monkeypatch):
    """Issue 54, item 20: the ETA jumped 0m54s -> 6m29s -> 5m22s on a loaded machine, paced by each
    window's own step time. The pace is now the average over the steady windows so far."""
    clock = iter([0.0, 10.0, 11.0, 21.0, 81.0, 91.0])
    monkeypatch.setattr("flopwise.measure.meter.time.perf_counter", lambda: next(clock))
    m = ThroughputMeter(flops_per_token=1.0, peak_flops=None, warmup_steps=2)  # clock 0.0
    paces = []
    for steps in (2, 10, 10, 10):  # the warm-up window, then windows of 1 s, 6 s and 1 s a step
        for _ in range(steps):
            m.step(100)
        w = m.window()
        paces.append((w["step_time_s"], m.pace()))
        if steps == 2:
            m.pause()
    assert [p for _, p in paces] == [None, pytest.approx(1.0), pytest.approx(3.5), pytest.approx(8 / 3)]
    assert [w for w, _ in paces][1:] == [pytest.approx(1.0), pytest.approx(6.0), pytest.approx(1.0)]
