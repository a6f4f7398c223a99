"""The import graph of flopwise: layered, acyclic, every internal import at the top of its file.

Layers, low to high (a module may import its own layer and the ones below, never above):

    0  flopwise (__init__), errors, fsio, deps, config, manifest, checkpoints
    1  model, data, plan, measure
    2  evaluate, parallel (process groups, DDP/ZeRO-1/FSDP2 wrapping, DiLoCo)
    3  train
    4  report, tune (preflight, the ladder, trials, the dry run: all of it times or traces train's step)
    5  cli, __main__

``checkpoints`` (the checkpoint directory: find, verify, read) sits with ``fsio`` at the bottom:
it is a file format that ``train`` writes and ``model/io`` and ``evaluate`` read; ``manifest``
(the size and CRC32 of a checkpoint's or a run's files) below it, free of torch, for ``report``. ``evaluate``
(validation loss, multiple-choice tasks, generation) sits below ``train``: it needs only a model
and data, and training validates, scores tasks and samples as it goes.

An import of a flopwise module inside a function is allowed only when it is lazy on purpose
(to keep ``flopwise --help``/``plan`` fast or an optional extra optional) and says so with a
``# lazy: <why>`` comment on its line. An import placed inside a function to dodge a cycle is a
cycle: move the shared piece below both instead.

The allow-lists below name every exception that remains, each with its reason; an entry that
is no longer needed fails :func:`test_allow_lists_hold_no_stale_entries`, so they only shrink.
The files are parsed (``ast``), never imported.
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path

import flopwise

SRC = Path(flopwise.__file__).resolve().parent  # src/flopwise
PACKAGE = SRC.name

LAYERS: dict[str, int] = {
    "__init__": 0, "errors": 0, "fsio": 0, "deps": 0, "config": 0, "manifest": 0, "checkpoints": 0,
    "model": 1, "data": 1, "plan": 1, "measure": 1,
    "evaluate": 2, "parallel": 2,
    "train": 3,
    "report": 4, "tune": 4,
    "cli": 5, "__main__": 5,
}
LAYER_NAMES = {0: "base (errors/fsio/deps/config/manifest/checkpoints)", 1: "model/data/plan/measure", 2: "evaluate/parallel", 3: "train",
               4: "report/tune", 5: "cli"}

# (file relative to src/flopwise, imported module) -> why it is still inside a function without `# lazy:`
ALLOWED_INNER: dict[tuple[str, str], str] = {}

# (file, imported module) -> why a module imports one of a higher layer
ALLOWED_UPWARD: dict[tuple[str, str], str] = {
    ("__init__.py", "flopwise.model.io"): "flopwise.load(), the package's public entry point, imports model/io "
                                          "lazily (marked)",
}

# modules that import each other (directly or through others) -> why
ALLOWED_CYCLES: dict[frozenset[str], str] = {}


@dataclass(frozen=True)
class Import:
    file: str  # relative to src/flopwise
    line: int
    importer: str  # dotted module name
    target: str  # the flopwise module imported
    source: str  # the statement as written
    in_function: bool
    lazy: bool  # a `# lazy:` comment on one of its lines
    type_checking: bool  # under `if TYPE_CHECKING:` (never runs)

    def where(self) -> str:
        return f"src/{PACKAGE}/{self.file}:{self.line}: {self.source}"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer(module: str) -> int:
    parts = module.split(".")
    key = parts[1] if len(parts) > 1 else "__init__"
    assert key in LAYERS, f"{module}: no layer assigned; add {key!r} to LAYERS in {__file__}"
    return LAYERS[key]


def _modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(SRC.rglob("*.py"))}


@functools.cache  # the tree does not change during a run: parsed once for the five tests, not five times
def collect() -> tuple[Import, ...]:
    """Every import of a flopwise module in src/flopwise, resolved to the module it loads."""
    modules = _modules()
    out: list[Import] = []
    for name, path in modules.items():
        text = path.read_text(encoding="utf-8")
        lines = text.splitlines()
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        rel = path.relative_to(SRC).as_posix()

        def visit(node: ast.AST, in_function: bool, type_checking: bool) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    for target in _targets(child, package, modules):
                        stmt = lines[child.lineno - 1: child.end_lineno]
                        out.append(Import(rel, child.lineno, name, target, " ".join(s.strip() for s in stmt),
                                          in_function, any("# lazy:" in s for s in stmt), type_checking))
                    continue
                func = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                tc = isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test)
                visit(child, in_function or func, type_checking or tc)

        visit(ast.parse(text, filename=str(path)), False, False)
    return tuple(out)


def _targets(node: ast.Import | ast.ImportFrom, package: str, modules: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == PACKAGE]
    if node.level:
        base_parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
        base = ".".join(base_parts + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    if base.split(".")[0] != PACKAGE:
        return []
    # `from pkg import sub` loads the submodule; `from mod import name` loads mod
    return sorted({f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names})


def _report(problems: list[str], what: str) -> str:
    return f"{len(problems)} {what}:\n  " + "\n  ".join(problems)


def test_internal_imports_sit_at_the_top_unless_marked_lazy():
    problems = [f"{i.where()}  (inside a function; move it to the top, or mark it `# lazy: <why>` if it is "
                f"deliberately lazy for cost)"
                for i in collect() if i.in_function and not i.lazy and (i.file, i.target) not in ALLOWED_INNER]
    assert not problems, _report(problems, "flopwise imports inside functions")


def test_no_module_imports_a_higher_layer():
    problems = []
    for i in collect():
        if (i.file, i.target) in ALLOWED_UPWARD:
            continue
        src, dst = layer(i.importer), layer(i.target)
        if dst > src:
            problems.append(f"{i.where()}  ({i.importer} is {LAYER_NAMES[src]}; {i.target} is "
                            f"{LAYER_NAMES[dst]}, above it)")
    assert not problems, _report(problems, "imports of a higher layer")


def _cycles(imports: tuple[Import, ...]) -> list[list[str]]:
    """Strongly connected components (more than one module) of the runtime import graph (Tarjan)."""
    graph: dict[str, set[str]] = {}
    for i in imports:
        if not i.type_checking and i.target != i.importer:
            graph.setdefault(i.importer, set()).add(i.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return found


def test_no_import_cycles():
    """Function-level imports count too: a lazy import inside a cycle still ties the modules together."""
    imports = collect()
    problems = []
    for component in _cycles(imports):
        if frozenset(component) in ALLOWED_CYCLES:
            continue
        members = set(component)
        edges = [i.where() for i in imports if i.importer in members and i.target in members and not i.type_checking]
        problems.append(" <-> ".join(component) + "\n    " + "\n    ".join(edges))
    assert not problems, _report(problems, "import cycles")


def test_allow_lists_hold_no_stale_entries():
    imports = collect()
    inner = {(i.file, i.target) for i in imports if i.in_function and not i.lazy}
    upward = {(i.file, i.target) for i in imports if layer(i.target) > layer(i.importer)}
    cycles = {frozenset(c) for c in _cycles(imports)}
    stale = ([f"ALLOWED_INNER {k}" for k in ALLOWED_INNER if k not in inner]
             + [f"ALLOWED_UPWARD {k}" for k in ALLOWED_UPWARD if k not in upward]
             + [f"ALLOWED_CYCLES {sorted(k)}" for k in ALLOWED_CYCLES if k not in cycles])
    assert not stale, _report(stale, f"allow-list entries no longer needed: remove them from {__file__}")


def test_the_checker_sees_what_it_checks():
    """The parser finds function-level, lazy and relative imports (a checker that sees nothing passes)."""
    imports = collect()
    assert any(i.file == "__init__.py" and i.in_function and i.lazy for i in imports)
    assert any(i.file == "data/prepare.py" and i.target == "flopwise.data.datadir" and not i.in_function
               for i in imports)  # `from .datadir import DataDir`
    assert any(i.file == "data/datadir.py" and i.type_checking for i in imports)
    assert {i.importer.split(".")[1] for i in imports if "." in i.importer} >= {"data", "model", "train", "evaluate"}
