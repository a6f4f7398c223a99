"""Every command in README.md and docs/ runs as written.

The lane reads the fenced code blocks of the pages: every line of a ``bash`` block, and the
``$ `` lines of an untagged block (a transcript), that starts ``flopwise``, ``python`` or
``torchrun``. It runs them in doc order, page by page, as separate processes in one workspace
(``HOME`` there too, so ``~/`` and the builtin corpus's cache are the workspace's) that holds
the small inputs the pages name (:func:`workspace`): a ``flopwise`` command forked from a
forkserver that imported torch once (``helpers.run_flopwise``: about 4 s of CPU a command), a
``python`` command as a new interpreter. Three documented changes make them
affordable here; nothing else is changed:

- :data:`SUBSTITUTE`: sizes a small corpus can fill (a vocabulary of 512, token budgets);
- :data:`SMALL`: overrides appended to every ``train`` and ``preflight``, the same model
  family at 2 layers of 64 and a few thousand tokens (a preset named is still built first;
  ``--dry-run`` keeps the page's batch);
- :data:`PARSE_ONLY`: commands that need a GPU, several nodes or the Hugging Face hub are
  parsed (torchrun's own parser, flopwise's, and the config they build) but not run.

A command that fails names its page and line. An output excerpt in the docs marked
``<!-- output of: COMMAND -->`` (or a transcript's ``$ COMMAND`` line) is compared by shape with
today's output of that command: each line it shows, by its label and its ``·``-separated
fields, exists in today's output.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import run_flopwise

from flopwise.cli import build_parser
from flopwise.config import build_config

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUNNERS = ("flopwise", "python", "torchrun")

# (page, text) -> text: sizes the small corpus can fill
SUBSTITUTE: list[tuple[str, str]] = [
    ("--vocab-size 8192", "--vocab-size 512"), ("--vocab-size 16384", "--vocab-size 512"),
    ("model.vocab_size=8192", "model.vocab_size=512"),
    # and the BPE trained on 1 MB of the text, not on all of it (31.5 MB of the stdlib: 20 s of a core for 40K tokens)
    ("--train-tokens 5M", "--train-tokens 40K --tokenizer-sample-mb 1"), ("--val-tokens 200K", "--val-tokens 4K"),
    ("--test-tokens 200K", "--test-tokens 4K"), ("--limit 500", "--limit 4"),
    ("--max-tokens 200", "--max-tokens 16"),
    # the tiny preset's 0.3 GiB, for the SMALL model: 16 fits, 32 does not (as the memory model counts since issue 54, item 15)
    ("--memory-gb 0.3", "--memory-gb 0.025"),
    (" ...", ""),  # "the rest of the command as above"
]
SMALL = ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=192",
         "model.max_seq_len=64", "train.seq_len=64", "train.micro_batch_size=4", "train.global_batch_size=8",
         "train.max_tokens=1024", "eval.every=0", "eval.windows=8", "eval.sample_tokens=8",
         "data.builtin_vocab_size=512", "data.builtin_max_mb=0.6"]
# a fragment of the command -> why it is only parsed
PARSE_ONLY: dict[str, str] = {
    "torchrun": "several GPUs or nodes",
    "hf:HuggingFaceFW/": "the Hugging Face hub",
    "--tasks arc_easy,arc_challenge": "the Hugging Face hub (the tasks' datasets)",
    "--tasks hellaswag": "the Hugging Face hub (the task's dataset)",
}
# commands not run by this lane, and where they are checked instead
RANK_COMMAND = ("flopwise preflight --dry-run --rank --preset tiny --gpu h100 --price-per-gpu-hour 3 "
                "--tokens 1000000000 train.seq_len=128 train.micro_batch_size=4 train.global_batch_size=16")
ELSEWHERE: dict[str, str] = {
    "./install.sh test && python -m pytest -q": "CI runs it verbatim (.ci/run)",
    # nine traces: run once, by the virtual preflight's end-to-end test, which checks this excerpt too
    RANK_COMMAND: "tests/integration/test_virtual_preflight.py::test_rank_command_end_to_end",
}
EXPECTED_STATUS = {"flopwise train model.n_layer=2 train.global_batch_size=33": 2}  # the docs show its error


@dataclass
class DocCommand:
    page: Path
    line: int
    text: str  # as the page writes it (continuations joined, comment dropped)
    output: list[str] | None = None  # a transcript's lines after it

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def _blocks(text: str):
    """(language, first line number, lines) of each fenced block."""
    for m in re.finditer(r"^```([^\n]*)\n(.*?)^```", text, flags=re.S | re.M):
        yield m.group(1).strip(), text[:m.start()].count("\n") + 2, m.group(2).rstrip("\n").split("\n")


def _logical_lines(start: int, lines: list[str]):
    i = 0
    while i < len(lines):
        number, line = start + i, lines[i]
        while line.rstrip().endswith("\\") and i + 1 < len(lines):
            i += 1
            line = line.rstrip()[:-1] + " " + lines[i].strip()
        yield number, line
        i += 1


def _command_text(line: str) -> str:
    """The line without its comment, words as the shell splits them, re-quoted (``&&`` kept)."""
    words, groups = shlex.split(line, comments=True), [[]]
    for word in words:
        if word == "&&":
            groups.append([])
        else:
            groups[-1].append(word)
    return " && ".join(shlex.join(g) for g in groups)


def doc_commands() -> list[DocCommand]:
    found = []
    for page in PAGES:
        for lang, start, lines in _blocks(page.read_text()):
            if lang in ("bash", "sh"):
                for number, line in _logical_lines(start, lines):
                    if line.strip() and not line.lstrip().startswith("#"):
                        found.append(DocCommand(page, number, _command_text(line)))
            elif lang == "":
                logical = list(_logical_lines(start, lines))
                for k, (number, line) in enumerate(logical):
                    if line.startswith("$ "):
                        after = [rest for _, rest in logical[k + 1:]]
                        end = next((j for j, rest in enumerate(after) if rest.startswith("$ ")), len(after))
                        found.append(DocCommand(page, number, _command_text(line[2:]), after[:end]))
    return found


def _split_and(cmd: DocCommand) -> list[str]:
    return [part.strip() for part in cmd.text.split(" && ")]


def _excerpts() -> list[tuple[Path, int, str, list[str]]]:
    """(page, line, command, lines) of each excerpt marked ``<!-- output of: COMMAND -->``."""
    out = []
    for page in PAGES:
        text = page.read_text()
        for m in re.finditer(r"<!-- output of: (.*?) -->\s*```[^\n]*\n(.*?)^```", text, flags=re.S | re.M):
            out.append((page, text[:m.start()].count("\n") + 1, m.group(1).strip(), m.group(2).split("\n")))
    return out


# ---------------------------------------------------------------- the workspace

def _write_workspace(ws: Path) -> None:
    """The inputs the pages name, made small: a folder of texts, JSON Lines (plain and
    zstd-compressed), a run config, a task file in the hub's format, a Hugging Face config."""
    texts = ws / "my_texts"
    texts.mkdir(parents=True)
    for i in range(40):
        body = " ".join(f"the quick brown fox {j} jumps over the lazy dog number {i}" for j in range(40))
        (texts / f"doc{i:02d}.txt").write_text(f"Document {i}. {body}\n")
    records = [{"text": f"record {i}: " + " ".join(f"token{j % 37}" for j in range(300)),
                "abstract": f"abstract {i}: " + " ".join(f"word{j % 41}" for j in range(300))} for i in range(60)]
    for name in ("a.jsonl", "b.jsonl"):
        (ws / name).write_text("".join(json.dumps(r) + "\n" for r in records))
    import zstandard

    (ws / "papers.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(
        "".join(json.dumps(r) + "\n" for r in records).encode()))
    (ws / "run.yaml").write_text("model:\n  n_layers: 2\ntrain:\n  max_tokens: 1024\n")
    arc = [{"id": f"q{i}", "question": f"Which number follows {i}?",
            "choices": {"text": [str(i + 1), str(i + 7), str(i * 3)], "label": ["A", "B", "C"]},
            "answerKey": "A"} for i in range(6)]
    (ws / "ARC-Easy-test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in arc))
    hf = ws / "models" / "SmolLM-360M"  # ~ is the workspace
    hf.mkdir(parents=True)
    (hf / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 64,
        "intermediate_size": 192, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True,
        "hidden_act": "silu"}))


def _run(words: list[str], ws: Path, env: dict) -> subprocess.CompletedProcess:
    """The command run in ``ws``: ``flopwise ...`` (or ``python -m flopwise ...``) as
    ``helpers.run_flopwise`` runs it, ``python ...`` with this test's interpreter."""
    fw = _flopwise_words(words)
    if fw is not None and words[0] in ("flopwise", "python"):
        return run_flopwise(fw, cwd=ws, env=env, timeout=900)
    argv = [sys.executable, *words[1:]] if words[0] == "python" else words
    return subprocess.run(argv, cwd=ws, env=env, capture_output=True, text=True, timeout=900)


def _flopwise_words(words: list[str]) -> list[str] | None:
    """The flopwise arguments of a command (after ``flopwise``, ``python -m flopwise`` or
    torchrun's ``-m flopwise``), or None."""
    if words[0] == "flopwise":
        return words[1:]
    if "-m" in words and words[words.index("-m") + 1] == "flopwise":
        return words[words.index("-m") + 2:]
    return None


def _parse_only(words: list[str], why: str) -> None:
    if words[0] == "torchrun":
        from torch.distributed.run import get_args_parser  # lazy: torch

        get_args_parser().parse_args(words[1:])
    args = build_parser().parse_args(_flopwise_words(words))
    if args.command in ("train", "preflight"):
        build_config(preset=args.preset, overrides=args.overrides)


def _prepared(words: list[str]) -> list[str]:
    fw = _flopwise_words(words)
    if fw and fw[0] in ("train", "preflight") and "--print-config" not in fw:
        if "--dry-run" in fw:  # the batch the page gives, at its ranks (the trace runs no step for real)
            return [*words, *(o for o in SMALL if not o.startswith(("train.micro_batch", "train.global_batch")))]
        return [*words, *SMALL]
    return words


def _substituted(text: str) -> str:
    for old, new in SUBSTITUTE:
        text = text.replace(old, new)
    return text


def _run_page(page: Path, ws: Path, env: dict) -> tuple[list[str], dict[str, str]]:
    """Run a page's commands in order: (failures, command -> combined output)."""
    failures, outputs = [], {}
    for cmd in [c for c in doc_commands() if c.page == page]:
        if cmd.text in ELSEWHERE:
            continue
        for part in _split_and(cmd):
            if part.startswith("./"):
                continue  # ./install.sh: the set-up this test runs in
            words = shlex.split(_substituted(part))
            why = next((w for k, w in PARSE_ONLY.items() if k in part), None)
            if why:
                try:
                    _parse_only(words, why)
                except (SystemExit, Exception) as e:
                    failures.append(f"{cmd.where}: `{part}` ({why}: parsed only) does not parse: {e!r}")
                continue
            expected = EXPECTED_STATUS.get(part, 0)
            done = _run(_prepared(words) if expected == 0 else words, ws, env)  # an error shown runs as written
            outputs[part] = done.stdout + done.stderr
            if done.returncode != expected:
                failures.append(f"{cmd.where}: `{part}` exited {done.returncode} (expected {expected}):\n"
                                f"{(done.stdout + done.stderr)[-2500:]}")
    return failures, outputs


def _seed_cache(ws: Path, request) -> None:
    """The workspace's ``~/.cache/flopwise`` starts with what the session already built and a
    user's cache keeps after first use: the small embedded corpus that ``SMALL`` names (the
    pages' ``train`` without ``data.path``) and the dry run's fake-CUDA shim; building them again
    here would repeat tests/unit/test_builtin.py and test_third_list_dryrun.py's first-use checks."""
    from flopwise.tune.shim import compiler

    cache = ws / ".cache" / "flopwise"
    _, corpus = request.getfixturevalue("small_builtin")
    shutil.copytree(corpus, cache / Path(corpus).name)
    if compiler() is not None:  # no compiler: the page's dry run fails here as it would for a user
        shim = request.getfixturevalue("fake_cuda_shim")
        shutil.copytree(shim.parent, cache / "fake-cuda" / shim.parent.name)


@pytest.fixture(scope="module")
def ran(tmp_path_factory, request) -> dict:
    """Every page's commands, run once in one workspace."""
    ws = tmp_path_factory.mktemp("docs-workspace")
    _write_workspace(ws)
    _seed_cache(ws, request)
    env = {**os.environ, "HOME": str(ws), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    env.pop("FLOPWISE_CACHE", None)
    # the run the evaluation page works on, and the data directories pages name without making
    setup = [["flopwise", "prepare", "my_texts/", "--out", "DIR", "--vocab-size", "512"],
             ["flopwise", "train", "data.path=DIR", "train.run_dir=runs/my-run", *SMALL]]
    for words in setup:
        done = _run(words, ws, env)
        assert done.returncode == 0, f"workspace set-up `{shlex.join(words)}`:\n{done.stderr[-2500:]}"
    (ws / "data").mkdir()
    (ws / "data" / "fineweb-10B").symlink_to(ws / "DIR")
    (ws / "fineweb").symlink_to(ws / "DIR")
    (ws / "smollm").mkdir()
    (ws / "smollm" / "tokenizer.json").symlink_to(ws / "DIR" / "tokenizer.json")
    (ws / "tokenizer.json").symlink_to(ws / "DIR" / "tokenizer.json")
    for name in ("a", "b", "c"):
        (ws / "runs" / name).symlink_to(ws / "runs" / "my-run")
    failures, outputs = [], {}
    for page in PAGES:  # data.md makes my_data before training on it: pages run in the order above
        f, o = _run_page(page, ws, env)
        failures += f
        outputs.update(o)
    return {"failures": failures, "outputs": outputs}


@pytest.mark.slow
def test_every_command_in_the_docs_runs(ran):
    assert not ran["failures"], "\n\n".join(ran["failures"])


def _label(line: str) -> str:
    """An output line's label: its words (after a list's ``- ``) up to the first number, value or
    column gap."""
    m = re.match(r"\s*(?:- )?([A-Za-z$][A-Za-z .'/_-]*?)(?=\s{2,}|:|\s·|\s\||\s+\d|\s*$|\s\(|\s')", line)
    return m.group(1).strip() if m else ""


# Fields whose presence depends on the timings, as the figures do: the micro-batch search skips
# the sizes past one slower by more than the noise, which one run on a loaded CPU meets and the
# next may not. The line's label is still checked.
TIMED_FIELDS = frozenset({"skipped"})


def _fields(line: str) -> list[str]:
    """The first word of each ``·``-separated field after the first (not :data:`TIMED_FIELDS`)."""
    return [m.group(0) for f in line.split(" · ")[1:]
            if (m := re.match(r"[A-Za-z][A-Za-z-]*", f.strip())) and m.group(0) not in TIMED_FIELDS]


def shape_problems(shown: list[str], today: str) -> list[str]:
    """Lines of an excerpt whose label, with its fields, is in no line of today's output."""
    lines = today.splitlines()
    problems = []
    for line in shown:
        label = _label(line)
        if not label or line.strip() in ("...", "…"):
            continue
        fields = _fields(line)
        if not any(_label(t) == label and all(f in t for f in fields) for t in lines):
            problems.append(f"{line.strip()[:100]!r} (label {label!r}, fields {fields})")
    return problems


@pytest.mark.slow
def test_output_excerpts_have_todays_shape(ran):
    problems = []
    checked = 0
    for cmd in doc_commands():  # transcripts: $ COMMAND and its output
        if cmd.output is None:
            continue
        today = ran["outputs"].get(cmd.text)
        assert today is not None, f"{cmd.where}: `{cmd.text}` did not run"
        problems += [f"{cmd.where}: {p}" for p in shape_problems(cmd.output, today)]
        checked += 1
    for page, line, command, shown in _excerpts():
        if command in ELSEWHERE:  # its own test runs it and checks its excerpt
            continue
        today = ran["outputs"].get(command)
        assert today is not None, f"{page.relative_to(ROOT)}:{line}: no command `{command}` ran on that page"
        problems += [f"{page.relative_to(ROOT)}:{line}: {p}" for p in shape_problems(shown, today)]
        checked += 1
    assert checked >= 6, checked  # README train, plan, dry run, prepare, preflight, a config error
    assert not problems, "lines shown in the docs that today's output no longer has:\n" + "\n".join(problems)


def test_shape_check_can_fail():
    shown = ["  device     cpu (2 threads) · precision float32 · peak no peak", "step 10/300 | loss 8.7"]
    assert not shape_problems(shown, "  device     cpu (8 threads) · precision bf16 · peak n/a\nstep 1/2 | loss 1")
    assert shape_problems(shown, "  device     cpu (8 threads) · dtype bf16 · peak n/a\nstep 1/2 | loss 1")
    assert shape_problems(shown, "  hardware   cpu · precision bf16 · peak n/a\nstep 1/2 | loss 1")
    trial = ["preflight: trial 6/6 without checkpointing: micro-batch 1 · skipped: micro-batch 2 was slower"]
    assert not shape_problems(trial, "preflight: trial 3/3 without checkpointing: micro-batch 1 · 5.1K tok/s")
    assert shape_problems(trial, "train: step 1/2")  # the label is still checked


def test_every_doc_command_is_found_and_classified():
    """The extraction sees the commands the pages show, and each is run, parsed or said to be
    checked elsewhere."""
    cmds = doc_commands()
    texts = [c.text for c in cmds]
    assert "flopwise export runs/my-run hf-out/" in texts
    assert any(t.startswith("torchrun --nnodes=2") and "-m flopwise train" in t for t in texts)
    assert "flopwise train model.n_layer=2 train.global_batch_size=33" in texts
    for c in cmds:
        for part in _split_and(c):
            assert part.startswith((*RUNNERS, "./")), f"{c.where}: `{part}` is in a bash block but not a command"
