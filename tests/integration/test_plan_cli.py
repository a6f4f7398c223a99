"""`flopwise plan` as a user runs it."""

import json

import pytest
import yaml

from flopwise.config import build_config
from flopwise.plan.budget import GIB
from flopwise.plan.memory import MemorySettings, estimate


def test_plan_table_answers_the_time_and_cost_question(cli):
    proc = cli("plan", "--model", "smollm-360m", "--gpu", "a100", "--mfu", "0.4", "--tokens", "6B",
                   "--price-per-gpu-hour", "2")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for text in ("Parameters", "embedding", "FLOPs", "6·N_matmul + 12·L·d_attn·T", "wall time", "39.1 h",
                 "GPU-hours", "cost", "$78.14", "Chinchilla", "verdict", "Memory per GPU", "largest micro-batch",
                 "Batch", "Scaling"):
        assert text in out, text


def test_plan_json_and_list_gpus(cli):
    proc = cli("plan", "--model", "smollm-360m", "--gpu", "a100", "--hours", "30", "--json")
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["params"] == 361_821_120 and plan["hours"] == 30 and 4.5e9 < plan["tokens"] < 4.7e9
    same = cli("plan", "--preset", "smollm-360m", "--gpu", "a100", "--hours", "30", "--json")  # as train spells it
    assert same.returncode == 0 and json.loads(same.stdout)["params"] == plan["params"], same.stderr
    proc = cli("plan", "--list-gpus")
    assert proc.returncode == 0 and "H100 SXM" in proc.stdout and "989.4" in proc.stdout
    assert "1979" not in proc.stdout  # never the sparse figure


def test_plan_raw_params_uses_6n(cli):
    proc = cli("plan", "--params", "8e9", "--gpu", "h100", "--gpus", "8", "--tokens", "1T", "--json")
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["flops_formula"] == "6n" and plan["flops_per_token"] == 48e9
    assert abs(plan["compute_hours"] - 6 * 8e9 * 1e12 / (989.4e12 * 8 * 0.4) / 3600) < 1e-6


def test_plan_errors_name_the_flag(cli):
    cases = [
        (["--model", "smollm-360m", "--hours", "-1"], "argument --hours: -1.0 is out of range"),
        (["--model", "smollm-360m", "--mfu", "1.2"], "argument --mfu: 1.2 is out of range"),
        (["--model", "smollm-360m", "--hours", "nan"], "argument --hours: nan is out of range"),
        (["--model", "smollm-360m", "--gpu", "h1000"], "--gpu 'h1000' is not in the hardware table"),
        (["--model", "smollm-360m", "--tokens", "1e9", "--hours", "3"], "--tokens and --hours were both given"),
        (["--model", "smollm-36m"], "did you mean 'smollm-360m'"),
        (["--params", "lots"], "argument --params"),
    ]
    for args, message in cases:
        proc = cli("plan", *args)
        assert proc.returncode == 2, (args, proc.stdout)
        assert message in proc.stderr, (args, proc.stderr)
        assert "Traceback" not in proc.stderr


def test_plan_gpu_names_are_exact(cli):
    # issue 19: "a100-40gb" was planned against the 80 GB A100
    proc = cli("plan", "--model", "smollm-360m", "--gpu", "a100-40gb")
    assert proc.returncode == 0, proc.stderr
    assert "A100 SXM 40GB × 1" in proc.stdout and "of 40 GiB" in proc.stdout and "of 80 GiB" not in proc.stdout
    for typed, hint in (("a100x", "a100"), ("h100x", "h100")):
        proc = cli("plan", "--model", "smollm-360m", "--gpu", typed)
        assert proc.returncode == 2, proc.stdout
        assert f"--gpu {typed!r} is not in the hardware table (did you mean {hint!r}?)" in proc.stderr
        assert "A100 SXM 40GB" in proc.stderr and "Traceback" not in proc.stderr
    proc = cli("plan", "--model", "smollm-360m", "--gpu", "h100", "--memory-gb", "40")
    assert proc.returncode == 0 and "of 40 GiB" in proc.stdout and "(--memory-gb)" in proc.stdout


def test_plan_that_does_not_fit_says_so_at_the_top(cli):
    # issue 19: 8B on 8 H100 with DDP was priced although its memory section said it did not fit
    proc = cli("plan", "--params", "8e9", "--tokens", "160B", "--gpu", "h100", "--gpus", "8")
    assert proc.returncode == 0, proc.stderr
    top = "\n".join(proc.stdout.splitlines()[:5])
    assert "ddp does NOT fit: 119.21 GiB per GPU" in top
    assert "planned with fsdp2 instead (14.90 GiB per GPU, states only: activations not counted)" in top
    assert "fsdp2 on 8 GPU(s)" in proc.stdout and "Scaling (fsdp2" in proc.stdout
    assert "activations                NOT counted" in proc.stdout
    assert "states only, activations NOT counted; fits under 90% of 80 GiB before activations" in proc.stdout
    proc = cli("plan", "--params", "8e9", "--tokens", "160B", "--gpu", "h100", "--gpus", "8", "--strategy", "ddp",
               "--price-per-gpu-hour", "2")
    assert proc.returncode == 0, proc.stderr
    top = "\n".join(proc.stdout.splitlines()[:5])
    assert "ddp does NOT fit" in top and "fsdp2 fits (14.90 GiB per GPU" in top and "--strategy fsdp2" in top
    for line in proc.stdout.splitlines():
        if line.strip().startswith(("wall time", "cost")):
            assert "NOT runnable" in line, line


def test_a_set_up_that_fits_nowhere_is_told_what_would_make_it_fit(cli):
    """smollm-1.7b on one 24 GB L4 needs 34.18 GiB (the step a default train takes there): the plan
    names the changes that fit, each planned, cheapest first, instead of a list of things to try."""
    proc = cli("plan", "--model", "smollm-1.7b", "--gpu", "l4", "--tokens", "10B")
    top = proc.stdout.splitlines()[:5]
    assert proc.returncode == 0 and "  ! fits with --gpus 2 --strategy fsdp2: 18.53 GiB per GPU" in top, top
    asked = ["--model", "smollm-360m", "--gpu", "l4", "--micro-batch", "8"]  # 8 x 2,048 tokens: too many
    plan, _ = _plan_json(cli, *asked)
    ways = plan["fit"]["suggestions"]
    assert [w["flags"] for w in ways] == ["--micro-batch 4", "--checkpointing full",
                                          "--gpus 2 --strategy fsdp2"], ways
    for w in ways:  # each suggestion, planned as its flags say, fits with the memory it named
        again, _ = _plan_json(cli, *asked, *w["flags"].split())
        assert again["runnable"] and again["memory_gb"] == pytest.approx(w["memory_gb"]), w
    params, _ = _plan_json(cli, "--params", "70B", "--gpu", "h100")  # states only: the GPU count alone
    assert [w["flags"] for w in params["fit"]["suggestions"]] == ["--gpus 16 --strategy fsdp2"]
    proc = cli("plan", "--model", "smollm-1.7b", "--gpu", "l4", "--seq-len", "2048", "--micro-batch", "1",
               "--memory-gb", "1")  # 2 GiB fits at 512 GPUs: the default step's chunked loss keeps no full logits
    assert "nothing up to 1,024 GPUs fits" in proc.stdout, proc.stdout[:400]


def _plan_json(cli, *args):
    proc = cli("plan", *args, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout), proc.stderr


def test_plan_config_plans_the_run_as_configured(cli, tmp_path):
    """fp16 + selective checkpointing is planned as fp16 + selective (it used to be planned
    as float32 without checkpointing), with the run's batch, loss and strategy."""
    run = {"preset": "smollm-135m",
           "train": {"seq_len": 1024, "micro_batch_size": 8, "global_batch_size": 128, "max_tokens": 2_000_000_000,
                     "precision": "fp16", "activation_checkpointing": "selective",
                     "activation_checkpointing_every": 3, "loss": "chunked"},
           "parallel": {"strategy": "zero1"}}
    f = tmp_path / "run.yaml"
    f.write_text(yaml.safe_dump(run))
    plan, err = _plan_json(cli, "--config", str(f), "--gpu", "a100", "--gpus", "2")
    s = plan["memory"]["settings"]
    assert (s["precision"], s["activation_checkpointing"], s["activation_checkpointing_every"]) == (
        "fp16", "selective", 3)
    assert (s["loss"], s["strategy"], s["n_gpus"]) == ("chunked", "zero1", 2)
    assert plan["gpu"]["dtype"] == "fp16" and plan["seq_len"] == 1024
    b = plan["batch"]
    assert (b["micro_batch"], b["grad_accum"], b["global_batch"]) == (8, 8, 128)
    assert plan["tokens"] == 2_000_000_000 // (128 * 1024) * 128 * 1024 + 128 * 1024  # whole steps, rounded up
    cfg = build_config(config_file=f)
    expected = estimate(cfg.model, 8, 1024, MemorySettings(
        precision="fp16", activation_checkpointing="selective", activation_checkpointing_every=3, loss="chunked",
        strategy="zero1", n_gpus=2)).total
    assert plan["memory_gb"] == pytest.approx(expected / GIB, rel=1e-9)  # --json rounds to 10 digits
    # ... which is not what float32 without checkpointing needs
    run["train"].update(precision="float32", activation_checkpointing="none")
    f.write_text(yaml.safe_dump(run))
    plain, _ = _plan_json(cli, "--config", str(f), "--gpu", "a100", "--gpus", "2")
    assert plain["memory"]["settings"]["precision"] == "float32" and plain["gpu"]["dtype"] == "fp32"
    assert plain["memory_gb"] > plan["memory_gb"]
    # a flag overrides the config
    over, _ = _plan_json(cli, "--config", str(f), "--gpu", "a100", "--gpus", "2", "--checkpointing", "full")
    assert over["memory"]["settings"]["activation_checkpointing"] == "full"


def test_plan_config_reads_a_run_directory_and_notes_renamed_keys(cli, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = build_config(overrides=["train.activation_checkpointing=selective"])
    data = cfg.to_dict()
    data["train"]["checkpoint_every_k"] = data["train"].pop("activation_checkpointing_every")  # an older run
    (run_dir / "config.yaml").write_text(yaml.safe_dump(data))
    plan, err = _plan_json(cli, "--config", str(run_dir))
    assert plan["memory"]["settings"]["activation_checkpointing"] == "selective"
    assert "note: train.checkpoint_every_k is now train.activation_checkpointing_every" in err
    assert err.count("checkpoint_every_k") == 1 and "Traceback" not in err
    # train.precision=auto is resolved as the trainer would, and the plan says how
    assert plan["memory"]["settings"]["precision"] == "bf16" and "train.precision=auto is bf16" in err


def test_plan_speaks_trains_names_and_still_understands_its_old_ones(cli):
    plan, err = _plan_json(cli, "--model", "tiny", "--precision", "bf16-amp", "--strategy", "fsdp", "--gpus", "2")
    assert plan["memory"]["settings"]["precision"] == "bf16" and plan["memory"]["settings"]["strategy"] == "fsdp2"
    assert "note: --precision bf16-amp is now called bf16" in err and "note: --strategy fsdp is now called fsdp2" in err
    plan, err = _plan_json(cli, "--model", "tiny", "--precision", "fp32")
    assert plan["memory"]["settings"]["precision"] == "float32" and "--precision fp32 is now called float32" in err
    # the old plan's bf16 was pure bf16: it now means autocast, as in train.precision, and says so
    plan, err = _plan_json(cli, "--model", "tiny", "--precision", "bf16")
    assert plan["memory"]["settings"]["precision"] == "bf16" and plan["memory"]["weight_copies"] > 0
    assert "--precision bf16 is bf16 autocast over fp32 weights" in err and "bf16-pure" in err
    pure, _ = _plan_json(cli, "--model", "tiny", "--precision", "bf16-pure")
    assert pure["memory"]["settings"]["precision"] == "bf16-pure"
    assert pure["memory"]["params"] < plan["memory"]["params"]
    proc = cli("plan", "--model", "tiny", "--precision", "fp8")
    assert proc.returncode == 2 and "--precision 'fp8': choose bf16, bf16-pure, fp16, float32" in proc.stderr


@pytest.mark.parametrize("flag, key, literal", [
    ("--attention", "model.attention", "AttentionBackend"), ("--loss", "train.loss", "Loss"),
    ("--precision", "train.precision", "PrecisionChoice"),
    ("--checkpointing", "train.activation_checkpointing", "ActivationCheckpointing"),
    ("--strategy", "parallel.strategy", "StrategyChoice")])
def test_plan_flags_take_every_value_the_config_takes(flag, key, literal, capsys):
    """``plan --attention flash`` was refused although train takes model.attention=flash."""
    from flopwise import config
    from flopwise.cli import main

    for value in config.choices(getattr(config, literal)):
        build_config(preset="tiny", overrides=[f"{key}={value}"])  # the config takes it
        rc = main(["plan", "--model", "smollm-135m", "--gpu", "h100", "--gpus", "2", "--tokens", "1B",
                   flag, value, "--json"])
        assert rc == 0, (flag, value, capsys.readouterr().err)
        capsys.readouterr()


def test_plan_diloco_over_25_gbit(cli, tmp_path):
    """Two 8 x H100 nodes on 25 Gbit/s Ethernet: DiLoCo's communication per step beside ddp's and
    fsdp2's, and the H at which it drops under 5% of the step."""
    asked = ("--model", "smollm-360m", "--gpu", "H100", "--gpus", "16", "--gpus-per-node", "8", "--strategy", "diloco",
             "--network", "25gbit")
    proc = cli("plan", *asked)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for text in ("diloco (ddp in groups of 8) on 16 GPU(s)", "DiLoCo outer state", "2.70 GiB",
                 "DiLoCo: 2 groups of 8 GPUs (ddp inside a group)", "every H = 30 inner steps",
                 "2(G-1)/G × 181 MB (a GPU's slice, the pseudo-gradient ÷ S) × 8 GPUs of a node on the NIC they share "
                 "÷ 3.125 GB/s (eth-25g)", "ddp, 16 GPUs", "fsdp2, 16 GPUs", "diloco, H = 30",
                 "under 5% of step time      H >= 66"):
        assert text in out, text
    plan, _ = _plan_json(cli, *asked)
    d = plan["diloco"]
    assert (d["group_size"], d["groups"], d["inner_steps"], d["outer_allreduce"]["link"]) == (8, 2, 30, "eth-25g")
    assert d["pseudo_gradient_bytes"] == 361_821_120 * 4
    assert d["outer_allreduce"]["s"] == pytest.approx(361_821_120 * 4 / 3.125e9)  # 2 (2-1)/2 = 1
    assert set(d["compare"]) == {"ddp", "fsdp2"} and d["compare"]["ddp"]["comm_share"] > 0.5 > d["comm_share"]
    h, inner, outer, compute = d["min_inner_steps"], d["inner"]["comm_s"], d["outer_s"], d["compute_s"]
    assert h == 66

    def share(k: int) -> float:
        return (inner + outer / k) / (compute + inner + outer / k)
    assert share(h) <= 0.05 < share(h - 1)
    # the same plan with H, the outer dtype and the share given
    plan, _ = _plan_json(cli, *asked, "--inner-steps", "100", "--outer-dtype", "bf16", "--comm-share", "0.1")
    d = plan["diloco"]
    assert (d["inner_steps"], d["outer_dtype"], d["target_comm_share"]) == (100, "bf16", 0.1)
    assert d["min_inner_steps"] < 66
    # fsdp2 inside a group of 4: four groups
    plan, _ = _plan_json(cli, *asked, "--inner-strategy", "fsdp2", "--group-size", "4")
    assert (plan["diloco"]["inner_strategy"], plan["diloco"]["groups"]) == ("fsdp2", 4)
    assert plan["memory"]["settings"]["inner_strategy"] == "fsdp2"
    # a run config with parallel.strategy=diloco plans its own H and inner strategy
    f = tmp_path / "run.yaml"
    f.write_text(yaml.safe_dump({"preset": "smollm-135m", "parallel": {
        "strategy": "diloco", "inner_steps": 20, "inner_strategy": "fsdp2"}}))
    plan, _ = _plan_json(cli, "--config", str(f), "--gpu", "h100", "--gpus", "16", "--network", "25gbit")
    assert (plan["diloco"]["inner_steps"], plan["diloco"]["inner_strategy"], plan["diloco"]["groups"]) == (
        20, "fsdp2", 2)


def test_plan_network_names_and_diloco_flags_are_checked(capsys):
    from flopwise.cli import main

    def plan(*args: str) -> tuple[int, str, str]:
        rc = main(["plan", "--model", "smollm-360m", "--gpu", "h100", "--gpus", "16", *args])
        out, err = capsys.readouterr()
        return rc, out, err

    rc, by_alias, _ = plan("--strategy", "ddp", "--network", "25gbit")
    assert rc == 0 and (rc, by_alias) == plan("--strategy", "ddp", "--network", "eth-25g")[:2]
    assert "eth-25g" in by_alias and "diloco" not in by_alias.lower()
    cases = [
        (["--network", "25gbe"], "--network '25gbe' is not known; choose one of pcie3,"),
        (["--interconnect", "nvlink9"], "--interconnect 'nvlink9' is not known; choose one of"),
        (["--inner-steps", "10"], "--inner-steps is a DiLoCo setting: give --strategy diloco"),
        (["--strategy", "diloco", "--group-size", "3"], "--group-size 3 must divide --gpus 16"),
        (["--strategy", "diloco", "--outer-dtype", "fp8"], "--outer-dtype 'fp8': choose fp32, bf16"),
    ]
    for args, message in cases:
        rc, out, err = plan(*args)
        assert rc == 2, (args, out)
        assert message in err, (args, err)
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "<N>gbit" in plan("--network", "x")[2]
