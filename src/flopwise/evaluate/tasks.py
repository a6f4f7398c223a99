"""Multiple-choice benchmarks (ARC, OpenBookQA, HellaSwag, PIQA) scored by log-probability.

Each example is a context and a few candidate continuations; the model "answers" with
the continuation it finds most likely. No sampling, no prompt engineering: this is the
zero-shot likelihood protocol that small pretrained models are usually compared with.

Data
----
:func:`load_task` reads a task's records either from the Hugging Face hub
(``datasets.load_dataset(hub_path, hub_config, split=...)``) or from local ``.jsonl`` /
``.json`` / ``.parquet`` files holding records in the same form as the hub dataset,
read with datasets' own ``json`` / ``parquet`` builders (streamed). Both routes hand the
same dicts to the same per-task parser (``_parse_arc`` ...), which validates every field
and raises :class:`TaskError` naming the file (or hub dataset), the 1-based record
number within that file (for JSON Lines without blank lines this is the line number;
for parquet the row), the field and the value.

- ``arc_easy``: ``allenai/ai2_arc``, config ``ARC-Easy``, split ``test``;
  context ``"Question: {question}\\nAnswer:"``, choices ``" {choices.text[k]}"``.
- ``arc_challenge``: ``allenai/ai2_arc``, config ``ARC-Challenge``, split ``test``; as ARC-Easy.
- ``openbookqa``: ``allenai/openbookqa``, config ``main``, split ``test``;
  context ``"{question_stem}"``, choices ``" {choices.text[k]}"``.
- ``hellaswag``: ``Rowan/hellaswag``, no config, split ``validation``;
  context ``"{activity_label}: {ctx_a} {Ctx_b}"``, choices ``" {endings[k]}"`` (both cleaned, below).
- ``piqa``: ``baber/piqa``, no config, split ``validation``;
  context ``"Question: {goal}\\nAnswer:"``, choices ``" {sol1}"``, ``" {sol2}"``.

Custom tasks: any other name, given with a local file or folder (``--task-data
NAME=PATH``, ``paths={NAME: PATH}``), is a task of one's own. Each record is either the
plain form ``{"context": str, "choices": [str, ...], "label": int}`` -- the choices are
appended to the context exactly as written, so give them their leading space (``" Paris"``)
-- or the form of a built-in task (ARC/OpenBookQA, HellaSwag or PIQA fields, recognised per
record by ``choices`` being an object, ``endings``, ``goal``), parsed as that task is.

``.jsonl`` files are read line by line with :mod:`json` (no ``datasets`` needed), so a
malformed line or record is named by its line number; blank lines are skipped.
``.json`` and ``.parquet`` go through datasets' builders.

ARC and OpenBookQA answers are ``answerKey``, one of ``choices.label`` (letters, or
digits "1".."5" in some ARC records); HellaSwag's ``label`` is a digit string ("2") and
PIQA's an integer 0/1 (either form is accepted for both).

PIQA's original hub copy ``ybisk/piqa`` is a loading script, which datasets >= 4 no
longer runs; ``baber/piqa`` holds the same records (``goal``, ``sol1``, ``sol2``,
``label``) as parquet. HellaSwag's ``test`` split has no labels (``label`` is ``""``), so
the validation split is the one to score.

HellaSwag text (context and each ending) is cleaned of WikiHow markup: ``" [title]"``
becomes ``". "``, any other bracketed tag (``[header]``, ``[step]``, ``[substeps]`` ...)
is removed, runs of spaces become one space and the ends are stripped. ``ctx_b``'s first
character is upper-cased (only the first: the rest keeps its case).

Scoring
-------
:func:`loglikelihoods` / :func:`score`: for each (context, choice) the scored token
sequence is ``[BOS] + encode(context) + encode(choice)``, the two strings encoded
*separately* (``add_special_tokens=False``) and concatenated. The choice's tokens are
therefore exactly ``encode(choice)``: a BPE merge across the context/choice boundary can
never move a byte of the choice into the context (or back), and the model is scored on
precisely the ids it is fed. BOS is the tokenizer's begin-of-text token
(:func:`flopwise.data.tokenizer.special_ids`) when it has one, else nothing; an example
whose context encodes to no token at all is conditioned on EOS instead (a document
boundary, which is how documents start in EOS-separated training data), since the first
choice token needs something to be predicted from.

``log P(choice | context) = sum over the choice's tokens of log_softmax(logits)[token]``,
computed in float32. The model input is the sequence minus its last token, so a sequence
may hold ``model.cfg.max_seq_len + 1`` tokens; a longer one loses context tokens from
the left (the BOS first: the window no longer starts a document), and a choice of more than ``max_seq_len`` tokens is an
error (some of its tokens would have no context). Sequences (all choices of all
examples) are sorted by length, longest first, and run ``batch_size`` at a time,
right-padded: a causal model's outputs at real positions do not depend on padding to
their right, so batch composition does not change the results (up to float rounding).
A model with ``forward_hidden`` and ``head_weight`` (a flopwise ``Transformer``) puts only
the choice positions through the output head, so no (B, T, V) logits are materialised;
any other module is called as ``model(idx) -> logits (B, T, V)``.

Metrics, each an accuracy over examples with argmax ties going to the lowest index:

- ``acc``: the choice with the highest summed log-prob (unnormalised; favours short
  choices, which pay for fewer tokens);
- ``acc_norm``: log-prob divided by the choice's length in UTF-8 bytes (as appended, so
  with its leading space): tokenizer-independent length normalisation;
- ``acc_token``: log-prob divided by the choice's token count (mean per-token log-prob).

Each has a standard error, ``stderr[metric] = sqrt(p (1 - p) / (n - 1))``: that of the mean of
the per-example 0/1 outcomes using the unbiased (n - 1) sample variance (NaN for n < 2).
``random`` is the chance baseline, the mean over examples of ``1 / len(choices)``.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import math
import os
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from flopwise.data.tokenizer import special_ids
from flopwise.errors import FlopwiseError
from flopwise.evaluate.loss import UNSHARDED, Shard
from flopwise.fsio import FileFormatError, check_json_depth

INSTALL_HINT = "pip install 'flopwise[data]'"
LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}  # extension -> datasets builder


class TaskError(FlopwiseError, ValueError):
    """Bad task name, file or record: the message names the file (or hub dataset), the
    record number, the field and the value at fault."""


@dataclass
class Example:
    context: str  # the question / prompt text
    choices: list[str]  # the candidate continuations, exactly as they are appended to the context
    label: int  # index of the right choice


@dataclass(frozen=True)
class TaskSpec:
    name: str
    hub_path: str  # datasets.load_dataset's first argument
    hub_config: str | None  # its config (subset) name
    split: str  # the split scored by default
    parse: Callable[[dict], Example]  # one canonical record -> Example; raises _Bad
    about: str


# --------------------------------------------------------------------------- record parsing

class _Bad(Exception):
    """A record fault, turned into a TaskError by the caller that knows the file and record."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field
        self.message = message


def _short(v: Any, limit: int = 80) -> str:
    r = repr(v)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def _kind(v: Any) -> str:
    if v is None:
        return "null"
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string",
            list: "a list", dict: "an object"}.get(type(v), type(v).__name__)


def _field(rec: dict, name: str) -> Any:
    if name not in rec or rec[name] is None:
        have = ", ".join(sorted(str(k) for k, v in rec.items() if v is not None)) or "none"
        raise _Bad(name, f"field {name!r} is missing or null (fields present: {have})")
    return rec[name]


def _text(rec: dict, name: str, empty_ok: bool = False) -> str:
    v = _field(rec, name)
    if not isinstance(v, str):
        raise _Bad(name, f"field {name!r} is {_kind(v)} ({_short(v)}), not a string")
    if not empty_ok and not v.strip():
        raise _Bad(name, f"field {name!r} is empty ({_short(v)})")
    return v


def _texts(v: Any, name: str) -> list[str]:
    """A list of at least 2 strings (the choices of one question)."""
    if not isinstance(v, (list, tuple)) or not all(isinstance(t, str) for t in v):
        raise _Bad(name, f"field {name!r} is {_kind(v)} ({_short(v)}), not a list of strings")
    if len(v) < 2:
        raise _Bad(name, f"field {name!r} has {len(v)} choice(s), need at least 2: {_short(v)}")
    return list(v)


def _index(rec: dict, name: str, n: int) -> int:
    """An answer index in [0, n): an integer or a string of decimal digits ("2")."""
    v = _field(rec, name)
    if isinstance(v, str) and v.strip().isdigit():
        i = int(v)
    elif isinstance(v, int) and not isinstance(v, bool):
        i = v
    else:
        raise _Bad(name, f"field {name!r} is {_kind(v)} ({_short(v)}), not an answer index 0..{n - 1}"
                   + (" (an unlabelled test split?)" if v == "" else ""))
    if not 0 <= i < n:
        raise _Bad(name, f"field {name!r} is {_short(v)}: out of range for {n} choices (0..{n - 1})")
    return i


def _lettered_choices(rec: dict) -> tuple[list[str], int]:
    """ARC / OpenBookQA: ``choices = {"text": [...], "label": ["A", ...]}`` and ``answerKey``
    naming one of the labels (letters, or digits "1".."5" in some ARC records)."""
    ch = _field(rec, "choices")
    if not isinstance(ch, dict):
        raise _Bad("choices", f"field 'choices' is {_kind(ch)} ({_short(ch)}), not an object with 'text' and 'label'")
    for sub in ("text", "label"):
        if ch.get(sub) is None:
            raise _Bad(f"choices.{sub}", f"field 'choices.{sub}' is missing or null")
    texts = _texts(ch["text"], "choices.text")
    labels = _texts(ch["label"], "choices.label")
    if len(labels) != len(texts):
        raise _Bad("choices.label", f"field 'choices.label' has {len(labels)} labels for {len(texts)} texts: "
                   f"{_short(labels)}")
    key = _field(rec, "answerKey")
    if not isinstance(key, str) or key.strip() not in labels:
        raise _Bad("answerKey", f"field 'answerKey' is {_short(key)}, not one of the choice labels {labels}")
    return texts, labels.index(key.strip())


def _parse_arc(rec: dict) -> Example:
    question = _text(rec, "question")
    texts, label = _lettered_choices(rec)
    return Example(f"Question: {question}\nAnswer:", [" " + t for t in texts], label)


def _parse_openbookqa(rec: dict) -> Example:
    stem = _text(rec, "question_stem")
    texts, label = _lettered_choices(rec)
    return Example(stem, [" " + t for t in texts], label)


_TAG = re.compile(r"\[[^\[\]]*\]")  # [header], [step], [substeps] ... (after [title] is handled)
_SPACES = re.compile(r" {2,}")


def clean_hellaswag(text: str) -> str:
    """Remove WikiHow markup: " [title]" -> ". ", other [tags] dropped, spaces collapsed, ends stripped."""
    text = text.replace(" [title]", ". ")
    text = _TAG.sub("", text)
    return _SPACES.sub(" ", text).strip()


def _parse_hellaswag(rec: dict) -> Example:
    activity = _text(rec, "activity_label", empty_ok=True)
    ctx_a = _text(rec, "ctx_a", empty_ok=True)
    ctx_b = _text(rec, "ctx_b", empty_ok=True)
    endings = _texts(_field(rec, "endings"), "endings")
    label = _index(rec, "label", len(endings))
    context = clean_hellaswag(f"{activity}: {ctx_a} {ctx_b[:1].upper()}{ctx_b[1:]}")
    return Example(context, [" " + clean_hellaswag(e) for e in endings], label)


def _parse_piqa(rec: dict) -> Example:
    goal = _text(rec, "goal")
    sols = [_text(rec, "sol1", empty_ok=True), _text(rec, "sol2", empty_ok=True)]
    label = _index(rec, "label", 2)
    return Example(f"Question: {goal}\nAnswer:", [" " + s for s in sols], label)


def _parse_custom(rec: dict) -> Example:
    """A custom task's record: the plain form, or a built-in task's (module docstring)."""
    ch = rec.get("choices")
    if isinstance(ch, dict):
        return _parse_openbookqa(rec) if "question_stem" in rec and "question" not in rec else _parse_arc(rec)
    if "endings" in rec:
        return _parse_hellaswag(rec)
    if "goal" in rec:
        return _parse_piqa(rec)
    if "context" not in rec and "choices" not in rec:
        have = ", ".join(sorted(map(str, rec))) or "none"
        raise _Bad("context", f"not a multiple-choice record: expected {{\"context\", \"choices\", \"label\"}} "
                   f"(or a built-in task's fields); fields present: {have}")
    context = _text(rec, "context", empty_ok=True)
    choices = _texts(_field(rec, "choices"), "choices")
    return Example(context, choices, _index(rec, "label", len(choices)))


def custom_spec(name: str) -> TaskSpec:
    """The spec of a custom task ``name`` (local files only: no hub dataset)."""
    return TaskSpec(name, "", None, "", _parse_custom, "a custom task from a local file")


TASKS: dict[str, TaskSpec] = {
    t.name: t
    for t in (
        TaskSpec("arc_easy", "allenai/ai2_arc", "ARC-Easy", "test", _parse_arc,
                 "AI2 Reasoning Challenge, easy set: grade-school science questions, 3-5 choices"),
        TaskSpec("arc_challenge", "allenai/ai2_arc", "ARC-Challenge", "test", _parse_arc,
                 "AI2 Reasoning Challenge, challenge set: questions retrieval and co-occurrence fail on"),
        TaskSpec("openbookqa", "allenai/openbookqa", "main", "test", _parse_openbookqa,
                 "OpenBookQA: elementary science questions, 4 choices"),
        TaskSpec("hellaswag", "Rowan/hellaswag", None, "validation", _parse_hellaswag,
                 "HellaSwag: pick the sensible ending of an ActivityNet / WikiHow passage, 4 endings"),
        TaskSpec("piqa", "baber/piqa", None, "validation", _parse_piqa,
                 "PIQA: physical commonsense, which of 2 solutions reaches the goal"),
    )
}


# --------------------------------------------------------------------------- loading

def _datasets():
    try:
        return importlib.import_module("datasets")
    except ImportError:
        raise TaskError(f"benchmark tasks are read with the 'datasets' package: {INSTALL_HINT}") from None


def _local_files(path: Path) -> list[Path]:
    """The benchmark files at ``path``: the file itself, or a folder's .jsonl/.json/.parquet
    files (recursively, hidden entries skipped), sorted by relative path."""
    if not path.exists():
        raise TaskError(f"{path}: no such file or folder")
    if path.is_file():
        if path.suffix.lower() not in LOCAL_FORMATS:
            raise TaskError(f"{path}: unrecognised extension; accepted: {', '.join(LOCAL_FORMATS)}")
        return [path]
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in filenames:
            p = Path(dirpath) / name
            if not name.startswith(".") and p.suffix.lower() in LOCAL_FORMATS and p.is_file():
                found.append((p.relative_to(path).as_posix(), p))
    if not found:
        raise TaskError(f"{path}: folder has no {', '.join(LOCAL_FORMATS)} file")
    return [p for _, p in sorted(found)]


def _records(ds: Iterable, where: str) -> Iterator[tuple[int, Any]]:
    """(1-based record number, record) from a datasets iterable; read errors name ``where``."""
    n = 0
    it = iter(ds)
    while True:
        try:
            rec = next(it)
        except StopIteration:
            return
        except Exception as e:  # malformed JSON, unreadable parquet, mixed column types ...
            raise TaskError(f"{where}: cannot read record {n + 1}: {type(e).__name__}: {e}") from e
        n += 1
        yield n, rec


def _jsonl_records(path: Path) -> Iterator[tuple[str, Any]]:
    """(where, record) for each non-blank line of a JSON Lines file; ``where`` names the file,
    the line and the record number; a line that is not JSON is an error naming both."""
    n = 0
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise TaskError(f"{path}: cannot read: {e.strerror or e}") from None
    with f:
        try:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                n += 1
                where = f"{path} line {line_no} (record {n})"
                try:
                    check_json_depth(line, where)  # before json.loads, which recurses once per level
                    rec = json.loads(line)
                except FileFormatError as e:
                    raise TaskError(str(e)) from None
                except json.JSONDecodeError as e:
                    raise TaskError(f"{where}: not valid JSON: {e.msg} at column {e.colno}: "
                                    f"{_short(line.strip())}") from None
                except ValueError as e:  # an integer of more than 4,300 digits
                    raise TaskError(f"{where}: not valid JSON: {_short(str(e))}") from None
                yield where, rec
        except UnicodeDecodeError as e:
            raise TaskError(f"{path}: not UTF-8 text after record {n}: {e.reason}") from None


def _parse(spec: TaskSpec, rec: Any, where: str, n: int | None) -> Example:
    where = where if n is None else f"{where} record {n}"
    if not isinstance(rec, dict):
        raise TaskError(f"{where}: is {_kind(rec)} ({_short(rec)}), not an object")
    try:
        return spec.parse(rec)
    except _Bad as e:
        raise TaskError(f"{where}: {spec.name}: {e.message}") from None


def load_task(name: str, path: str | os.PathLike | None = None, split: str | None = None,
              limit: int = 0) -> list[Example]:
    """The examples of task ``name``, in the dataset's order.

    ``path`` None reads the hub dataset (``TASKS[name].hub_path`` / ``hub_config``, split
    ``split`` or the task's default). ``path`` set reads a local file or folder of
    records in the hub's form (see the module docstring); ``split`` must then be None (a
    local file is read whole). A ``name`` not in :data:`TASKS` is a custom task and needs
    ``path``. ``limit > 0`` keeps the first ``limit`` examples and stops reading there.
    Raises :class:`TaskError`.
    """
    if name not in TASKS and path is None:
        raise TaskError(f"unknown task {name!r}; valid tasks: {', '.join(TASKS)}; a task of your own needs its "
                        f"file: --task-data {name}=FILE.jsonl")
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
        raise TaskError(f"limit must be an integer >= 0 (0 = all examples), got {limit!r}")
    spec = TASKS[name] if name in TASKS else custom_spec(name)
    out: list[Example] = []

    def take(ds: Iterable, where: str) -> bool:
        """Parse records from ``ds`` into ``out``; True once ``limit`` is reached."""
        if limit and len(out) >= limit:
            return True
        for n, rec in _records(ds, where):
            out.append(_parse(spec, rec, where, n))
            if limit and len(out) >= limit:
                return True
        return False

    def take_jsonl(f: Path) -> bool:
        if limit and len(out) >= limit:
            return True
        for where, rec in _jsonl_records(f):
            out.append(_parse(spec, rec, where, None))
            if limit and len(out) >= limit:
                return True
        return False

    if path is None:
        datasets = _datasets()
        split = split or spec.split
        where = f"{spec.hub_path}" + (f":{spec.hub_config}" if spec.hub_config else "") + f" split={split}"
        try:
            ds = datasets.load_dataset(spec.hub_path, spec.hub_config, split=split)
        except Exception as e:  # no network, unknown split, hub changes ...
            raise TaskError(f"{where}: cannot load the dataset for task {name}: {type(e).__name__}: {e}") from e
        take(ds, where)
    else:
        if split is not None:
            raise TaskError(f"task {name}: split={split!r} applies to the hub dataset only; "
                            f"the local path {path} is read whole")
        try:
            files = _local_files(Path(path).expanduser())
        except TaskError as e:
            raise TaskError(f"task {name}: {e}") from None
        for f in files:
            builder = LOCAL_FORMATS[f.suffix.lower()]
            if f.suffix.lower() == ".jsonl":
                if take_jsonl(f):
                    break
                continue
            datasets = _datasets()
            try:
                ds = datasets.load_dataset(builder, data_files=[str(f)], split="train", streaming=True)
            except Exception as e:
                raise TaskError(f"{f}: cannot open with datasets' {builder} builder: {type(e).__name__}: {e}") from e
            if take(ds, str(f)):
                break
    if not out:
        raise TaskError(f"task {name}: no examples in {path if path is not None else spec.hub_path}")
    return out


# --------------------------------------------------------------------------- scoring

def _encode(tokenizer, texts: list[str]) -> list[list[int]]:
    return [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)]


class _Requests(NamedTuple):
    """One request per (example, choice), in example then choice order."""

    seqs: list[list[int]]  # each: context + choice, cut on the left to max_len + 1 tokens
    ncont: list[int]  # choice tokens at the end of each sequence
    owner: list[tuple[int, int]]  # (example, choice) of each
    truncated: int  # sequences that lost context on the left


def _requests(tokenizer, examples: list[Example], max_len: int) -> _Requests:
    """The token sequences to score (module docstring: how they are built and cut)."""
    ids = special_ids(tokenizer)
    bos, eos = ids["bos_id"], ids["eos_id"]
    # Token ids: contexts once per example, choices flattened.
    ctx_ids = _encode(tokenizer, [ex.context for ex in examples])
    choice_ids = _encode(tokenizer, [c for ex in examples for c in ex.choices])
    seqs: list[list[int]] = []
    ncont: list[int] = []
    owner: list[tuple[int, int]] = []
    truncated = 0
    r = 0
    for i, ex in enumerate(examples):
        prefix = ([bos] if bos is not None else []) + ctx_ids[i]
        if not prefix:
            if eos is None:
                raise TaskError(f"example {i}: the context {ex.context!r} encodes to no token and the tokenizer has "
                                 f"neither BOS nor EOS to condition the first choice token on")
            prefix = [eos]
        for j, choice in enumerate(ex.choices):
            cont = choice_ids[r]
            r += 1
            if not cont:
                raise TaskError(f"example {i} choice {j}: {choice!r} encodes to no token")
            if len(cont) > max_len:
                raise TaskError(f"example {i} choice {j}: {len(cont)} tokens, more than model.max_seq_len "
                                 f"{max_len}: some of its tokens would have no context")
            seq = prefix + cont
            if len(seq) > max_len + 1:  # the input is seq[:-1]: at most max_len tokens
                seq = seq[-(max_len + 1):]
                truncated += 1
            seqs.append(seq)
            ncont.append(len(cont))
            owner.append((i, j))
    return _Requests(seqs, ncont, owner, truncated)


def _batch_logprobs(model: torch.nn.Module, seqs: list[list[int]], ncont: list[int], device: str | torch.device,
                    autocast: Callable[[], contextlib.AbstractContextManager]) -> torch.Tensor:
    """Summed log-probabilities (B,) of the last ``ncont[b]`` tokens of each of ``seqs``, in one
    forward over the sequences right-padded (float64, on ``device``)."""
    T = max(len(s) for s in seqs) - 1
    idx = torch.zeros((len(seqs), T), dtype=torch.long)  # (B, T) inputs, right-padded with id 0
    rows, targets, seg = [], [], []  # one entry per choice token in the batch (cols too)
    cols: list[int] = []
    for b, (s, n) in enumerate(zip(seqs, ncont)):
        L = len(s) - 1  # real input length
        idx[b, :L] = torch.tensor(s[:-1])
        rows += [b] * n
        cols += range(L - n, L)  # logits at position t predict token t + 1
        targets += s[L + 1 - n :]
        seg += [b] * n
    idx = idx.to(device)
    rows_t = torch.tensor(rows, device=device)
    cols_t = torch.tensor(cols, device=device)
    use_hidden = hasattr(model, "forward_hidden") and hasattr(model, "head_weight")
    with autocast():
        if use_hidden:  # only the needed rows through the head: no (B, T, V) logits
            h = model(idx, return_hidden=True)[rows_t, cols_t]  # (N, D)
            logits = F.linear(h, model.head_weight)  # type: ignore[arg-type]  # a Transformer's (use_hidden)
        else:
            logits = model(idx)[rows_t, cols_t]  # (N, V)
    logp = logits.float().log_softmax(-1)  # (N, V) float32
    tok = logp.gather(1, torch.tensor(targets, device=device)[:, None]).squeeze(1)  # (N,)
    sums = torch.zeros(len(seqs), dtype=torch.float64, device=device)
    return sums.index_add_(0, torch.tensor(seg, device=device), tok.double())  # (B,)


@torch.no_grad()
def loglikelihoods(model: torch.nn.Module, tokenizer, examples: list[Example], device: str | torch.device = "cpu",
                   batch_size: int = 16,
                   autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                   shard: Shard = UNSHARDED,
                   ) -> tuple[list[list[float]], list[list[int]], int]:
    """``(logprobs, n_tokens, truncated)``: for example i and choice j, ``logprobs[i][j]``
    = log P(choice | context) (float32 log-softmax, summed) over ``n_tokens[i][j]``
    choice tokens; ``truncated`` counts sequences that lost context on the left.

    ``tokenizer`` is a ``tokenizers.Tokenizer``; conventions in the module docstring.

    Under data parallelism (``shard``) each rank scores every world-th batch and
    ``shard.reduce`` sums the per-request results over ranks (each is filled by one rank,
    zero elsewhere), so every rank returns the whole answer. All ranks run the same number
    of forwards (a rank short of batches repeats one and discards it): FSDP2 gathers
    weights collectively inside every forward."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    cfg = getattr(model, "cfg", None)
    max_len = getattr(cfg, "max_seq_len", None)
    if not isinstance(max_len, int) or max_len < 1:
        raise ValueError("the model needs cfg.max_seq_len (its longest input) to be a positive integer")
    req = _requests(tokenizer, examples, max_len)

    # Longest first: little padding per batch, and a too-big batch fails on the first one.
    order = sorted(range(len(req.seqs)), key=lambda k: -len(req.seqs[k]))
    result = [0.0] * len(req.seqs)
    was_training = model.training
    model.eval()
    batches = [order[start : start + batch_size] for start in range(0, len(order), batch_size)]
    mine = batches[shard.rank :: shard.world]  # round robin: every rank gets long and short sequences alike
    try:
        for turn in range(-(-len(batches) // shard.world)):
            counted = turn < len(mine)
            batch = mine[turn] if counted else batches[0]
            sums = _batch_logprobs(model, [req.seqs[k] for k in batch], [req.ncont[k] for k in batch], device,
                                   autocast)
            if counted:
                for k, v in zip(batch, sums.tolist()):
                    result[k] = v
    finally:
        model.train(was_training)
    if shard.reduce is not None:
        result = shard.reduce(result)

    logprobs = [[0.0] * len(ex.choices) for ex in examples]
    ntoks = [[0] * len(ex.choices) for ex in examples]
    for k, (i, j) in enumerate(req.owner):
        logprobs[i][j] = result[k]
        ntoks[i][j] = req.ncont[k]
    return logprobs, ntoks, req.truncated


def _argmax(values: list[float]) -> int:
    """Index of the largest value, the lowest index on ties; NaN never wins."""
    best, best_v = 0, -math.inf
    for j, v in enumerate(values):
        if v > best_v:  # strict: a tie keeps the earlier index; NaN > x is False
            best, best_v = j, v
    return best


def _stderr(p: float, n: int) -> float:
    """Standard error of a mean of n 0/1 outcomes with mean p: sqrt(p (1 - p) / (n - 1))."""
    return math.sqrt(p * (1.0 - p) / (n - 1)) if n > 1 else math.nan


def metrics(examples: list[Example], logprobs: list[list[float]], n_tokens: list[list[int]]) -> dict:
    """Accuracies (acc, acc_norm, acc_token), their standard errors and the chance baseline."""
    n = len(examples)
    hits = {"acc": 0, "acc_norm": 0, "acc_token": 0}
    for ex, lp, nt in zip(examples, logprobs, n_tokens):
        nbytes = [len(c.encode("utf-8")) for c in ex.choices]
        hits["acc"] += _argmax(lp) == ex.label
        hits["acc_norm"] += _argmax([v / b for v, b in zip(lp, nbytes)]) == ex.label
        hits["acc_token"] += _argmax([v / t for v, t in zip(lp, nt)]) == ex.label
    out: dict[str, Any] = {"n": n, **{key: h / n for key, h in hits.items()}}
    out["stderr"] = {key: _stderr(h / n, n) for key, h in hits.items()}
    out["random"] = sum(1.0 / len(ex.choices) for ex in examples) / n
    return out


def score(model: torch.nn.Module, tokenizer, examples: list[Example], device: str | torch.device = "cpu",
          batch_size: int = 16,
          autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
          shard: Shard = UNSHARDED) -> dict:
    """Score ``examples`` by log-probability (module docstring: tokenization, truncation,
    normalisations, stderr formula).

    Returns ``{"n", "acc", "acc_norm", "acc_token", "stderr": {"acc", "acc_norm",
    "acc_token"}, "random", "truncated"}``: accuracies and chance as fractions in [0, 1],
    ``truncated`` the number of (example, choice) sequences cut on the left."""
    if not examples:
        raise TaskError("no examples to score")
    for i, ex in enumerate(examples):
        if len(ex.choices) < 1 or not 0 <= ex.label < len(ex.choices):
            raise TaskError(f"example {i}: label {ex.label} is not an index into its {len(ex.choices)} choices")
    logprobs, ntoks, truncated = loglikelihoods(model, tokenizer, examples, device, batch_size, autocast, shard)
    out = metrics(examples, logprobs, ntoks)
    out["truncated"] = truncated
    return out


def evaluate_tasks(model: torch.nn.Module, tokenizer, names: list[str], paths: dict[str, str] | None = None,
                   limit: int = 0, **score_kwargs) -> dict[str, dict]:
    """``{task: score(...) + {"source"}}`` for each task in ``names``.

    ``paths`` maps a task to a local file or folder (others come from the hub); a name in
    ``names`` that is not a built-in task must have one (a custom task). Every task
    is loaded, and so checked, before any is scored: a bad file fails in seconds, not
    after an hour of scoring."""
    paths = dict(paths or {})
    unknown = [n for n in names if n not in TASKS and n not in paths]
    if unknown:
        raise TaskError(f"unknown task(s) {', '.join(map(repr, unknown))}; valid tasks: {', '.join(TASKS)}; "
                        f"a task of your own needs its file: --task-data NAME=FILE.jsonl")
    loaded = {}
    for name in names:
        path = paths.get(name)
        if path is not None:
            source = str(path)
        else:
            spec = TASKS[name]  # a built-in: names neither built in nor given a file were refused above
            source = spec.hub_path + (f":{spec.hub_config}" if spec.hub_config else "") + f" split={spec.split}"
        loaded[name] = (load_task(name, path, limit=limit), source)
    results = {}
    for name, (examples, source) in loaded.items():
        results[name] = {**score(model, tokenizer, examples, **score_kwargs), "source": source}
    return results
