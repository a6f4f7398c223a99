"""``flopwise eval``: validation loss / perplexity / bits per byte and multiple-choice tasks for
a run, a checkpoint or a Hugging Face model directory -- once, or ``--watch``-ing a run
directory and evaluating each checkpoint as it lands.

Results of runs and checkpoints are appended to the run's ``evals.jsonl`` (one JSON object
per evaluated checkpoint, keyed by step), which ``flopwise report`` shows next to the
training metrics. A separate file from ``metrics.jsonl``: the evaluator may run on another
machine sharing the run directory, and a resumed training run rewrites its own file. Each
row says what it measured -- ``val_data`` (path, fingerprint, ``runs``: the run's own data)
and ``val_windows`` x ``val_seq_len``, ``val_set`` "run" when both are the run's own
validation set -- so the report puts only those beside the run's validation curve. Only a
checkpoint inside its run (:func:`run_of`) is recorded: an export or a checkpoint copied
out of its run has no run to record into.

The data is checked to be the data the run trained on (the fingerprint its checkpoint, or
the export's ``flopwise.json``, recorded) on every path, ``--data`` or not, and everything
that can be refused is refused before the model is loaded or a shard is read.

Validation windows (count x length) are chosen, in this order, by ``--windows`` /
``--seq-len``; the run's own (``eval.windows`` windows of ``train.seq_len`` tokens, the set
the trainer validates on -- the count its checkpoint recorded, which a run resumed with
another setting keeps -- whatever the micro-batch) for a run or checkpoint; the
same, read from ``flopwise.json``, for a Hugging Face directory flopwise exported (whose
data directory is then the run's too, unless ``--data`` names one; the file is checked field
by field and never chooses a cache folder); else 64 windows of
``min(max_seq_len, 1024)`` tokens. The log line says which, and where each came from, so a
loss is never compared across different windows unknowingly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from flopwise.checkpoints import CheckpointError, latest_checkpoint, list_checkpoints, read_state
from flopwise.config import (
    CHECKPOINTS,
    MAX_VAL_TOKENS,
    RUN_FILES,
    TIME_USED,
    ConfigError,
    DataConfig,
    RunConfig,
    load_run_config,
    recorded_paths,
)
from flopwise.data.datadir import DataDir, DataDirError, check_cache_path, resolve_data_dir
from flopwise.data.loader import fixed_windows, overlap_note
from flopwise.data.tokenizer import load_tokenizer
from flopwise.errors import shown
from flopwise.evaluate.loss import bits_per_byte, evaluate_loss, perplexity, target_bytes
from flopwise.evaluate.tasks import evaluate_tasks
from flopwise.fsio import AppendFile, WriteError, is_write_fault, loads_json, write_error
from flopwise.manifest import read_run_json
from flopwise.model.io import EXPORT_RECORD, ModelSource, ModelSourceError, load_model, read_export_record, resolve

Log = Callable[[str], None]
EVALS_FILE = "evals.jsonl"
MAX_WINDOWS = 1 << 20  # validation windows asked for (--windows, flopwise.json): more is a typo, not an eval
# MAX_VAL_TOKENS (config's, the bound of eval.windows too): tokens of the windows held at once as int64
# (1 GiB); 20M windows asked for 19 GiB
MAX_SEQ_LEN = 1 << 20  # a window length flopwise.json may give (the model's max_seq_len is checked too)
MAX_BUILTIN_VOCAB = 1 << 20  # the embedded corpus' BPE size flopwise.json may ask for


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


@dataclasses.dataclass(frozen=True)
class EvalOptions:
    """What ``flopwise eval`` measures and how, the same for every checkpoint it evaluates.

    ``data``: the data directory of the validation loss ("": the run's own), refused when it
    is not the data the run trained on unless ``other_data``. ``tasks``: the multiple-choice
    tasks to score, ``task_paths`` a task's local file or folder, ``limit`` examples per task
    (0: all). ``windows`` x ``seq_len``: the validation windows (0: chosen as the module
    docstring says). ``batch_size``: windows or sequences per forward. ``device``: "auto"
    (CUDA where there is one) or a torch device name."""

    data: str = ""
    other_data: bool = False
    tasks: list[str] = dataclasses.field(default_factory=list)
    task_paths: dict[str, str] = dataclasses.field(default_factory=dict)
    limit: int = 0
    windows: int = 0
    seq_len: int = 0
    batch_size: int = 8
    device: str = "auto"


def evaluate(path: str | os.PathLike, options: EvalOptions = EvalOptions(), log: Log = print) -> dict[str, Any]:
    """Evaluate the model at ``path``; return ``{"step", "tokens", "checkpoint", "val_loss",
    "val_ppl", "val_bpb", "val_windows", "val_seq_len", "val_data", "val_set", "eval": {task:
    scores}}`` (keys present when measured). Which windows: the module docstring. Everything
    that can be refused (the data, the windows, a malformed ``flopwise.json``) is refused
    before the model is loaded or a shard is read."""
    dev = _device(options.device)
    src = resolve(path)
    run_dir = run_of(src.path) if src.kind != "hf" else None
    if run_dir is not None:  # its scores are appended to the run's evals.jsonl: refused now, not after the work
        check_can_record(run_dir)
    out: dict[str, Any] = {"checkpoint": str(src.path)}
    run_cfg, trained_on, validated_on = None, None, None
    if src.kind != "hf":
        state = read_state(src.path)  # checked field by field
        out.update(step=state["step"], tokens=state.get("tokens"))
        run_cfg = _from_where_it_ran(load_run_config(src.path / "config.yaml"), src.path)
        trained_on, validated_on = state.get("data_fingerprint"), state.get("val_windows")
    geometry = _run_geometry(run_cfg, src, validated_on)
    if run_cfg is None and geometry is not None:
        trained_on = geometry["fingerprint"]
    dd, said = _validation_data(options, run_cfg, geometry, trained_on, src, log)
    if dd is not None:
        n, T, why = _windows(options.windows, options.seq_len, geometry, src.cfg.max_seq_len)
        _check_readable(dd, n, T, src, options, geometry)
        dd.check_shards(check_cache_path((run_cfg.data if run_cfg else DataConfig()).cache_dir, dd.path))
    tok = _task_tokenizer(src, path) if options.tasks else None
    model, src = load_model(src.path, device=dev)
    amp = torch.bfloat16 if dev.type == "cuda" and torch.cuda.is_bf16_supported() else None
    autocast = (lambda: torch.autocast(dev.type, dtype=amp)) if amp else contextlib.nullcontext
    if dd is not None:
        w = fixed_windows(dd, "val", T, n)
        loss = evaluate_loss(model, w, options.batch_size, dev, autocast, dd.eos_id, dd.bos_id)
        found = dd.meta.get("fingerprint")
        # The run's own data: its fingerprint is the one the run trained on, or (a checkpoint from
        # before state.json recorded one) it is the directory the run's config names.
        runs = bool(trained_on and found == trained_on) or (not trained_on and not options.data and run_cfg is not None)
        own_set = geometry is not None and (n, T) == (geometry["windows"], geometry["seq_len"])
        out.update(val_loss=loss, val_ppl=perplexity(loss),
                   val_bpb=bits_per_byte(loss, w[:, 1:].numel(), target_bytes(w, dd.tokenizer)),
                   val_windows=n, val_seq_len=T,
                   val_data={"path": str(dd.path), "fingerprint": found, "runs": runs},
                   val_set="run" if runs and own_set else "other")
        overlap = overlap_note(n, T, dd.num_tokens("val"))
        log(f"  val        loss {loss:.4f} · ppl {out['val_ppl']:,.1f} · bpb {out['val_bpb']:.4f} "
            f"({n} windows x {T} tokens: {why}; {dd.path}{'; ' + overlap if overlap else ''})")
    elif not options.tasks and not said:
        log("  val        skipped: no data directory (give --data DIR)")
    if tok is not None:
        results = evaluate_tasks(model, tok, options.tasks, paths=options.task_paths, limit=options.limit,
                                 device=dev, batch_size=options.batch_size, autocast=autocast)
        out["eval"] = results
        for name, r in results.items():
            log(f"  {name:<14} acc {r['acc']:.4f} · acc_norm {r['acc_norm']:.4f} · acc_token {r['acc_token']:.4f}"
                f" (± {r['stderr']['acc']:.4f}; random {r['random']:.4f}; n {r['n']})")
    return out


def _task_tokenizer(src: ModelSource, path: str | os.PathLike) -> Any:
    """The tokenizer the tasks are scored with, refused before any work when it has ids the
    model has no embedding for (a Hugging Face directory with another model's tokenizer.json:
    an IndexError in the middle of the first task)."""
    if src.tokenizer_path is None:
        raise ModelSourceError(f"{path}: no tokenizer.json to score the tasks with")
    tok = load_tokenizer(src.tokenizer_path)  # a malformed file: an error naming it
    size = tok.get_vocab_size(with_added_tokens=True)
    if size > src.cfg.vocab_size:
        raise ModelSourceError(f"{src.tokenizer_path}: its vocabulary ({size:,} tokens) is larger than the model's "
                               f"({src.cfg.vocab_size:,}): not the model's tokenizer")
    return tok


def _validation_data(options: EvalOptions, run_cfg: RunConfig | None, geometry: dict[str, Any] | None,
                     trained_on: str | None, src: ModelSource, log: Log) -> tuple[DataDir | None, bool]:
    """``(data directory, said)``: the validation data, opened (headers only: its shards are
    read later, once nothing else can be refused) and checked to be the data the run trained
    on -- on every path, not only ``--data``: a directory prepared again since (``prepare
    --overwrite``) is refused as another one is. ``said``: why there is none was logged."""
    if options.other_data and not options.data:
        raise ConfigError(["--other-data: only with --data DIR (it allows evaluating on a data directory that is "
                           "not the one the run trained on)"])
    for flag, value, high in (("--windows", options.windows, MAX_WINDOWS), ("--seq-len", options.seq_len, MAX_SEQ_LEN)):
        if not 0 <= value <= high:
            raise ConfigError([f"{flag} {value}: give a whole number from 1 to {high:,} (0: the run's)"])
    if options.data:
        dd, where = DataDir(options.data), f"--data {options.data}"
    elif run_cfg is not None:
        recorded = run_cfg.data.path
        if recorded and not Path(recorded).expanduser().is_dir():
            typed = _typed_path(src.path, "data.path")
            as_typed = f" (typed as {typed!r})" if typed and typed != recorded else ""
            raise DataDirError(f"the run's data directory {recorded}{as_typed} is not here: give --data DIR where "
                               f"it is now (the run's data has fingerprint {str(trained_on)[:12]}; another "
                               "directory is refused unless --other-data)")
        dd = DataDir(resolve_data_dir(run_cfg.data, log=lambda s: None))
        where = f"{dd.path} (the run's data.path)" if recorded else f"{dd.path} (the run's embedded corpus)"
    elif geometry is not None and geometry["data"] is not None:  # an export of a run: the run's data
        try:
            dd = DataDir(resolve_data_dir(geometry["data"], log=lambda s: None))
        except (OSError, ValueError) as e:
            log(f"  val        skipped: the run's data directory (from {EXPORT_RECORD}) is not usable here: {e}; "
                "give --data DIR")
            return None, True
        where = f"{dd.path} (the run's data, from {geometry['origin']})"
    else:
        return None, False
    found = dd.meta.get("fingerprint")
    if trained_on and found != trained_on and not options.other_data:
        again = "" if options.data else " (prepared again since the run trained on it?)"
        raise DataDirError(f"{where}: not the data the run trained on{again} (fingerprint {str(found)[:12]}, the "
                           f"run's {trained_on[:12]}): give --data DIR with a copy of the run's data, or --data DIR "
                           "--other-data to evaluate on other data knowingly")
    return dd, False


def _check_readable(dd: DataDir, n: int, T: int, src: ModelSource, options: EvalOptions,
                    geometry: dict[str, Any] | None) -> None:
    """Refuse, before any work, windows the model cannot read: ids beyond its vocabulary (an
    IndexError in the embedding), more positions than it has, more tokens than memory holds."""
    cfg = src.cfg
    if dd.vocab_size > cfg.vocab_size:
        raise DataDirError(f"{dd.path}: its vocabulary ({dd.vocab_size:,} tokens) is larger than the model's "
                           f"({cfg.vocab_size:,}): not data tokenized for this model; give --data DIR with data "
                           "of the model's tokenizer")
    if T > cfg.max_seq_len:
        given = f"--seq-len {T}" if options.seq_len else \
            f"validation windows of {T} tokens (train.seq_len, from {(geometry or {}).get('origin', 'the run')})"
        raise ConfigError([f"{given}: longer than the model reads (max_seq_len {cfg.max_seq_len:,}); give "
                           f"--seq-len {cfg.max_seq_len} or less"])
    if n * (T + 1) > MAX_VAL_TOKENS:
        raise ConfigError([f"{n:,} validation windows x {T + 1:,} tokens: more than {MAX_VAL_TOKENS:,} tokens held "
                           "at once; give fewer --windows"])


def _run_record(source: Path) -> dict[str, Any]:
    """The object in the ``run.json`` of the run ``source`` belongs to (a checkpoint's run is two
    levels up); {} when there is none. One changed or torn since the run wrote it (its manifest
    says) is refused, a CheckpointError naming it, as a resume refuses it."""
    for run_dir in (source, source.parent.parent):
        if (run_dir / "run.json").is_file():
            found = read_run_json(run_dir, "run.json")
            return found if isinstance(found, dict) else {}
    return {}


def _typed_path(source: Path, name: str) -> str | None:
    """What the user typed for the path setting ``name`` when the run started (its
    ``run.json``), or None."""
    paths = _run_record(source).get("paths") or {}
    entry = paths.get(name) if isinstance(paths, dict) else None
    return entry.get("typed") if isinstance(entry, dict) else None


def _from_where_it_ran(cfg: RunConfig, source: Path) -> RunConfig:
    """``cfg`` with its relative path settings read from the directory the run started in, as
    its ``run.json`` records it (``cwd``): a run whose config.yaml kept them as typed (written
    before runs recorded them resolved) reads them relative to where they were typed, not to
    wherever eval runs. A run that records no such directory is read as it is."""
    cwd = _run_record(source).get("cwd")
    if not isinstance(cwd, str) or not Path(cwd).is_absolute():
        return cfg
    return recorded_paths(cfg, Path(cwd))[0]


def _run_geometry(run_cfg: RunConfig | None, src: ModelSource,
                  validated_on: int | None = None) -> dict[str, Any] | None:
    """The run's validation set: ``{"windows", "seq_len", "data" (DataConfig or None),
    "fingerprint", "origin"}`` from its config -- the windows its checkpoint validated on
    (``validated_on``, from its ``state.json``) when it recorded them --, or from
    ``flopwise.json`` in a Hugging Face directory flopwise exported; None for a Hugging Face
    directory from elsewhere."""
    if run_cfg is not None:
        windows, origin = run_cfg.eval.windows, "the run's config"
        if validated_on and validated_on != windows:  # resumed with another eval.windows: it kept its first set
            windows, origin = validated_on, f"{src.path / 'state.json'} (the set the run validated on)"
        return {"windows": windows, "seq_len": run_cfg.train.seq_len, "data": run_cfg.data, "fingerprint": None,
                "origin": origin}
    record = read_export_record(src.path)
    val = (record or {}).get("validation")
    if val is None:
        return None
    where = src.path / EXPORT_RECORD
    if not isinstance(val, dict):
        raise ModelSourceError(f"{where}: validation: expected an object, got {shown(val)}")
    data_rec = val.get("data")
    if data_rec is not None and not isinstance(data_rec, dict):
        raise ModelSourceError(f"{where}: validation.data: expected an object, got {shown(data_rec)}")
    fingerprint = val.get("data_fingerprint")
    if fingerprint is not None and not isinstance(fingerprint, str):
        raise ModelSourceError(f"{where}: validation.data_fingerprint: expected text, got {shown(fingerprint)}")
    return {"windows": _whole(val, "windows", 1, MAX_WINDOWS, where), "seq_len": _whole(val, "seq_len", 1,
                                                                                         MAX_SEQ_LEN, where),
            "data": _export_data(data_rec, where) if data_rec is not None else None,
            "fingerprint": fingerprint, "origin": f"{where}"}


def _whole(record: dict[str, Any], key: str, low: int, high: int, where: Path, prefix: str = "validation.") -> int:
    """``record[key]``, a whole number in [low, high], else an error naming the file, field and value."""
    value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        shown_value = f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else shown(value)
        raise ModelSourceError(f"{where}: {prefix}{key}: {shown_value} is not a whole number from {low:,} to "
                               f"{high:,}")
    return value


def _export_data(rec: dict[str, Any], where: Path) -> DataConfig:
    """The run's data as ``flopwise.json`` records it -- where the data is and which embedded
    corpus, each checked -- and nothing else: the record is a file anyone can send, so it never
    chooses where eval writes (``data.cache_dir`` is the reader's own default) nor how the data
    is loaded."""
    path = rec.get("path", "")
    if not isinstance(path, str):
        raise ModelSourceError(f"{where}: validation.data.path: expected a directory name, got {shown(path)}")
    vocab = _whole(rec, "builtin_vocab_size", 1, MAX_BUILTIN_VOCAB, where, "validation.data.") \
        if "builtin_vocab_size" in rec else DataConfig.builtin_vocab_size
    max_mb = rec.get("builtin_max_mb", DataConfig.builtin_max_mb)
    if isinstance(max_mb, bool) or not isinstance(max_mb, (int, float)) or not 0 <= max_mb < float("inf"):
        raise ModelSourceError(f"{where}: validation.data.builtin_max_mb: {shown(max_mb)} is not a number >= 0")
    return DataConfig(path=path, builtin_vocab_size=vocab, builtin_max_mb=float(max_mb))


def _windows(windows: int, seq_len: int, geometry: dict[str, Any] | None, max_seq_len: int) -> tuple[int, int, str]:
    """``(count, length, why)`` of the validation windows; ``why`` says where each came from."""
    if geometry is not None:
        n = windows or geometry["windows"]
        T = seq_len or geometry["seq_len"]
        run = f"the run's eval.windows and train.seq_len, from {geometry['origin']}"
        if not windows and not seq_len:
            return n, T, run
        given = " and ".join(x for x, v in (("--windows", windows), ("--seq-len", seq_len)) if v)
        return n, T, f"{given} given, the rest {run}" if not (windows and seq_len) else f"{given} given"
    n = windows or 64
    T = seq_len or min(max_seq_len, 1024)
    parts = ["--windows" if windows else "64 windows by default",
             "--seq-len" if seq_len else "min(model max_seq_len, 1024) tokens by default"]
    return n, T, ", ".join(parts) + " (a Hugging Face directory without flopwise.json: no run to take them from)"


def run_of(checkpoint: Path) -> Path | None:
    """The run directory ``checkpoint`` is a checkpoint of, or None: a ``--format pt`` export, a
    checkpoint copied out of its run (the folder two levels up is then somebody else's)."""
    run = checkpoint.parent.parent
    if checkpoint.parent.name != CHECKPOINTS or not (run / "config.yaml").is_file():
        return None
    return run if any((run / name).is_file() for name in RUN_FILES) else None  # what train writes beside them


def check_can_record(run_dir: Path) -> None:
    """Refuse, before anything is computed, a run whose ``evals.jsonl`` cannot be appended to (a
    read-only folder or file): a :class:`~flopwise.fsio.WriteError` naming the file. Opens it as
    :func:`record` will, writing nothing; a file that was not there is made and removed again, so
    a refusal later in the evaluation leaves the run as it was. A full disk still fails in
    :func:`record` (an open needs no room), which takes the torn line back."""
    path = run_dir / EVALS_FILE
    try:
        try:
            fd, made = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666), True
        except FileExistsError:
            fd, made = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC), False
        os.close(fd)
        if made:
            path.unlink()
    except OSError as e:
        if not is_write_fault(e):
            raise
        raise write_error(path, e, "the evaluation results", "nothing was evaluated (its scores could not be "
                          "recorded)") from e


def record(run_dir: Path, result: dict[str, Any]) -> None:
    """Append one evaluation to the run's ``evals.jsonl`` (one line, fsynced). A line that does
    not fit (a full disk) is cut off again, never left torn; that, a read-only folder and the
    like are a :class:`~flopwise.fsio.WriteError` naming the file."""
    line = json.dumps({**result, "evaluated": time.strftime("%Y-%m-%dT%H:%M:%S")}) + "\n"
    try:
        f = AppendFile(run_dir / EVALS_FILE, "the evaluation results")
        try:
            f.write(line, sync=True)
        finally:
            f.close()
    except WriteError as e:
        step = f" of step {result['step']:,}" if isinstance(result.get("step"), int) else ""
        raise WriteError(f"{e}; the scores{step} printed above were not recorded", e.errno, e.filename) from e


def evaluated_steps(run_dir: Path) -> set[int]:
    try:
        lines = (run_dir / EVALS_FILE).read_text(encoding="utf-8").splitlines()
    except OSError:
        return set()
    steps = set()
    for line in lines:
        try:
            steps.add(int(loads_json(line, str(run_dir / EVALS_FILE))["step"]))
        except (ValueError, KeyError, TypeError):
            continue
    return steps


def run_finished(run_dir: Path) -> bool:
    """The training process wrote its result and its last checkpoint is the run's final step."""
    try:
        record_ = read_run_json(run_dir, "run.json")
        cfg = load_run_config(run_dir / "config.yaml")
    except (OSError, ValueError, CheckpointError):  # not a finished run as it wrote itself
        return False
    last = latest_checkpoint(run_dir)
    if cfg.time_only:  # no last step: it finished when its time was used (a signal's stop is not that)
        result = record_.get("result") if isinstance(record_, dict) else None
        return isinstance(result, dict) and result.get("stopped") == TIME_USED and last is not None
    total = cfg.total_steps()
    return isinstance(record_, dict) and "result" in record_ and last is not None and int(last.name[5:]) >= total


def watch(run_dir: str | os.PathLike, options: EvalOptions = EvalOptions(), poll_s: float = 30.0,
          timeout_s: float = 0.0, log: Log = print, before_eval: Callable[[Path], None] | None = None) -> int:
    """Evaluate (as ``options`` say) every complete checkpoint of ``run_dir`` not yet in
    ``evals.jsonl``, as they land, until the run has finished and its last checkpoint is
    evaluated (or ``timeout_s``). Returns the number of checkpoints evaluated.

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
                result = evaluate(ckpt, options, log=log)
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
