"""Reading a run directory written by ``flopwise train`` into plain Python data.

Only ``metrics.jsonl`` is required; ``evals.jsonl`` (``flopwise eval``), ``plan.json``,
``preflight.json``, ``virtual.json`` (``preflight --dry-run --rank``), ``run.json``, ``config.yaml``
and ``samples.txt`` are used when present. Corruption is an error that names the file (and the
line of ``metrics.jsonl``): a report drawn from silently dropped rows would mislead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flopwise.config import ConfigError, identity_mismatch, load_run_config, read_yaml
from flopwise.errors import FlopwiseError
from flopwise.fsio import FileFormatError, loads_json, read_json
from flopwise.manifest import run_file_problem
from flopwise.measure.sinks import OUTER_SYNC

METRICS = "metrics.jsonl"
EVALS = "evals.jsonl"  # written by ``flopwise eval`` beside the training metrics
VIRTUAL = "virtual.json"  # ``preflight --dry-run --rank``: the settings ranked by predicted tokens/s


class ReportError(FlopwiseError, ValueError):
    """A path that is not a run directory, or a file of one that cannot be read; names the file."""


def number(value: Any) -> float | None:
    """``value`` as a finite float, or None (missing, null, NaN, text, bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


@dataclass
class Run:
    """One run directory: its metrics rows split by kind, and its side files."""

    path: Path
    rows: list[dict[str, Any]]  # every non-event row: training, validation, evaluation, per-layer
    events: list[dict[str, Any]]  # rows with an ``event`` key (loss_spike, nonfinite, ...), outer syncs apart
    plan: dict[str, Any] | None = None
    preflight: dict[str, Any] | None = None
    virtual: dict[str, Any] | None = None  # virtual.json's "virtual" object: predicted, never measured
    record: dict[str, Any] | None = None  # run.json
    config: dict[str, Any] | None = None  # config.yaml
    samples: str | None = None
    eval_rows: list[dict[str, Any]] = field(default_factory=list)  # evals.jsonl
    warnings: list[str] = field(default_factory=list)  # shown in the page's notes
    name: str = ""
    # what the charts' legends put before a series of this run: "NAME · " among several runs,
    # nothing when the report is of one run (its name is the page's title already)
    prefix: str = ""
    color: str = ""
    outer_syncs: list[dict[str, Any]] = field(default_factory=list)  # DiLoCo: a row per outer step

    # ---------------------------------------------------------------- series
    def series(self, x_key: str, y_key: str) -> tuple[list[float], list[float]]:
        """(x, y) of the rows where both keys hold finite numbers, sorted by x."""
        given = [(number(r.get(x_key)), number(r.get(y_key))) for r in self.rows]
        pairs = sorted((x, y) for x, y in given if x is not None and y is not None)
        return [p[0] for p in pairs], [p[1] for p in pairs]

    def has(self, key: str) -> bool:
        return any(number(r.get(key)) is not None for r in self.rows)

    def values(self, key: str) -> list[float]:
        return [v for v in (number(r.get(key)) for r in self.rows) if v is not None]

    def training_rows(self) -> list[dict[str, Any]]:
        """Rows logged at a training step (they carry a training loss), in step order."""
        rows = [r for r in self.rows if number(r.get("loss")) is not None and number(r.get("step")) is not None]
        return sorted(rows, key=lambda r: r["step"])

    def evals(self) -> list[tuple[float | None, float | None, dict[str, dict[str, Any]]]]:
        """(step, tokens, {task: results}) of the evaluation rows of both files, in token order."""
        out = []
        for r in self.rows + self.eval_rows:
            tasks = r.get("eval")
            if isinstance(tasks, dict):
                clean = {str(k): v for k, v in tasks.items() if isinstance(v, dict)}
                tokens = number(r.get("tokens"))
                step = number(r.get("step"))
                out.append((step, tokens if tokens is not None else self.tokens_at(step), clean))
        return sorted(out, key=lambda e: (e[1] is None, e[1] or 0.0))

    def layer_stats(self, key: str = "grad_norms") -> list[tuple[float, dict[str, float]]]:
        """(step, {parameter: value}) of the per-layer rows (``grad_norms``, ``update_ratios``), by step."""
        out = []
        for r in self.rows:
            norms, step = r.get(key), number(r.get("step"))
            if isinstance(norms, dict) and step is not None:
                out.append((step, {str(k): v for k, v in norms.items() if number(v) is not None}))
        return sorted(out, key=lambda e: e[0])

    def tokens_at(self, step: float | None) -> float | None:
        """Tokens seen at ``step``, interpolated from the rows that log both (events log only a step)."""
        if step is None:
            return None
        xs, ys = self.series("step", "tokens")
        if not xs:
            return None
        for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
            if x0 <= step <= x1:
                return y0 if x1 == x0 else y0 + (y1 - y0) * (step - x0) / (x1 - x0)
        per_step = ys[-1] / xs[-1] if xs[-1] else None
        return step * per_step if per_step is not None else None

    def starts(self) -> list[tuple[float, dict[str, Any]]]:
        """(the step it began at, its run.json entry) of each process start of the run, in order:
        one for a run never resumed. run.json's ``starts`` says (train appends one at each start,
        and closes it with the start's own averages at its end); a run.json from before it did
        (none, or one whose first start is a resume) is completed from metrics.jsonl, where each
        start restarts the ``elapsed_s`` clock -- at the last step logged before, the entry empty."""
        given = (self.record or {}).get("starts")
        recorded = [(number(s.get("at_step")), s) for s in given if isinstance(s, dict)] \
            if isinstance(given, list) else []
        out = [(step, s) for step, s in recorded if step is not None]
        if out and out[0][0] == 0:
            return out
        restarts, last = [0.0], None
        timed = [(number(r.get("step")), number(r.get("elapsed_s"))) for r in self.rows]
        for step, elapsed in sorted((s, e) for s, e in timed if s is not None and e is not None):
            if last is not None and elapsed < last[1]:  # the clock restarted: a new process
                restarts.append(last[0])
            last = (step, elapsed)
        if not out:
            return [(step, {}) for step in restarts]
        earlier = [step for step in restarts if step <= out[0][0]]
        # the last restart up to the first recorded start is that start's own (logged a step or more before it)
        unrecorded: list[tuple[float, dict[str, Any]]] = [(step, {}) for step in earlier[:-1] or earlier]
        return unrecorded + out

    # ---------------------------------------------------------------- side files
    @property
    def result(self) -> dict[str, Any]:
        """The result summary of run.json (empty while a run is in progress or after a crash)."""
        res = (self.record or {}).get("result")
        return res if isinstance(res, dict) else {}

    def flat_config(self) -> dict[str, Any]:
        """config.yaml as ``section.key -> value``."""
        return flatten(self.config or {})


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def read_jsonl(path: Path, warnings: list[str]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(rows, event rows) of a JSON Lines file; a bad line is a ReportError naming file and line.

    The one exception: a last line with no newline that does not parse is a row being
    written (a live run) or cut by a crash; it is left out with a warning."""
    rows: list[dict[str, Any]] = []
    events: list[dict[str, Any]] = []
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ReportError(f"{path}: cannot be read ({e.strerror or e})") from None
    lines = data.split(b"\n")
    for n, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            row = loads_json(raw, f"{path}, line {n}")
        except FileFormatError as e:
            if n == len(lines):  # no newline after it: still being written, or cut short
                warnings.append(f"{path}, line {n}: incomplete last line left out (a row being written, "
                                "or cut by a crash)")
                continue
            snippet = raw[:80].decode("utf-8", "replace")
            raise ReportError(f"{path}, line {n}: not a JSON object ({e.reason}): {snippet!r}") from None
        if not isinstance(row, dict):
            raise ReportError(f"{path}, line {n}: expected a JSON object, got {type(row).__name__}")
        (events if "event" in row else rows).append(row)
    return rows, events


def _read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object of the run's; one its manifest lists (plan.json, run.json) checked against it first."""
    if not path.is_file():
        return None
    problem = run_file_problem(path.parent, path.name)
    if problem:
        raise ReportError(f"{path}: {problem}")
    try:
        data = read_json(path)
    except FileFormatError as e:
        raise ReportError(f"{path}: not valid JSON ({e.reason})") from None
    except OSError as e:
        raise ReportError(f"{path}: cannot be read ({e.strerror or e})") from None
    if not isinstance(data, dict):
        raise ReportError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _read_virtual(path: Path, warnings: list[str]) -> dict[str, Any] | None:
    """The ``virtual`` object of a run's ``virtual.json``: train copies it beside preflight.json, or a
    user puts it there by hand. One of another shape is left out with a warning, as the report's
    other columns do not depend on it."""
    doc = _read_json(path)
    virtual = (doc or {}).get("virtual")
    if doc is not None and not (isinstance(virtual, dict) and isinstance(virtual.get("candidates"), list)):
        warnings.append(f'{path}: not a virtual preflight result (no "virtual" object with "candidates"): left out')
        return None
    return virtual


def _of_this_step(virtual: dict[str, Any] | None, run: Path, warnings: list[str]) -> dict[str, Any] | None:
    """``virtual`` when it predicted this run's step (its ``of``: the model, sequence length and
    global batch of the config it traced); None, with a warning, when it predicted another (put
    in by hand: train keeps none of another step). One without ``of`` (older, or hand-made) is
    kept: nothing tells."""
    if virtual is None or "of" not in virtual or not (run / "config.yaml").is_file():
        return virtual
    try:
        differs = identity_mismatch(virtual["of"], load_run_config(run / "config.yaml"))
    except ConfigError:  # the config's own problem is the report's to say elsewhere
        return virtual
    if differs:
        warnings.append(f"{run / VIRTUAL}: the virtual preflight predicted another step ({differs}): left out")
        return None
    return virtual


def _read_yaml(path: Path) -> dict[str, Any] | None:
    """A run's ``config.yaml``, read by the bounded reader every other command uses (its size,
    nesting and alias expansion capped): a 600-byte alias bomb expands to billions of values,
    which the configuration table would walk and print."""
    if not path.is_file():
        return None
    try:
        data = read_yaml(path, str(path))
    except ConfigError as e:
        raise ReportError(" ".join(str(e).split())) from None
    except OSError as e:
        raise ReportError(f"{path}: cannot be read ({e.strerror or e})") from None
    except ValueError as e:  # PyYAML's int() of a number longer than Python converts
        raise ReportError(f"{path}: not valid YAML ({' '.join(str(e).split())[:300]})") from None
    if data is None:
        return None
    if not isinstance(data, dict):
        raise ReportError(f"{path}: expected a mapping of config sections")
    return data


def load_run(path: str | Path) -> Run:
    """Read the run directory at ``path`` (or the directory of a ``metrics.jsonl`` given directly)."""
    path = Path(path).expanduser()
    if path.is_file() and path.name == METRICS:
        path = path.parent
    if not path.exists():
        raise ReportError(f"{path}: no such run directory")
    if not path.is_dir():
        raise ReportError(f"{path}: not a run directory (a file, not a directory)")
    metrics = path / METRICS
    if not metrics.is_file():
        raise ReportError(f"{path}: not a run directory: no {METRICS} in it "
                          "(flopwise train writes metrics.jsonl, config.yaml, plan.json and run.json there)")
    warnings: list[str] = []
    rows, events = read_jsonl(metrics, warnings)
    outer_syncs = [e for e in events if e.get("event") == OUTER_SYNC]  # a record, not an anomaly to mark
    events = [e for e in events if e.get("event") != OUTER_SYNC]
    eval_rows, _ = read_jsonl(path / EVALS, warnings) if (path / EVALS).is_file() else ([], [])
    samples = path / "samples.txt"
    try:
        sample_text = samples.read_text(encoding="utf-8", errors="replace") if samples.is_file() else None
    except OSError:
        sample_text = None
    virtual = _of_this_step(_read_virtual(path / VIRTUAL, warnings), path, warnings)
    return Run(path=path, rows=rows, events=events, plan=_read_json(path / "plan.json"),
               preflight=_read_json(path / "preflight.json"), virtual=virtual,
               record=_read_json(path / "run.json"), config=_read_yaml(path / "config.yaml"), samples=sample_text,
               eval_rows=eval_rows, warnings=warnings, outer_syncs=outer_syncs)


def unique_names(paths: list[Path]) -> list[str]:
    """Short names for runs: the directory name, with as many parents as it takes to tell them apart."""
    parts = [p.resolve().parts for p in paths]
    depth = 1
    while True:
        names = ["/".join(ps[-depth:]) for ps in parts]
        if len(set(names)) == len(names) or depth >= max(len(ps) for ps in parts):
            break
        depth += 1
    seen: dict[str, int] = {}
    out = []
    for name in names:  # the same directory given twice
        seen[name] = seen.get(name, 0) + 1
        out.append(name if seen[name] == 1 else f"{name} ({seen[name]})")
    return out

