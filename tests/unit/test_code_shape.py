"""The shape of the code a newcomer reads: no function that needs a page of arguments or
scrolls past a screen, and a training package that holds only the loop.

A function over the limits is a sign that settings travel loose (gather them into the
object they belong to: ``TuneRequest``, ``LoaderOptions``, ``EvalOptions``...) or that
it does several things (split it into named steps). The files are parsed, never imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

import flopwise

SRC = Path(flopwise.__file__).resolve().parent
MAX_PARAMS = 8  # self/cls not counted; keyword-only, *args and **kwargs counted
MAX_LINES = 100  # from the def line to the last line of the body
MAX_TRAIN_MODULES = 15  # train/ (__init__ aside): the loop; tuning is in tune/, data parallelism in parallel/


def _functions():
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield path.relative_to(SRC), node


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = fn.args
    n = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + bool(a.vararg) + bool(a.kwarg)
    return n - 1 if a.args and a.args[0].arg in ("self", "cls") else n


def test_no_function_takes_more_than_eight_parameters_or_runs_over_a_hundred_lines():
    over = [f"src/flopwise/{rel}:{fn.lineno} {fn.name}: {_params(fn)} parameters, "
            f"{fn.end_lineno - fn.lineno + 1} lines"
            for rel, fn in _functions()
            if _params(fn) > MAX_PARAMS or fn.end_lineno - fn.lineno + 1 > MAX_LINES]
    assert not over, "over the limits (%d parameters, %d lines):\n%s" % (MAX_PARAMS, MAX_LINES, "\n".join(over))


def test_the_check_sees_an_offender(tmp_path):
    src = "def f(a, b, c, d, e, f, g, h, i):\n    return a\n\nclass C:\n    def m(self, a):\n" + "        a += 1\n" * 120
    fns = [n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.FunctionDef)]
    assert [_params(f) for f in fns] == [9, 1]
    assert fns[1].end_lineno - fns[1].lineno + 1 > MAX_LINES


def test_train_holds_the_loop_and_little_else():
    modules = sorted(p.name for p in (SRC / "train").glob("*.py") if p.name != "__init__.py")
    assert len(modules) <= MAX_TRAIN_MODULES, f"train/ holds {len(modules)} modules: {modules}"
