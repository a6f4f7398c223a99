"""Issue 52's defects on the way: ``--rank`` on a GPU it cannot predict traced every candidate,
then said "no candidate fits" with exit 0. (The other, an fp8 step priced as bf16: its scaled
matmuls are now recorded and priced at the fp8 rate, tests/integration/test_fp8_dryrun.py.)"""

from __future__ import annotations


def test_rank_on_a_gpu_with_no_prediction_stops_before_any_trace_naming_the_missing_constant(cli):
    proc = cli("preflight", "--dry-run", "--rank", "--preset", "tiny", "--gpu", "v100")  # no bf16 tensor rate
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-500:], proc.stderr[-500:])
    assert "trace 1 done" not in proc.stdout and "nothing to choose" not in proc.stdout, proc.stdout
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and "V100 SXM2 32GB has no dense bf16 peak" in err[0], err
    assert "--rank ranks the candidates by their predicted step time" in err[0], err
