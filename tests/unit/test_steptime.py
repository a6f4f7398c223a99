"""The step-time model (plan/steptime.py) on hand-made kernel lists: each piece able to fail."""

from __future__ import annotations

import pytest

from flopwise.plan import steptime

A100 = steptime.gpu("a100")
H100 = steptime.gpu("h100")


def rec(kind: str, op: str, reads=(), writes=(), phase: str = "forward", micro: int = 1, **detail) -> dict:
    """A kernel record as tune/kernels.py writes it: ``reads``/``writes`` are (value, bytes)."""
    return {"kind": kind, "op": op, "reads": [list(x) for x in reads], "writes": [list(x) for x in writes],
            "phase": phase, "micro": micro, "host": 1, **detail}


def mm(m: int, n: int, k: int, phase: str = "forward", reads=((1, 0),), writes=((2, 0),), micro: int = 1) -> dict:
    return rec("mm", "mm", reads, writes, phase, micro, m=m, n=n, k=k, batch=1, dtype="bfloat16")


def step(records: list[dict], accum: int = 1, compiled: bool = False, g: steptime.Gpu = A100, **meta) -> dict:
    kernels = {"records": records, "tail_host": 0, "traced_accum": accum, "run_accum": meta.pop("run_accum", accum),
               "micro_batch": 1, "seq_len": 1, "world": 1, **meta}
    return steptime.predict(kernels, g, compiled)


# --------------------------------------------------------------------------- matrix multiplies

def test_a_gemm_that_fills_the_sms_beats_one_that_leaves_a_wave_mostly_empty():
    """A100: 108 SMs. 108 output tiles of 128 x 128 are one full wave; 109 need a second wave
    holding one tile: nearly twice the time for 1% more work."""
    full = steptime.matmul_s(A100, 128 * 12, 128 * 9, 8192)  # 12 x 9 = 108 tiles
    over = steptime.matmul_s(A100, 128 * 109, 128, 8192)  # 109 tiles
    assert steptime.tile_efficiency(108, 128 * 12, 128 * 9, 8192) == pytest.approx(1.0)
    assert steptime.tile_efficiency(108, 128 * 109, 128, 8192) == pytest.approx(109 / 216)
    per_flop_full, per_flop_over = full / (128 * 12 * 128 * 9), over / (128 * 109 * 128)
    assert per_flop_over / per_flop_full == pytest.approx(216 / 109, rel=1e-6), (full, over)


def test_a_large_gemm_runs_at_the_measured_matmul_ceiling():
    m = n = k = 128 * 108 * 2  # whole waves, no padding
    seconds = steptime.matmul_s(A100, m, n, k)
    assert 2 * m * n * k / seconds == pytest.approx(312e12 * steptime.GEMM_FRACTION["A100 SXM 80GB"], rel=1e-9)


def test_a_skinny_gemm_is_split_along_k_and_bound_by_its_bytes_when_thin():
    # 768 x 768 outputs = 36 tiles on 132 SMs: split 3 ways along a long K
    assert steptime.tile_efficiency(132, 768, 768, 65536) == pytest.approx(108 / 132)
    # a matrix-vector product moves far more bytes than it computes on
    m, n, k = 65536, 1, 4096
    assert steptime.matmul_s(H100, m, n, k) == pytest.approx((m * k + k * n + m * n) * 2 / H100.hbm)


# --------------------------------------------------------------------------- attention

def attn(causal: bool, way: str = "fwd", kernel: str = "flash", head_dim: int = 128, t: int = 2048) -> dict:
    return rec("attn", "sdpa", kernel=kernel, way=way, batch=8, heads=16, kv_heads=16, q_len=t, k_len=t,
               head_dim=head_dim, causal=causal, dtype="bfloat16", flops=0)


def tflops(g: steptime.Gpu, r: dict) -> float:
    """The speed a kernel record is predicted at, FLOPs counted as the FlashAttention figures count
    them (half when causal, 2.5 x for the backward), in TFLOP/s."""
    f = 4.0 * r["batch"] * r["heads"] * r["q_len"] * r["k_len"] * r["head_dim"] * (0.5 if r["causal"] else 1.0)
    return f * (2.5 if r["way"] == "bwd" else 1.0) / steptime.attention_s(g, r) / 1e12


def test_a_measured_kernel_runs_at_its_figure_speed_forward_and_backward():
    """A100 figure, FlashAttention-2, head dim 128 at 2k: 187 TFLOP/s full, 155 causal; the H100
    figure's causal head-dim-64 FlashAttention v1 at 2k: 136."""
    assert tflops(A100, attn(False)) == pytest.approx(187, rel=1e-9)
    assert tflops(A100, attn(True)) == pytest.approx(155, rel=1e-9)
    assert tflops(A100, attn(True, "bwd")) == pytest.approx(155, rel=1e-9)
    assert tflops(H100, attn(True, kernel="flash1", head_dim=64)) == pytest.approx(136, rel=1e-9)
    # a causal kernel does half the work: at its (lower) measured speed it takes a bit more than half
    full, causal = steptime.attention_s(A100, attn(False)), steptime.attention_s(A100, attn(True))
    assert causal / full == pytest.approx(0.5 * 187 / 155, rel=1e-9)


def test_the_speed_follows_the_sequence_length_between_measured_ones():
    assert tflops(A100, attn(True, t=1024)) == pytest.approx(133, rel=1e-9)
    mid = tflops(A100, attn(True, t=2896))  # ~ 2^11.5: half way between 2k (155) and 4k (173) in log2
    assert mid == pytest.approx(164, abs=0.1)
    assert tflops(A100, attn(True, t=256)) == pytest.approx(99, rel=1e-9)  # below 512: 512's speed
    assert tflops(A100, attn(True, t=65536)) == pytest.approx(189, rel=1e-9)  # above 16k: 16k's
    # head dims up to 64 take the 64 figures, anything above them the 128 ones
    assert tflops(A100, attn(True, head_dim=32)) == pytest.approx(140, rel=1e-9)
    assert tflops(A100, attn(True, head_dim=96)) == pytest.approx(155, rel=1e-9)


def test_attention_kernel_choice_changes_the_time():
    fwd, bwd = steptime.attention_s(A100, attn(True)), steptime.attention_s(A100, attn(True, "bwd"))
    assert bwd == pytest.approx(2.5 * fwd)  # the figures time both together: one speed, 2.5x the FLOPs
    assert steptime.attention_s(A100, attn(True, kernel="efficient")) == pytest.approx(fwd * 155 / 82)
    assert steptime.attention_s(A100, attn(True, kernel="flash1")) == pytest.approx(fwd * 155 / 69)
    # a kernel the figures lack takes its published fraction of the peak: cuDNN forward, head dim 128
    assert tflops(H100, attn(True, kernel="cudnn")) == pytest.approx(0.60 * 989.4, rel=1e-3)
    with pytest.raises(steptime.Unpredictable, match="math"):
        steptime.attention_s(A100, attn(True, kernel="math"))
    with pytest.raises(steptime.Unpredictable, match="flash_triton"):  # a kernel no figure measured
        steptime.attention_s(A100, attn(True, kernel="flash_triton"))


# --------------------------------------------------------------------------- fusion

def chain() -> list[dict]:
    """x (value 1, 64 MB) -> a -> b -> c, each elementwise op reading and writing 64 MB; c is
    read by the matrix multiply after them."""
    mb = 64 << 20
    return [rec("mem", "mul", [(1, mb)], [(2, mb)]), rec("mem", "add", [(2, mb)], [(3, mb)]),
            rec("mem", "silu", [(3, mb)], [(4, mb)]), mm(4096, 4096, 4096, reads=[(4, mb)], writes=[(5, mb)])]


def test_a_fused_region_reads_its_inputs_and_writes_its_outputs_once():
    mb = 64 << 20
    eager = step(chain())["breakdown"]["memory"]
    fused = step(chain(), compiled=True)["breakdown"]["memory"]
    assert eager == pytest.approx(6 * mb / A100.hbm)  # three ops, each a read and a write
    assert fused == pytest.approx(2 * mb / A100.hbm)  # the region: x in, c out
    # a value made in the region and read after it (saved for backward) is written too
    saved = chain() + [rec("mem", "mul", [(2, mb)], [(6, mb)], phase="backward")]
    assert step(saved, compiled=True)["breakdown"]["memory"] == pytest.approx(3 * mb / A100.hbm + 2 * mb / A100.hbm)


def test_ops_the_trace_marks_eager_are_priced_eager_in_a_compiled_step():
    """compile=blocks: the blocks are graphs, the loss after them runs eagerly. Records marked
    ``graph: False`` (the loss) are priced op by op with Python's dispatch cost each, though the
    step is compiled; those marked ``graph: True`` fuse. A record without the mark (an older
    trace) follows the step's compile flag as before."""
    mb = 64 << 20
    blocks = [dict(r, graph=True) if r["kind"] == "mem" else r for r in chain()]
    loss = [dict(r, graph=False) for r in chain()]
    in_graph = step(blocks, compiled=True)
    eager = step(loss, compiled=True)
    assert in_graph["breakdown"]["memory"] == pytest.approx(2 * mb / A100.hbm)
    assert eager["breakdown"]["memory"] == pytest.approx(6 * mb / A100.hbm), eager["breakdown"]
    assert eager["breakdown"]["memory"] == pytest.approx(step(chain(), compiled=False)["breakdown"]["memory"])
    # the host: three eager dispatches against one fused kernel's launch
    host = steptime.HOST_OP_S
    assert sum(k.host_s for k in steptime.kernels_of(loss, A100, compiled=True)) == pytest.approx(
        3 * host + steptime.HOST_GEMM_S)  # three elementwise ops and the matmul, each dispatched eagerly
    # the fused region's one kernel, and the matmul (unmarked: in the graph, as the whole step is compiled)
    assert sum(k.host_s for k in steptime.kernels_of(blocks, A100, compiled=True)) == pytest.approx(
        2 * steptime.HOST_KERNEL_S)
    # a graph region ends where an eager op runs between its ops
    split = [blocks[0], dict(blocks[1], graph=False), blocks[2], blocks[3]]
    assert step(split, compiled=True)["breakdown"]["memory"] == pytest.approx(6 * mb / A100.hbm)


def test_the_optimizer_is_not_fused_into_the_backward():
    mb = 64 << 20
    records = [rec("mem", "mul", [(1, mb)], [(2, mb)], phase="backward"),
               rec("mem", "_fused_adamw_", [(2, mb), (3, mb)], [(3, mb)], phase="step")]
    out = step(records, compiled=True)["breakdown"]
    assert out["optimizer"] == pytest.approx(3 * mb / A100.hbm) and out["memory"] == pytest.approx(2 * mb / A100.hbm)


# --------------------------------------------------------------------------- collectives

def test_a_collective_hidden_behind_backward_costs_nothing_exposed_at_the_end_costs_it_all():
    grad = 400 << 20  # 400 MB of gradients: ~3.4 ms on NVLink 3 at 8 ranks
    comm = steptime.collective_s(A100, "allreduce_", grad, 8)
    work = [mm(8192, 8192, 8192, "backward", reads=[(10 + i, 0)], writes=[(20 + i, 0)]) for i in range(4)]
    compute = sum(steptime.matmul_s(A100, 8192, 8192, 8192) for _ in work)
    assert compute > 2 * comm
    reduce_ = rec("coll", "allreduce_", [(1, grad)], [(2, grad)], phase="backward", bytes=grad, group=8)
    optimizer = rec("mem", "_fused_adamw_", [(2, grad)], [(3, grad)], phase="step")
    made = rec("mem", "copy_", [(0, grad)], [(1, grad)], phase="backward")
    hidden = step([made, reduce_, *work, optimizer])
    exposed = step([*work, made, reduce_, optimizer])
    assert hidden["breakdown"]["exposed_comm"] == pytest.approx(0.0, abs=1e-9)
    assert exposed["breakdown"]["exposed_comm"] == pytest.approx(comm, rel=1e-6)
    # (the exposed order starts with a GEMM, whose dispatch is longer than the copy's that starts the other)
    head_start = steptime.HOST_GEMM_S - steptime.HOST_OP_S
    assert exposed["step_s"] - hidden["step_s"] == pytest.approx(comm + head_start, rel=1e-6)
    assert hidden["comm_s"] == exposed["comm_s"] == pytest.approx(comm)


def test_ring_collectives_scale_with_ranks_and_cross_the_network_between_nodes():
    one_gb = 1 << 30
    reduce8 = steptime.collective_s(A100, "allreduce_", one_gb, 8)
    gather8 = steptime.collective_s(A100, "_allgather_base_", one_gb, 8)
    assert reduce8 - steptime.LATENCY_S["link"] == pytest.approx(2 * (gather8 - steptime.LATENCY_S["link"]))
    # two nodes: the NIC bounds it (a DGX A100's, InfiniBand HDR)
    across = steptime.collective_s(steptime.gpu("a100", network="ib-hdr"), "_allgather_base_", one_gb, 16)
    assert across > 8 * gather8
    assert steptime.collective_s(A100, "allreduce_", one_gb, 1) == 0.0


def test_a_small_group_on_two_nodes_crosses_the_network_and_one_inside_a_node_does_not():
    """DiLoCo's outer sync: rank 0 and rank 8, one per node, 2 ranks, over the network; its worker
    group, ranks 0-7, over NVLink. The group's size alone cannot tell them apart."""
    g = steptime.gpu("a100", network="ib-hdr")
    one_gb = 1 << 30
    across = steptime.collective_s(g, "allreduce_", one_gb, 2, ranks=[0, 8])
    inside = steptime.collective_s(g, "allreduce_", one_gb, 2, ranks=[0, 1])
    bus = g.network_bytes_s * steptime.NETWORK_FRACTION
    assert across == pytest.approx(steptime.LATENCY_S["network"] + 2 * (1 / 2) * one_gb / bus)
    assert inside == steptime.collective_s(g, "allreduce_", one_gb, 2) < across / 5
    node = list(range(8))
    assert steptime.collective_s(g, "allreduce_", one_gb, 8, ranks=node) == steptime.collective_s(g, "allreduce_",
                                                                                                  one_gb, 8)


# --------------------------------------------------------------------------- the host, accumulation, GPUs

def test_tiny_kernels_make_the_host_the_bound():
    records = [rec("mem", "add", [(i, 1024)], [(i + 1, 1024)]) for i in range(1000)]
    out = step(records)
    assert out["step_s"] == pytest.approx(1000 * steptime.HOST_OP_S + steptime.KERNEL_MIN_S, rel=1e-9)
    assert out["breakdown"]["launch_host"] > 0.5 * out["step_s"]


def test_the_first_traced_micro_batch_stands_for_the_runs_extra_ones():
    big = mm(8192, 8192, 8192)
    records = [big, dict(big, micro=2)]
    two, eight = step(records, accum=2), step(records, accum=2, run_accum=8)
    one_mm = steptime.matmul_s(A100, 8192, 8192, 8192)
    assert eight["step_s"] - two["step_s"] == pytest.approx(6 * one_mm, rel=1e-9)


def test_breakdown_adds_up_to_the_step():
    grad = 64 << 20
    records = [*chain(), rec("coll", "allreduce_", [(5, grad)], [(6, grad)], phase="backward", bytes=grad, group=8),
               rec("mem", "_fused_adamw_", [(6, grad)], [(7, grad)], phase="step")]
    for compiled in (False, True):
        out = step(records, compiled=compiled)
        assert sum(out["breakdown"].values()) == pytest.approx(out["step_s"], rel=1e-9), out


def test_a_gpu_missing_a_constant_gets_no_prediction_and_says_which():
    with pytest.raises(steptime.Unpredictable, match="T4 has no dense bf16 peak"):
        steptime.gpu("t4")
    with pytest.raises(steptime.Unpredictable, match="V100 SXM2 32GB has no dense bf16 peak"):
        steptime.gpu("v100")
    # L4 had no measured matmul ceiling; issue 52 measured one (tests/unit/test_gpus_beyond_h100.py)


@pytest.mark.parametrize("name, table_name, sms, rated", [
    ("h100 nvl", "H100 NVL", 132, 835.0), ("h100 pcie", "H100 PCIe", 114, 756.5),
    ("h100 96gb", "H100 SXM 96GB", 132, 886.5),  # its 500 W default limit: between NVL's 835 and SXM's 989.4
])
def test_every_h100_variant_gets_a_step_time_from_its_own_constants(name, table_name, sms, rated):
    """Issue 51: H100 NVL and PCIe said "no step time"; the 96 GB HBM2e H100 was not in the table."""
    from flopwise.plan import hardware

    g = steptime.gpu(name)
    spec = hardware.find(name)
    assert g.name == table_name and g.sms == sms and g.hbm_bytes_s == spec.bandwidth_tbs * 1e12
    m = n = k = 128 * sms * 2  # whole waves, no padding: the sustained share of the rated rate
    assert 2 * m * n * k / steptime.matmul_s(g, m, n, k) == pytest.approx(rated * 1e12 * 0.753, rel=1e-9)


def test_a_power_limited_h100_runs_attention_and_matmuls_below_the_sxm_and_memory_at_its_own_bandwidth():
    """The 96 GB HBM2e H100 at 500 W: its tensor cores (matmul and attention) at 886.5 / 989.4 of the
    700 W H100 SXM's, its elementwise kernels at 2.4 / 3.35 of the SXM's bandwidth."""
    g96 = steptime.gpu("h100 96gb")
    m = n = k = 128 * 132 * 2
    assert steptime.matmul_s(g96, m, n, k) / steptime.matmul_s(H100, m, n, k) == pytest.approx(989.4 / 886.5)
    r = attn(True, t=8192)
    assert steptime.attention_s(g96, r) / steptime.attention_s(H100, r) == pytest.approx(989.4 / 886.5)
    assert steptime.memory_s(g96, 1 << 30) / steptime.memory_s(H100, 1 << 30) == pytest.approx(3.35 / 2.4)


def test_the_dry_runs_prediction_names_the_missing_constant_and_refuses_fp8():
    from flopwise.config import build_config
    from flopwise.tune.predict import predicted, render

    cfg = build_config("tiny")
    result = {"request": {"gpu": {"spec": "T4"}, "nproc_per_node": 1}, "precision": "bf16", "compile": "off",
              "trace": {"kernels": {"records": [mm(128, 128, 128)], "traced_accum": 1, "run_accum": 1,
                                    "micro_batch": 1, "seq_len": 1, "world": 1}}}
    p = predicted(result, cfg)
    assert p == {"predicted": False, "why": "T4 has no dense bf16 peak: no step time is predicted for it"}
    assert render(p) == [f"  predicted  no step time: {p['why']}"]
    ok = predicted({**result, "request": {"gpu": {"spec": "A100 SXM 80GB"}, "nproc_per_node": 1}}, cfg)
    assert ok["predicted"] and all("predicted" in line for line in render(ok))


def test_each_compile_mode_is_priced_as_it_runs_and_named():
    """reduce-overhead and max-autotune replay the compiled graphs as CUDA graphs: a host-bound
    compiled step (many tiny matmuls in the graph) loses its launch time; the default mode keeps
    it. The output names the mode and
    what of it is not modelled. (Every mode once got the default's prediction, unnamed.)"""
    from flopwise.config import build_config
    from flopwise.tune.predict import predicted, render

    tiny = [dict(mm(64, 64, 64, reads=[(i, 0)], writes=[(i + 1, 0)]), graph=True) for i in range(1000)]
    eager = [dict(mm(64, 64, 64, reads=[(2000, 0)], writes=[(2001, 0)]), graph=False)]
    default = step(tiny + eager, compiled=True)
    graphs = steptime.predict({"records": tiny + eager, "tail_host": 0, "traced_accum": 1, "run_accum": 1,
                               "micro_batch": 1, "seq_len": 1, "world": 1}, A100, True, cuda_graphs=True)
    # the default mode: the host launches each of the graph's kernels, slower than the GPU runs them
    assert default["step_s"] == pytest.approx(1000 * steptime.HOST_KERNEL_S + steptime.HOST_GEMM_S
                                              + steptime.KERNEL_MIN_S, rel=1e-6)
    # CUDA graphs: the GPU's own time bounds it; the eager op's dispatch hides behind it
    assert graphs["step_s"] == pytest.approx(1001 * steptime.KERNEL_MIN_S, rel=1e-6)
    assert graphs["breakdown"]["launch_host"] == 0.0 < default["breakdown"]["launch_host"]
    result = {"request": {"gpu": {"spec": "A100 SXM 80GB"}, "nproc_per_node": 1}, "precision": "bf16",
              "compile": "blocks", "trace": {"kernels": {"records": tiny + eager, "traced_accum": 1, "run_accum": 1,
                                                         "micro_batch": 1, "seq_len": 1, "world": 1}}}
    steps, lines = {}, {}
    for mode in ("default", "reduce-overhead", "max-autotune"):
        p = predicted(result, build_config("tiny", overrides=[f"train.compile_mode={mode}"]))
        steps[mode], lines[mode] = p["step_s"], "\n".join(render(p))
        assert f"compiled blocks, mode {mode}" in lines[mode], lines[mode]
    assert steps["reduce-overhead"] == steps["max-autotune"] < steps["default"], steps
    assert "CUDA graphs" in lines["reduce-overhead"] and "CUDA graphs" not in lines["default"]
    assert "autotuning is not modelled" in lines["max-autotune"], lines["max-autotune"]


def test_small_gemms_cost_what_h100_measures_on_top_of_a_near_empty_call():
    """Issue 51 (Muon): are 768-wide GEMMs priced near peak? pytorch/pytorch PR 184886 times cuBLAS
    bf16 C = A @ A.T on an H100 one call at a time (CUDA events, median of 200): 18.7 us at 128 x 128,
    19.6 at 1024 x 1024, 37.2 at 2048 x 2048, 230.8 at 4096 x 4096, 425.4 at 4096 x 8192 (M x K).
    Each call is mostly its dispatch (the GPU waits for the host); less the 128 x 128 call (dispatch
    and a near-empty kernel), what the kernel itself adds is 0.9, 18.5, 212.1 and 406.7 us. The tile
    model's kernels add the same, within 20%: the GPU side of small GEMMs is not what is fast."""
    measured = {(1024, 1024): 19.6, (2048, 2048): 37.2, (4096, 4096): 230.8, (4096, 8192): 425.4}
    near_empty = steptime.matmul_s(H100, 128, 128, 128)
    for (m, k), call_us in measured.items():
        added = (steptime.matmul_s(H100, m, m, k) - near_empty) * 1e6
        if m * m * k <= 1024**3:  # latency-bound: the kernel adds under a microsecond either way
            assert added < 1.0, (m, k, added)
        else:
            assert added == pytest.approx(call_us - 18.7, rel=0.2), (m, k, added)
    # 768-wide Newton-Schulz GEMMs are shape-bound: 36 output tiles on 132 SMs at K = 768
    assert steptime.tile_efficiency(H100.sms, 768, 768, 768) == pytest.approx(36 / 132)


def test_eager_newton_schulz_is_bound_by_the_hosts_gemm_dispatch():
    """Muon's Newton-Schulz on one 768 x 768 and one 768 x 3072 matrix, eager: 5 steps of 3
    dependent GEMMs each (A = X Xt, B = b A + c A A, X = a X + B X). Each GEMM's kernel takes a few
    microseconds; the host issues an eager torch.mm at 9.9-12.6 us a call (back-to-back calls
    measured on H100 SXM, H100 PCIe and H800 PCIe), so the chain costs that per GEMM. Priced at
    the 6 us of an elementwise op's dispatch, the optimizer was predicted 2.5 x faster than a
    public record measured (issue 51). Compiled (in a graph) the launches cost 3 us each."""
    records, v = [], 0
    for m, k in ((768, 768), (768, 3072)):
        for _ in range(5):
            for shape in ((m, m, k), (m, m, m), (m, k, m)):
                records.append(rec("mm", "mm", [(v, 0)], [(v + 1, 0)], phase="step", m=shape[0], n=shape[1],
                                   k=shape[2], batch=1, dtype="bfloat16"))
                v += 1
    per_gemm = step(records, g=H100)["step_s"] / len(records)
    assert 9.9e-6 <= per_gemm <= 12.6e-6, per_gemm
    graphed = [dict(r, phase="backward", graph=True) for r in records]
    assert step(graphed, compiled=True, g=H100)["step_s"] / len(records) < 6e-6


def test_on_a_nic_the_node_shares_a_collective_of_one_rank_a_node_gets_an_eighth_of_it():
    """HSDP's shard all-reduce (one rank on each node, all 8 of a node at once) through 25 Gbit/s
    Ethernet shared by the node gets 1/8 of the NIC; one ring over all 16 GPUs of two nodes crosses
    it once each way and gets all of it -- as on a NIC per GPU of the same rate, where both do."""
    one_gb = 1 << 30
    shared = steptime.gpu("h100", network="25gbit")
    own = steptime.gpu("h100", network="25gbit")
    own = steptime.Gpu(**{**own.__dict__, "network_shared": False})
    assert shared.network_shared and not own.network_shared
    column = [0, 8]  # one rank on each of two nodes
    wire = steptime.LATENCY_S["network"]
    assert steptime.collective_s(shared, "allreduce_", one_gb, 2, column) - wire == pytest.approx(
        8 * (steptime.collective_s(own, "allreduce_", one_gb, 2, column) - wire))
    everyone = list(range(16))
    assert steptime.collective_s(shared, "allreduce_", one_gb, 16, everyone) == pytest.approx(
        steptime.collective_s(own, "allreduce_", one_gb, 16, everyone))
    assert steptime.collective_s(shared, "allreduce_", one_gb, 16) == pytest.approx(
        steptime.collective_s(own, "allreduce_", one_gb, 16))  # no ranks: a ring over the nodes' GPUs
