"""Issue 52's two defects on the way: an fp8 step priced as bf16, and ``--rank`` on a GPU it
cannot predict tracing every candidate, then saying "no candidate fits" with exit 0."""

from __future__ import annotations

from test_virtual_preflight import CFG, result

from flopwise.config import build_config
from flopwise.tune.predict import predicted


def test_an_fp8_step_is_not_priced_as_bf16():
    """The worker reports an fp8 run's precision as bf16 (fp8 is train.fp8, not a precision): the
    guard that looked for "fp8" in the precision let it through, priced at bf16 rates."""
    traced = result(8, 30.0, work=4)
    assert traced["precision"] == "bf16" and predicted(traced, CFG)["predicted"]
    fp8 = build_config("tiny", overrides=["train.seq_len=128", "train.micro_batch_size=4",
                                          "train.global_batch_size=16", "train.fp8=true"])
    p = predicted(traced, fp8)
    assert p["predicted"] is False and "fp8 steps are not predicted" in p["why"], p


def test_rank_on_a_gpu_with_no_prediction_stops_before_any_trace_naming_the_missing_constant(cli):
    proc = cli("preflight", "--dry-run", "--rank", "--preset", "tiny", "--gpu", "v100")  # no bf16 tensor rate
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-500:], proc.stderr[-500:])
    assert "trace 1 done" not in proc.stdout and "nothing to choose" not in proc.stdout, proc.stdout
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and "V100 SXM2 32GB has no dense bf16 peak" in err[0], err
    assert "--rank ranks the candidates by their predicted step time" in err[0], err
