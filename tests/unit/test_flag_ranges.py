"""Every number a user types has a range (issue 44, item 13): NaN, infinities, negatives and
values past a flag's bounds are refused in one line naming the flag and the value, before any
work -- on the command line (every int/float flag of every subcommand, found by walking the
parser, so a flag added without a range fails here) and as KEY=VALUE config overrides."""

from __future__ import annotations

import argparse
import dataclasses
import math
import typing

import pytest

from flopwise.cli import build_parser, main
from flopwise.config import SECTIONS, ConfigError, build_config

NOT_NUMBERS = {"device_name"}  # argparse types that parse something else than a number


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def numeric_flags() -> list[tuple[str, argparse.Action]]:
    """(subcommand, action) of every option that takes a number: by its type, or by a number default."""
    out = []
    for name, p in subcommands().items():
        for a in p._actions:
            if not a.option_strings or a.nargs == 0:
                continue
            typename = getattr(a.type, "__name__", "")
            numeric_default = isinstance(a.default, (int, float)) and not isinstance(a.default, bool)
            if (a.type is not None and a.type is not str and typename not in NOT_NUMBERS) or numeric_default:
                out.append((name, a))
    return out


def positionals(p: argparse.ArgumentParser) -> list[str]:
    """Placeholders for a subcommand's required positionals (choices: the first)."""
    out = []
    for a in p._actions:
        if a.option_strings or a.nargs in ("?", "*") or isinstance(a, argparse._SubParsersAction):
            continue
        out.append(str(a.choices[0]) if a.choices else "x")
    return out


def refusal(command: str, flag: str, value: str, capsys) -> str:
    """The one-line usage error for ``command FLAG=VALUE`` (the parser exits 2)."""
    p = subcommands()[command]
    with pytest.raises(SystemExit) as stop:
        build_parser().parse_args([command, *positionals(p), f"{flag}={value}"])
    assert stop.value.code == 2, (command, flag, value)
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


def test_every_numeric_flag_has_a_range():
    unbounded = [f"{cmd} {a.option_strings[0]}" for cmd, a in numeric_flags() if not hasattr(a.type, "bounds")]
    assert not unbounded, f"flags without a range (give them cli.whole/number/count): {unbounded}"


FLAGS = numeric_flags()


@pytest.mark.parametrize("command,action", FLAGS, ids=[f"{c}{a.option_strings[0]}" for c, a in FLAGS])
def test_non_finite_and_out_of_range_values_are_refused_naming_flag_and_value(command, action, capsys):
    bounds = getattr(action.type, "bounds", None)
    if bounds is None:
        pytest.fail(f"{command} {action.option_strings[0]} has no range")
    low, high, low_open, high_open = bounds
    flag = action.option_strings[0]
    bad = ["nan", "inf", "-inf", "-1"]
    bad.append(f"{low}" if low_open else f"{low - 1}")
    if high < math.inf:
        bad.append(f"{high}" if high_open else f"{high + 1}")
    for value in bad:
        if value == "-1" and low < -1:
            continue
        err = refusal(command, flag, value, capsys)
        assert flag in err and value in err.lower(), (value, err)
    if action.default is not None:  # the default is inside the range
        assert action.type(str(action.default)) == action.default


@pytest.mark.parametrize("argv", [
    ["plan", "--params", "1B", "--gpu", "h100", "--hours", "nan"],
    ["plan", "--params", "1B", "--gpu", "h100", "--tokens", "1B", "--memory-gb", "inf"],
    ["plan", "--params", "1B", "--gpu", "h100", "--tokens", "1B", "--price-per-gpu-hour", "nan"],
    ["preflight", "--hours", "-1"],
    ["prepare", "SOURCE", "--out", "data", "--vocab-size", "300", "--tokenizer-sample-mb", "nan"],
    ["prepare", "SOURCE", "--out", "data", "--vocab-size", "inf"],
    ["prepare", "SOURCE", "--out", "data", "--vocab-size", "300", "--shard-tokens", "1"],
])
def test_the_reported_cases_stop_in_one_line_before_any_work(argv, capsys, tmp_path, monkeypatch):
    source = tmp_path / "source.txt"
    source.write_text("a few words of text\n" * 50)
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    with pytest.raises(SystemExit) as stop:
        main([str(source) if a == "SOURCE" else a for a in argv])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "Traceback" not in err and err.count("\n") == 1, err
    assert argv[-2] in err and argv[-1] in err, err
    assert not any((tmp_path / "cwd").iterdir())  # nothing written


def config_numbers() -> list[str]:
    cfg = build_config(preset="tiny")
    out = []
    for section in SECTIONS:
        obj = getattr(cfg, section)
        hints = typing.get_type_hints(type(obj))
        out += [f"{section}.{f.name}" for f in dataclasses.fields(obj) if hints[f.name] in (int, float)]
    return out


@pytest.mark.parametrize("key", config_numbers())
def test_every_numeric_config_field_refuses_nan_infinity_and_negatives(key):
    for value in ("nan", "inf", "-1"):
        with pytest.raises((ConfigError, ValueError)) as err:
            build_config(preset="tiny", overrides=[f"{key}={value}"])
        assert key in str(err.value), (value, str(err.value))
