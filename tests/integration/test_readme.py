"""The README and docs/ say what the code does: their commands work as written, their links
lead somewhere, every config key is documented with its real default, the layout page lists
every module, and the README stays a short front page."""

import dataclasses
import re
import shlex
from pathlib import Path

from flopwise.cli import main as cli_main
from flopwise.config import RunConfig, build_config
from flopwise.data.datadir import DataDir
from flopwise.plan.flops import flops_per_token, param_counts
from flopwise.train.trainer import train

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_LINES = 260
SECTIONS = ("model", "data", "optim", "train", "eval", "tracking", "parallel")


def _snippet(path: Path, name: str, lang: str) -> str:
    text = path.read_text()
    m = re.search(rf"<!-- snippet: {name} -->\s*```{lang}\n(.*?)```", text, flags=re.S)
    assert m, f"{path.relative_to(ROOT)} has no {lang} block after <!-- snippet: {name} -->"
    return m.group(1)


def _code_blocks(text: str) -> list[str]:
    return re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.S | re.M)


def _without_code(text: str) -> str:
    """The Markdown outside fenced code blocks and inline code spans."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def _pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


# ---------------------------------------------------------------- the README's own commands

def test_prepare_snippet_builds_a_data_directory_that_trains(tmp_path, monkeypatch):
    texts = tmp_path / "my_texts"
    texts.mkdir()
    for i in range(40):
        (texts / f"doc{i:02d}.txt").write_text(
            f"Document {i}. " + " ".join(f"the quick brown fox {j} jumps over the lazy dog" for j in range(30))
        )
    monkeypatch.chdir(tmp_path)
    lines = [line for line in _snippet(DOCS / "data.md", "prepare", "bash").splitlines() if line.strip()]
    prepare_lines = [line for line in lines if line.startswith("flopwise prepare")]
    assert len(prepare_lines) == 2 and lines[-1].startswith("flopwise train")
    for line in prepare_lines:  # the same commands, with a vocabulary and budget this corpus can fill
        argv = shlex.split(line.replace("--vocab-size 8192", "--vocab-size 400").replace("200K", "500"))
        assert cli_main(argv[1:]) == 0, line

    dd = DataDir(tmp_path / "my_data", verify=True)
    assert dd.vocab_size <= 400 and dd.num_tokens("val") == 500 and dd.num_tokens("train") > 500
    # The train line's data.path and vocabulary override, on a model small enough for a test.
    overrides = [a for a in shlex.split(lines[-1]) if a.startswith(("data.path=", "model.vocab_size="))]
    assert overrides == ["data.path=my_data", "model.vocab_size=8192"]
    cfg = build_config(overrides=[
        "data.path=my_data", "model.vocab_size=400", "model.d_model=32", "model.n_layers=1",
        "model.n_heads=2", "model.n_kv_heads=1", "model.ffn_hidden=64", "train.seq_len=32",
        "train.micro_batch_size=4", "train.global_batch_size=4", "train.max_steps=3", "eval.windows=4",
        "eval.sample_tokens=4", f"train.run_dir={tmp_path / 'run'}",
    ])
    result = train(cfg, log=lambda s: None)
    assert result.steps == 3 and (tmp_path / "run" / "checkpoints" / "step-0000003").is_dir()


def test_readme_two_commands_are_the_ones_ci_runs():
    blocks = [b for b in _code_blocks(README.read_text()) if "./install.sh" in b]
    assert len(blocks) == 1, "the README has one block with the two set-up commands"
    commands = [line.split("#")[0].strip() for line in blocks[0].splitlines()]
    assert commands == ["./install.sh && flopwise train", "./install.sh test && python -m pytest -q"]
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert commands[1] in ci, ".ci/run no longer runs the README's test command verbatim"


def test_readme_default_run_matches_the_tiny_preset():
    """The quoted run is a real one; if the preset changes, the quote is stale and must be redone."""
    run = next((b for b in _code_blocks(README.read_text()) if b.startswith("flopwise train · preset tiny")), None)
    assert run, "the README quotes the output of the default `flopwise train`"
    cfg = build_config(preset="tiny")
    m, counts = cfg.model, param_counts(cfg.model)
    assert f"{m.arch} · {m.n_layers} layers · d_model {m.d_model} · heads {m.n_heads} q / {m.n_kv_heads} kv" in run
    assert f"for {counts['total']:,} parameters" in run
    assert f"{cfg.total_steps()} steps × {cfg.tokens_per_step:,} tokens" in run
    assert f"FLOPs      {flops_per_token(m, cfg.train.seq_len) / 1e6:.2f}M/token" in run
    assert f"vocab {m.vocab_size:,}" in run


def test_readme_is_a_front_page():
    n = len(README.read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES}): move detail to docs/"
    linked = set(re.findall(r"\]\(docs/([\w-]+\.md)", README.read_text()))
    assert {p.name for p in DOCS.glob("*.md")} <= linked, "every docs/ page is linked from the README"


# ---------------------------------------------------------------- links

def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", lambda mm: mm.group(1) or "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    return {_slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}


def test_every_relative_link_leads_to_a_file_and_heading_that_exist():
    broken = []
    for page in _pages():
        for target in re.findall(r"\]\(([^)\s]+)\)", _without_code(page.read_text())):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_every_table_row_has_its_header_s_cells():
    """An unescaped | inside a cell splits it and shifts the rest of the row."""
    def cells(line: str) -> int:
        return len(re.split(r"(?<!\\)\|", line.strip().strip("|")))

    bad = []
    for page in _pages():
        lines = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M).splitlines()
        header = None
        for n, line in enumerate(lines):
            if not line.startswith("|"):
                header = None
            elif header is None:
                header = cells(line)
            elif cells(line) != header:
                bad.append(f"{page.relative_to(ROOT)}: {line[:80]}")
    assert not bad, "\n".join(bad)


# ---------------------------------------------------------------- config keys

def _fmt_default(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value or '""'
    return repr(value)


def test_every_config_key_is_documented_with_its_default():
    rows = dict(re.findall(r"^\| `([a-z_]+\.[a-z0-9_]+)` \| `([^`]*)` \|", (DOCS / "training.md").read_text(), re.M))
    problems = []
    config = RunConfig()
    for section in SECTIONS:
        values = getattr(config, section)
        for f in dataclasses.fields(values):
            key, want = f"{section}.{f.name}", _fmt_default(getattr(values, f.name))
            if key not in rows:
                problems.append(f"{key} is not in docs/training.md's key tables")
            elif rows[key] != want:
                problems.append(f"{key}: docs/training.md says default `{rows[key]}`, the code has `{want}`")
    fields = {f"{s}.{f.name}" for s in SECTIONS for f in dataclasses.fields(getattr(config, s))}
    problems += [f"docs/training.md documents {key}, which the config no longer has" for key in rows if key not in fields]
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------- layout

def test_layout_lists_every_module_and_only_existing_ones():
    text = (DOCS / "layout.md").read_text()
    src = ROOT / "src" / "flopwise"
    listed = set(re.findall(r"^- `([\w/]+\.py)` — ", text, flags=re.M))
    modules = {p.relative_to(src).as_posix() for p in src.rglob("*.py")}
    modules -= {m for m in modules if m.endswith("/__init__.py")}  # a package is its own heading
    assert not modules - listed, f"docs/layout.md misses {sorted(modules - listed)}"
    stale = {m for m in listed if not (src / m).exists() and not (ROOT / m).exists()}
    assert not stale, f"docs/layout.md lists modules that are gone: {sorted(stale)}"
    packages = {p.parent.relative_to(src).as_posix() for p in src.rglob("__init__.py")} - {"."}
    assert all(f"## `flopwise/{p}/`" in text for p in packages), "a package of src/flopwise has no heading"
    test_dirs = {p.name for p in (ROOT / "tests").iterdir() if p.is_dir() and not p.name.startswith(("_", "."))}
    assert all(f"`tests/{d}/`" in text for d in test_dirs), "a tests/ folder is missing from docs/layout.md"
