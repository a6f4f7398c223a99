"""`flopwise plan` as a user runs it."""

import json



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
    proc = cli("plan", "--list-gpus")
    assert proc.returncode == 0 and "H100 SXM" in proc.stdout and "989.4" in proc.stdout
    assert "1979" not in proc.stdout  # never the sparse figure


def test_plan_raw_params_uses_6n(cli):
    proc = cli("plan", "--params", "8e9", "--gpu", "h100", "--gpus", "8", "--tokens", "1T", "--json")
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["flops_formula"] == "6n" and plan["flops_per_token"] == 48e9
    assert abs(plan["hours"] - 6 * 8e9 * 1e12 / (989.4e12 * 8 * 0.4) / 3600) < 1e-6


def test_plan_errors_name_the_flag(cli):
    cases = [
        (["--model", "smollm-360m", "--hours", "-1"], "--hours must be > 0"),
        (["--model", "smollm-360m", "--mfu", "1.2"], "--mfu must be in (0, 1]"),
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
    assert "planned with fsdp instead (14.90 GiB per GPU, states only: activations not counted)" in top
    assert "fsdp on 8 GPU(s)" in proc.stdout and "Scaling (fsdp" in proc.stdout
    assert "activations                NOT counted" in proc.stdout
    assert "states only, activations NOT counted; fits under 90% of 80 GiB before activations" in proc.stdout
    proc = cli("plan", "--params", "8e9", "--tokens", "160B", "--gpu", "h100", "--gpus", "8", "--strategy", "ddp",
               "--price-per-gpu-hour", "2")
    assert proc.returncode == 0, proc.stderr
    top = "\n".join(proc.stdout.splitlines()[:5])
    assert "ddp does NOT fit" in top and "fsdp fits (14.90 GiB per GPU" in top and "--strategy fsdp" in top
    for line in proc.stdout.splitlines():
        if line.strip().startswith(("wall time", "cost")):
            assert "NOT runnable" in line, line
