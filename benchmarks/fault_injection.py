"""Fault injection: SIGKILL a training run exactly ``--kills`` times at moments chosen from its
own progress (start-up, mid-step, inside a checkpoint save), resume it after each kill, and
check that its final weights equal an uninterrupted run's, bit for bit.

The run is the tiny model on a 0.6 MB slice of the embedded corpus, checkpointing every 2
steps and keeping 2 (so saves and retention happen often). First an uninterrupted reference
run is watched to learn how long start-up, a step and a save take on this machine. Then each
attempt starts ``flopwise train`` on the same run directory -- it resumes from the latest
complete checkpoint -- with one kill planned, of one of three kinds:

- ``start-up``: after a random delay shorter than the start-up last observed (interpreter,
  imports, data, model, checkpoint load, up to the first logged step);
- ``step``: once ``metrics.jsonl`` shows a randomly chosen step, plus a random part of a step;
- ``save``: once the hidden ``checkpoints/.tmp-step-N`` of a chosen checkpoint appears, plus a
  random part of a save (if the save was over before it was seen, the next one is aimed at).

Targets are drawn ahead of the resumed step and spread so that the run does not finish while
kills are still owed; if an attempt does finish unkilled it is counted, and the kills still
owed are dealt to a fresh run (a new "round", whose final weights are compared too). Each
kill goes to the process group the attempt was started in, which is waited for (waitpid) and
checked empty before the next attempt starts, so no dead run still holds the run directory.
A kill counts as inside a save when it leaves a ``.tmp-step-*`` directory this attempt wrote
(and as inside retention when it leaves a ``.deleting-step-*``). After the last kill the run
is resumed to completion. The script exits non-zero, saying why, unless exactly ``--kills``
kills were dealt and every round's final weights match the reference.

    python benchmarks/fault_injection.py [--kills 8] [--steps 60] [--seed 0] [--rtol 0]

Prints each kill and a summary and writes benchmarks/results/fault-injection-<device>-<date>.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _run
import torch
from _results import cores as n_cores  # benchmarks/ is on sys.path when a script runs
from _results import cpu_label, save_result
from _run import group_alive, run

from flopwise.checkpoints import latest_checkpoint
from flopwise.train.record import code_version  # the git commit and dirty flag a run records

CHECKPOINT_EVERY = 2
POLL_S = 0.001  # how often a running attempt's metrics.jsonl and checkpoints/ are looked at
KINDS = ("start-up", "step", "save")


def overrides(cache: Path, run_dir: Path, steps: int) -> list[str]:
    return [
        f"data.cache_dir={cache}", "data.builtin_vocab_size=512", "data.builtin_max_mb=0.6",
        "model.vocab_size=512", "model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
        "model.ffn_hidden=192", "model.max_seq_len=64", "train.seq_len=64", "train.micro_batch_size=8",
        "train.global_batch_size=16", f"train.max_steps={steps}", f"train.checkpoint_every={CHECKPOINT_EVERY}",
        "train.keep_checkpoints=2", "train.log_every=1", "eval.every=0", "eval.sample_tokens=0",
        f"train.run_dir={run_dir}",
    ]


def ckpt_step(path: Path | None) -> int:
    return int(path.name[5:]) if path is not None else 0


# --------------------------------------------------------------------------- watching a run


class Watch:
    """What a running attempt has done so far, read from its run directory: the latest step in
    ``metrics.jsonl`` (rows left by an earlier attempt do not count until this one has rewritten
    the file), and the checkpoint directories (``step-*``, ``.tmp-step-*``, ``.deleting-step-*``)
    it created or touched since it started."""

    def __init__(self, run_dir: Path):
        self.metrics = run_dir / "metrics.jsonl"
        self.ckpts = run_dir / "checkpoints"
        self.started_ns = time.time_ns()
        st = self._stat(self.metrics)
        self.stale_inode = st.st_ino if st else None
        self.stale_max = self._max_step() if st else -1
        self._key: tuple | None = None
        self._step = -1

    @staticmethod
    def _stat(path: Path) -> os.stat_result | None:
        try:
            return os.stat(path)
        except FileNotFoundError:
            return None

    def _max_step(self) -> int:
        try:
            text = self.metrics.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return -1
        best = -1
        for line in text.splitlines():
            try:
                row = json.loads(line)
            except ValueError:  # a line being written, or cut by a kill
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), int):
                best = max(best, row["step"])
        return best

    def step(self) -> int:
        """The latest step this attempt has logged (-1: none yet)."""
        st = self._stat(self.metrics)
        if st is None:
            return -1
        key = (st.st_ino, st.st_size, st.st_mtime_ns)
        if key != self._key:
            self._key = key
            best = self._max_step()
            self._step = best if st.st_ino != self.stale_inode or best > self.stale_max else -1
        return self._step

    def fresh(self, prefix: str) -> list[str]:
        """Entries of checkpoints/ named ``prefix*`` created or changed since this attempt started."""
        out = []
        try:
            with os.scandir(self.ckpts) as it:
                for entry in it:
                    if entry.name.startswith(prefix):
                        try:
                            if entry.stat(follow_symlinks=False).st_ctime_ns >= self.started_ns:
                                out.append(entry.name)
                        except FileNotFoundError:  # removed meanwhile
                            pass
        except FileNotFoundError:
            pass
        return sorted(out)


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the attempt's whole process group, reap the leader and wait until none is left."""
    if left := _run.kill_group(proc, wait_s=30):
        raise RuntimeError(f"processes {left} of the killed run's group are still alive after 30 s")


def run_attempt(cmd: list[str], run_dir: Path, log: Path, plan: dict[str, Any] | None, est: dict[str, float],
                rng: random.Random, watchdog_s: float) -> dict[str, Any]:
    """Start ``flopwise train`` on ``run_dir`` and, with a ``plan``, SIGKILL it when the plan says.

    Returns what happened: ``outcome`` killed / finished / failed, the seconds into the attempt,
    the step logged before the kill, when start-up ended, what the save watch saw."""
    watch = Watch(run_dir)
    t0 = time.perf_counter()
    with open(log, "wb") as out:
        # not _run.run: an attempt is watched while it runs and killed at a moment of the plan's choosing
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        return _drive(proc, watch, t0, plan, est, rng, watchdog_s)
    finally:  # this script interrupted (Ctrl-C, an error): leave no run behind, it has a session of its own
        if proc.returncode is None or group_alive(proc.pid):
            kill_group(proc)


def _drive(proc: subprocess.Popen, watch: Watch, t0: float, plan: dict[str, Any] | None, est: dict[str, float],
           rng: random.Random, watchdog_s: float) -> dict[str, Any]:
    kill_at = None
    target = dict(plan or {})
    first_row_s = None
    resumed_from = target.get("resumed_from", 0)
    if target.get("kind") == "start-up":
        kill_at = rng.uniform(0.02, max(0.05, est["startup_s"]))
    save_seen: dict[int, float] = {}  # checkpoint step -> when its .tmp was first seen
    save_done: dict[int, float] = {}  # checkpoint step -> when its step-* was first seen
    note = ""
    while True:
        rc = proc.poll()
        now = time.perf_counter() - t0
        if rc is not None:
            group_left = group_alive(proc.pid)
            if group_left:  # a child outliving a finished leader would keep the run directory locked
                kill_group(proc)
            return {"outcome": "finished" if rc == 0 else "failed", "returncode": rc, "seconds": now,
                    "first_row_s": first_row_s, "save_seen": save_seen, "save_done": save_done,
                    "target": target, "note": note}
        if now > watchdog_s:
            kill_group(proc)
            return {"outcome": "failed", "returncode": None, "seconds": now, "first_row_s": first_row_s,
                    "save_seen": save_seen, "save_done": save_done, "target": target,
                    "note": f"no exit after {watchdog_s:.0f} s: killed by the watchdog"}
        step = watch.step()
        if first_row_s is None and step > resumed_from:
            first_row_s = now
        for name in watch.fresh(".tmp-step-"):
            if name[10:].isdigit():
                save_seen.setdefault(int(name[10:]), now)
        for name in watch.fresh("step-"):
            if name[5:].isdigit():
                save_done.setdefault(int(name[5:]), now)
        if kill_at is None and target:
            if target["kind"] == "step" and step >= target["step"]:
                kill_at = now + rng.uniform(0.0, est["step_s"])
            elif target["kind"] == "save":
                s = target["save"]
                if s in save_seen and s not in save_done:
                    kill_at = now + rng.uniform(0.0, est["save_s"])
                elif s in save_done or step > s:  # over before it was seen: aim at the next one
                    nxt = s + CHECKPOINT_EVERY
                    if nxt <= target["last"]:
                        note += f"save {s} missed; "
                        target["save"] = nxt
                    else:
                        note += f"save {s} missed, none left: killed at once; "
                        kill_at = now
        if kill_at is not None and now >= kill_at:
            before = watch.step()
            kill_group(proc)
            now = time.perf_counter() - t0
            if proc.returncode != -signal.SIGKILL:  # it exited on its own just before the kill
                return {"outcome": "finished" if proc.returncode == 0 else "failed",
                        "returncode": proc.returncode, "seconds": now, "first_row_s": first_row_s,
                        "save_seen": save_seen, "save_done": save_done, "target": target, "note": note}
            return {"outcome": "killed", "returncode": proc.returncode, "seconds": now, "first_row_s": first_row_s,
                    "step_logged": before, "save_seen": save_seen, "save_done": save_done, "target": target,
                    "in_save": watch.fresh(".tmp-step-"), "in_retention": watch.fresh(".deleting-step-"),
                    "note": note}
        time.sleep(POLL_S)


def plan_kill(kind: str, resumed_from: int, steps: int, owed: int, rng: random.Random) -> dict[str, Any]:
    """Where to kill the next attempt. Targets lie ahead of the checkpoint it resumes from, at
    most ``2 x (steps left) / (kills owed + 1)`` ahead, so that on average the kills spread over
    the run and the last one still lands before its end."""
    span = max(1, round(2 * (steps - resumed_from) / (owed + 1)))
    if kind == "step" and resumed_from + 1 > steps - 1:
        kind = "save"
    if kind == "save" and resumed_from >= steps:  # killed after the final checkpoint: only start-up is left
        kind = "start-up"
    plan: dict[str, Any] = {"kind": kind, "resumed_from": resumed_from}
    if kind == "step":
        plan["step"] = min(steps - 1, resumed_from + rng.randint(1, span))
    elif kind == "save":
        at = resumed_from + rng.randint(1, span)
        plan["save"] = min(steps, CHECKPOINT_EVERY * math.ceil(at / CHECKPOINT_EVERY))
        plan["last"] = steps
    return plan


# --------------------------------------------------------------------------- weights


def load_tensors(ckpt: Path, stem: str) -> dict[str, Any] | None:
    """``<stem>.safetensors`` or ``<stem>.pt`` of a checkpoint, read as tensors only."""
    if (ckpt / f"{stem}.safetensors").is_file():
        from safetensors.torch import load_file

        return load_file(ckpt / f"{stem}.safetensors")
    if (ckpt / f"{stem}.pt").is_file():
        return torch.load(ckpt / f"{stem}.pt", weights_only=True, map_location="cpu")
    return None


def flat(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts/lists flattened to ``a.b.0.c`` -> leaf."""
    if isinstance(obj, dict):
        return {k: v for key, val in obj.items() for k, v in flat(val, f"{prefix}{key}.").items()}
    if isinstance(obj, (list, tuple)):
        return {k: v for i, val in enumerate(obj) for k, v in flat(val, f"{prefix}{i}.").items()}
    return {prefix.rstrip("."): obj}


def compare(ref: dict[str, Any], got: dict[str, Any], rtol: float) -> dict[str, Any]:
    """Bitwise equality, the largest absolute difference, and the largest difference relative to
    the tensor's own largest magnitude (the tolerance ``rtol`` is measured against that)."""
    a, b = flat(ref), flat(got)
    out: dict[str, Any] = {"bitwise_equal": a.keys() == b.keys(), "max_abs_diff": 0.0, "max_rel_diff": 0.0,
                           "worst": None, "missing_or_extra": sorted(set(a) ^ set(b))}
    for k in sorted(set(a) & set(b)):
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            if x.shape != y.shape or x.dtype != y.dtype:
                out["bitwise_equal"] = False
                out["max_abs_diff"] = out["max_rel_diff"] = math.inf
                out["worst"] = f"{k}: shape/dtype {tuple(x.shape)} {x.dtype} vs {tuple(y.shape)} {y.dtype}"
                continue
            if torch.equal(x, y):
                continue
            out["bitwise_equal"] = False
            diff, scale = (x.double() - y.double()).abs().max().item(), x.double().abs().max().item()
            rel = diff / scale if scale > 0 else math.inf
            if rel > out["max_rel_diff"] or out["worst"] is None:
                out["worst"] = k
            out["max_abs_diff"] = max(out["max_abs_diff"], diff)
            out["max_rel_diff"] = max(out["max_rel_diff"], rel)
        elif x != y:
            out["bitwise_equal"] = False
            out["worst"] = f"{k}: {x!r} vs {y!r}"
            out["max_abs_diff"] = out["max_rel_diff"] = math.inf
    out["within_tolerance"] = out["bitwise_equal"] or (not out["missing_or_extra"] and out["max_rel_diff"] <= rtol)
    return out


# --------------------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=8, help="SIGKILLs to deal, exactly (default 8)")
    ap.add_argument("--steps", type=int, default=60, help="training steps of the run (default 60)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the kill plan and its random delays")
    ap.add_argument("--rtol", type=float, default=0.0,
                    help="accept final weights whose largest difference is at most this times the tensor's "
                         "largest magnitude (default 0: bit for bit)")
    ap.add_argument("--keep", type=Path, default=None, help="keep the run directories and logs here")
    a = ap.parse_args()
    if a.kills < 0 or a.steps < 2 * CHECKPOINT_EVERY:
        ap.error("--kills must be >= 0 and --steps >= 4")
    rng = random.Random(a.seed)
    t_all = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="flopwise-faults-"))
    logs = tmp / "logs"
    logs.mkdir()
    code = code_version()
    try:
        return _main(a, rng, tmp, logs, code, t_all)
    finally:
        if a.keep is not None:
            shutil.copytree(tmp, a.keep, dirs_exist_ok=True)
            print(f"run directories and logs kept in {a.keep}")
        shutil.rmtree(tmp, ignore_errors=True)


def _main(a: argparse.Namespace, rng: random.Random, tmp: Path, logs: Path, code: dict[str, Any],
          t_all: float) -> int:
    cache = tmp / "cache"

    def cmd(run_dir: Path) -> list[str]:
        return [sys.executable, "-m", "flopwise", "train", *overrides(cache, run_dir, a.steps)]

    def fail(why: str, log: Path | None = None) -> int:
        if log is not None and log.is_file():
            print(f"--- last lines of {log.name} ---", file=sys.stderr)
            print("\n".join(log.read_text(errors="replace").splitlines()[-40:]), file=sys.stderr)
        print(f"fault injection FAILED: {why}", file=sys.stderr)
        return 1

    # 1. The uninterrupted reference, watched for how long start-up, a step and a save take.
    # A first short run prepares the data cache, so that the reference's start-up is a resume's.
    ref = tmp / "ref"
    warm = run([sys.executable, "-m", "flopwise", "train", *overrides(cache, tmp / "warm", 2)])
    if not warm.ok:
        print(warm.stderr, file=sys.stderr)
        return fail(f"the data-preparing warm-up run failed ({warm.failure})")
    shutil.rmtree(tmp / "warm", ignore_errors=True)
    r = run_attempt(cmd(ref), ref, logs / "ref.log", None, {}, rng, watchdog_s=1800)
    if r["outcome"] != "finished" or ckpt_step(latest_checkpoint(ref)) != a.steps:
        return fail(f"the reference run {r['outcome']} (exit {r['returncode']}) {r['note']}", logs / "ref.log")
    ref_seconds = r["seconds"]
    first_row = r["first_row_s"] or ref_seconds / 2
    saves = [r["save_done"][s] - r["save_seen"][s] for s in r["save_seen"] if s in r["save_done"]]
    est = {"startup_s": first_row,
           "step_s": max(1e-3, (ref_seconds - first_row) / a.steps),
           "save_s": sorted(saves)[len(saves) // 2] if saves else 0.005}
    ref_timing = {"seconds": ref_seconds, "first_step_logged_s": first_row, "step_s": est["step_s"],
                  "save_s_median": est["save_s"] if saves else None, "saves_seen_in_progress": len(saves),
                  "saves": len(r["save_done"])}
    print(f"reference: {ref_seconds:.1f} s, first step logged at {first_row:.2f} s, "
          f"{1000 * est['step_s']:.0f} ms/step, save {1000 * est['save_s']:.1f} ms "
          f"({len(saves)} of {len(r['save_done'])} saves caught in progress)")
    if not saves:
        print("  warning: no save of the reference run was seen in progress (no checkpoints/.tmp-step-* "
              "directory): kills aimed at saves will probably land just after them", file=sys.stderr)
    watchdog_s = max(120.0, 20 * ref_seconds)

    # 2. The kills: at least one of each kind, the rest drawn at random.
    kinds = list(KINDS[:min(a.kills, len(KINDS))]) + rng.choices(KINDS, weights=(1, 2, 2),
                                                                k=max(0, a.kills - len(KINDS)))
    rng.shuffle(kinds)
    kills: list[dict[str, Any]] = []
    attempts, finished_unkilled, rounds = 0, 0, [tmp / "run-1"]
    while len(kills) < a.kills:
        if attempts >= 3 * a.kills + 10:
            return fail(f"only {len(kills)} of {a.kills} kills dealt in {attempts} attempts "
                        f"({finished_unkilled} finished before their kill)")
        run_dir = rounds[-1]
        resumed_from = ckpt_step(latest_checkpoint(run_dir))
        owed = a.kills - len(kills)
        plan = plan_kill(kinds[len(kills)], resumed_from, a.steps, owed, rng)
        attempts += 1
        log = logs / f"attempt-{attempts:03d}.log"
        r = run_attempt(cmd(run_dir), run_dir, log, plan, est, rng, watchdog_s)
        if r["first_row_s"] is not None:
            est["startup_s"] = r["first_row_s"]
        if r["outcome"] == "failed":
            return fail(f"attempt {attempts} (round {len(rounds)}, resuming step {resumed_from}) exited "
                        f"{r['returncode']} without being killed {r['note']}", log)
        if r["outcome"] == "finished":
            finished_unkilled += 1
            done = ckpt_step(latest_checkpoint(run_dir))
            if done != a.steps:
                return fail(f"attempt {attempts} exited 0 at checkpoint step {done}, not {a.steps}", log)
            print(f"  attempt {attempts}: finished before its {plan['kind']} kill; "
                  f"the {owed} kill(s) still owed go to a fresh run")
            rounds.append(tmp / f"run-{len(rounds) + 1}")
            continue
        after = ckpt_step(latest_checkpoint(run_dir))
        landed = ("save" if r["in_save"] else "retention" if r["in_retention"]
                  else "start-up" if r["first_row_s"] is None else "after the final save" if after == a.steps
                  else "step")
        kill = {"attempt": attempts, "round": len(rounds), "aimed_at": r["target"]["kind"],
                "target": r["target"].get("step", r["target"].get("save")), "landed_in": landed,
                "seconds_into_attempt": round(r["seconds"], 3), "resumed_from_step": resumed_from,
                "step_logged_at_kill": max(r["step_logged"], resumed_from),
                "latest_checkpoint_after": after, "partial_saves_left": r["in_save"],
                "deletions_left": r["in_retention"]}
        if r["note"]:
            kill["note"] = r["note"].strip("; ")
        kills.append(kill)
        print(f"  kill {len(kills):>3}/{a.kills}: aimed at {kill['aimed_at']:<8} landed in {landed:<9} "
              f"{r['seconds']:6.2f} s into attempt {attempts}, resumed from step {resumed_from}, "
              f"logged step {kill['step_logged_at_kill']}, latest checkpoint now {after}"
              + (f" ({kill['note']})" if r["note"] else ""))

    # 3. Resume the last round to completion (a round ended by an unkilled finish is complete).
    run_dir = rounds[-1]
    attempts += 1
    log = logs / f"attempt-{attempts:03d}.log"
    r = run_attempt(cmd(run_dir), run_dir, log, None, est, rng, watchdog_s)
    done = ckpt_step(latest_checkpoint(run_dir))
    if r["outcome"] != "finished" or done != a.steps:
        return fail(f"the final resume {r['outcome']} (exit {r['returncode']}) at checkpoint step {done} "
                    f"{r['note']}", log)
    resumes = attempts - len(rounds)  # every attempt but each round's first started on a killed run

    # 4. Every round's final weights (and optimizer state) against the reference's.
    ref_ckpt = latest_checkpoint(ref)
    ref_w, ref_opt = load_tensors(ref_ckpt, "model"), load_tensors(ref_ckpt, "optimizer")
    if ref_w is None:
        return fail(f"no model weights found in {ref_ckpt}")
    comparisons = []
    for i, run_dir in enumerate(rounds, 1):
        ckpt = latest_checkpoint(run_dir)
        w = load_tensors(ckpt, "model")
        if w is None:
            return fail(f"no model weights found in {ckpt}")
        c = {"round": i, "final_checkpoint": ckpt.name, "weights": compare(ref_w, w, a.rtol)}
        opt = load_tensors(ckpt, "optimizer")
        if ref_opt is not None and opt is not None:
            c["optimizer_state"] = compare(ref_opt, opt, a.rtol)
        record = json.loads((run_dir / "run.json").read_text()) if (run_dir / "run.json").is_file() else {}
        starts = record.get("starts")
        c["starts_in_run_json"] = [s.get("at_step") for s in starts] if isinstance(starts, list) else None
        c["code_in_run_json"] = record.get("code")  # what the training processes themselves recorded
        comparisons.append(c)
    equal = all(c["weights"]["bitwise_equal"] for c in comparisons)
    within = all(c["weights"]["within_tolerance"] for c in comparisons)
    max_abs = max(c["weights"]["max_abs_diff"] for c in comparisons)
    max_rel = max(c["weights"]["max_rel_diff"] for c in comparisons)

    in_save = sum(k["landed_in"] == "save" for k in kills)
    landed = {kind: sum(k["landed_in"] == kind for k in kills)
              for kind in ("start-up", "step", "save", "retention", "after the final save")}
    dealt_ok = len(kills) == a.kills
    result = {
        "code": code,
        "seed": a.seed,
        "steps": a.steps,
        "checkpoint_every": CHECKPOINT_EVERY,
        "kills_requested": a.kills,
        "kills_dealt": len(kills),
        "kills_inside_saves": in_save,
        "kills_landed_in": landed,
        "kills_aimed_at": {kind: sum(k["aimed_at"] == kind for k in kills) for kind in KINDS},
        "resumes": resumes,
        "attempts": attempts,
        "attempts_finished_unkilled": finished_unkilled,
        "rounds": len(rounds),
        "kills": kills,
        "reference_run": ref_timing,
        "final_weights_bitwise_equal": equal,
        "final_weights_max_abs_diff": max_abs,
        "final_weights_max_rel_diff": max_rel,
        "rtol": a.rtol,
        "final_weights_within_tolerance": within,
        "final_optimizer_state_bitwise_equal": all(c.get("optimizer_state", {}).get("bitwise_equal", False)
                                                   for c in comparisons) if ref_opt is not None else None,
        "comparisons": comparisons,
        "wall_seconds": time.perf_counter() - t_all,
    }
    late = f", {landed['after the final save']} after the final save" if landed["after the final save"] else ""
    print(f"{len(kills)} of {a.kills} SIGKILLs dealt ({in_save} inside a save, {landed['retention']} in retention, "
          f"{landed['step']} mid-step, {landed['start-up']} in start-up{late}), {resumes} resumes, {attempts} attempts "
          f"({finished_unkilled} finished unkilled, {len(rounds)} round(s)); final weights "
          f"{'BIT-IDENTICAL' if equal else 'DIFFERENT'} to the uninterrupted run's "
          f"(max abs diff {max_abs:.3g}, max rel diff {max_rel:.3g}); "
          f"code {(code['git_commit'] or 'not in git')[:12]}{' + uncommitted changes' if code['git_dirty'] else ''}")
    save_result("fault-injection", f"cpu{n_cores()}", cpu_label(), result)
    if not dealt_ok:
        return fail(f"{len(kills)} kills dealt, {a.kills} requested")
    if not within:
        return fail(f"final weights differ from the uninterrupted run's (max abs diff {max_abs:.3g}, "
                    f"max rel diff {max_rel:.3g} > rtol {a.rtol:g}; worst "
                    f"{[c['weights']['worst'] for c in comparisons]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
