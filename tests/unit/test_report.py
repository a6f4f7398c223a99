"""``flopwise report``: a self-contained HTML page (and PNGs) from run directories.

Synthetic runs with every kind of row (validation, events, evaluation, step-time
breakdown, per-layer gradient norms) and known plan/preflight numbers; a real tiny
training run; the errors; and, where a Chromium is installed, a headless render."""

import json
import math
import re
import shutil
import subprocess

import pytest
import yaml

from flopwise.report import ReportError, build_report
from flopwise.report import png as png_out
from flopwise.report.svg import HLine, LineChart, Marker, Series, fmt_tick, line_chart_svg, linear_ticks, log_ticks

TOKENS_PER_STEP = 1024
STEPS = 40
ODD_NAME = 'run-b <&"x>'  # a run name that must be escaped everywhere


def write_run(root, name, *, lr, cuda, resumed=False):
    """A run directory as flopwise train (and the coming features) would write it, with
    round numbers so the plan-vs-measured table can be checked exactly."""
    d = root / name
    d.mkdir()
    rows = [{"step": 0, "tokens": 0, "loss": None, "lr": None, "grad_norm": None, "tok_per_s": None, "mfu": None,
             "val_loss": 6.2, "val_ppl": math.exp(6.2), "val_bpb": 2.5}]
    for step in range(5, STEPS + 1, 5):
        elapsed = 0.25 * step + 0.24
        if resumed:  # the process restarted after step 20: the clock starts again
            elapsed = 0.25 * step + 2.0 if step <= 20 else 1.0 + 0.25 * (step - 20)
        row = {"step": step, "tokens": step * TOKENS_PER_STEP, "loss": 6.0 - 0.05 * step + (0.1 if cuda else 0.0),
               "lr": lr * min(1.0, step / 10), "grad_norm": 1.0 / (1 + step / 10) + (0.1 if cuda else 0.0),
               "tok_per_s": 4000.0 if cuda else 3900.0 + step,
               "step_time_s": 0.256, "mfu": 0.32, "mfu_6n": 0.29, "elapsed_s": elapsed,
               "time_data_s": 0.010, "time_fwd_bwd_s": 0.200, "time_optim_s": 0.030, "time_log_s": 0.001}
        if cuda:
            row.update(mem_alloc_gb=1.5, mem_peak_gb=2.0 + step / 80, mem_reserved_gb=2.8)
        else:
            row.update(mem_rss_gb=0.5, mem_rss_peak_gb=0.6)
        if step % 10 == 0:
            row.update(val_loss=row["loss"] + 0.1, val_ppl=math.exp(row["loss"] + 0.1),
                       val_bpb=2.5 - step / (40 if cuda else 30))
        rows.append(row)
        if step % 10 == 0:
            rows.append({"step": step, "grad_norms": {f"layers.{i}.attn.wqkv.weight": 0.1 * (i + 1) / step
                                                      for i in range(12)} | {"tok_emb.weight": 0.01}})
        if step in (20, 40):
            rows.append({"step": step, "tokens": step * TOKENS_PER_STEP, "eval": {
                "arc_easy": {"acc": 0.26 + step / 1000, "acc_norm": 0.27 + step / (1000 if cuda else 500),
                             "acc_token": 0.25,
                             "stderr": {"acc": 0.01, "acc_norm": 0.01, "acc_token": 0.01}, "random": 0.25,
                             "n": 500},
                "hellaswag": {"acc": 0.25, "acc_norm": 0.26, "acc_token": 0.25, "acc_stderr": 0.02,
                              "random": 0.25, "n": 200}}})
    rows.insert(4, {"step": 17, "event": "loss_spike", "loss": 9.5, "ratio": 3.4})
    rows.insert(6, {"step": 23, "event": "nonfinite", "loss": None, "grad_norm": None, "policy": "skip"})
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    tokens = STEPS * TOKENS_PER_STEP
    # plan: 5,000 tok/s (5e9 FLOP/s / 1e6 FLOP/token), 40% MFU, 2.0 GiB, tokens / 5,000 s
    (d / "plan.json").write_text(json.dumps({
        "params": 1_000_000, "flops_per_token": 1e6, "effective_flops": 5e9, "mfu": 0.4, "memory_gb": 2.0,
        "tokens": float(tokens), "hours": tokens / 5000 / 3600}))
    (d / "preflight.json").write_text(json.dumps({"measured": {"tok_per_s": 4500.0, "mfu": 0.35},
                                                  "memory_gb": 2.4}))
    (d / "run.json").write_text(json.dumps({
        "flopwise": "0.1.0", "python": "3.11.7", "torch": "2.13.0", "cuda": "12.8" if cuda else None,
        "device": "cuda:0 (NVIDIA H100 80GB HBM3)" if cuda else "cpu (2 threads)",
        "precision": "bf16" if cuda else "float32", "argv": ["flopwise", "train", f"optim.lr={lr}"],
        "started": "2026-11-22T00:00:00",
        "result": {"steps": STEPS, "tokens": tokens, "final_loss": 4.0, "val_loss_start": 6.2, "val_loss_end": 4.1,
                   "uniform_loss": 6.238, "tok_per_s": 4000.0, "mfu": 0.32, "wall_time_s": 11.0, "stopped": None}}))
    config = {"model": {"arch": "llama", "n_layers": 12, "d_model": 64, "n_heads": 4, "n_kv_heads": 2,
                        "mlp": "swiglu", "ffn_hidden": 192, "vocab_size": 512, "attention": "sdpa"},
              "optim": {"lr": lr, "warmup_steps": 10, "schedule": "cosine", "weight_decay": 0.1},
              "train": {"run_dir": str(d), "seq_len": 64, "global_batch_size": 16, "micro_batch_size": 8,
                        "max_steps": STEPS, "max_tokens": 0},
              "data": {"path": "<script>alert(1)</script>"}, "preset": "tiny"}
    (d / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    (d / "samples.txt").write_text("--- prompt 'def '\ndef f(x): return x < 1 && y\n")
    return d


@pytest.fixture
def two_runs(tmp_path):
    return [write_run(tmp_path, "run-a", lr=3e-3, cuda=True),
            write_run(tmp_path, ODD_NAME, lr=1e-3, cuda=False, resumed=True)]


def figures(html):
    """{figure id: its <svg> element text}."""
    out = {}
    for m in re.finditer(r'<svg[^>]*data-figure="([^"]+)".*?</svg>', html, re.S):
        assert m.group(1) not in out, f"figure {m.group(1)} twice"
        out[m.group(1)] = m.group(0)
    return out


def comparison_cells(html):
    """{(run, key, column): float or None} of the plan-vs-measured table."""
    out = {}
    for row in re.finditer(r'<tr data-run="([^"]*)" data-key="([^"]+)">(.*?)</tr>', html, re.S):
        for col, value in re.findall(r'data-col="([^"]+)" data-value="([^"]*)"', row.group(3)):
            out[(row.group(1), row.group(2), col)] = float(value) if value else None
    return out


@pytest.mark.slow
def test_report_of_two_synthetic_runs(two_runs, tmp_path):
    out = build_report(two_runs, out=tmp_path / "cmp.html")
    assert out == tmp_path / "cmp.html"
    html = out.read_text()

    # self-contained: nothing fetched from elsewhere, no script
    assert not re.search(r'(src|href)\s*=\s*["\']?\s*(https?:)?//', html, re.I)
    assert "<script" not in html.lower() and "@import" not in html and "url(http" not in html

    figs = figures(html)
    expected = {"loss", "bpb", "throughput", "mfu", "memory", "lr", "grad_norm", "step_time",
                "eval-0-arc_easy", "eval-1-hellaswag"}
    layer_figs = {f for f in figs if f.startswith("layers-")}
    assert set(figs) - layer_figs == expected
    assert len(layer_figs) == 2 and all(f.endswith("-grad_norms") for f in layer_figs)
    assert html.count("<svg") == len(figs)
    escaped = 'run-b &lt;&amp;&quot;x&gt;'
    for fid in expected:
        for run in ("run-a", escaped):
            assert f'data-run="{run}"' in figs[fid], (fid, run)
    # the series of each run, in its own colour, and a legend naming them
    assert 'data-series="run-a · train"' in figs["loss"] and f'data-series="{escaped} · val ' in figs["loss"]
    assert "vs run-a at 40.96K tokens" in figs["loss"]  # the second run's gap to the first, in the legend
    assert figs["loss"].count('class="marker"') == 4  # two events in each run
    assert "uniform ln V = 6.238" in figs["loss"]
    assert "random 25.0%" in figs["eval-0-arc_easy"]
    assert 'data-series="forward + backward"' in figs["step_time"] and 'data-series="other"' in figs["step_time"]
    assert "run-a · RSS" not in figs["memory"] and f"{escaped} · RSS" in figs["memory"]

    # escaping: run names and config values never appear raw
    assert ODD_NAME not in html and escaped in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html  # data.path, shown as text

    cells = comparison_cells(html)
    a, b = "run-a", escaped
    assert cells[(a, "tok_per_s", "plan")] == pytest.approx(5000.0)
    assert cells[(a, "tok_per_s", "preflight")] == pytest.approx(4500.0)
    assert cells[(a, "tok_per_s", "actual")] == pytest.approx(4000.0)
    assert cells[(a, "tok_per_s", "plan_error")] == pytest.approx(-0.2)
    assert cells[(a, "tok_per_s", "preflight_error")] == pytest.approx(4000 / 4500 - 1)
    assert cells[(a, "mfu", "plan")] == pytest.approx(0.4) and cells[(a, "mfu", "plan_error")] == pytest.approx(-0.2)
    assert cells[(a, "mfu", "preflight_error")] == pytest.approx(0.32 / 0.35 - 1)
    assert cells[(a, "memory_gb", "actual")] == pytest.approx(2.5)  # max mem_peak_gb
    assert cells[(a, "memory_gb", "plan_error")] == pytest.approx(0.25)
    assert cells[(a, "memory_gb", "preflight_error")] == pytest.approx(2.5 / 2.4 - 1)
    assert cells[(a, "wall_time_s", "plan")] == pytest.approx(STEPS * TOKENS_PER_STEP / 5000)
    assert cells[(a, "wall_time_s", "actual")] == pytest.approx(10.24)  # last elapsed_s
    assert cells[(a, "wall_time_s", "plan_error")] == pytest.approx(10.24 / 8.192 - 1)
    # the CPU run: RSS is measured (not like for like), the clock restarted at the resume
    assert cells[(b, "memory_gb", "actual")] == pytest.approx(0.6)
    assert cells[(b, "wall_time_s", "actual")] == pytest.approx(7.0 + 6.0)
    assert "+25.0%" in html and "-20.0%" in html

    # the config diff names the differing key, not the run directory
    diff = html[html.index('class="config-diff"'):]
    assert 'data-key="optim.lr"' in diff and 'data-key="train.run_dir"' not in diff
    # the events and evaluation tables
    assert html.count("loss_spike") >= 2 and "nonfinite" in html and "policy skip" in html
    assert re.search(r"<td>arc_easy</td>", html) and "30.0% ± 1.0" in html

    if png_out.available():
        pngs = sorted(p.name for p in (tmp_path / "cmp_figures").glob("*.png"))
        assert pngs == sorted(f"{f}.png" for f in figs)
        assert all((tmp_path / "cmp_figures" / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)
        assert "PNG copies of the 12 figures" in html


def comparison_bases(html):
    """{(run, key, column): "measured" | "assumed" | ""} of the plan-vs-measured table."""
    out = {}
    for row in re.finditer(r'<tr data-run="([^"]*)" data-key="([^"]+)">(.*?)</tr>', html, re.S):
        for col, basis in re.findall(r'data-col="([^"]+)" data-value="[^"]*" data-basis="([^"]*)"', row.group(3)):
            out[(row.group(1), row.group(2), col)] = basis
    return out


def test_preflight_assumptions_are_never_shown_as_measurements(tmp_path):
    """Issue 19: on a CPU preflight measures no MFU (no device peak) and no peak memory; its
    preflight.json still holds the planner's nominal 40% MFU and the planner's memory estimate.
    The report showed 40.0% in the preflight column as if measured."""
    cpu, old = write_run(tmp_path, "cpu", lr=1e-3, cuda=False), write_run(tmp_path, "old", lr=1e-3, cuda=False)
    trials = [{"micro_batch": 8, "checkpointing": "none", "status": "ok", "tok_per_s": 4500.0, "mfu": None,
               "peak_gb": None, "predicted_gb": 0.3}]
    prediction = {"tokens": 40960, "tok_per_s": 4500.0, "mfu": None, "memory_gb": 0.3, "memory_basis": "assumed",
                  "wall_time_s": 40960 / 4500.0, "hours": 40960 / 4500.0 / 3600,
                  "planner": {"mfu": 0.40, "hours": None, "note": "cpu: no peak"}}
    doc = {"device": "cpu", "trials": trials, "data_share": 0.01, "prediction": prediction,
           "chosen": {"micro_batch_size": 8, "activation_checkpointing": "none"}}
    (cpu / "preflight.json").write_text(json.dumps(doc))
    del prediction["memory_basis"]  # a preflight.json written before the basis was recorded
    (old / "preflight.json").write_text(json.dumps(doc))
    html = build_report([cpu, old], out=tmp_path / "r.html").read_text()
    cells, bases = comparison_cells(html), comparison_bases(html)
    for run in ("cpu", "old"):
        assert cells[(run, "mfu", "preflight")] is None  # n/a stays n/a, not the planner's 40%
        assert bases[(run, "mfu", "preflight")] == ""
        assert cells[(run, "tok_per_s", "preflight")] == pytest.approx(4500.0)
        assert bases[(run, "tok_per_s", "preflight")] == "measured"
        assert cells[(run, "memory_gb", "preflight")] == pytest.approx(0.3)
        assert bases[(run, "memory_gb", "preflight")] == "assumed"  # the planner's estimate, so labelled
        assert bases[(run, "mfu", "plan")] == "assumed"  # the plan's MFU is its assumption
    assert "cpu · preflight (assumed)" in figures(html)["memory"]
    assert "cpu · preflight" not in figures(html)["mfu"]  # no preflight MFU line at all
    row = re.search(r'<tr data-run="cpu" data-key="mfu">(.*?)</tr>', html, re.S).group(1)
    assert "40.0%" in row.split('data-col="preflight"')[0]  # the plan's assumption, in the plan column
    assert "40.0%" not in row.split('data-col="preflight"')[1]


@pytest.mark.slow
def test_png_figures_with_matplotlib(two_runs, tmp_path):
    pytest.importorskip("matplotlib")
    out = build_report(two_runs[:1])  # default place: <first run>/report.html
    assert out == two_runs[0] / "report.html"
    folder = two_runs[0] / "report_figures"
    assert (folder / "loss.png").stat().st_size > 5000
    (folder / "stale.png").write_bytes(b"x")  # a figure an earlier report had is removed
    build_report(two_runs[:1])
    assert not (folder / "stale.png").exists()


def test_without_matplotlib_the_page_says_so(two_runs, tmp_path, monkeypatch):
    monkeypatch.setattr(png_out, "available", lambda: False)
    html = build_report(two_runs, out=tmp_path / "r.html").read_text()
    assert "matplotlib is not installed" in html and not (tmp_path / "r_figures").exists()
    html = build_report(two_runs, out=tmp_path / "s.html", png=False).read_text()
    assert "PNG figures not requested" in html and not (tmp_path / "s_figures").exists()


def test_report_of_a_real_tiny_run(tiny_overrides, tmp_path):
    from flopwise.config import build_config
    from flopwise.train.trainer import train

    result = train(build_config(overrides=tiny_overrides + ["train.max_steps=12"]), log=lambda s: None)
    out = build_report([result.run_dir], out=tmp_path / "tiny.html")
    html = out.read_text()
    figs = figures(html)
    assert {"loss", "throughput", "memory", "lr", "grad_norm"} <= set(figs)
    assert figs["loss"].count('class="series"') >= 2  # train and validation
    cells = comparison_cells(html)
    run = result.run_dir.name
    assert cells[(run, "tok_per_s", "actual")] == pytest.approx(result.tok_per_s)
    assert cells[(run, "memory_gb", "plan")] == pytest.approx(json.loads((result.run_dir / "plan.json").read_text())
                                                              ["memory_gb"])
    assert cells[(run, "memory_gb", "actual")] > 0
    assert "completed" in html and "cpu" in html


def test_errors_name_the_file_and_line(two_runs, tmp_path):
    empty = tmp_path / "not-a-run"
    empty.mkdir()
    with pytest.raises(ReportError, match=r"not-a-run.*not a run directory.*metrics\.jsonl"):
        build_report([empty])
    with pytest.raises(ReportError, match="no such run directory"):
        build_report([tmp_path / "missing"])
    with pytest.raises(ReportError, match="no run directories"):
        build_report([])

    metrics = two_runs[0] / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    lines[2] = lines[2][: len(lines[2]) // 2]  # a line cut in half
    metrics.write_text("\n".join(lines) + "\n")
    with pytest.raises(ReportError, match=r"run-a/metrics\.jsonl, line 3: not a JSON object"):
        build_report(two_runs)
    lines[2] = "[1, 2]"
    metrics.write_text("\n".join(lines) + "\n")
    with pytest.raises(ReportError, match=r"metrics\.jsonl, line 3: expected a JSON object, got list"):
        build_report(two_runs)
    # a last line without its newline is a row being written: left out, with a note
    metrics.write_text("\n".join(lines[:2] + lines[3:]) + '\n{"step": 41, "tok')
    html = build_report(two_runs, out=tmp_path / "live.html", png=False).read_text()
    assert f"line {len(lines)}: incomplete last line left out" in html
    (two_runs[1] / "plan.json").write_text("{not json")
    metrics.unlink()
    with pytest.raises(ReportError, match="plan.json: not valid JSON"):
        build_report(two_runs[1:])


def test_in_progress_run_without_side_files(tmp_path):
    d = tmp_path / "live"
    d.mkdir()
    (d / "metrics.jsonl").write_text(
        json.dumps({"step": 0, "tokens": 0, "val_loss": 5.0}) + "\n"
        + json.dumps({"step": 1, "tokens": 100, "loss": 5.1, "lr": 1e-3, "grad_norm": float("nan"),
                      "tok_per_s": 90.0, "mfu": None, "elapsed_s": 2.0}) + "\n\n")
    html = build_report([d]).read_text()
    assert "in progress or interrupted" in html and "no plan.json or preflight.json" in html
    assert "loss" in figures(html)


def test_ticks_and_numbers():
    assert linear_ticks(0, 12288)[2] == [0, 2000, 4000, 6000, 8000, 10000, 12000, 14000]
    lo, hi, ticks = linear_ticks(0.31, 0.77)
    assert ticks[0] <= 0.31 and ticks[-1] >= 0.77 and all(round(t, 6) == t for t in ticks)
    assert log_ticks(1e-4, 10)[2] == [1e-4, 1e-3, 1e-2, 1e-1, 1, 10]
    lo, hi, ticks = log_ticks(3.2, 9.1)  # less than a decade: plain steps
    assert lo <= 3.2 and hi >= 9.1 and ticks == [3, 4, 5, 6, 7, 8, 9, 10]
    assert [fmt_tick(v) for v in (0, 1500, 2_000_000, 3e-4)] == ["0", "1.5K", "2M", "3e-4"]
    assert fmt_tick(0.35, 0.05, percent=True) == "35%"


def test_missing_values_break_the_line_and_labels_are_escaped():
    chart = LineChart("c", "a <title>", "x & y", "y", [Series("s<1>", [0, 1, 2, 3, 4], [1, 2, None, 4, float("nan")],
                                                                  "#000")])
    svg = line_chart_svg(chart)
    d = re.search(r' d="([^"]+)"', svg).group(1)
    assert d.count("M") == 2  # (0,1)-(1,2), then (3,4) alone
    assert svg.count("<circle") == 1  # the lone point is drawn as a dot
    assert "a &lt;title&gt;" in svg and "x &amp; y" in svg and "s&lt;1&gt;" in svg and "<1>" not in svg


@pytest.mark.parametrize("log_y", [False, True])
def test_no_nan_or_infinity_reaches_a_coordinate(log_y):
    """A diverged run's NaN or inf, in a value, an error bar, a reference line or a marker, is
    left out of the chart; the finite points are still drawn, on axes they alone set."""
    nan, inf = float("nan"), float("inf")
    chart = LineChart("c", "t", "x", "y", [Series("s", [1, 2, 3, 4], [1.0, nan, 2.0, inf], "#000", points=True,
                                                  err=[0.1, 0.1, nan, 0.1])],
                      log_y=log_y, hlines=[HLine(nan, "h"), HLine(inf, "i")],
                      markers=[Marker(nan, 1.0, "at no step"), Marker(2, nan, "diverged")])
    svg = line_chart_svg(chart)
    coords = re.findall(r'(?:x|y|x1|y1|x2|y2|cx|cy)="([^"]*)"', svg) + re.findall(r' d="([^"]*)"', svg)
    assert coords and not [c for c in coords if re.search(r"nan|inf", c, re.I)], svg
    assert svg.count("<title>s: ") == 2 and svg.count('class="errorbar"') == 1 and svg.count('class="marker"') == 1


CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium on PATH (chromium, chromium-browser or google-chrome): "
                                             "the headless render is not checked here")
def test_headless_chromium_renders_the_page(two_runs, tmp_path):
    out = build_report(two_runs, out=tmp_path / "page.html", png=False)
    shot = tmp_path / "shot.png"
    common = [CHROMIUM, "--headless", "--disable-gpu", "--no-sandbox", f"--user-data-dir={tmp_path / 'profile'}",
              "--window-size=1200,3000"]
    subprocess.run(common + [f"--screenshot={shot}", out.as_uri()], capture_output=True, timeout=180)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert shot.stat().st_size > 50_000  # charts and tables, not a blank page
    dom = subprocess.run(common + ["--dump-dom", out.as_uri()], capture_output=True, text=True, timeout=180).stdout
    assert len(re.findall(r'<svg[^>]*data-figure="', dom)) == 12
    assert 'data-figure="loss"' in dom and 'id="plan-vs-actual"' in dom


def test_a_diloco_run_shows_its_outer_steps_bytes_and_drift(tmp_path):
    """The outer loop's measures (metrics.jsonl, as the trainer logs them) reach the card and a
    chart of their own; a run without them has neither."""
    plain = write_run(tmp_path, "plain", lr=1e-3, cuda=False)
    d = write_run(tmp_path, "diloco", lr=1e-3, cuda=False)
    rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        if r.get("loss") is not None and "tokens" in r:
            n = r["step"] // 10  # an outer step every 10 steps
            r.update(outer_steps=n, outer_s=0.25, outer_bytes=4_000_000, outer_bytes_total=8_000_000 * n,
                     outer_bytes_per_token=8_000_000 * n / r["tokens"])
            if n:
                r.update(pseudo_grad_norm=1.0 / n, drift=0.5 / n)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    html = build_report([plain, d], out=tmp_path / "r.html", png=False).read_text()
    total = 8_000_000 * (STEPS // 10)
    assert (f"<dt>DiLoCo</dt><dd>{STEPS // 10} outer steps · {total / 2**20:,.1f} MiB across groups "
            f"({total / (STEPS * TOKENS_PER_STEP):,.1f} B/token) · {0.25 * STEPS / 5:.2f} s waiting on them") in html
    assert html.count("<dt>DiLoCo</dt>") == 1  # the plain run's card has none
    chart = figures(html)["diloco"]
    assert "diloco · drift" in chart and "plain" not in chart
    assert "diloco" not in figures(build_report([plain], out=tmp_path / "p.html", png=False).read_text())


def test_two_runs_legend_names_the_later_ones_validation_gap_at_the_same_tokens(tmp_path):
    """Issue 53, item 4: a DiLoCo run beside its ddp twin -- the loss chart is in tokens and the
    second run's validation series says its last loss and the gap to the first's at those tokens."""
    from flopwise.report.report import loss_chart
    from flopwise.report.runs import load_run

    write_run(tmp_path, "ddp", lr=1e-3, cuda=False)
    write_run(tmp_path, "diloco", lr=1e-3, cuda=True)  # its losses are the first's + 0.1
    runs = [load_run(tmp_path / "ddp"), load_run(tmp_path / "diloco")]
    for run, name in zip(runs, ("ddp", "diloco")):
        run.name, run.prefix = name, f"{name} · "
    chart = loss_chart(runs)
    assert chart.x_label == "tokens"
    labels = [s.label for s in chart.series if "val" in s.label]
    want = (4.1 + 0.1) / 4.1 - 1  # at step 40, 40,960 tokens: 4.2 against 4.1
    assert labels[0] == "ddp · val" and labels[1] == f"diloco · val 4.2, {want:+.2%} vs ddp at 40.96K tokens", labels
