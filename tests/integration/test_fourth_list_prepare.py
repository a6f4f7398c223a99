"""Issue 54 (the fourth list), `flopwise prepare`: item 3, every file checked by its content
whatever its name; item 16 (prepare's half), a fixed validation request that takes a large share
said in the summary. Real files, each made here: UTF-16 text, gzip, bzip2 and random bytes under
text names, through the real command."""

from __future__ import annotations

import bz2
import gzip
import json
import random

import pytest

TEXT = "".join(f"The quick brown fox {i} jumps over the lazy dog, and then some more words.\n" for i in range(3000))


def _source(folder):
    folder.mkdir()
    (folder / "good.txt").write_text(TEXT)
    (folder / "utf16.txt").write_bytes(TEXT.encode("utf-16"))
    (folder / "utf16.jsonl").write_bytes(('{"text": "hello there"}\n' * 50).encode("utf-16"))
    (folder / "packed.txt").write_bytes(gzip.compress(TEXT.encode()))
    (folder / "archive.md").write_bytes(bz2.compress(TEXT.encode()))
    rng = random.Random(0)
    (folder / "random.txt").write_bytes(bytes(rng.randrange(256) for _ in range(5000)))
    return folder


def test_every_file_is_checked_by_content_and_what_is_skipped_is_named(cli, tmp_path):
    src = _source(tmp_path / "src")
    proc = cli("prepare", str(src), "--out", str(tmp_path / "data"), "--vocab-size", "300", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout + proc.stderr
    skipped = next(line for line in out.splitlines() if "skipping" in line)
    assert "skipping 4 file(s) that are not text" in skipped, skipped
    assert "utf16.txt (UTF-16 text (its byte-order mark): convert it to UTF-8 first" in skipped
    assert "utf16.jsonl (UTF-16 text" in skipped
    assert "random.txt (binary: a NUL byte" in skipped or "random.txt (not UTF-8 text" in skipped
    assert "archive.md (bzip2-compressed data named .md: decompress it first)" in skipped
    # gzip named .txt is read as gzip, and said
    assert "as their content shows" in out and "packed.txt (gzip-compressed by its first bytes)" in out
    meta = json.loads((tmp_path / "data" / "meta.json").read_text())
    files = [f[0] for f in meta["source"]["identity"]["files"]] if "identity" in meta.get("source", {}) else None
    if files is not None:
        assert sorted(files) == ["good.txt", "packed.txt"], files
    # the two readable files hold the same text: the tokens are twice one file's
    total = sum(s["tokens"] for s in meta["splits"].values())
    single = cli("prepare", str(src / "good.txt"), "--out", str(tmp_path / "one"), "--vocab-size", "300",
                 cwd=tmp_path)
    assert single.returncode == 0, single.stderr
    one = json.loads((tmp_path / "one" / "meta.json").read_text())
    assert total == pytest.approx(2 * sum(s["tokens"] for s in one["splits"].values()), rel=0.02)


@pytest.mark.parametrize("name, says", [("utf16.txt", "UTF-16 text"), ("random.txt", "random.txt: not text"),
                                        ("archive.md", "bzip2-compressed data")])
def test_a_single_file_that_is_not_text_is_refused_naming_why(cli, tmp_path, name, says):
    src = _source(tmp_path / "src")
    proc = cli("prepare", str(src / name), "--out", str(tmp_path / "data"), "--vocab-size", "300", cwd=tmp_path)
    assert proc.returncode == 2 and says in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "data").exists()


def test_a_fixed_validation_request_over_a_tenth_is_said(cli, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "good.txt").write_text(TEXT)
    big = cli("prepare", str(src), "--out", str(tmp_path / "big"), "--vocab-size", "300", "--val-tokens", "20K",
              cwd=tmp_path)
    assert big.returncode == 0, big.stderr
    line = next((ln for ln in big.stdout.splitlines() if "held out:" in ln), "")
    assert "--val-tokens 20,000 is" in line and "more than 10%" in line, big.stdout
    small = cli("prepare", str(src), "--out", str(tmp_path / "small"), "--vocab-size", "300", "--val-tokens", "2K",
                cwd=tmp_path)
    assert small.returncode == 0 and "held out:" not in small.stdout, small.stdout


def test_bytes_that_are_not_utf8_past_the_head_are_said_with_file_and_offset(cli, tmp_path):
    """The content check reads a head block; a file whose head is UTF-8 but holds Latin-1 bytes
    further on was read with U+FFFD in their place without a word. The replacement stays (as
    documented) and is said: the file, how many, and the first one's byte offset."""
    src = tmp_path / "src"
    src.mkdir()
    head = TEXT.encode()[:20000]
    (src / "good.txt").write_text(TEXT)
    (src / "latin.txt").write_bytes(head + "caf\xe9 cr\xe8me\n".encode("latin-1") + head)
    (src / "later.jsonl.gz").write_bytes(gzip.compress(b'{"text": "fine"}\n' * 1000 + b'{"text": "na\xefve"}\n'))
    proc = cli("prepare", str(src), "--out", str(tmp_path / "data"), "--vocab-size", "300", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    line = next((ln for ln in proc.stdout.splitlines() if "not UTF-8" in ln), "")
    assert "2 file(s)" in line, proc.stdout
    assert "latin.txt (2 sequence(s), the first at byte 20,003: 0xe9)" in line, line
    assert "later.jsonl.gz (1 sequence(s), the first at byte 17,012 of its decompressed text: 0xef)" in line, line
    assert "good.txt" not in line
