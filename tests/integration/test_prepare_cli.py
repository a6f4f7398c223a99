"""`flopwise prepare` and `flopwise prepare --verify` from the command line: results, exit codes, messages."""

import json
import struct
import zlib

import numpy as np
import pytest

from flopwise.cli import main as cli_main
from flopwise.data.shards import HEADER_SIZE


@pytest.fixture
def prepared(tmp_path, capsys):
    corpus = tmp_path / "corpus.jsonl"
    with open(corpus, "w") as f:
        for i in range(200):
            f.write(json.dumps({"body": f"record {i}: " + "lorem ipsum dolor sit amet " * (1 + i % 7)}) + "\n")
    out = tmp_path / "data"
    rc = cli_main(["prepare", str(corpus), "--text-field", "body", "--vocab-size", "300", "--out", str(out),
                   "--train-tokens", "2000", "--val-tokens", "300", "--workers", "2"])
    assert rc == 0
    assert f"train on it with: flopwise train data.path={out}" in capsys.readouterr().out
    return out


def test_prepare_then_verify(prepared, capsys):
    assert cli_main(["prepare", "--verify", str(prepared)]) == 0
    text = capsys.readouterr().out
    assert "train          2,000 tokens" in text and "checksums and id range OK" in text and "OK (vocab" in text


def test_verify_names_the_shard_with_a_flipped_byte(prepared, capsys):
    shard = prepared / "train-00000.bin"
    raw = bytearray(shard.read_bytes())
    raw[HEADER_SIZE + 10] ^= 0x01
    shard.write_bytes(bytes(raw))
    assert cli_main(["prepare", "--verify", str(prepared)]) == 2
    err = capsys.readouterr().err
    assert "train-00000.bin" in err and "checksum" in err.lower()


def test_verify_finds_an_id_outside_the_vocabulary_even_with_a_matching_checksum(prepared, capsys):
    shard = prepared / "val-00000.bin"
    raw = bytearray(shard.read_bytes())
    tokens = np.frombuffer(bytes(raw[HEADER_SIZE:]), dtype=np.uint16).copy()
    tokens[5] = 60_000  # far beyond the 300-token vocabulary
    body = tokens.tobytes()
    magic, version, code, vocab, n, _crc = struct.unpack_from("<8sIIQQI", raw)
    head = struct.pack("<8sIIQQI", magic, version, code, vocab, n, zlib.crc32(body) & 0xFFFFFFFF)
    shard.write_bytes(head + bytes(raw[len(head):HEADER_SIZE]) + body)
    assert cli_main(["prepare", "--verify", str(prepared)]) == 2
    err = capsys.readouterr().err
    assert "val-00000.bin" in err and "60000" in err.replace(",", "")


def test_bad_flags_are_named_and_nothing_is_written(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("some text")
    out = tmp_path / "data"
    assert cli_main(["prepare", str(tmp_path / "a.txt"), "--out", str(out), "--vocab-size", "300",
                     "--tokenizer", str(tmp_path / "missing.json"), "--val-fraction", "0.1"]) == 2
    err = capsys.readouterr().err
    assert "exactly one of --tokenizer" in err and "--tokenizer" in err and "missing.json" in err
    with pytest.raises(SystemExit) as stop:  # out of range: refused by the parser
        cli_main(["prepare", str(tmp_path / "a.txt"), "--out", str(out), "--vocab-size", "300", "--val-fraction", "2"])
    assert stop.value.code == 2
    assert "argument --val-fraction: 2.0 is out of range" in capsys.readouterr().err
    assert not out.exists() and not list(tmp_path.glob(".data*"))
    assert cli_main(["prepare", str(tmp_path / "nope"), "--out", str(out), "--vocab-size", "300"]) == 2
    assert "nope" in capsys.readouterr().err and not out.exists()
    assert cli_main(["prepare"]) == 2
    assert "give a SOURCE" in capsys.readouterr().err


def test_the_default_validation_split_has_a_floor_and_an_explicit_fraction_has_none(tmp_path, capsys):
    corpus = tmp_path / "corpus.jsonl"
    with open(corpus, "w") as f:
        for i in range(200):
            f.write(json.dumps({"body": f"record {i}: " + "lorem ipsum dolor sit amet " * (1 + i % 7)}) + "\n")
    common = ["prepare", str(corpus), "--text-field", "body", "--vocab-size", "300", "--workers", "1"]
    assert cli_main([*common, "--out", str(tmp_path / "default")]) == 0
    text = capsys.readouterr().out
    assert "short of the floor" in text and "--val-fraction 0.005 alone would give" in text  # too small
    meta = json.loads((tmp_path / "default" / "meta.json").read_text())
    assert meta["recipe"]["val_floor"]["applied"] and meta["recipe"]["val_fraction"] == 0.005
    assert cli_main([*common, "--out", str(tmp_path / "explicit"), "--val-fraction", "0.005"]) == 0
    assert "the floor" not in capsys.readouterr().out
    explicit = json.loads((tmp_path / "explicit" / "meta.json").read_text())
    assert explicit["recipe"]["val_floor"] is None and explicit["recipe"]["val_fraction"] == 0.005
    assert explicit["splits"]["val"]["tokens"] < meta["splits"]["val"]["tokens"]
