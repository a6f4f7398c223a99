"""When one rank of a ``torchrun`` job dies, the others stop with one line that says so.

Before, rank 0 of a 2-rank gloo run whose rank 1 was SIGKILLed printed gloo's traceback
("[rank0]: RuntimeError: [.../gloo/transport/tcp/pair.cc:553] Connection closed by peer
[127.0.0.1]:45203 ... GLHF!") and was then SIGTERMed by torchrun. Now its collective's failure
becomes ``flopwise train: rank 0 stops: rank 1 died or left the job (...)`` and it exits 2
(``DistEnv.peer_failure``, ``trainer._peer_failures``). torchrun's own summary of the failed
child (and its ChildFailedError traceback) is torchrun's and stays.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from helpers import torchrun_children

from flopwise.errors import FlopwiseError
from flopwise.parallel.distributed import DistEnv, PeerFailure
from flopwise.train.stopping import NonFiniteError, SignalStop, ignore_sigterm

GLOO_CLOSED = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
               "[127.0.0.1]:45203. This is typically caused by a remote worker crashing. Check the logs of the "
               "remote worker before reporting an error. GLHF!")
GLOO_RESET = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:651: "
              "Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the "
              "application. Check the logs of the remote worker before reporting an error. GLHF!")
GLOO_TIMEOUT = ("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 1800000ms for recv "
                "operation to complete")


# ------------------------------------------------------------------ which errors are a peer's death

def test_a_peers_death_in_a_two_rank_job_names_the_other_rank():
    failure = DistEnv(0, 0, 2, "gloo").peer_failure(RuntimeError(GLOO_CLOSED))
    assert isinstance(failure, PeerFailure) and isinstance(failure, FlopwiseError)
    message = str(failure)
    assert "\n" not in message
    assert message.startswith("rank 0 stops: rank 1 died or left the job "
                              "(gloo: Connection closed by peer [127.0.0.1]:45203)")
    assert "rank 1's own output says why" in message and "GLHF" not in message
    assert str(DistEnv(1, 1, 2, "gloo").peer_failure(RuntimeError(GLOO_RESET))).startswith(
        "rank 1 stops: rank 0 died or left the job (gloo: Read error [127.0.0.1]:651: Connection reset by peer)")


def test_in_a_larger_job_the_peer_is_another_rank_at_its_address():
    message = str(DistEnv(2, 2, 4, "gloo").peer_failure(RuntimeError(GLOO_CLOSED)))
    assert message.startswith("rank 2 stops: another rank at 127.0.0.1:45203 died or left the job")


def test_a_timeout_says_the_peer_did_not_answer_within_the_groups_timeout():
    message = str(DistEnv(0, 0, 4, "gloo").peer_failure(RuntimeError(GLOO_TIMEOUT), timeout_min=30))
    assert message.startswith("rank 0 stops: another rank did not answer within parallel.timeout_min=30 "
                              "(gloo: Timed out waiting 1800000ms for recv operation to complete): it died, hung")
    nccl = dist.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:1970, remote process exited or there was a "
                                 "network error, NCCL version 2.21.5")
    assert "rank 1 died or left the job" in str(DistEnv(0, 0, 2, "nccl").peer_failure(nccl))


@pytest.mark.parametrize("env, err", [
    (DistEnv(0, 0, 2, "gloo"), RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")),  # not a peer
    (DistEnv(0, 0, 2, "gloo"), RuntimeError("Connection reset by peer")),  # not from the process group (a W&B upload)
    (DistEnv(0, 0, 2, "gloo"), ConnectionResetError(104, "Connection reset by peer")),  # an OSError
    (DistEnv(0, 0, 2, "gloo"), NonFiniteError("gloo: connection closed by peer")),  # already a user's error
    (DistEnv(), RuntimeError(GLOO_CLOSED)),  # one process: no peers
    (DistEnv(0, 0, 1, "gloo", _owns_group=False), RuntimeError(GLOO_CLOSED)),  # a one-rank group
])
def test_other_errors_keep_their_own_message(env, err):
    assert env.peer_failure(err) is None


def test_a_stopping_rank_ignores_torchruns_sigterm_also_after_the_loops_signal_handling():
    before = signal.getsignal(signal.SIGTERM)
    try:
        with SignalStop():
            ignore_sigterm()
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN  # not restored to the default (death)
        signal.signal(signal.SIGTERM, before)
        with SignalStop():
            pass
        assert signal.getsignal(signal.SIGTERM) == before  # otherwise restored as before
    finally:
        signal.signal(signal.SIGTERM, before)


# ------------------------------------------------------------------ a real rank killed under torchrun

def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                            "MASTER_PORT", "FLOPWISE_DEBUG")}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _logged_steps(run: Path) -> int:
    metrics = run / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.is_file() else 0


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc to find the rank processes")
@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo")
def test_when_rank_1_is_killed_rank_0_stops_with_one_line(small_builtin, tmp_path):
    _, data = small_builtin
    run = tmp_path / "run"
    overrides = [
        f"data.path={data}", "model.vocab_size=512", "model.d_model=64", "model.n_layers=2", "model.n_heads=4",
        "model.n_kv_heads=2", "model.ffn_hidden=192", "model.max_seq_len=64", "train.seq_len=64",
        "train.micro_batch_size=4", "train.global_batch_size=16", "train.max_steps=100000", "train.log_every=1",
        "eval.every=0", "parallel.strategy=ddp", "tracking.tensorboard=false", f"train.run_dir={run}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "flopwise",
           "train", *overrides]
    launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
                                start_new_session=True)  # its own process group: cleaned up whatever happens
    try:
        deadline = time.monotonic() + 300  # not a timing assertion: only how long to wait before giving up
        while _logged_steps(run) < 3 and launcher.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _logged_steps(run) >= 3, "the run did not reach step 3"
        ranks = torchrun_children(launcher.pid)
        assert set(ranks) == {0, 1}, ranks
        os.kill(ranks[1], signal.SIGKILL)  # mid-run, as the kernel's OOM killer or a lost node would
        out, err = launcher.communicate(timeout=300)  # the survivors do not hang
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.communicate()
    assert launcher.returncode != 0
    ours = [line for line in err.splitlines() if line.startswith("flopwise train:")]
    assert len(ours) == 1, err[-5000:]
    assert ours[0].startswith("flopwise train: rank 0 stops: rank 1 died or left the job (gloo: "), ours[0]
    assert "rank 1's own output says why" in ours[0]
    # No traceback from rank 0 (torch's excepthook prefixes its lines with "[rank0]:"); the only
    # traceback left is torchrun's own, of its ChildFailedError.
    assert "[rank0]" not in err, err[-5000:]
    assert err.count("Traceback (most recent call last)") == err.count("ChildFailedError:"), err[-5000:]
    assert "Connection closed by peer [" not in err.replace(ours[0], "")  # gloo's message only inside our line
    # rank 0 ended by itself with the command line's status 2 (torchrun's SIGTERM did not cut it off)
    assert re.search(r"rank\s*:\s*0 \(local_rank: 0\)\s*\n\s*exitcode\s*:\s*2\b", err), err[-3000:]
