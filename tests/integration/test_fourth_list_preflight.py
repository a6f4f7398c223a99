"""Issue 54 (the fourth list), `flopwise preflight`: what it was given and dropped, and where it
writes. Each through the real command, before any trace or trial runs."""

from __future__ import annotations

import pytest


# ---------------------------------------------------------------- item 9: flags accepted and ignored
@pytest.mark.parametrize("flags, named, fix", [
    (["--tokens", "1e9"], "--tokens", "add --rank"),
    (["--hours", "2", "--price-per-gpu-hour", "2"], "--hours, --price-per-gpu-hour", "add --rank"),
    (["--out", "somewhere"], "--out", "add --rank"),
    (["--steps", "5"], "--steps", "drop --dry-run to measure"),
    (["--warmup", "0", "--budget-minutes", "1"], "--warmup, --budget-minutes", "drop --dry-run to measure"),
    (["--rank", "--isolation", "process"], "--isolation", "drop --dry-run to measure"),
])
def test_a_dry_run_refuses_the_flags_it_would_drop(cli, tmp_path, flags, named, fix):
    proc = cli("preflight", "--dry-run", *flags, "model.n_layers=1", cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = next(line for line in proc.stderr.splitlines() if line.strip().startswith("- "))
    assert line.strip().startswith(f"- {named}:") and fix in line, proc.stderr
    assert "Traceback" not in proc.stderr and "traced" not in proc.stdout
    assert not (tmp_path / "somewhere").exists()


# ---------------------------------------------------------------- item 13: --out that is a file
@pytest.mark.parametrize("mode", [["--dry-run", "--rank"], []])
def test_out_that_is_a_file_is_refused_and_left_as_it_was(cli, tmp_path, mode):
    target = tmp_path / "f.json"
    target.write_text('{"mine": true}\n')
    proc = cli("preflight", *mode, "--out", str(target), "model.n_layers=1", cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"--out {target}: a file is there; give a directory" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and "FileExistsError" not in proc.stderr
    assert target.read_text() == '{"mine": true}\n'
