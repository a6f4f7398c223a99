"""``flopwise eval``: validation loss / perplexity / bits per byte and multiple-choice tasks for
a run, a checkpoint or a Hugging Face model directory -- once, or ``--watch``-ing a run
directory and evaluating each checkpoint as it lands.

Results of runs and checkpoints are appended to the run's ``evals.jsonl`` (one JSON object
per evaluated checkpoint, keyed by step), which ``flopwise report`` shows next to the
training metrics. A separate file from ``metrics.jsonl``: the evaluator may run on another
machine sharing the run directory, and a resumed training run rewrites its own file.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from flopwise.config import DataConfig, load_run_config
from flopwise.data.datadir import DataDir, check_cache_path, open_data_dir
from flopwise.data.loader import fixed_windows
from flopwise.evaluate.loss import bits_per_byte, evaluate_loss, perplexity, target_bytes
from flopwise.model.io import load_model, resolve
from flopwise.train.checkpoint import latest_checkpoint, list_checkpoints

Log = Callable[[str], None]
EVALS_FILE = "evals.jsonl"


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def evaluate(path: str | os.PathLike, data: str = "", tasks: list[str] | None = None,
             task_paths: dict[str, str] | None = None, limit: int = 0, windows: int = 0, seq_len: int = 0,
             batch_size: int = 8, device: str = "auto", log: Log = print) -> dict[str, Any]:
    """Evaluate the model at ``path``; return ``{"step", "tokens", "checkpoint", "val_loss",
    "val_ppl", "val_bpb", "eval": {task: scores}}`` (keys present when measured)."""
    dev = _device(device)
    src = resolve(path)
    model, src = load_model(src.path, device=dev)
    amp = torch.bfloat16 if dev.type == "cuda" and torch.cuda.is_bf16_supported() else None
    autocast = (lambda: torch.autocast(dev.type, dtype=amp)) if amp else contextlib.nullcontext
    out: dict[str, Any] = {"checkpoint": str(src.path)}
    run_cfg = None
    if src.kind != "hf":
        state = json.loads((src.path / "state.json").read_text())
        out.update(step=state["step"], tokens=state.get("tokens"))
        run_cfg = load_run_config(src.path / "config.yaml")
    dd: DataDir | None = None
    if data:  # checked like a run's own data: checksums and id range, remembered per shard
        dd = DataDir(data)
        dd.check_shards(check_cache_path((run_cfg.data if run_cfg else DataConfig()).cache_dir, dd.path))
    elif run_cfg is not None:
        dd = open_data_dir(run_cfg.data, log=lambda s: None)
    if dd is not None:
        T = seq_len or (run_cfg.train.seq_len if run_cfg else min(model.cfg.max_seq_len, 1024))
        n = windows or (run_cfg.eval.batches * run_cfg.train.micro_batch_size if run_cfg else 64)
        w = fixed_windows(dd, "val", T, n)
        loss = evaluate_loss(model, w, batch_size, dev, autocast, dd.eos_id, dd.bos_id)
        out.update(val_loss=loss, val_ppl=perplexity(loss),
                   val_bpb=bits_per_byte(loss, w[:, 1:].numel(), target_bytes(w, dd.tokenizer)))
        log(f"  val        loss {loss:.4f} · ppl {out['val_ppl']:,.1f} · bpb {out['val_bpb']:.4f} "
            f"({n} windows of {T} tokens, {dd.path})")
    elif not tasks:
        log("  val        skipped: no data directory (give --data DIR)")
    if tasks:
        from flopwise.evaluate.tasks import evaluate_tasks

        if src.tokenizer_path is None:
            raise ValueError(f"{path}: no tokenizer.json to score the tasks with")
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(src.tokenizer_path))
        results = evaluate_tasks(model, tok, tasks, paths=task_paths, limit=limit, device=dev,
                                 batch_size=batch_size, autocast=autocast)
        out["eval"] = results
        for name, r in results.items():
            log(f"  {name:<14} acc {r['acc']:.4f} · acc_norm {r['acc_norm']:.4f} · acc_token {r['acc_token']:.4f}"
                f" (± {r['stderr']['acc']:.4f}; random {r['random']:.4f}; n {r['n']})")
    return out


def record(run_dir: Path, result: dict[str, Any]) -> None:
    """Append one evaluation to the run's ``evals.jsonl`` (one line, flushed and fsynced)."""
    with open(run_dir / EVALS_FILE, "a", encoding="utf-8") as f:
        f.write(json.dumps({**result, "evaluated": time.strftime("%Y-%m-%dT%H:%M:%S")}) + "\n")
        f.flush()
        os.fsync(f.fileno())


def evaluated_steps(run_dir: Path) -> set[int]:
    try:
        lines = (run_dir / EVALS_FILE).read_text(encoding="utf-8").splitlines()
    except OSError:
        return set()
    steps = set()
    for line in lines:
        try:
            steps.add(int(json.loads(line)["step"]))
        except (ValueError, KeyError, TypeError):
            continue
    return steps


def run_finished(run_dir: Path) -> bool:
    """The training process wrote its result and its last checkpoint is the run's final step."""
    try:
        record_ = json.loads((run_dir / "run.json").read_text())
        total = load_run_config(run_dir / "config.yaml").total_steps()
    except (OSError, ValueError):
        return False
    last = latest_checkpoint(run_dir)
    return "result" in record_ and last is not None and int(last.name[5:]) >= total


def watch(run_dir: str | os.PathLike, poll_s: float = 30.0, timeout_s: float = 0.0, log: Log = print,
          before_eval: Callable[[Path], None] | None = None, **kwargs) -> int:
    """Evaluate every complete checkpoint of ``run_dir`` not yet in ``evals.jsonl``, as they
    land, until the run has finished and its last checkpoint is evaluated (or ``timeout_s``).
    Returns the number of checkpoints evaluated.

    Training prunes old checkpoints (``train.keep_checkpoints``) while this runs, so one
    listed a moment ago may be gone when it is read: whatever error that gives (a missing
    directory or file, a half-deleted file failing its checksum) the checkpoint is skipped
    with a note when it no longer exists under its name; one that still exists and fails is
    a real error and raised. ``before_eval(checkpoint)`` runs between the listing and the
    loading of each one (the moment of that race; tests delete a checkpoint there)."""
    run = Path(run_dir)
    start = time.monotonic()
    n = 0
    while True:
        done = evaluated_steps(run)
        finished = run_finished(run)  # read before listing: a final checkpoint is then in the list
        for ckpt in list_checkpoints(run):
            step = int(ckpt.name[5:])
            if step in done:
                continue
            if before_eval is not None:
                before_eval(ckpt)
            log(f"eval: {ckpt}")
            try:
                result = evaluate(ckpt, log=log, **kwargs)
            except Exception as err:  # noqa: BLE001 - which error a deletion gives depends on its timing
                if not vanished(ckpt):
                    raise
                log(f"eval: {ckpt.name} was deleted while it was read (train.keep_checkpoints pruned it): "
                    f"skipped ({type(err).__name__})")
                continue
            record(run, result)
            n += 1
        if finished:
            return n
        if timeout_s and time.monotonic() - start > timeout_s:
            log(f"eval: --timeout {timeout_s:g}s reached")
            return n
        time.sleep(poll_s)


def vanished(ckpt: Path) -> bool:
    """Whether ``ckpt`` no longer exists under its name. Retention renames a checkpoint (to
    ``.deleting-step-N``) before deleting it, so the name is gone at once, whatever is left
    of its files elsewhere; a directory still there is not retention's doing."""
    return not ckpt.exists()
