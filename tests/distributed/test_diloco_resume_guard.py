"""A DiLoCo checkpoint resumed under settings it cannot continue exactly is refused, never
silently cut down (issue 44, item 11).

One 2-rank run (2 worker groups of 1 gloo rank, H = 2, a fragment's all-reduce landing a step
after it is sent) leaves three checkpoints: step 1 between syncs, step 2 with the fragment in
flight, step 3 at the run's last sync. From copies of that run:

- step 2 resumed with another ``parallel.inner_steps``: refused, naming the field and both
  values (the in-flight fragment was scheduled under the old one);
- step 1 resumed in one process (``parallel.strategy=single``): refused (group 1's weights, the
  anchor and the outer momentum would be dropped); the checkpoint is left as it was;
- step 3, where every group holds the same weights, resumes in one process with a note that the
  outer momentum is left behind.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from test_data_parallel import ok, one_process, torchrun

from flopwise.checkpoints import latest_checkpoint, list_checkpoints

pytestmark = pytest.mark.slow  # launches torchrun


@pytest.fixture(scope="module")
def diloco_run(small_builtin, tmp_path_factory):
    _, data = small_builtin
    common = [
        f"data.path={data}", "data.loader=epoch", "model.vocab_size=512", "model.d_model=32", "model.n_layers=1",
        "model.n_heads=2", "model.n_kv_heads=1", "model.ffn_hidden=64", "model.max_seq_len=32",
        "train.seq_len=32", "train.global_batch_size=4", "train.micro_batch_size=2", "train.log_every=1",
        "eval.every=0", "eval.windows=2", "eval.sample_tokens=0", "optim.warmup_steps=1",
        "tracking.tensorboard=false", "train.checkpoint_every=1", "train.keep_checkpoints=0",
    ]
    diloco = ["parallel.strategy=diloco", "parallel.group_size=1", "parallel.inner_steps=2",
              "parallel.overlap_steps=1"]
    run = tmp_path_factory.mktemp("diloco-guard") / "run"
    ok(torchrun(2, common + diloco + ["train.max_steps=3", f"train.run_dir={run}"]))
    assert [p.name for p in list_checkpoints(run)] == ["step-0000001", "step-0000002", "step-0000003"]
    return run, common, diloco


def copy_up_to(run: Path, step: int, dest: Path) -> Path:
    """A copy of ``run`` whose latest checkpoint is ``step`` (the later ones left out of the copy)."""
    shutil.copytree(run, dest, ignore=lambda d, names: [n for n in names if n.startswith("step-")
                                                        and int(n[5:]) > step])
    assert latest_checkpoint(dest).name == f"step-{step:07d}"
    return dest


def test_another_inner_steps_with_a_fragment_in_flight_is_refused(diloco_run, tmp_path):
    run, common, diloco = diloco_run
    copy = copy_up_to(run, 2, tmp_path / "run")
    before = (latest_checkpoint(copy) / "diloco" / "outer.pt").read_bytes()
    changed = [a for a in diloco if not a.startswith("parallel.inner_steps")] + ["parallel.inner_steps=3"]
    proc = torchrun(2, common + changed + ["train.max_steps=6", f"train.run_dir={copy}"])
    assert proc.returncode != 0, proc.stdout[-2000:]
    err = proc.stderr
    assert "src/flopwise" not in err, err[-3000:]  # one line from flopwise (torchrun adds its own report)
    assert err.count("parallel.inner_steps=2 (this launch: parallel.inner_steps=3)") == 1, err[-3000:]
    assert "in flight" in err and "Resume with the recorded values" in err, err[-3000:]
    assert latest_checkpoint(copy).name == "step-0000002"
    assert (latest_checkpoint(copy) / "diloco" / "outer.pt").read_bytes() == before


def test_a_checkpoint_between_syncs_is_refused_in_one_process_and_one_at_a_sync_resumes(diloco_run, tmp_path):
    run, common, _ = diloco_run
    between = copy_up_to(run, 1, tmp_path / "between")
    proc = one_process(common + ["parallel.strategy=single", "train.max_steps=3", f"train.run_dir={between}"])
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "between outer syncs" in proc.stderr and "parallel.strategy=diloco" in proc.stderr, proc.stderr[-3000:]
    assert [p.name for p in list_checkpoints(between)] == ["step-0000001"]  # nothing trained, nothing pruned

    synced = copy_up_to(run, 3, tmp_path / "synced")
    proc = ok(one_process(common + ["parallel.strategy=single", "train.max_steps=4", f"train.run_dir={synced}"]))
    assert "outer momentum" in proc.stdout, proc.stdout[-3000:]
    assert latest_checkpoint(synced).name == "step-0000004"
