"""The plan as a readable table: each number next to the inputs of its formula."""

from __future__ import annotations

from typing import Any

from flopwise.plan import hardware


def _n(x: float | None, unit: str = "", digits: int = 3) -> str:
    if x is None:
        return "n/a"
    for threshold, suffix in ((1e24, "Y"), (1e21, "Z"), (1e18, "E"), (1e15, "P"), (1e12, "T"), (1e9, "G"),
                              (1e6, "M"), (1e3, "K")):
        if abs(x) >= threshold:
            return f"{x / threshold:.{digits}g} {suffix}{unit}"
    return f"{x:.{digits}g} {unit}".rstrip()


def _count(x: float | None) -> str:
    """Parameters and tokens: 361.8M, 7.2B."""
    if x is None:
        return "n/a"
    for threshold, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(x) >= threshold:
            return f"{x / threshold:.4g}{suffix}"
    return f"{x:.0f}"


def _hours(h: float | None) -> str:
    if h is None:
        return "n/a"
    if h < 1:
        return f"{h * 60:.1f} min"
    if h < 48:
        return f"{h:.1f} h"
    return f"{h:.0f} h ({h / 24:.1f} days)"


def _gb(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f} GiB"


def format_plan(plan: dict[str, Any]) -> str:
    out: list[str] = []

    def section(title: str) -> None:
        out.append("")
        out.append(title)

    def row(label: str, value: str, how: str = "") -> None:
        out.append(f"  {label:<26} {value:<18} {how}".rstrip())

    out.append(f"flopwise plan · {plan['model']}")
    out.extend(_fit_banner(plan))

    section("Parameters")
    b = plan["params_breakdown"]
    total = plan["params"]
    if b:
        def share(k: str) -> str:
            return f"{100 * b[k] / total:.1f}% of total"
        row("embedding", _count(b["embedding"]), share("embedding"))
        if b.get("position"):
            row("positions (learned)", _count(b["position"]), share("position"))
        row("attention", _count(b["attention"]), share("attention"))
        mlp_how = share("mlp")
        if b["router"]:
            mlp_how += f"; active per token {_count(b['mlp_active'])} (router {_count(b['router'])})"
        row("MLP" + (" (all experts)" if b["router"] else ""), _count(b["mlp"]), mlp_how)
        row("norms", _count(b["norm"]), share("norm"))
        row("LM head", _count(b["lm_head"]) if b["lm_head"] else "tied", share("lm_head") if b["lm_head"] else
            "shares the embedding matrix")
        row("total", f"{total:,}", f"active {b['active']:,}" if b["active"] != total else "")
        row("N_matmul", _count(b["matmul"]), "weights in matmuls, head once (lookups, norms and biases excluded)")
    else:
        row("total", f"{total:,}", "given with --params")

    section("FLOPs")
    T = plan["seq_len"]
    if plan["flops_per_token_palm"] is not None:
        row("per token (PaLM)", _n(plan["flops_per_token_palm"]), f"6·N_matmul + 12·L·d_attn·T at T={T}")
    row("per token (6N)", _n(plan["flops_per_token_6n"]), "6 × parameters" + (" (active)" if b and b["router"] else ""))
    if plan.get("flops_per_token_hardware"):
        row("per token (hardware)", _n(plan["flops_per_token_hardware"]),
            f"+ recomputed forward of {100 * plan['recomputed_fraction']:.0f}% of the blocks (HFU's numerator)")
    row("formula used", plan["flops_formula"], "")
    if plan["tokens"] is not None:
        row("tokens", _count(plan["tokens"]), "")
        row("total", _n(plan["total_flops"], "FLOP"), "FLOPs/token × tokens")

    section("Time and cost")
    g = plan["gpu"]
    peak = g["peak_tflops"]
    row("GPU", f"{g['name'] or 'unspecified'} × {plan['gpus']}",
        f"dense {g['dtype']} peak {peak:g} TFLOP/s ({g['peak_source']})" if peak
        else "no peak: give --gpu or --peak-tflops")
    if g.get("memory_gb"):
        row("GPU memory", f"{g['memory_gb']:g} GiB", f"per GPU ({g.get('memory_source') or 'hardware table'})")
    not_runnable = "  NOT runnable: does not fit in memory (see the top)" if plan.get("runnable") is False else ""
    row("MFU", f"{100 * plan['mfu']:.1f}%", "assumed model FLOPs utilisation")
    if plan["effective_flops"]:
        row("effective", _n(plan["effective_flops"], "FLOP/s"), f"{peak:g}T × {plan['gpus']} GPUs × {plan['mfu']:g}")
    if plan["hours"] is not None:
        row("wall time", _hours(plan["hours"]), "total FLOPs ÷ effective FLOP/s" + not_runnable)
        row("GPU-hours", f"{plan['gpu_hours']:,.1f}", f"{_hours(plan['hours'])} × {plan['gpus']}")
        if plan["cost"] is not None:
            row("cost", f"${plan['cost']:,.2f}",
                f"GPU-hours × ${plan['price_per_gpu_hour']:g}/GPU-hour" + not_runnable)
        sc = plan["scaling"]
        if plan["gpus"] > 1 and sc["hours_with_comm"]:
            row("with communication", _hours(sc["hours_with_comm"]),
                f"÷ scaling efficiency {100 * sc['at_gpus']['efficiency']:.1f}% (see Scaling)" + not_runnable)
    elif plan["tokens"] is None:
        out.append("  (no --tokens, --hours or --chinchilla: no time estimate)")

    section("Chinchilla")
    row("optimal tokens", _count(plan["chinchilla_tokens"]),
        "20 × parameters" + (" (active)" if b and b["router"] else ""))
    if plan["tokens"] is not None:
        row("planned", f"{_count(plan['tokens'])} ({plan['tokens_per_param']:.1f}/param)",
            f"{plan['chinchilla_ratio']:.2f}× Chinchilla")
        out.append(f"  verdict: {plan['verdict']}")

    section("Memory per GPU")
    mem = plan["memory"]
    s = mem["settings"]
    batch = plan["batch"]
    ckpt = s["activation_checkpointing"]
    if ckpt == "selective":
        k = s["activation_checkpointing_every"]
        ckpt += f" (blocks 0, {k}, {2 * k}, ...)"
    how = {"bf16-pure": " (fp32 master weights)" if s["master_weights"] else " (no master weights)",
           "bf16": " (autocast, fp32 weights)", "fp16": " (autocast, fp32 weights)"}.get(s["precision"], "")
    strategy_how = s["strategy"]
    if s["strategy"] == "diloco":
        strategy_how += f" ({s['inner_strategy']} in groups of {s['group_size']})"
    out.append(f"  settings: precision {s['precision']}{how}"
               + f" · attention {s['attention']} · checkpointing {ckpt} · loss {s['loss']}"
               + f" · {strategy_how} on {s['n_gpus']} GPU(s)")
    row("parameters", _gb(mem["params"]), "")
    row("gradients", _gb(mem["grads"]), "")
    row("optimizer (AdamW)", _gb(mem["optimizer"]), "exp_avg + exp_avg_sq, fp32")
    if mem.get("master"):
        row("master weights", _gb(mem["master"]), "fp32 copy")
    if mem.get("outer"):
        row("DiLoCo outer state", _gb(mem["outer"]),
            "anchor + outer momentum (fp32), and a sync's pseudo-gradient beyond the step's freed activations"
            + (f", sharded over {s['group_size']}" if s["inner_strategy"] == "fsdp2" else ""))
    if mem.get("activations") is not None:
        row("activations", _gb(mem["activations"]), f"saved for backward, micro-batch {batch['micro_batch']} × seq {T}")
        row("logits + loss", _gb(mem.get("logits")),
            "LM-head output and float32 log-softmax" if s["loss"] == "plain" else
            "chunked: head-input and head-weight gradients computed in forward")
    else:
        row("activations", "NOT counted", "--params gives no model shape: activations, logits and FSDP buffers "
            "are left out (give --model or --config to count them)")
    for key, label, how in (("weight_copies", "autocast weight copies", "2-byte copies of the matmul weights"),
                            ("transient", "backward transients", "peak temporaries of the loss/attention backward"),
                            ("fsdp_buffers", "FSDP gather buffers", "unsharded params/grads in flight"),
                            ("buffers", "buffers", "RoPE tables"),
                            ("overhead", "overhead", "CUDA context etc. (--headroom covers it by default)")):
        if mem.get(key) and mem[key] >= 0.005:  # hide terms that round to 0.00 GiB
            row(label, _gb(mem[key]), how)
    mem_gb = g["memory_gb"]
    verdict = ""
    if plan["fits"] is not None:
        verdict = (f"fits under {100 * plan['headroom']:.0f}% of {mem_gb:g} GiB" if plan["fits"]
                   else f"does NOT fit under {100 * plan['headroom']:.0f}% of {mem_gb:g} GiB")
    if mem.get("activations") is None:
        verdict = "states only, activations NOT counted" + (f"; {verdict} before activations" if verdict else "")
    row("total", _gb(plan["memory_gb"]), verdict)
    if plan["max_micro_batch"] is not None:
        row("largest micro-batch", str(plan["max_micro_batch"]), f"at seq {T} under the headroom")
    if plan["memory_variants"]:
        for label, v in plan["memory_variants"].items():
            mm = v["max_micro_batch"]
            row(f"  with {label}", _gb(v["total_gb"]), f"largest micro-batch {mm}" if mm is not None else "")

    section("Batch")
    row("micro-batch", str(batch["micro_batch"]), batch["micro_batch_source"])
    row("accumulation", str(batch["grad_accum"]), "")
    row("global batch", f"{batch['global_batch']} seq", f"micro × accumulation × {plan['gpus']} GPU(s)")
    row("tokens per step", f"{batch['tokens_per_step']:,}", f"target {batch['target_tokens_per_step']:,}")
    if "steps" in batch:
        row("optimizer steps", f"{batch['steps']:,}", "")

    strategy = plan["scaling"]["strategy"]
    section(f"Scaling ({'ddp' if strategy == 'single' else strategy} at n GPUs, same global batch; "
            f"{plan['scaling']['assumption']})" + (" -- NOT runnable: does not fit" if not_runnable else ""))
    out.append(f"  {'GPUs':>5} {'link':<9} {'comm/step':>10} {'compute/step':>13} {'comm share':>11} "
               f"{'efficiency':>11}")
    for r in plan["scaling"]["table"]:
        comp = "n/a" if r["compute_s"] is None else f"{1000 * r['compute_s']:.1f} ms"
        comm = "n/a" if r["comm_share"] is None else f"{100 * r['comm_share']:.1f}%"
        eff = "n/a" if r["efficiency"] is None else f"{100 * r['efficiency']:.1f}%"
        out.append(f"  {r['gpus']:>5} {r['link']:<9} {1000 * r['comm_s']:>7.1f} ms {comp:>13} {comm:>11} {eff:>11}")
    at = plan["scaling"]["at_gpus"]
    if strategy == "diloco":
        out.append(f"  diloco: {at['inner_strategy']} inside groups of up to {at['group_size']} GPUs every step, the "
                   f"outer all-reduce across groups once every {at['inner_steps']} steps (see DiLoCo below)")
    elif strategy == "fsdp2":
        out.append("  fsdp2: all-gather the parameters for forward and backward on every micro-batch, reduce-scatter "
                   "fp32 gradients once per step: (n-1)/n × params × (2 × gather bytes × micro-batches + 4) "
                   "÷ link GB/s")
    else:
        out.append(f"  all-reduce: 2(n-1)/n × {_n(at['grad_bytes'], 'B')} gradients ÷ link GB/s, once per optimizer "
                   "step"
                   + ("; zero1 adds (n-1)/n × the parameters, broadcast after each rank's update"
                      if strategy == "zero1" else ""))
    if plan.get("diloco"):
        out.extend(_diloco_section(plan["diloco"], plan["mfu"]))
    return "\n".join(out)


def _ms(seconds: float) -> str:
    return f"{1000 * seconds:.1f} ms"


def _pct(share: float | None, digits: int = 1) -> str:
    return "n/a" if share is None else f"{100 * share:.{digits}f}%"


def _diloco_section(d: dict[str, Any], mfu: float) -> list[str]:
    """DiLoCo's communication against ddp's and fsdp2's at the same GPUs, and the smallest H."""
    S, G, H = d["group_size"], d["groups"], d["inner_steps"]
    ar, ag, inner = d["outer_allreduce"], d["outer_allgather"], d["inner"]
    pg = _n(d["pseudo_gradient_bytes"], "B")
    out = ["", f"DiLoCo: {G} group{'s' if G > 1 else ''} of {S} GPUs ({d['inner_strategy']} inside a group), the "
               f"pseudo-gradient all-reduced across groups every H = {H} inner steps; not overlapped with compute"]

    def row(label: str, value: str, how: str = "") -> None:
        out.append(f"  {label:<26} {value:<18} {how}".rstrip())

    row("pseudo-gradient", pg, f"{_count(d['pseudo_gradient_bytes'] / d['outer_bytes_per_param'])} parameters "
        f"× {d['outer_bytes_per_param']} B ({d['outer_dtype']})")
    if G > 1:
        row("outer all-reduce", _ms(ar["s"]),
            f"2(G-1)/G × {pg} ÷ {ar['link_gb_per_s']:g} GB/s ({ar['link']}), G = {G}; once per H steps")
        row("in-group all-gather", _ms(ag["s"]),
            f"(S-1)/S × {pg} ÷ {ag['link_gb_per_s']:g} GB/s ({ag['link']}), S = {S}; once per H steps")
    else:
        row("outer all-reduce", _ms(0.0), "one group: nothing to reduce across groups")
    row("in-group per step", _ms(inner["comm_s"]), f"{d['inner_strategy']} over {S} GPUs ({inner['link']}), "
        "every step")
    compute = d["compute_s"]
    row("compute per step", "n/a" if compute is None else _ms(compute), f"at {100 * mfu:.1f}% MFU")
    out.append(f"  {'communication per step':<26} {'comm/step':>10} {'share':>7}")
    what = {"ddp": "gradient all-reduce", "fsdp2": "all-gathers and reduce-scatter"}
    for name, r in d["compare"].items():
        out.append(f"    {name + ', ' + str(r['gpus']) + ' GPUs':<24} {_ms(r['comm_s']):>10} {_pct(r['comm_share']):>7}"
                   f"  {what[name]} over {r['link']}, every step")
    out.append(f"    {'diloco, H = ' + str(H):<24} {_ms(d['comm_s']):>10} {_pct(d['comm_share']):>7}  "
               f"{_ms(inner['comm_s'])} in-group + {_ms(d['outer_s'])} outer ÷ {H}")
    target = f"{100 * d['target_comm_share']:g}%"
    h = d["min_inner_steps"]
    if h is not None:
        at, below = d["at_min_inner_steps"], d["below_min_inner_steps"]
        digits = 2  # enough to tell H's share from H-1's
        while below and digits < 6 and _pct(at["comm_share"], digits) == _pct(below["comm_share"], digits):
            digits += 1
        how = f"diloco at H = {h}: {_ms(at['comm_s'])}, {_pct(at['comm_share'], digits)} of the step"
        if below:
            how += f" (H = {below['inner_steps']}: {_pct(below['comm_share'], digits)})"
        row(f"under {target} of step time", f"H >= {h}", how)
    else:
        row(f"under {target} of step time", "no H", d["none_reason"])
    return out


def _fit_banner(plan: dict[str, Any]) -> list[str]:
    """The lines under the title when the set-up as asked does not fit in memory."""
    fit = plan.get("fit")
    if not fit or fit["asked_fits"] is not False:
        return []
    mem_gb, headroom = plan["gpu"]["memory_gb"], 100 * plan["headroom"]
    states = ", states only: activations not counted" if fit["states_only"] else ""
    asked = fit["asked"]
    over = "already over" if states else "over"
    lines = [f"  ! {asked} does NOT fit: {_gb(fit['asked_memory_gb'])} per GPU ({over} {headroom:.0f}% of "
             f"{mem_gb:g} GiB{states})."]
    if fit["per_strategy"]:
        lines.append("  ! per GPU: " + " · ".join(
            f"{s} {_gb(v['memory_gb'])} ({'fits' if v['fits'] else 'does not fit'})"
            for s, v in fit["per_strategy"].items()))
    proposed = fit["proposed"]
    alt = fit.get("inner_alternative")
    if alt:  # diloco is planned only as asked: its fsdp2 inner strategy is the way out
        if alt["fits"]:
            lines.append(f"  ! diloco with --inner-strategy fsdp2 fits ({_gb(alt['memory_gb'])} per GPU): rerun with "
                         "it. The time, cost and scaling below are NOT runnable as set up.")
            return lines
        lines.append(f"  ! diloco with --inner-strategy fsdp2 does not fit either ({_gb(alt['memory_gb'])} per GPU).")
    if fit["switched"]:
        lines.append(f"  ! planned with {proposed} instead ({_gb(plan['memory_gb'])} per GPU{states}): the memory, "
                     f"time, cost and scaling below are for {proposed}; --strategy {asked} to see it as asked.")
    elif proposed:
        lines.append(f"  ! {proposed} fits ({_gb(fit['per_strategy'][proposed]['memory_gb'])} per GPU{states}): "
                     f"rerun with --strategy {proposed}. The time, cost and scaling below are NOT runnable as set up "
                     f"({asked}).")
    else:
        lines.append("  ! no strategy fits as set up: the time, cost and scaling below are NOT runnable.")
        ways = fit.get("suggestions") or []
        for way in ways:
            lines.append(f"  ! fits with {way['flags']}: {_gb(way['memory_gb'])} per GPU")
        if not ways:
            lines.append("  ! nothing up to 1,024 GPUs fits: a shorter --seq-len (or a smaller model) is needed")
    return lines


def format_gpu_table() -> str:
    lines = [f"{'GPU':<24} {'bf16':>8} {'fp16':>8} {'fp8':>8} {'tf32':>8} {'fp32':>7} {'memory':>8} {'TB/s':>6}",
             "  (dense TFLOP/s: sparse datasheet figures halved)"]
    for d in hardware.DEVICES:
        def f(v):
            return "-" if v is None else f"{v:g}"
        lines.append(f"{d.name:<24} {f(d.bf16):>8} {f(d.fp16):>8} {f(d.fp8):>8} {f(d.tf32):>8} {f(d.fp32):>7}"
                     f" {d.memory_gb:>5g} GB {d.bandwidth_tbs:>6g}")
    lines.append("")
    lines.append("Names --gpu accepts (exact; case, spaces, dashes and 'GB' do not matter; a bare family name is "
                 "the SXM part):")
    for d in hardware.DEVICES:
        lines.append(f"  {d.name:<24} {', '.join(hardware.accepted_names(d)[1:]) or '-'}")
    lines.append("")
    lines.append("Links (--interconnect within a node, --network between nodes), GB/s per GPU one way:")
    for link in hardware.LINKS.values():
        also = f" (also {', '.join(link.aliases)})" if link.aliases else ""
        lines.append(f"  {link.name:<9} {link.gb_per_s:>6g}  {link.description}{also}")
    lines.append(f"  {'<N>gbit':<9} {'N/8':>6}  any other network rate: N Gbit/s, e.g. 10gbit")
    return "\n".join(lines)
