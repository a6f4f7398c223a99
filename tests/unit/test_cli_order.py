"""Every subcommand takes its options anywhere: before, between and after its positionals
(``flopwise export RUN --format hf OUT`` once failed with "unrecognized arguments: OUT")."""

from __future__ import annotations

import argparse
import itertools

import pytest

from flopwise.cli import build_parser

# command -> (positional words in their order, option units). Each unit is an option with its
# value(s), moved as one. An option that takes any number of values (--data-files, --task-data)
# ends where the next option starts, so it is only ever followed by another option or the end.
EXAMPLES: dict[str, tuple[list[str], list[list[str]]]] = {
    "train": (["model.n_layers=2", "optim.lr=1e-3"], [["--preset", "tiny"], ["--fresh"]]),
    "prepare": (["corpus/"], [["--out", "data"], ["--vocab-size", "512"], ["--data-files", "a.txt", "b.txt"]]),
    "preflight": (["train.seq_len=256"], [["--preset", "tiny"], ["--steps", "3"], ["--dry-run"]]),
    "eval": (["runs/a"], [["--tasks", "val"], ["--task-data", "x=y.jsonl"], ["--limit", "5"]]),
    "generate": (["runs/a"], [["--prompt", "Hello"], ["--max-tokens", "8"]]),
    "report": (["runs/a", "runs/b"], [["--out", "r.html"], ["--no-png"]]),
    "export": (["runs/a", "out"], [["--format", "hf"], ["--overwrite"]]),
    "checkpoint": (["verify", "runs/a/checkpoints/step-10"], []),
    "plan": ([], [["--model", "smollm-135m"], ["--gpu", "h100"], ["--tokens", "1B"]]),
    "presets": ([], []),
}
VARIADIC = {"--data-files", "--task-data"}


def _orders(positionals: list[str], options: list[list[str]]):
    """Every order of the option units, interleaved every way with the positionals (kept in
    their order, as their meaning depends on it)."""
    n = len(positionals) + len(options)
    for slots in itertools.combinations(range(n), len(positionals)):
        for perm in itertools.permutations(options):
            units, pos, opt = [], iter(positionals), iter(perm)
            for i in range(n):
                units.append([next(pos)] if i in slots else next(opt))
            if any(u[0] in VARIADIC and nxt[0] in positionals for u, nxt in zip(units, units[1:])):
                continue
            yield [word for unit in units for word in unit]


def _parsed(argv: list[str]) -> dict:
    return {k: v for k, v in vars(build_parser().parse_args(argv)).items() if k not in ("func", "_commands")}


def test_every_subcommand_has_an_example():
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) == set(EXAMPLES)


@pytest.mark.parametrize("command", sorted(EXAMPLES))
def test_options_anywhere(command):
    positionals, options = EXAMPLES[command]
    orders = list(_orders(positionals, options))
    assert orders
    expected = _parsed([command, *orders[0]])
    for argv in orders[1:]:
        assert _parsed([command, *argv]) == expected, argv


def test_options_between_positionals_were_refused_before(capsys):
    """The case that broke, parsed by a plain argparse parser: the test can tell the difference."""
    plain = argparse.ArgumentParser()
    plain.add_argument("source")
    plain.add_argument("out", nargs="?")
    plain.add_argument("--format")
    with pytest.raises(SystemExit):
        plain.parse_args(["RUN", "--format", "hf", "OUT"])
    assert "unrecognized arguments: OUT" in capsys.readouterr().err
    assert _parsed(["export", "RUN", "--format", "hf", "OUT"])["out"] == "OUT"


@pytest.mark.parametrize("argv, phrase", [
    (["generate", "RUN", "--num-samples", "0"], "--num-samples: 0 is out of range"),
    (["generate", "RUN", "--temperature", "nan"], "--temperature: nan is out of range"),
    (["generate", "RUN", "--temperature", "-1"], "--temperature: -1.0 is out of range"),
    (["generate", "RUN", "--top-k", "-3"], "--top-k: -3 is out of range"),
    (["generate", "RUN", "--max-tokens", "-5"], "-5 is out of range"),
    (["generate", "RUN", "--top-p", "0"], "--top-p: 0.0 is out of range"),
    (["generate", "RUN", "--seed", "-1"], "--seed: -1 is out of range"),
    (["generate", "RUN", "--device", "gpu"], "--device: 'gpu'"),
    (["eval", "RUN", "--batch-size", "0"], "--batch-size: 0 is out of range"),
    (["eval", "RUN", "--poll", "0"], "--poll: 0.0 is out of range"),
])
def test_generate_and_eval_arguments_are_checked_before_any_work(argv, phrase, capsys):
    """generate took --temperature -1, --top-k -3 and a negative token count silently, and ended
    --num-samples 0 and --temperature nan in tracebacks, after loading the model."""
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and phrase in err and len(err.strip().splitlines()) == 1, err
