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
