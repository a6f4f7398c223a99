"""The console script, as a user runs it."""

import pytest


@pytest.mark.slow
def test_train_from_the_command_line(cli, tiny_overrides, tmp_path):
    proc = cli("train", *tiny_overrides, "train.max_steps=10")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "flopwise train · preset tiny" in out
    assert "step     10/10" in out and "done: 10 steps" in out
    assert (tmp_path / "run" / "checkpoints" / "step-0000010" / "model.pt").is_file()


def test_bad_input_fails_fast_with_every_problem_and_writes_nothing(cli, tmp_path):
    run_dir = tmp_path / "never"
    proc = cli("train", "model.n_layer=2", "train.global_batch_size=33", f"train.run_dir={run_dir}")
    assert proc.returncode == 2
    assert "unknown key model.n_layer (did you mean 'n_layers'?)" in proc.stderr
    assert "train.global_batch_size (33) must be divisible by train.micro_batch_size (16)" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not run_dir.exists()


@pytest.mark.slow
def test_missing_data_directory_is_named(cli, tmp_path):
    missing = tmp_path / "nodata"
    proc = cli("train", f"data.path={missing}", f"train.run_dir={tmp_path / 'run'}")
    assert proc.returncode == 2
    assert str(missing) in proc.stderr and "Traceback" not in proc.stderr


def test_presets_listing_and_print_config(cli):
    proc = cli("presets")
    assert proc.returncode == 0 and "smollm-360m" in proc.stdout and "361.8M" in proc.stdout
    proc = cli("train", "--preset", "smollm-360m", "--print-config", "train.micro_batch_size=4")
    assert proc.returncode == 0 and "d_model: 960" in proc.stdout and "micro_batch_size: 4" in proc.stdout


@pytest.mark.slow
def test_split_too_small_for_the_window_is_named(cli, tiny_overrides, tmp_path):
    proc = cli("train", *tiny_overrides, "train.seq_len=100000", "model.max_seq_len=100000")
    assert proc.returncode == 2, proc.stderr
    assert "too small for seq_len=100000" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_unavailable_attention_backend_falls_back_or_fails_with_strict(cli, tiny_overrides, tmp_path):
    proc = cli("train", *tiny_overrides, "train.max_steps=2", "model.attention=flash")
    assert proc.returncode == 0, proc.stderr
    assert "flash unavailable on cpu/float32" in proc.stdout and "falling back to sdpa" in proc.stdout
    strict_dir = tmp_path / "strict"
    proc = cli("train", "--strict", *tiny_overrides, "train.max_steps=2", "model.attention=flash",
               f"train.run_dir={strict_dir}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "flash" in proc.stderr and "needs CUDA" in proc.stderr
    assert not strict_dir.exists()
