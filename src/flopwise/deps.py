"""Optional packages: which feature needs which, checked before any work starts.

flopwise's core needs torch, numpy, tokenizers, PyYAML, tqdm, and for Hugging Face export
and import (``flopwise export --format hf``, ``model.hf_config``, ``flopwise.load`` of a
Hugging Face directory) safetensors and transformers. Everything else is an extra
(``pyproject.toml``) or a package of its own, needed only by the feature that uses it:

- ``tensorboard`` (``pip install 'flopwise[track]'``): ``tracking.tensorboard=true``
  (the default ``auto`` uses it when installed and goes without it otherwise);
- ``wandb`` (``pip install wandb``): ``tracking.wandb=true``;
- ``datasets`` (``pip install 'flopwise[data]'``): ``prepare hf:NAME``, and benchmark
  tasks (``eval --tasks``, ``eval.tasks`` in training) read from the hub or from local
  ``.json`` / ``.parquet`` files (a ``.jsonl`` task file is read with :mod:`json`);
- ``pyarrow`` (``flopwise[data]``): ``prepare`` of ``.parquet`` files;
- ``zstandard`` (``flopwise[data]``): ``prepare`` of ``.zst`` / ``.zstd`` files;
- ``matplotlib`` (``pip install 'flopwise[report]'``): PNG copies of the report's
  figures, skipped with a note when missing (never an error);
- ``torchao`` (``pip install torchao``): ``train.fp8=true``;
- ``liger_kernel`` (``pip install liger-kernel``): ``train.loss=fused``;
- ``flash_attn`` (``pip install flash-attn``): ``model.attention=flash`` (without it,
  attention falls back to sdpa and says why, or fails with ``attention_strict``).

:data:`OPTIONAL` holds this table, :data:`CORE` the core packages imported where they are
used (so that a broken installation gets the same one line, not a traceback).

Where an optional (or lazily imported core) package is imported, :func:`load` does it: a
package that cannot be imported is a :class:`MissingDependencyError` whose one line names
the command that installs it, never a ``ModuleNotFoundError`` traceback.

A command asks for its list of problems first (:func:`missing_for_run`,
:func:`missing_for_eval`, :func:`missing_for_source`) and stops with all of them
together (:func:`require`) before it writes a file, loads a model or tokenizes a
document: a missing package must not cost a half-written run directory or a whole
validation pass. Only an explicit request is an error: ``tracking.tensorboard=auto``
(the default) quietly goes without TensorBoard when the package is absent.

Presence is tested with :func:`importlib.util.find_spec` (no import: cheap, and
importing tensorboard or datasets would cost seconds); a package present but broken
still fails later, where it is imported, with its own error.

Layering: the bottom layer; imports nothing from flopwise but ``config``.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from flopwise.config import ConfigError


@dataclass(frozen=True)
class OptionalPackage:
    import_name: str  # what find_spec looks for
    package: str  # the name on PyPI
    install: str  # the command that installs it
    needed_by: str  # for people: the features that use it


OPTIONAL: dict[str, OptionalPackage] = {
    o.import_name: o
    for o in (
        OptionalPackage("tensorboard", "tensorboard", "pip install 'flopwise[track]'",
                 "TensorBoard scalars (tracking.tensorboard=true; auto uses it when installed)"),
        OptionalPackage("wandb", "wandb", "pip install wandb", "Weights & Biases tracking (tracking.wandb=true)"),
        OptionalPackage("datasets", "datasets", "pip install 'flopwise[data]'",
                 "prepare hf:NAME sources; benchmark tasks (eval --tasks, eval.tasks)"),
        OptionalPackage("pyarrow", "pyarrow", "pip install 'flopwise[data]'", "prepare of .parquet files"),
        OptionalPackage("zstandard", "zstandard", "pip install 'flopwise[data]'", "prepare of .zst / .zstd files"),
        OptionalPackage("matplotlib", "matplotlib", "pip install 'flopwise[report]'",
                 "PNG copies of the report's figures (optional: skipped with a note)"),
        OptionalPackage("torchao", "torchao", "pip install torchao", "float8 linear layers (train.fp8=true)"),
        OptionalPackage("liger_kernel", "liger-kernel", "pip install liger-kernel",
                 "the fused linear cross-entropy kernel (train.loss=fused, on CUDA)"),
        OptionalPackage("flash_attn", "flash-attn", "pip install flash-attn",
                 "FlashAttention kernels (model.attention=flash, on CUDA)"),
    )
}

# Core dependencies (``pyproject.toml``'s ``dependencies``) that are imported where they are
# used rather than at start-up; missing only from a broken or partial installation.
CORE: dict[str, OptionalPackage] = {
    o.import_name: o
    for o in (
        OptionalPackage("safetensors", "safetensors", "pip install safetensors",
                        "Hugging Face weights (flopwise export --format hf, model.hf_config, flopwise.load)"),
        OptionalPackage("transformers", "transformers", "pip install transformers",
                        "Hugging Face configs (flopwise export --format hf)"),
    )
}

# file names prepare reads with an optional package (mirrors flopwise.data.sources' formats:
# a compressed file counts only when what is inside is a format it reads)
_TEXT_SUFFIXES = (".txt", ".jsonl", ".ndjson", ".json")
_ZSTD_SUFFIXES = (".zst", ".zstd")


class MissingDependencyError(ConfigError):
    """One or more optional packages that the requested work needs are not installed;
    each problem names the setting or input that needs it and the command to install it."""

    def __init__(self, problems: list[str]):
        super().__init__(problems)
        if len(self.problems) == 1:  # one line
            ValueError.__init__(self, self.problems[0])
        else:
            lines = "\n".join(f"  - {p}" for p in self.problems)
            ValueError.__init__(self, f"missing package(s) ({len(self.problems)}):\n{lines}")


def available(import_name: str) -> bool:
    """Whether ``import_name`` can be found (without importing it)."""
    try:
        return importlib.util.find_spec(import_name) is not None
    except (ImportError, ValueError):  # blocked (sys.modules[name] is None) or a broken parent package
        return False


def message(import_name: str, what: str) -> str:
    """``"{what} needs the {package} package: {install}"``."""
    o = OPTIONAL.get(import_name) or CORE[import_name]
    return f"{what} needs the {o.package} package: {o.install}"


def load(import_name: str, what: str) -> ModuleType:
    """``import import_name`` (a package of :data:`OPTIONAL` or :data:`CORE`, or one of its
    modules) for ``what``. When it cannot be imported: :class:`MissingDependencyError`, one
    line naming the install command (and the module that is missing, when it is another
    one: a package present but missing one of its own dependencies)."""
    top = import_name.split(".")[0]
    try:
        return importlib.import_module(import_name)
    except ImportError as e:
        text = message(top, what)
        missing = (e.name or "").split(".")[0]
        if missing and missing != top:
            text += f" (it is installed, but importing it failed: {e})"
        raise MissingDependencyError([text]) from None


def require(problems: list[str]) -> None:
    """Raise :class:`MissingDependencyError` with every problem, if there is any."""
    if problems:
        raise MissingDependencyError(problems)


def missing_for_tracking(tracking) -> list[str]:
    """Optional packages the ``tracking`` settings (a ``TrackingConfig``) ask for and lack."""
    problems = []
    if str(tracking.tensorboard).lower() == "true" and not available("tensorboard"):
        problems.append(message("tensorboard", "tracking.tensorboard=true")
                        + " (or tracking.tensorboard=auto: TensorBoard only when installed)")
    if tracking.wandb and not available("wandb"):
        problems.append(message("wandb", "tracking.wandb=true"))
    return problems


def missing_for_run(cfg) -> list[str]:
    """Optional packages a training run of ``cfg`` (a ``RunConfig``) asks for and lacks."""
    problems = missing_for_tracking(cfg.tracking)
    if cfg.train.fp8 and not available("torchao"):
        problems.append(message("torchao", "train.fp8=true"))
    if cfg.train.loss == "fused" and not available("liger_kernel"):
        problems.append(message("liger_kernel", "train.loss=fused"))
    names = [t.strip() for t in str(cfg.eval.tasks).split(",") if t.strip()]
    root = Path(cfg.eval.task_dir).expanduser() if cfg.eval.task_dir else None
    local = {n: str(root / f"{n}.jsonl") for n in names if root is not None and (root / f"{n}.jsonl").is_file()}
    problems += [p.replace("eval --tasks ", "eval.tasks=", 1) for p in missing_for_eval(names, local)]
    return problems


def missing_for_eval(tasks: Iterable[str], task_paths: dict[str, str] | None = None) -> list[str]:
    """Optional packages ``flopwise eval --tasks`` lacks. A task read from the Hugging Face hub,
    or from a local ``.json`` / ``.parquet`` file (or a folder), is read with ``datasets``; a
    ``--task-data`` file ending in ``.jsonl`` is read line by line with :mod:`json` and needs
    nothing (see ``flopwise.evaluate.tasks``)."""
    paths = task_paths or {}
    need = [t for t in tasks if t and not str(paths.get(t, "")).lower().endswith(".jsonl")]
    if need and not available("datasets"):
        return [message("datasets", f"eval --tasks {','.join(need)}")
                + " (benchmark tasks are read with it from the hub, and local .json/.parquet files; "
                  "--task-data NAME=FILE.jsonl needs nothing)"]
    return []


def needs_for_file(name: str) -> str | None:
    """The optional package ``prepare`` needs to read a file of this name, or None."""
    low = name.lower()
    if low.endswith(".parquet"):
        return "pyarrow"
    for z in _ZSTD_SUFFIXES:
        if low.endswith(z) and low[: -len(z)].endswith(_TEXT_SUFFIXES):
            return "zstandard"
    return None


def missing_for_source(spec: str) -> list[str]:
    """Optional packages ``flopwise prepare SOURCE`` lacks: ``hf:`` -> datasets; ``.parquet``
    files -> pyarrow; ``.zst`` / ``.zstd`` files -> zstandard. A folder is walked for file
    names only (hidden entries skipped, links not followed: the source's own checks still
    cover what they lead to); nothing is opened."""
    if not isinstance(spec, str) or not spec or spec == "builtin":
        return []
    if spec.startswith("hf:"):
        return [] if available("datasets") else [message("datasets", f"SOURCE {spec} (a Hugging Face dataset)")]
    path = os.path.expanduser(spec)
    found: dict[str, str] = {}  # import name -> an example file
    if os.path.isdir(path):
        for dirpath, dirnames, filenames in os.walk(path):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for name in sorted(filenames):
                need = None if name.startswith(".") else needs_for_file(name)
                if need and need not in found:
                    found[need] = os.path.relpath(os.path.join(dirpath, name), path)
    elif os.path.isfile(path):
        need = needs_for_file(os.path.basename(path))
        if need:
            found[need] = spec
    problems = []
    for need, example in found.items():
        if not available(need):
            what = f"SOURCE {spec}" + (f" ({example} ...)" if example != spec else "")
            kind = ".parquet files" if need == "pyarrow" else ".zst files"
            problems.append(message(need, f"{what}: reading {kind}"))
    return problems
