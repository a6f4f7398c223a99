"""Issue 45, items 5-7: `flopwise plan` as a new user meets it -- a config that names a small
data directory, KEY=VALUE overrides as train takes them, and a --hours budget over several GPUs."""

import json

import pytest
import yaml

from flopwise.config import build_config
from flopwise.data.datadir import DataDir
from flopwise.plan.budget import chinchilla_verdict
from flopwise.plan.flops import param_counts


def _config_with_data(tmp_path, data_path) -> str:
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({"preset": "tiny", "data": {"path": str(data_path)}}))
    return str(cfg)


# ---------------------------------------------------------------- item 5: the data's epochs
def test_plan_of_a_config_with_data_says_how_many_epochs_and_warns_past_four(cli, small_builtin, tmp_path):
    _, data = small_builtin
    train_tokens = DataDir(data).num_tokens("train")
    cfg = _config_with_data(tmp_path, data)
    proc = cli("plan", "--config", cfg, "--tokens", "1B", "--json")
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["data"]["path"] == str(data) and plan["data"]["train_tokens"] == train_tokens
    assert plan["data"]["epochs"] == pytest.approx(1e9 / train_tokens)
    assert "Muennighoff" in plan["data"]["warning"]
    table = cli("plan", "--config", cfg, "--tokens", "1B")
    assert table.returncode == 0, table.stderr
    epochs = f"{1e9 / train_tokens:,.0f} epochs"
    top = "\n".join(table.stdout.splitlines()[:4])
    assert epochs in top and "Muennighoff et al. 2023" in top, top  # said at the top, not only in a section
    assert f"{train_tokens:,}" in table.stdout and str(data) in table.stdout


def test_a_budget_of_a_few_epochs_is_counted_without_a_warning(cli, small_builtin, tmp_path):
    _, data = small_builtin
    train_tokens = DataDir(data).num_tokens("train")
    cfg = _config_with_data(tmp_path, data)
    proc = cli("plan", "--config", cfg, "--tokens", str(3 * train_tokens), "--json")
    assert proc.returncode == 0, proc.stderr
    d = json.loads(proc.stdout)["data"]
    assert d["epochs"] == pytest.approx(3.0) and d["warning"] is None
    table = cli("plan", "--config", cfg, "--tokens", str(3 * train_tokens))
    assert "3.00 epochs" in table.stdout and "Muennighoff" not in table.stdout


def test_a_data_path_that_is_not_here_is_said_and_the_plan_goes_on(cli, tmp_path):
    # a config written for the cluster, planned on a laptop: its data is not here
    cfg = _config_with_data(tmp_path, tmp_path / "not-here")
    proc = cli("plan", "--config", cfg, "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["data"] is None
    assert "epochs not counted" in proc.stderr and "not-here" in proc.stderr and "Traceback" not in proc.stderr


# ---------------------------------------------------------------- item 6: KEY=VALUE overrides
def test_plan_takes_the_overrides_train_takes(cli, small_builtin, tmp_path):
    proc = cli("plan", "--model", "tiny", "model.vocab_size=8192", "model.n_layers=2", "--json")
    assert proc.returncode == 0, proc.stderr
    want = param_counts(build_config(preset="tiny", overrides=["model.vocab_size=8192", "model.n_layers=2"]).model)
    assert json.loads(proc.stdout)["params"] == want["total"]
    # on a config, the run as train would run it: its batch and the data named by an override
    _, data = small_builtin
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({"preset": "tiny"}))
    proc = cli("plan", "--config", str(cfg), "train.micro_batch_size=2", f"data.path={data}", "--json")
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["batch"]["micro_batch"] == 2 and plan["data"]["path"] == str(data)
    # with neither --model nor --config, the default preset, as train
    proc = cli("plan", "model.n_layers=2", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["params"] == param_counts(build_config(overrides=["model.n_layers=2"]).model)["total"]


@pytest.mark.parametrize("override", ["model.bogus=1", "model.n_layers=-2", "nonsense", "modle.n_layers=2"])
def test_a_bad_override_is_the_same_error_as_trains(cli, override):
    plan = cli("plan", "--model", "tiny", override)
    train = cli("train", "--preset", "tiny", override, "--print-config")
    assert plan.returncode == train.returncode == 2, (plan.stdout, train.stdout)
    assert plan.stderr.replace("flopwise plan:", "flopwise train:") == train.stderr
    assert "Traceback" not in plan.stderr


def test_overrides_with_params_are_refused(cli):
    proc = cli("plan", "--params", "8e9", "model.n_layers=2")
    assert proc.returncode == 2 and "model.n_layers=2" in proc.stderr and "--params" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


# ---------------------------------------------------------------- item 7: --hours with communication
# (issue 54, item 4: the MFU is end-to-end; the communication is a part of the wall time, not added)
def test_hours_hold_the_budget_and_price_it(cli):
    args = ["plan", "--model", "smollm-360m", "--gpu", "h100", "--gpus", "8", "--hours", "6",
            "--price-per-gpu-hour", "2"]
    proc = cli(*args, "--json")
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["hours"] == pytest.approx(6.0) and plan["compute_hours"] == pytest.approx(6.0)
    assert plan["tokens"] * plan["flops_per_token"] == pytest.approx(6.0 * 3600 * plan["effective_flops"])
    assert 0 < plan["comm_hours"] < 6.0 * 0.05  # visible at 8 GPUs, and a part of the 6 h
    assert plan["gpu_hours"] == pytest.approx(48.0) and plan["cost"] == pytest.approx(96.0)
    out = cli(*args).stdout
    assert "wall time                  6.0 h" in out and "$96.00" in out
    assert "6.1 h" not in out


def test_tokens_are_priced_at_the_mfu_alone(cli):
    proc = cli("plan", "--model", "smollm-360m", "--gpu", "h100", "--gpus", "8", "--tokens", "20B",
               "--price-per-gpu-hour", "2", "--json")
    plan = json.loads(proc.stdout)
    wall = 20e9 * plan["flops_per_token"] / plan["effective_flops"] / 3600
    assert plan["hours"] == pytest.approx(wall) == plan["compute_hours"]
    assert plan["cost"] == pytest.approx(wall * 8 * 2)


@pytest.mark.parametrize("ratio, words", [
    (0.3, "far under-trained (below 0.5x)"),
    (0.51, "under-trained (0.5x to 0.9x)"),
    (1.0, "compute-optimal (0.9x to 1.1x)"),
    (1.97, "over-trained (1.1x to 2x)"),
    (3.2, "far over-trained (above 2x)"),
])
def test_the_chinchilla_verdict_says_how_far(ratio, words):
    params = 1e9
    verdict = chinchilla_verdict(ratio * 20 * params, params, 6 * params * ratio * 20 * params)
    assert verdict.startswith(f"{ratio:.2f}x the compute-optimal tokens"), verdict
    assert words in verdict, verdict
    assert "close to" not in verdict
