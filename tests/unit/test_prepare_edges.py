"""``flopwise prepare`` at its edges (issue 44, item 18 and "also noticed"): a shard size of a
token, a source of two documents under a share of validation it cannot honour, and
``--val-fraction`` beside ``--val-tokens``. Through the command, on real files."""

from __future__ import annotations

import json

import pytest

from flopwise.cli import MIN_SHARD_TOKENS
from flopwise.cli import main as cli_main
from flopwise.data import DataDir


def two_documents(tmp_path):
    source = tmp_path / "two.jsonl"
    source.write_text("".join(json.dumps({"text": f"document {i} " + "lorem ipsum dolor sit amet " * 400}) + "\n"
                              for i in range(2)))
    return source


def summary(capsys) -> str:
    return capsys.readouterr().out


def test_a_shard_of_one_token_is_refused_with_the_floor(tmp_path, capsys):
    source = two_documents(tmp_path)
    out = tmp_path / "data"
    with pytest.raises(SystemExit) as stop:
        cli_main(["prepare", str(source), "--out", str(out), "--vocab-size", "300", "--shard-tokens", "1"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1, err
    assert "--shard-tokens" in err and f"{MIN_SHARD_TOKENS:,}" in err, err
    assert not out.exists()
    assert cli_main(["prepare", str(source), "--out", str(out), "--vocab-size", "300",
                     "--shard-tokens", str(MIN_SHARD_TOKENS)]) == 0  # the floor itself is a size


@pytest.mark.parametrize("extra,asked", [([], "at most 10%"), (["--val-fraction", "0.1"], "10.0% asked")])
def test_two_documents_say_the_share_validation_really_got(tmp_path, capsys, extra, asked):
    source = two_documents(tmp_path)
    out = tmp_path / "data"
    assert cli_main(["prepare", str(source), "--out", str(out), "--vocab-size", "300", *extra]) == 0
    text = summary(capsys)
    dd = DataDir(out)
    val, train = dd.num_tokens("val"), dd.num_tokens("train")
    assert val == train  # one document each: half of the tokens held out
    assert "at most 10% of the tokens" not in text, text  # never a bound the output breaks
    line = next((x for x in text.splitlines() if "50%" in x), "")
    assert f"val: {val:,} tokens, 50%" in line and asked in line and "2 documents" in line, text
    assert "--val-tokens" in line  # what holds out an exact amount


def test_a_share_honoured_within_its_documents_adds_no_line(tmp_path, capsys):
    source = tmp_path / "many.jsonl"
    source.write_text("".join(json.dumps({"text": f"document {i} " + "lorem ipsum dolor sit amet " * 20}) + "\n"
                              for i in range(200)))
    assert cli_main(["prepare", str(source), "--out", str(tmp_path / "data"), "--vocab-size", "300",
                     "--val-fraction", "0.1"]) == 0
    assert "asked" not in summary(capsys)


def test_val_fraction_beside_val_tokens_is_an_error_naming_both(tmp_path, capsys):
    source = two_documents(tmp_path)
    out = tmp_path / "data"
    assert cli_main(["prepare", str(source), "--out", str(out), "--vocab-size", "300", "--val-tokens", "100",
                     "--val-fraction", "0.1"]) == 2
    err = capsys.readouterr().err
    assert "--val-fraction" in err and "--val-tokens" in err and "Traceback" not in err, err
    assert not out.exists()
