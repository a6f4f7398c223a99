"""Issue 54, item 6, the arithmetic: a resumed run's measured tokens/s and MFU are the whole
run's -- every start's steady-state tokens (each start's own warm-up left out) over their
seconds, and over the tokens the device's peak would have trained in them -- whether run.json
closes each start with its averages or only metrics.jsonl's windows tell; where the starts
are (run.json ``starts``, or where metrics.jsonl's clock restarts); and a run of one start
keeps run.json's figures. Hand-written run directories, with the issue's figures: a first
start at 3.03K tok/s, a second at 9.59K."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_report import comparison_cells, figures  # noqa: E402

from flopwise.report.compare import measured_mfu, measured_tok_per_s, measured_wall_time  # noqa: E402
from flopwise.report.report import build_report  # noqa: E402
from flopwise.report.runs import load_run  # noqa: E402

PER_STEP = 1000  # tokens
# (first step, last step, steady tok/s, MFU, world size); the first window of each start is slow (warm-up)
STARTS = [(0, 40, 3030.0, 0.10, 1), (40, 100, 9590.0, 0.16, 2)]
FIRST_TOKENS, SECOND_TOKENS = 35 * PER_STEP, 55 * PER_STEP  # the windows after steps 5..35, 45..95 (warm-up: 3)
SECONDS = FIRST_TOKENS / 3030.0 + SECOND_TOKENS / 9590.0
WHOLE_TPS = (FIRST_TOKENS + SECOND_TOKENS) / SECONDS
WHOLE_MFU = (FIRST_TOKENS + SECOND_TOKENS) / (FIRST_TOKENS / 0.10 + SECOND_TOKENS / 0.16)


def rows_of(at: int, end: int, rate: float, mfu: float) -> list[dict]:
    rows, elapsed = [], 0.0
    for step in range(at + 5, end + 1, 5):
        r = 500.0 if step == at + 5 else rate  # the start's first window: compiling, warming up
        elapsed += 5 * PER_STEP / r
        rows.append({"step": step, "tokens": step * PER_STEP, "loss": 5.0 - step / 100, "tok_per_s": r,
                     "mfu": mfu * r / rate, "elapsed_s": elapsed, "step_time_s": PER_STEP / r})
    return rows


def write(tmp_path: Path, name: str, starts: list[dict] | None, closed: bool = True) -> Path:
    """A run of the two STARTS; run.json's ``starts`` as given (None: a run.json from before it),
    each closed with its averages when ``closed``; ``result`` is the last start's."""
    d = tmp_path / name
    d.mkdir()
    rows = [{"step": 0, "tokens": 0, "loss": None, "val_loss": 6.0}]
    for at, end, rate, mfu, _ in STARTS:
        rows += rows_of(at, end, rate, mfu)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    record: dict = {"device": "cuda:0", "started": "2026-11-28T12:00:00",
                    "result": {"steps": 100, "tokens": 100 * PER_STEP, "tok_per_s": 9590.0, "mfu": 0.16,
                               "wall_time_s": 7.0}}
    if starts is not None:
        record["starts"] = starts
    (d / "run.json").write_text(json.dumps(record))
    (d / "preflight.json").write_text(json.dumps({"measured": {"tok_per_s": 9630.0, "mfu": 0.16}}))
    return d


def entries(closed: tuple[bool, bool] = (True, True)) -> list[dict]:
    out = []
    for (at, end, rate, mfu, world), tokens, done in zip(STARTS, (FIRST_TOKENS, SECOND_TOKENS), closed):
        entry = {"at_step": at, "started": f"2026-11-28T1{len(out)}:00:00", "world_size": world}
        if done:
            entry.update(ended_step=end, tok_per_s=rate, mfu=mfu, steady_time_s=tokens / rate, wall_time_s=6.0)
        out.append(entry)
    return out


@pytest.mark.parametrize("closed", [(True, True), (False, True), (True, False), (False, False)],
                         ids=["both-closed", "first-crashed", "last-crashed", "neither"])
def test_the_whole_runs_rates_pool_every_starts_steady_state(tmp_path, closed):
    run = load_run(write(tmp_path, "r", entries(closed)))
    assert [s for s, _ in run.starts()] == [0, 40]
    assert measured_tok_per_s(run) == pytest.approx(WHOLE_TPS)  # 5.29K, not the last start's 9.59K
    assert measured_mfu(run) == pytest.approx(WHOLE_MFU)  # the peak doubled with the ranks: not 0.13 by time
    assert measured_wall_time(run) == pytest.approx(sum(5 * PER_STEP / 500 + (end - at - 5) * PER_STEP / rate
                                                        for at, end, rate, _, _ in STARTS))


def test_a_run_json_from_before_starts_were_recorded_finds_them_where_the_clock_restarts(tmp_path):
    run = load_run(write(tmp_path, "old", None))
    assert [s for s, _ in run.starts()] == [0, 40]  # the last step logged before the restart
    assert measured_tok_per_s(run) == pytest.approx(WHOLE_TPS)
    # an old run.json resumed by a train that records its starts: the first recorded is the resume
    run = load_run(write(tmp_path, "mixed", entries()[1:]))
    assert [s for s, _ in run.starts()] == [0, 40]
    assert measured_tok_per_s(run) == pytest.approx(WHOLE_TPS) and measured_mfu(run) == pytest.approx(WHOLE_MFU)


def test_a_run_of_one_start_keeps_run_jsons_figures(tmp_path):
    d = write(tmp_path, "one", [{"at_step": 0}])
    rows = [r for r in map(json.loads, (d / "metrics.jsonl").read_text().splitlines()) if r["step"] <= 40]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = load_run(d)
    assert measured_tok_per_s(run) == 9590.0 and measured_mfu(run) == 0.16  # run.json's result, as before


def test_the_report_of_the_issues_run_compares_the_whole_run_and_marks_the_resume(tmp_path):
    run = write(tmp_path, "issue", entries())
    html = build_report([run], png=False).read_text()
    cells = comparison_cells(html)
    assert cells[("issue", "tok_per_s", "actual")] == pytest.approx(WHOLE_TPS)
    assert cells[("issue", "tok_per_s", "preflight_error")] == pytest.approx(WHOLE_TPS / 9630.0 - 1)  # -45%, red
    assert cells[("issue", "mfu", "actual")] == pytest.approx(WHOLE_MFU)
    assert "2 starts · resumed at step 40" in html
    assert "12.0 s in run.json (all 2 starts, with final saves)" in html  # each start's wall time, summed
    svg = figures(html)["loss"]
    assert svg.count('class="resume"') == 1 and f'data-x="{40.0 * PER_STEP!r}"' in svg
