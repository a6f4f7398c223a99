"""Fault injection: SIGKILL a training run at random moments, resume it each time, and check
that its final weights equal an uninterrupted run's, bit for bit.

The run is the tiny model on a 0.6 MB slice of the embedded corpus, checkpointing every 2
steps (so kills land in steps, in saves, in retention and in start-up alike). After each kill
the same command is run again on the same run directory -- ``flopwise train`` resumes from
the latest complete checkpoint -- until ``--kills`` kills have been dealt; then the run is
left to finish. Also counted: kills that left a partial ``.tmp-step-*`` directory behind
(i.e. landed during a save).

    python benchmarks/fault_injection.py [--kills 25] [--steps 60] [--seed 0]

Prints a summary and writes benchmarks/results/fault-injection-<device>-<date>.json.
"""

from __future__ import annotations

import argparse
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


from _results import cores as n_cores, cpu_label, save_result  # benchmarks/ is on sys.path when a script runs
from flopwise.train.checkpoint import latest_checkpoint


def overrides(cache: Path, run_dir: Path, steps: int) -> list[str]:
    return [
        f"data.cache_dir={cache}", "data.builtin_vocab_size=512", "data.builtin_max_mb=0.6",
        "model.vocab_size=512", "model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
        "model.ffn_hidden=192", "model.max_seq_len=64", "train.seq_len=64", "train.micro_batch_size=8",
        "train.global_batch_size=16", f"train.max_steps={steps}", "train.checkpoint_every=2",
        "train.keep_checkpoints=2", "train.log_every=1", "eval.every=0", "eval.sample_tokens=0",
        f"train.run_dir={run_dir}",
    ]


def run(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "flopwise", "train", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(latest_checkpoint(run_dir) / "model.pt", weights_only=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=25)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    tmp = Path(tempfile.mkdtemp(prefix="flopwise-faults-"))
    try:
        cache = tmp / "cache"
        ref = tmp / "ref"
        t0 = time.perf_counter()
        proc = run(overrides(cache, ref, a.steps))
        _, err = proc.communicate()
        if proc.returncode != 0:
            print(err, file=sys.stderr)
            return 1
        ref_seconds = time.perf_counter() - t0

        target = tmp / "killed"
        kills, in_save, restarts, resumed_steps = 0, 0, 0, []
        while True:
            proc = run(overrides(cache, target, a.steps))
            restarts += 1
            if kills < a.kills:
                # Anywhere from interpreter start-up to well into training.
                time.sleep(rng.uniform(0.2, 1.2 * ref_seconds / 2))
                if proc.poll() is None:
                    proc.send_signal(signal.SIGKILL)
                    proc.wait()
                    kills += 1
                    if list((target / "checkpoints").glob(".tmp-step-*")):
                        in_save += 1
                    last = latest_checkpoint(target)
                    resumed_steps.append(int(last.name[5:]) if last else 0)
                    continue
            _, err = proc.communicate()
            if proc.returncode != 0:
                print(err, file=sys.stderr)
                return 1
            if latest_checkpoint(target).name == f"step-{a.steps:07d}":
                break

        wa, wb = weights(ref), weights(target)
        equal = wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
        cores = n_cores()
        result = {
            "steps": a.steps,
            "checkpoint_every": 2,
            "kills": kills,
            "kills_during_a_save": in_save,
            "processes_started": restarts,
            "latest_checkpoint_after_each_kill": resumed_steps,
            "uninterrupted_run_seconds": ref_seconds,
            "final_weights_bitwise_equal": equal,
        }
        print(f"{kills} SIGKILLs ({in_save} during a save), {restarts} processes; "
              f"final weights {'EQUAL' if equal else 'DIFFERENT'} to the uninterrupted run's")
        save_result("fault-injection", f"cpu{cores}", cpu_label(), result)
        return 0 if equal else 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
