"""benchmarks/predict_vs_public.py's calibration cases, without tracing: every case's config
validates, its model has the source's parameter count, its batch is the source's, and the
measured tokens/s per GPU it holds (or derives) is the reference file's figure. The script's
own logic (no prediction, a prediction, the network flag, the summary) runs on a stand-in
dry run."""

import re
import sys
from pathlib import Path

import pytest

from flopwise.plan import hardware
from flopwise.plan.flops import param_counts

ROOT = Path(__file__).resolve().parents[2]
# The reference's rows of the calibration cases, kept in the repository (a test reads nothing outside it).
REFERENCE = ROOT / "benchmarks" / "reference" / "calibration-rows.md"

# As the reference gives them: GPUs, GPU, seq, micro-batch, accumulation
# (None: not in the reference) and global batch in sequences.
BATCHES = {
    "MF-a": (8, "A100 SXM 80GB", 2048, 32, 2, 512), "MF-b": (8, "A100 SXM 80GB", 2048, 32, 2, 512),
    "MF-c": (8, "A100 SXM 80GB", 2048, 24, 2, 384), "MF-d": (8, "A100 SXM 80GB", 2048, 14, 4, 448),
    "MF-e": (8, "A100 SXM 80GB", 2048, 10, 2, 160), "MF-g": (8, "H100 SXM", 2048, 24, 2, 384),
    "MF-h": (8, "H100 SXM", 2048, 14, 1, 112), "MF-k": (8, "A100 SXM 40GB", 2048, 26, 3, 624),
    "MF-l": (8, "A100 SXM 40GB", 2048, 8, 8, 512),
    "FA-1": (8, "A100 SXM 80GB", 2048, 32, None, 256), "FA-2": (8, "A100 SXM 80GB", 2048, 16, None, 256),
    "FA-3": (8, "A100 SXM 80GB", 2048, 16, None, 256), "FA-4": (8, "A100 SXM 80GB", 2048, 8, None, 512),
    "FA-5": (8, "A100 SXM 80GB", 2048, 4, None, 512),
    "LC-1": (8, "A100 SXM 80GB", 1024, 64, 1, 512), "LC-2": (8, "A100 SXM 80GB", 1024, 64, 1, 512),
    "LC-3": (8, "A100 SXM 80GB", 1024, 32, 2, 512), "LC-4": (8, "H100 SXM", 1024, 16, 8, 1024),
    "TL-1": (16, "A100 SXM 40GB", 2048, 8, None, None), "TT-6": (64, "A100 SXM 80GB", 8192, 1, None, 64),
}
# tokens/s per GPU as the reference states it or derives it: (value, the tolerance its rounding leaves)
MEASURED = {
    "MF-a": (141_737, 0), "MF-b": (58_782, 0), "MF-c": (32_434, 0), "MF-d": (20_513, 0), "MF-e": (10_811, 0),
    "MF-g": (63_147, 0), "MF-h": (45_455, 0), "MF-k": (136_334, 0), "MF-l": (19_271, 0),
    "FA-1": (163_800, 50), "FA-2": (62_900, 50), "FA-3": (30_600, 50), "FA-4": (21_100, 50), "FA-5": (10_600, 50),
    "LC-1": (524_288 / 0.300 / 8, 0.5), "LC-2": (524_288 / 0.820 / 8, 0.5), "LC-3": (524_288 / 1.7 / 8, 0.5),
    "LC-4": (1_048_576 / 2.80 / 8, 0.5), "TL-1": (24_000, 0), "TT-6": (2_904, 0),
}


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(ROOT / "benchmarks"))  # the script imports its sibling _results as a script does
    try:
        import predict_vs_public
        yield predict_vs_public
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
        sys.modules.pop("predict_vs_public", None)


@pytest.fixture(scope="module")
def cases(bench):
    return {c.id: c for c in bench.cases()}


def test_every_calibration_case_is_there_once(cases, bench):
    assert sorted(cases) == sorted(BATCHES)
    assert len(bench.cases()) == len(BATCHES)


def test_every_case_builds_a_valid_config_on_a_known_gpu(cases):
    for cid, c in cases.items():
        cfg = c.config()  # raises ConfigError naming every problem
        gpus, gpu, seq, micro, accum, gbs = BATCHES[cid]
        assert hardware.find(c.gpu).name == gpu, cid
        assert c.gpus == gpus == c.nproc_per_node * c.nnodes, cid
        assert (cfg.train.seq_len, cfg.train.micro_batch_size) == (seq, micro), cid
        assert cfg.model.max_seq_len >= seq, cid
        if accum is not None:
            assert cfg.grad_accum_steps(gpus) == accum, cid
        if gbs is not None:
            assert cfg.train.global_batch_size == gbs, cid
        assert cfg.train.global_batch_size == micro * cfg.grad_accum_steps(gpus) * gpus, cid
        assert c.compile_why and (c.network is None) == (c.nnodes == 1), cid
        if c.network:
            assert hardware.find_link(c.network) is not None and c.network_why, cid


def test_parameter_counts_are_the_sources(cases):
    with_count = [c for c in cases.values() if c.params]
    assert {c.id for c in with_count} == {k for k in BATCHES if k.startswith("MF-")}
    for c in with_count:  # MPT's NumParams includes its learned position table, as param_counts does
        total = param_counts(c.config().model)["total"]
        assert abs(total / c.params - 1) <= 0.02, (c.id, total, c.params)
    # sizes the sources name without a count: TinyLlama 1.1B, Llama 3 8B, GPT-2 124M / 1558M
    for cid, size in (("TL-1", 1.1e9), ("TT-6", 8.03e9), ("LC-1", 124e6), ("LC-4", 1558e6)):
        assert abs(param_counts(cases[cid].config().model)["total"] / size - 1) <= 0.02, cid


def test_measured_tokens_per_s_per_gpu_are_the_references(cases):
    for cid, (value, tol) in MEASURED.items():
        assert abs(cases[cid].measured - value) <= tol, (cid, cases[cid].measured, value)


def _reference_rows() -> dict[str, list[str]]:
    rows = {}
    for line in REFERENCE.read_text().splitlines():
        cells = [x.strip() for x in line.strip().strip("|").split("|")]
        if cells and re.fullmatch(r"(MF|FA|LC|TL|TT)-\w+", cells[0]):
            rows[cells[0]] = cells
    return rows


def _number(text: str) -> float:
    m = re.search(r"([\d,.]+)\s*(k|ms|s)?", text)
    value = float(m.group(1).replace(",", ""))
    return value * {"k": 1000, "ms": 1e-3}.get(m.group(2) or "", 1)


def test_the_tables_above_match_the_reference_file(cases):
    rows = _reference_rows()
    assert sorted(rows) == sorted(cases)
    for cid, cells in rows.items():
        if cid.startswith("LC-"):  # tokens/step and the step time: derived per GPU
            value = _number(cells[-2]) / _number(cells[-1]) / 8
        elif cid.startswith("FA-"):
            value = _number(cells[-1])
        else:
            value = _number(cells[-2])
        tol = 50 if cid.startswith("FA-") else 0.5
        assert abs(cases[cid].measured - value) <= tol, (cid, cases[cid].measured, value)


def test_list_traces_nothing(bench, monkeypatch, capsys):
    monkeypatch.setattr(bench, "dry_run", lambda *a, **k: pytest.fail("--list traced"))
    assert bench.main(["--list", "--case", "mf-a", "TT-6"]) == 0
    out = capsys.readouterr().out
    assert "MF-a" in out and "TT-6" in out and "LC-1" not in out and "differs:" in out


def test_a_prediction_gives_the_ratio_and_the_network_and_the_trace_is_kept(bench, cases, monkeypatch, tmp_path):
    seen, traced = {}, []

    def dry_run(cfg, gpu=None, nproc_per_node=1, nnodes=1, log=print):
        traced.append(gpu)
        seen.update(gpu=gpu, nproc_per_node=nproc_per_node, nnodes=nnodes)
        return {"compile": cfg.train.compile, "loss": "plain", "gpu": gpu}

    def predicted(result, cfg, link=None, network=None):
        seen["network"] = network
        if result["gpu"] != "a100 sxm 40gb":
            return {"predicted": False, "why": "no SM count for this GPU"}
        return {"predicted": True, "step_s": 1.0, "tokens_per_s_per_gpu": 12_000.0, "mfu": 0.5,
                "breakdown": {"matmul": 0.8}}

    monkeypatch.setattr(bench, "dry_run", dry_run)
    monkeypatch.setattr(bench, "predicted", predicted)
    row = bench.predict(cases["TL-1"], tmp_path)
    assert seen == {"gpu": "a100 sxm 40gb", "nproc_per_node": 8, "nnodes": 2, "network": "ib-hdr"}
    assert row["ratio"] == pytest.approx(0.5) and row["breakdown"] == {"matmul": 0.8}
    assert bench.predict(cases["TL-1"], tmp_path)["ratio"] == pytest.approx(0.5)
    assert traced == ["a100 sxm 40gb"] and (tmp_path / "TL-1.json").is_file()  # the second read the kept trace
    line = bench._line({**bench.describe(cases["TL-1"]), **row})
    assert "12,000 (predicted)" in line and "24,000" in line and "predicted step 1.000 s: matmul 0.8" in line
    missing = bench.predict(cases["TT-6"])
    assert missing["predicted"] is None and missing["why"] == "no SM count for this GPU"
    s = bench.summary([{**row, "id": "TL-1"}, {**missing, "id": "TT-6"},
                       {"id": "X", "ratio": 1.1}, {"id": "Y", "ratio": 0.9}])
    assert s["predicted_cases"] == 3 and s["largest_case"] == "TL-1"
    assert s["largest_abs_error"] == pytest.approx(0.5) and s["median_abs_error"] == pytest.approx(0.1)
    assert s["within_25pct"] == 2


def test_the_sources_that_ran_flashattention_v1_are_predicted_at_its_speed(cases):
    """llm-foundry (its Triton port of v1) and flash-attention's README (2022, before v2) ran
    FlashAttention v1; the rest run the kernel flopwise's trace chose or one no figure measured."""
    v1 = {cid for cid, c in cases.items() if c.attention_as == "flash1"}
    assert v1 == {cid for cid in BATCHES if cid.startswith(("MF-", "FA-"))}
    # llm.c's cuDNN attention was never measured apart: its cases keep SDPA's flash kernel, whichever
    # kernel flopwise's torch picks on the GPU (cuDNN on H100 from torch 2.11's wheels)
    assert all(c.attention_as == ("flash" if cid.startswith("LC-") else None)
               for cid, c in cases.items() if cid not in v1)
    for c in cases.values():
        if c.attention_as:
            assert any(c.attention_as in line for line in c.differs), c.id  # said, not silently applied


def _kept_trace(kernel: str = "flash") -> dict:
    """A dry run's result as the benchmark keeps it: one forward and one backward SDPA kernel and a
    matmul, on 8 A100s."""
    def attn(way: str) -> dict:
        return {"kind": "attn", "op": "sdpa", "kernel": kernel, "way": way, "batch": 8, "heads": 16, "kv_heads": 16,
                "q_len": 2048, "k_len": 2048, "head_dim": 64, "causal": True, "dtype": "bfloat16", "flops": 0,
                "reads": [], "writes": [], "phase": "forward" if way == "fwd" else "backward", "micro": 1, "host": 1}
    mm = {"kind": "mm", "op": "mm", "m": 16384, "n": 4096, "k": 1024, "batch": 1, "dtype": "bfloat16", "reads": [],
          "writes": [], "phase": "forward", "micro": 1, "host": 1}
    kernels = {"records": [mm, attn("fwd"), attn("bwd")], "tail_host": 0, "traced_accum": 1, "run_accum": 1,
               "micro_batch": 8, "seq_len": 2048, "world": 8}
    return {"request": {"gpu": {"spec": "A100 SXM 80GB"}, "nproc_per_node": 8, "nnodes": 1}, "precision": "bf16",
            "compile": "off", "loss": "plain", "trace": {"kernels": kernels, "flops": {}}}


def test_the_sources_attention_kernel_slows_the_prediction_by_its_measured_speed(bench, cases, tmp_path):
    import json

    from flopwise.plan import steptime

    (tmp_path / "MF-a.json").write_text(json.dumps(_kept_trace()))
    row = bench.predict(cases["MF-a"], tmp_path)
    assert row["attention_as"] == "flash1" and row["ratio"] < row["ratio_flopwise_attention"]
    a100 = steptime.gpu("a100")
    records = _kept_trace()["trace"]["kernels"]["records"]
    flash = sum(steptime.attention_s(a100, r) for r in records[1:])
    v1 = sum(steptime.attention_s(a100, {**r, "kernel": "flash1"}) for r in records[1:])
    assert v1 / flash == pytest.approx(140 / 77)  # the A100 figure, causal, head dim 64, 2k: v2 140, v1 77
    step_own = 8 * 2048 / (row["ratio_flopwise_attention"] * cases["MF-a"].measured)
    step_v1 = 8 * 2048 / (row["ratio"] * cases["MF-a"].measured)
    assert step_v1 - step_own == pytest.approx(v1 - flash, rel=1e-6)  # the kernels run back to back here
    # as_source leaves the trace it was given as it was, and other kernels as traced
    kept = _kept_trace("efficient")
    assert bench.as_source(kept, "flash1") == kept
    (tmp_path / "TT-6.json").write_text(json.dumps(_kept_trace()))
    same = bench.predict(cases["TT-6"], tmp_path)
    assert same["attention_as"] is None and same["ratio"] == same["ratio_flopwise_attention"]


# NumParams of some held-out llm-foundry rows as the README gives them (the position table grows with seq)
FOUNDRY_PARAMS = {"MF-125m-a100-8k": 130_030_080, "MF-350m-a100-8k": 362_276_864, "MF-760m-h100-4k": 763_616_256,
                  "MF-1b-a100-4k": 1_320_144_896, "MF-1b-h100-1k": 1_313_853_440}


def test_the_held_out_foundry_rows_follow_their_rule_and_the_sources_shapes(bench):
    rows = {c.id: c for c in bench.foundry_rows()}
    assert len(rows) == 18 and not set(rows) & {c.id for c in bench.cases()}
    for cid, c in rows.items():
        cfg = c.config()
        size, gpu, seq = cid.split("-")[1:]
        assert size in ("125m", "350m", "760m", "1b") and cfg.train.seq_len in (1024, 4096, 8192), cid
        assert f"{cfg.train.seq_len // 1024}k" == seq and c.gpus == 8 and c.nnodes == 1, cid
        assert hardware.find(c.gpu).name == {"a100": "A100 SXM 80GB", "h100": "H100 SXM"}[gpu], cid
        assert cfg.train.activation_checkpointing == "none" and c.attention_as == "flash1", cid
        total = param_counts(cfg.model)["total"]
        assert abs(total / c.params - 1) <= 0.02, (cid, total, c.params)
    for cid, count in FOUNDRY_PARAMS.items():
        assert rows[cid].params == count, cid
    assert {c.id for c in bench.holdouts()} >= set(rows)


def test_every_case_names_where_its_gpu_variant_comes_from(bench, cases):
    """Issue 51: each source's GPU variant as it was (A100 80GB / 40GB, H100 SXM / 96 GB HBM2e)."""
    for c in [*cases.values(), *bench.holdouts()]:
        assert c.gpu_why and hardware.find(c.gpu) is not None, c.id
    assert {hardware.find(c.gpu).name for c in cases.values()} == {"A100 SXM 80GB", "A100 SXM 40GB", "H100 SXM"}


# Llama 3 8B on H100 (issue 51), as the sources give them: GPUs, local batch, compiled, tokens/s/GPU
TITAN_H100 = {"TTH-8": (8, 2, False, 5762), "TTH-8c": (8, 2, True, 6667), "TTH-128": (128, 2, False, 5605),
              "TTH-128c": (128, 2, True, 6514), "F-1-bf16": (8, 1, True, 6150)}


def test_the_held_out_8b_h100_rows_follow_their_rule(bench, cases):
    rows = {c.id: c for c in bench.titan_h100_rows()}
    assert sorted(rows) == sorted(TITAN_H100) and not set(rows) & set(cases)
    assert {c.id for c in bench.holdouts()} >= set(rows)
    for cid, (gpus, micro, compiled, measured) in TITAN_H100.items():
        c, cfg = rows[cid], rows[cid].config()
        assert hardware.find(c.gpu).name == "H100 SXM 96GB" and c.gpus == gpus and c.measured == measured, cid
        assert (cfg.train.seq_len, cfg.train.micro_batch_size, cfg.grad_accum_steps(gpus)) == (8192, micro, 1), cid
        assert cfg.train.compile == ("blocks" if compiled else "off") and cfg.train.precision == "bf16", cid
        assert cfg.parallel.strategy == "fsdp2" and cfg.train.activation_checkpointing == "selective", cid
        assert any("per-op" in line for line in c.differs), cid  # the source's AC, said until flopwise has it
        assert (c.network == "400gbit") == (gpus > 8) and c.attention_as == "flash", cid  # torch 2.6/2.7: flash
        assert abs(param_counts(cfg.model)["total"] / 8.03e9 - 1) <= 0.02, cid
    assert hardware.find_link("400gbit").gb_per_s == 50.0  # "400 Gb/s per GPU"


# The cases beyond A100/H100 and fp8 (issue 52): GPUs, GPU, seq, micro-batch, accumulation, fp8 recipe,
# the bf16 twin, and tokens/s per GPU as the reference gives or derives them (None: only a speed-up)
BEYOND = {
    "B-1": (8, "B200", 8192, 1, 1, None, None, 8307.5), "B-2": (8, "B200", 8192, 1, 1, "tensorwise", "B-1", 10417.0),
    "B-3": (8, "B200", 8192, 1, 1, "mxfp8", "B-1", 9969.0),
    "B-6": (8, "B200", 8192, 2, 8, "tensorwise", None, 30624),
    "C-1": (2, "RTX 4090", 1024, 32, 4, None, None, 262_144 / 1.19136 / 2),
    "C-3": (1, "RTX 4090", 1024, 12, 40, None, None, 491_520 / 4.620),
    "F-1": (8, "H100 SXM 96GB", 8192, 1, 1, "tensorwise", "F-1-bf16", 7689.5),
    "F-2": (8, "H100 SXM 96GB", 8192, 1, 1, "rowwise", "F-1-bf16", 6768),
    "F-6-bf16": (8, "H100 SXM", 512, 40, 6, None, None, 27965), "F-6": (8, "H100 SXM", 512, 40, 6, "tensorwise",
                                                                         "F-6-bf16", 36527),
    "F-9-bf16": (8, "H100 SXM", 512, 56, 4, None, None, 52275), "F-9": (8, "H100 SXM", 512, 56, 4, "tensorwise",
                                                                         "F-9-bf16", 70315),
    "F-12-bf16": (128, "H100 SXM", 8192, 1, 1, None, None, None),
    "F-12": (128, "H100 SXM", 8192, 1, 1, "tensorwise", "F-12-bf16", None),
}


def test_the_cases_beyond_a100_h100_are_the_references(bench):
    beyond = {c.id: c for c in bench.beyond()}
    assert sorted(beyond) == sorted(BEYOND)
    for cid, (gpus, gpu, seq, micro, accum, fp8, twin, measured) in BEYOND.items():
        c, cfg = beyond[cid], beyond[cid].config()
        assert hardware.find(c.gpu).name == gpu and c.gpus == gpus == c.nproc_per_node * c.nnodes, cid
        assert (cfg.train.seq_len, cfg.train.micro_batch_size, cfg.grad_accum_steps(gpus)) == (seq, micro, accum), cid
        assert (cfg.train.fp8_recipe if cfg.train.fp8 else None) == fp8 and c.twin == twin, cid
        assert c.measured == (pytest.approx(measured) if measured else None), cid
        assert c.gpu_why and c.compile_why and c.differs, cid
        if twin:  # an fp8 case and its twin differ in fp8 alone
            same = [o for o in c.overrides if not o.startswith("train.fp8")]
            base = next(x for x in [*bench.beyond(), *bench.holdouts()] if x.id == twin)
            assert same == list(base.overrides) and base.gpu == c.gpu, cid
    # power-limited B200s: only their speed-up is held; MXFP8 is traced with its casts as to_mx
    assert {cid for cid, c in beyond.items() if c.ratio_only} == {"B-1", "B-2", "B-3"}
    assert not beyond["B-3"].unsupported and "train.fp8_recipe=mxfp8" in beyond["B-3"].overrides
    assert any(d.startswith("MXFP8: ") for d in beyond["B-3"].differs) and beyond["F-12"].speedup == 1.50
    rows = _beyond_reference_rows()
    assert sorted(rows) == sorted({cid.split("-bf16")[0] for cid in BEYOND})
    for cid in ("B-1", "B-2", "B-3", "B-6"):
        assert float(rows[cid][11].split()[0]) == BEYOND[cid][-1], cid
    for cid in ("F-1", "F-2", "F-6", "F-9"):  # "bf16 -> fp8"
        bf16, fp8 = (float(x.split()[0].replace(",", "")) for x in rows[cid][11].split("→"))
        assert fp8 == BEYOND[cid][-1] and bf16 == (6150 if cid in ("F-1", "F-2") else BEYOND[f"{cid}-bf16"][-1])
    assert "1191.36 ms/step (262,144 tokens)" in rows["C-1"][11] and "~4620 ms/iter (491,520 tokens)" in rows["C-3"][11]


def _beyond_reference_rows() -> dict[str, list[str]]:
    rows = {}
    for line in REFERENCE.read_text().splitlines():
        cells = [x.strip() for x in line.strip().strip("|").split("|")]
        if cells and re.fullmatch(r"[BCF]-\d+", cells[0]):
            rows[cells[0]] = cells
    return rows


def test_an_fp8_case_brings_its_twin_and_the_pair_gives_both_speed_ups(bench):
    known = {c.id.lower(): c for c in [*bench.cases(), *bench.beyond(), *bench.holdouts()]}
    chosen = bench.with_twins([known["f-1"], known["f-2"]], known)
    assert [c.id for c in chosen] == ["F-1-bf16", "F-1", "F-2"]  # the twin once, before its first fp8 case
    rows = [{"id": "F-1-bf16", "measured_tokens_per_s_per_gpu": 6150, "predicted": 7000.0},
            {"id": "F-1", "measured_tokens_per_s_per_gpu": 7689.5, "predicted": 9100.0},
            {"id": "F-2", "measured_tokens_per_s_per_gpu": 6768, "predicted": None, "why": "not traced: x"}]
    one, two = bench.pairs(rows, chosen)
    assert one["measured_speedup"] == pytest.approx(7689.5 / 6150) and one["predicted_speedup"] == pytest.approx(1.3)
    assert one["difference"] == pytest.approx(1.3 - 7689.5 / 6150)
    assert two["predicted_speedup"] is None and two["why"] == "not traced: x"
    assert "+0.050" in bench._pair_line(one) and "(predicted)" in bench._pair_line(one)
    # a source that gives only the speed-up: the pair takes it as measured
    f12 = bench.pairs([{"id": "F-12-bf16", "measured_tokens_per_s_per_gpu": None, "predicted": 300.0},
                       {"id": "F-12", "measured_tokens_per_s_per_gpu": None, "predicted": 420.0}],
                      [known["f-12-bf16"], known["f-12"]])
    assert f12[0]["measured_speedup"] == 1.5 and f12[0]["predicted_speedup"] == pytest.approx(1.4)


def test_an_unsupported_case_is_reported_not_traced_and_ratio_only_cases_stay_out_of_the_median(bench, monkeypatch):
    [b3] = [c for c in bench.beyond() if c.id == "B-3"]
    monkeypatch.setattr(bench, "dry_run", lambda *a, **k: pytest.fail("traced"))
    row = bench.predict(bench._with(b3, unsupported="a kernel flopwise does not run"))
    assert row["predicted"] is None and row["why"] == "not traced: a kernel flopwise does not run"
    s = bench.summary([{"id": "B-1", "ratio": 2.5, "ratio_only": "power limited"}, {"id": "C-3", "ratio": 1.05}])
    assert s["predicted_cases"] == 1 and s["largest_case"] == "C-3"


def test_as_source_swaps_cudnn_kernels_too(bench):
    kept = _kept_trace("cudnn")
    swapped = bench.as_source(kept, "flash")
    kinds = {r["kernel"] for r in swapped["trace"]["kernels"]["records"] if r["kind"] == "attn"}
    assert kinds == {"flash"} and bench.own_kernel({"trace": {"sdpa_kernels": {"cudnn": 8}}}) == "cudnn"


def test_transformer_engines_casts_are_priced_fused_and_nothing_else_is(bench):
    """F-6/F-9 ran TransformerEngine's fp8: each scaled matmul's eager cast chain, back to the
    tensor another op made, is marked as one compiled region; the op that made the input is not."""
    def mem(op, reads, writes):
        return {"kind": "mem", "op": op, "reads": [[v, 8] for v in reads], "writes": [[v, 8] for v in writes],
                "phase": "forward", "micro": 1, "host": 1, "graph": False}
    records = [mem("native_layer_norm", [1], [2]), mem("abs", [2], [3]), mem("max", [3], [4]),
               mem("reciprocal", [4], [5]), mem("_to_copy", [2], [6]), mem("mul", [5, 6], [7]),
               mem("clamp", [7], [8]), mem("_to_copy", [8], [9]),
               {"kind": "mm", "op": "_scaled_mm", "reads": [[9, 8], [5, 8]], "writes": [[10, 8]], "phase": "forward",
                "micro": 1, "host": 1, "graph": False, "m": 8, "n": 8, "k": 8, "batch": 1, "dtype": "float8_e4m3fn"},
               mem("gelu", [10], [11])]
    result = {"trace": {"kernels": {"records": records}}}
    marked = bench.as_fused_casts(result)["trace"]["kernels"]["records"]
    assert [r["graph"] for r in marked] == [False] + [True] * 7 + [False, False]
    assert [r["graph"] for r in records] == [False] * 10  # the trace it was given is left as it was


def test_transformer_engines_casts_are_cast_once_with_their_transpose_and_its_bias_rides_the_gemm(bench):
    """TE casts a tensor once a micro-batch (its fp8 copy and the copy's transpose, one kernel) and
    reuses both in backward, and adds a bias inside its fp8 GEMM: torchao's second cast of the same
    tensor (here in backward) and its separate bias add are dropped, and the kept cast writes one
    more fp8 copy. A cast of the same tensor in another micro-batch is kept."""
    def mem(op, reads, writes, phase="forward", micro=1, size=64):
        return {"kind": "mem", "op": op, "reads": [[v, size] for v in reads], "writes": [[v, size] for v in writes],
                "phase": phase, "micro": micro, "host": 1, "graph": False}

    def scaled(reads, out, phase="forward", micro=1):
        return {"kind": "mm", "op": "_scaled_mm", "reads": [[v, 64] for v in reads], "writes": [[out, 64]],
                "phase": phase, "micro": micro, "host": 1, "graph": False, "m": 8, "n": 8, "k": 8, "batch": 1,
                "dtype": "float8_e4m3fn"}
    records = [mem("native_layer_norm", [1], [2]), mem("abs", [2], [3]), mem("_to_copy", [3], [4]),  # cast x
               scaled([4], 5), {**mem("add", [5], [7]), "reads": [[5, 64], [6, 1]]},  # x @ w, + bias
               mem("abs", [2], [8], "backward"), mem("_to_copy", [8], [9], "backward"),  # x cast again
               scaled([9], 10, "backward"),
               mem("abs", [2], [11], micro=2), mem("_to_copy", [11], [12], micro=2), scaled([12], 13, micro=2)]
    out = bench.as_fused_casts({"trace": {"kernels": {"records": records}}})["trace"]["kernels"]["records"]
    ops = [(r["op"], r["phase"], r["micro"]) for r in out]
    assert ops == [("native_layer_norm", "forward", 1), ("abs", "forward", 1), ("_to_copy", "forward", 1),
                   ("_scaled_mm", "forward", 1), ("_scaled_mm", "backward", 1),
                   ("abs", "forward", 2), ("_to_copy", "forward", 2), ("_scaled_mm", "forward", 2)], ops
    assert len(out[2]["writes"]) == 2 and out[2]["writes"][1][1] == 64  # the transposed fp8 copy
    assert [r["graph"] for r in out] == [False, True, True, False, False, True, True, False]
