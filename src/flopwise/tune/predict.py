"""The dry run's predicted step time: ``plan/steptime.py`` over the traced step's kernels.

:func:`predicted` is what ``preflight --dry-run`` prints and ``--json`` carries as
``prediction``; :func:`render` its lines, each figure marked predicted. Nothing here ran on a GPU.
"""

from __future__ import annotations

from typing import Any

from flopwise.config import RunConfig
from flopwise.measure.sinks import human
from flopwise.plan import accuracy, hardware, steptime
from flopwise.plan.flops import flops_per_token, param_counts
from flopwise.plan.render import network_text

LABELS = {"matmul": "matmul", "attention": "attention", "memory": "memory-bound", "optimizer": "optimizer",
          "launch_host": "launch/host", "exposed_comm": "exposed comm"}


def predicted(result: dict[str, Any], cfg: RunConfig, link: str | None = None,
              network: str | None = None) -> dict[str, Any]:
    """The prediction for a dry run's ``result`` of ``cfg``: step time, tokens/s per GPU and in
    all, MFU and HFU against the GPU's dense peak, the breakdown by kind; or ``predicted: False``
    with why (a GPU missing a constant, fp8, a trace without kernels). ``network`` is the link
    between nodes (None: :data:`hardware.DEFAULT_NETWORK`); a step over several nodes names it
    as ``between_nodes`` (:func:`hardware.network_facts`)."""
    spec_name = result["request"]["gpu"]["spec"]
    kernels = result.get("trace", {}).get("kernels")
    if not kernels:
        return {"predicted": False, "why": "the trace recorded no kernels"}
    r = result["request"]
    try:
        g = steptime.gpu(spec_name, link, network, per_node=r["nproc_per_node"])
        compiled = result.get("compile", "off") != "off"
        mode = cfg.train.compile_mode if compiled else "default"
        cuda_graphs, not_modelled = steptime.compile_mode(mode)
        out = steptime.predict(kernels, g, compiled=compiled, cuda_graphs=cuda_graphs)
    except steptime.Unpredictable as e:
        return {"predicted": False, "why": str(e)}
    peak = hardware.peak_tflops(spec_name, "bf16" if "bf16" in result["precision"] else result["precision"])
    model = flops_per_token(cfg.model, cfg.train.seq_len) * out["tokens_per_s_per_gpu"]
    flops = result["trace"].get("flops") or {}
    hardware_flops = flops.get("total", 0) * flops.get("per_step_scale", 1.0) / out["step_s"]
    out["mfu"] = model / (peak * 1e12) if peak else None
    out["hfu"] = hardware_flops / (peak * 1e12) if peak and hardware_flops else None
    out["link"], out["network"] = g.link_bytes_s / 1e9, g.network_bytes_s / 1e9
    if r.get("nnodes", 1) > 1:  # its collectives cross the network: which one it assumed, and whether by default
        out["between_nodes"] = hardware.network_facts(network)
    out["compiled"] = compiled
    fp8 = any(x.get("dtype") in steptime.FP8_DTYPES for x in kernels["records"] if x["kind"] == "mm")
    derived = [*g.derived, *([g.fp8_derived] if fp8 and g.fp8_derived else [])]
    if derived:  # constants taken from another part or architecture: the prediction says which
        out["derived"] = derived
    if fp8:  # priced at the fp8 rate: which matmuls ran in fp8, and which torchao left in bf16
        mms = [x for x in kernels["records"] if x["kind"] == "mm"]
        out["fp8"] = {"matmuls": sum(x.get("dtype") in steptime.FP8_DTYPES for x in mms), "of": len(mms)}
    b = accuracy.band(g.arch, param_counts(cfg.model)["total"], int(kernels["world"]), int(r.get("nnodes", 1)))
    if b is not None:  # the range the held-out evidence of this regime supports
        out["band"] = {**b, "step_s": [out["step_s"] * b["low"], out["step_s"] * b["high"]]}
    if compiled:  # which mode it priced, and what of it it could not
        out["compile"] = {"how": result["compile"], "mode": mode, "cuda_graphs": cuda_graphs,
                          "not_modelled": not_modelled}
    return out


def render(p: dict[str, Any]) -> list[str]:
    """The prediction's lines for the dry run's report; every figure says it is predicted."""
    if not p.get("predicted"):
        return [f"  predicted  no step time: {p.get('why', 'not predicted')}"]
    mfu = f"{100 * p['mfu']:.1f}%" if p.get("mfu") is not None else "n/a"
    hfu = f"{100 * p['hfu']:.1f}%" if p.get("hfu") is not None else "n/a"
    parts = " · ".join(f"{LABELS[k]} {1e3 * v:.2f} ms" for k, v in p["breakdown"].items() if v > 0)
    nodes = p.get("between_nodes")
    return [f"  predicted  step {1e3 * p['step_s']:.1f} ms · {human(p['tokens_per_s_per_gpu'])} tokens/s per GPU, "
            f"{human(p['tokens_per_s'])} in all · MFU {mfu} · HFU {hfu} (predicted from the traced kernels on "
            f"{p['gpu']}; not measured)",
            f"             predicted breakdown: {parts}",
            *([_band_line(p["band"])] if p.get("band") else []),
            *([f"             derived constants ({p['gpu']}): {'; '.join(p['derived'])}"] if p.get("derived") else []),
            *([f"             predicted with {p['fp8']['matmuls']} of {p['fp8']['of']} matmuls in fp8 (torchao's "
               "scaled matmuls at the fp8 rate; the rest, the LM head's among them, in bf16)"] if p.get("fp8") else []),
            *([_compile_line(p["compile"])] if p.get("compile") else []),
            *([f"             predicted over the {network_text(nodes)}"] if nodes else [])]


def _compile_line(c: dict[str, Any]) -> str:
    """How the prediction took ``train.compile`` and its mode."""
    graphs = ("CUDA graphs: the graphs' kernels launched without host time" if c["cuda_graphs"]
              else "each graph's kernels launched from its generated code")
    rest = f"; {c['not_modelled']}" if c["not_modelled"] else ""
    return f"             predicted as compiled {c['how']}, mode {c['mode']} ({graphs}){rest}"


def _band_line(b: dict[str, Any]) -> str:
    low, high = b["step_s"]
    return f"             likely a step of {1e3 * low:.1f}-{1e3 * high:.1f} ms ({accuracy.band_text(b)})"
