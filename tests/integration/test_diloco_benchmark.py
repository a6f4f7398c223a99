"""benchmarks/diloco.py's short version (issue 53): it runs ddp and DiLoCo on the same tokens,
records both, and -- as an hours-long comparison run across sessions must -- a second call with
the same --work reads finished runs back and resumes one cut short from its checkpoint to the
same result. The gap itself is the long benchmark's to measure, not this test's."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # torchrun processes (about a minute)

ROOT = Path(__file__).resolve().parents[2]


def bench(work: Path, out: Path, data: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "diloco.py"), "--nproc", "2", "--groups", "2", "--steps", "4",
           "--global-batch", "8", "--contenders", "2:0.7:0.9", "--diloco-lr", "0.003", "0.006",
           "--checkpoint-every", "2", "--val-windows", "16",
           "--work", str(work), "--json-out", str(out),
           f"data.path={data}", "model.vocab_size=512", "model.d_model=64", "model.n_layers=2", "model.n_heads=4",
           "model.n_kv_heads=2", "model.ffn_hidden=192", "model.max_seq_len=64", "train.seq_len=64"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_the_short_diloco_benchmark_runs_and_a_cut_run_resumes_to_the_same_result(small_builtin, tmp_path):
    _, data = small_builtin
    work = tmp_path / "work"
    bench(work, tmp_path / "a.json", data)
    first = json.loads((tmp_path / "a.json").read_text())["rows"]
    assert [r["strategy"] for r in first] == ["ddp", "diloco", "diloco"] and first[1]["groups"] == 2
    assert first[1]["outer_steps"] == 2 and first[1]["fewer_bytes_than_ddp"] > 1
    assert first[0]["tokens"] == first[1]["tokens"] == first[2]["tokens"]
    # ddp at the preset's rate, DiLoCo at each of its own against that one ddp
    assert first[0]["inner_lr"] == 3e-3
    assert [(r["inner_lr"], r["ddp_lr"]) for r in first[1:]] == [(3e-3, 3e-3), (6e-3, 3e-3)]
    assert first[1]["val_loss"] != first[2]["val_loss"]
    assert all(r["wall_s"] > 0 for r in first)  # every run's wall time, summed over its starts
    # cut the DiLoCo run short after its step-2 checkpoint, as a killed benchmark leaves it
    diloco = work / "diloco-2-b8-lr0.006-m2-h2-lr0.7-mu0.9"
    (diloco / "run.json").unlink()
    shutil.rmtree(diloco / "checkpoints" / "step-0000004")
    proc = bench(work, tmp_path / "b.json", data)
    assert "finished in" in proc.stdout and "read back" in proc.stdout  # ddp was not run again
    second = json.loads((tmp_path / "b.json").read_text())["rows"]
    assert [r["val_loss"] for r in second] == [r["val_loss"] for r in first]  # resumed exactly
