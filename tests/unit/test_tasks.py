"""Multiple-choice benchmarks: loaders on canonical-format fixture files, log-prob scoring.

Loaders read small files written here in the hub datasets' record format (through
datasets' own json/parquet builders, as real local copies are read); the hub route is
checked with load_dataset replaced by a stand-in that serves a local file. Scoring is
checked on a bigram lookup-table "model" whose log-probs are set by hand, and against a
one-sequence-at-a-time computation on a real flopwise model with a trained BPE tokenizer.
"""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("datasets")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from tokenizers import Tokenizer, models, pre_tokenizers

from flopwise.config import ModelConfig
from flopwise.data.tokenizer import train_bpe
from flopwise.evaluate import tasks
from flopwise.evaluate.tasks import (
    TASKS,
    Example,
    TaskError,
    evaluate_tasks,
    load_task,
    loglikelihoods,
    score,
)
from flopwise.model import build_model


def write_jsonl(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def write_parquet(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(records), path)
    return path


def arc(i, question, texts, key, labels="ABCDE"):
    labels = list(labels[: len(texts)]) if isinstance(labels, str) else labels
    return {"id": f"Q{i}", "question": question, "choices": {"text": texts, "label": labels}, "answerKey": key}


def hswag(i, ctx_a, ctx_b, endings, label, activity="Baking cookies"):
    return {"ind": i, "activity_label": activity, "ctx_a": ctx_a, "ctx_b": ctx_b, "ctx": f"{ctx_a} {ctx_b}",
            "endings": endings, "source_id": f"activitynet~v_{i}", "split": "val", "split_type": "indomain",
            "label": label}


def piqa(goal, sol1, sol2, label):
    return {"goal": goal, "sol1": sol1, "sol2": sol2, "label": label}


# --------------------------------------------------------------------------- loaders

def test_task_table():
    assert set(TASKS) == {"arc_easy", "arc_challenge", "openbookqa", "hellaswag", "piqa"}
    assert (TASKS["arc_easy"].hub_path, TASKS["arc_easy"].hub_config, TASKS["arc_easy"].split) == \
        ("allenai/ai2_arc", "ARC-Easy", "test")
    assert TASKS["arc_challenge"].hub_config == "ARC-Challenge"
    assert (TASKS["openbookqa"].hub_path, TASKS["openbookqa"].hub_config) == ("allenai/openbookqa", "main")
    assert (TASKS["hellaswag"].hub_path, TASKS["hellaswag"].split) == ("Rowan/hellaswag", "validation")
    assert (TASKS["piqa"].hub_path, TASKS["piqa"].split) == ("baber/piqa", "validation")


def test_arc_jsonl_letter_and_numeric_keys(tmp_path):
    p = write_jsonl(tmp_path / "arc.jsonl", [
        arc(1, "Which is a gas?", ["ice", "steam", "rock", "wood"], "B"),
        arc(2, "How many legs has a spider?", ["six", "eight", "ten"], "2", labels=["1", "2", "3"]),
    ])
    exs = load_task("arc_easy", str(p))
    assert exs == [
        Example("Question: Which is a gas?\nAnswer:", [" ice", " steam", " rock", " wood"], 1),
        Example("Question: How many legs has a spider?\nAnswer:", [" six", " eight", " ten"], 1),
    ]
    assert load_task("arc_challenge", p, limit=1) == exs[:1]


def test_arc_json_array_file(tmp_path):
    p = tmp_path / "arc.json"
    p.write_text(json.dumps([arc(1, "Q?", ["a", "b"], "A"), arc(2, "R?", ["c", "d"], "B")]))
    assert [e.label for e in load_task("arc_challenge", p)] == [0, 1]


def test_openbookqa_parquet(tmp_path):
    rec = {"id": "7-980", "question_stem": "The sun is responsible for",
           "choices": {"text": ["puppies learning new tricks", "plants sprouting"], "label": ["A", "B"]},
           "answerKey": "B"}
    p = write_parquet(tmp_path / "obqa.parquet", [rec, {**rec, "answerKey": "A"}])
    exs = load_task("openbookqa", p)
    assert exs[0] == Example("The sun is responsible for", [" puppies learning new tricks", " plants sprouting"], 1)
    assert exs[1].label == 0


def test_hellaswag_folder_cleanup_order_and_limit(tmp_path):
    d = tmp_path / "hs"
    write_jsonl(d / "b" / "part-1.jsonl", [hswag(3, "x", "y", ["a", "b", "c", "d"], "3")])
    write_jsonl(d / "a.jsonl", [
        hswag(1, "[header] How to clean a rug [title] Vacuum the rug.", "then shake it out",
              ["[step] Use  a brush.", "b [substeps] c", "plain", "[title] gone"], "0", activity="Home and Garden"),
        hswag(2, "A man is in a kitchen.", "", ["he cooks.", "he sleeps.", "x", "y"], 2),  # int label accepted
    ])
    (d / "README.md").write_text("not data")  # skipped: other extension
    write_jsonl(d / ".hidden.jsonl", [{"junk": 1}])  # skipped: hidden
    exs = load_task("hellaswag", d)
    assert [e.label for e in exs] == [0, 2, 3]  # a.jsonl before b/part-1.jsonl
    assert exs[0].context == "Home and Garden: How to clean a rug. Vacuum the rug. Then shake it out"
    assert exs[0].choices == [" Use a brush.", " b c", " plain", " gone"]
    assert exs[1].context == "Baking cookies: A man is in a kitchen."  # empty ctx_b: no trailing space
    assert load_task("hellaswag", d, limit=2) == exs[:2]
    assert tasks.clean_hellaswag("a  [step]   b [title] c") == "a b. c"


def test_piqa_parquet_and_jsonl(tmp_path):
    recs = [piqa("Open a jar", "Twist the lid.", "Hit the lid.", 0), piqa("Dry hair", "Use a fan.", "Use a towel.", 1)]
    for p in (write_parquet(tmp_path / "piqa.parquet", recs), write_jsonl(tmp_path / "piqa.jsonl", recs)):
        exs = load_task("piqa", p)
        assert exs[0] == Example("Question: Open a jar\nAnswer:", [" Twist the lid.", " Hit the lid."], 0)
        assert exs[1].label == 1


@pytest.mark.parametrize("task,records,fmt,want", [
    ("arc_easy", [arc(1, "Q?", ["a", "b"], "A"), {**arc(2, "R?", ["a", "b"], "A"), "question": None}],
     "jsonl", ["record 2", "'question'", "missing"]),
    ("arc_easy", [arc(1, "Q?", ["a", "b", "c"], "E")], "jsonl", ["record 1", "'answerKey'", "'E'"]),
    ("arc_easy", [arc(1, "Q?", ["a", "b"], "A", labels=["A"])], "jsonl", ["record 1", "'choices.label'"]),
    ("arc_easy", [arc(1, "Q?", ["a"], "A")], "jsonl", ["'choices.text'", "at least 2"]),
    ("hellaswag", [hswag(1, "a", "b", ["w", "x", "y", "z"], "7")], "jsonl", ["record 1", "'label'", "'7'", "range"]),
    ("hellaswag", [hswag(1, "a", "b", ["w", "x", "y", "z"], "")], "jsonl", ["'label'", "unlabelled"]),
    ("hellaswag", [hswag(1, "a", "b", "wxyz", "1")], "jsonl", ["'endings'", "not a list"]),
    ("piqa", [piqa("g", "s", "t", 0), piqa("g", "s", "t", 2)], "parquet", ["record 2", "'label'", "range"]),
    ("piqa", [{"goal": "g", "sol1": "s", "label": 0}], "parquet", ["record 1", "'sol2'", "missing"]),
    ("openbookqa", [{"id": "1", "question_stem": 5, "choices": {"text": ["a", "b"], "label": ["A", "B"]},
                     "answerKey": "A"}], "jsonl", ["'question_stem'", "not a string"]),
])
def test_bad_records_name_file_record_field(tmp_path, task, records, fmt, want):
    p = (write_parquet if fmt == "parquet" else write_jsonl)(tmp_path / f"bad.{fmt}", records)
    with pytest.raises(TaskError) as e:
        load_task(task, p)
    msg = str(e.value)
    assert str(p) in msg
    for w in want:
        assert w in msg, msg


def test_bad_names_paths_and_files(tmp_path):
    with pytest.raises(TaskError) as e:
        load_task("arc_medium")
    assert all(n in str(e.value) for n in TASKS)
    with pytest.raises(TaskError, match="no such file"):
        load_task("piqa", tmp_path / "missing.jsonl")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(TaskError, match="unrecognised extension"):
        load_task("piqa", tmp_path / "x.csv")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TaskError, match="folder has no"):
        load_task("piqa", tmp_path / "empty")
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps(piqa("g", "s", "t", 0)) + "\n{not json\n")
    with pytest.raises(TaskError) as e:
        load_task("piqa", broken)
    assert str(broken) in str(e.value)
    good = write_jsonl(tmp_path / "good.jsonl", [piqa("g", "s", "t", 0)])
    with pytest.raises(TaskError, match="split"):
        load_task("piqa", good, split="test")
    with pytest.raises(TaskError, match="limit"):
        load_task("piqa", good, limit=-1)


def test_hub_route_calls_load_dataset(tmp_path, monkeypatch):
    """The hub branch, with load_dataset standing in for the network: it gets the task's
    name, config and split, and its records go through the same parser."""
    import datasets

    real = datasets.load_dataset
    p = write_jsonl(tmp_path / "arc.jsonl", [arc(1, "Q?", ["a", "b"], "B")] * 3)
    calls = []

    def fake(path, name=None, **kw):
        if path in ("json", "parquet"):
            return real(path, name, **kw)
        calls.append((path, name, kw))
        if path == "allenai/ai2_arc":
            return real("json", data_files=[str(p)], split="train", streaming=True)
        raise ConnectionError("hub unreachable")

    monkeypatch.setattr(datasets, "load_dataset", fake)
    exs = load_task("arc_challenge", limit=2)
    assert calls == [("allenai/ai2_arc", "ARC-Challenge", {"split": "test"})]
    assert [e.label for e in exs] == [1, 1]
    load_task("arc_easy", split="validation")
    assert calls[-1] == ("allenai/ai2_arc", "ARC-Easy", {"split": "validation"})
    with pytest.raises(TaskError, match="Rowan/hellaswag split=validation.*hub unreachable"):
        load_task("hellaswag")
    with pytest.raises(TaskError, match="baber/piqa split=validation"):
        load_task("piqa")


# --------------------------------------------------------------------------- a lookup-table model

def word_tokenizer(words, bos=False):
    """Whitespace-split word-level tokenizer: one word, one token (no BOS unless asked)."""
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["<unk>", *words])}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<|endoftext|>"] + (["<s>"] if bos else []))
    return tok


class Bigram(torch.nn.Module):
    """logits[b, t] = table[idx[b, t]]: the next token depends only on the current one.
    Records every input it is given."""

    def __init__(self, table, max_seq_len=64):
        super().__init__()
        self.register_buffer("table", table)  # (V, V) log-probs, rows sum to 1 in prob space
        self.cfg = SimpleNamespace(max_seq_len=max_seq_len)
        self.inputs = []

    def forward(self, idx):  # idx (B, T) -> (B, T, V)
        self.inputs.append(idx.clone())
        return self.table[idx]


def bigram_table(tok, rules: dict[str, dict[str, float]]):
    """(V, V) log-probs: ``rules[prev][next] = log p``; each row's leftover mass spread evenly."""
    V = tok.get_vocab_size()
    table = torch.full((V, V), -math.log(V), dtype=torch.float64)
    for prev, nexts in rules.items():
        p = {tok.token_to_id(w): math.exp(lp) for w, lp in nexts.items()}
        rest = (1.0 - sum(p.values())) / (V - len(p))
        assert rest > 0
        row = torch.full((V,), math.log(rest), dtype=torch.float64)
        for i, q in p.items():
            row[i] = math.log(q)
        table[tok.token_to_id(prev)] = row
    return table.float()


QA_WORDS = ["q1", "q2", "q3", "q4", "a1", "a2", "a3", "a4", "d1", "d2", "d3", "d4", "what", "is", "x"]


def qa_setup(max_seq_len=64, bos=False):
    tok = word_tokenizer(QA_WORDS, bos=bos)
    rules = {f"q{i}": {f"a{i}": math.log(0.9)} for i in range(1, 5)}
    rules.update({f"a{i}": {f"a{i}": math.log(0.5)} for i in range(1, 5)})
    return tok, Bigram(bigram_table(tok, rules), max_seq_len)


QA_EXAMPLES = [
    Example("q1", [" a1", " d1"], 0),
    Example("what is q2", [" d2", " d3", " a2"], 2),
    Example("q3", [" d4", " a3 a3"], 1),
    Example("q4", [" d1", " d2", " d3", " a4"], 3),
]


@pytest.mark.parametrize("batch_size", [1, 3, 16])
def test_known_answers_score_one_and_flipped_zero(batch_size):
    tok, model = qa_setup()
    res = score(model, tok, QA_EXAMPLES, batch_size=batch_size)
    assert (res["n"], res["acc"], res["acc_norm"], res["acc_token"]) == (4, 1.0, 1.0, 1.0)
    assert res["stderr"] == {"acc": 0.0, "acc_norm": 0.0, "acc_token": 0.0} and res["truncated"] == 0
    flipped = [Example(e.context, e.choices, (e.label + 1) % len(e.choices)) for e in QA_EXAMPLES]
    res = score(model, tok, flipped, batch_size=batch_size)
    assert (res["acc"], res["acc_norm"], res["acc_token"]) == (0.0, 0.0, 0.0)
    assert len(model.inputs) == 2 * math.ceil(11 / batch_size)  # 11 (example, choice) sequences per call


def test_stderr_and_random_by_hand():
    tok, model = qa_setup()
    exs = QA_EXAMPLES[:3] + [Example("q4", [" d1", " d2", " d3", " a4"], 0)]  # the last one is wrong
    res = score(model, tok, exs)
    assert res["acc"] == 0.75
    assert res["stderr"]["acc"] == pytest.approx(0.25)  # sqrt(0.75 * 0.25 / (4 - 1))
    assert res["random"] == pytest.approx((1 / 2 + 1 / 3 + 1 / 2 + 1 / 4) / 4)
    one = score(model, tok, exs[:1])
    assert one["n"] == 1 and one["acc"] == 1.0 and all(math.isnan(v) for v in one["stderr"].values())


def test_log_probs_exact_and_ties_go_low():
    tok, model = qa_setup()
    lp, nt, trunc = loglikelihoods(model, tok, QA_EXAMPLES[2:3])
    V = tok.get_vocab_size()
    rest = math.log(0.1 / (V - 1))
    assert nt == [[1, 2]] and trunc == 0
    assert lp[0] == pytest.approx([rest, math.log(0.9) + math.log(0.5)], abs=1e-5)
    tie = Example("q1", [" d2", " d3", " d4"], 1)  # three identical log-probs
    res = score(model, tok, [tie])
    assert res["acc"] == 0.0
    assert score(model, tok, [Example(tie.context, tie.choices, 0)])["acc"] == 1.0


def test_three_normalisations_differ_as_designed():
    """Choices: short " b" (1 token, 2 bytes), " c d e f" (4 tokens, 8 bytes) and one
    18-letter word (1 token, 20 bytes). Sum favours the short one, per-token the
    4-token one with likely tokens, per-byte the long single word."""
    long_word = "w" * 18
    tok = word_tokenizer(["q", "b", "c", "d", "e", "f", long_word])
    rules = {"q": {"b": -1.2, "c": -0.7, long_word: -2.5}, "c": {"d": -0.7}, "d": {"e": -0.7}, "e": {"f": -0.7}}
    model = Bigram(bigram_table(tok, rules))
    choices = [" b", " c d e f", " " + long_word]
    lp, nt, _ = loglikelihoods(model, tok, [Example("q", choices, 0)])
    assert lp[0] == pytest.approx([-1.2, -2.8, -2.5], abs=1e-5)
    assert nt[0] == [1, 4, 1]
    # sum: -1.2 > -2.5 > -2.8; per token: -0.7 > -1.2 > -2.5; per byte: -0.125 > -0.35 > -0.6
    want = {0: (1.0, 0.0, 0.0), 1: (0.0, 1.0, 0.0), 2: (0.0, 0.0, 1.0)}
    for label, (acc, acc_token, acc_norm) in want.items():
        res = score(model, tok, [Example("q", choices, label)])
        assert (res["acc"], res["acc_token"], res["acc_norm"]) == (acc, acc_token, acc_norm)


def test_bos_prepended_and_empty_context_uses_eos():
    tok, model = qa_setup(bos=True)
    bos = tok.token_to_id("<s>")
    loglikelihoods(model, tok, [Example("q1", [" a1"], 0)])
    assert model.inputs[-1].tolist() == [[bos, tok.token_to_id("q1")]]
    tok, model = qa_setup(bos=False)
    loglikelihoods(model, tok, [Example("", [" a1 a1"], 0)])
    assert model.inputs[-1].tolist() == [[tok.token_to_id("<|endoftext|>"), tok.token_to_id("a1")]]


def test_truncation_from_the_left_and_overlong_choice():
    tok, model = qa_setup(max_seq_len=4)
    ids = {w: tok.token_to_id(w) for w in QA_WORDS}
    ex = Example("what is x x x q1", [" a1 a1", " d1"], 0)  # 6 + 2 tokens: 8 > 4 + 1
    lp, _, trunc = loglikelihoods(model, tok, [ex])
    assert trunc == 2  # 6 + 2 and 6 + 1 tokens: both over max_seq_len + 1 = 5
    inputs = [row for batch in model.inputs for row in batch.tolist()]
    assert [ids["x"], ids["x"], ids["q1"], ids["a1"]] in inputs  # last 5 of 8 tokens, minus the last
    assert lp[0][0] == pytest.approx(math.log(0.9) + math.log(0.5), abs=1e-5)  # bigram: context cut is harmless
    ok = loglikelihoods(model, tok, [Example("q1", [" a1 a1 a1 a1"], 0)])  # 1 + 4 tokens: fits exactly
    assert ok[2] == 0
    with pytest.raises(ValueError, match="more than model.max_seq_len"):
        loglikelihoods(model, tok, [Example("q1", [" a1 a1 a1 a1 a1"], 0)])


# --------------------------------------------------------------------------- a real model

TEXT = [
    "Question: Which gas do plants take in?\nAnswer: carbon dioxide",
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "hello world, hello world again; the world says hello to the world.",
    "Water boils at one hundred degrees and freezes at zero degrees.",
] * 20


@pytest.fixture(scope="module")
def real():
    tok = train_bpe(TEXT, 400)
    cfg = ModelConfig(vocab_size=tok.get_vocab_size(), d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                      ffn_hidden=64, max_seq_len=24)
    torch.manual_seed(0)
    model = build_model(cfg, seed=3)
    with torch.no_grad():  # break the init's near-uniform outputs so that log-probs differ visibly
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return tok, model


REAL_EXAMPLES = [
    Example("Question: Which gas do plants take in?\nAnswer:", [" carbon dioxide", " oxygen", " sand"], 0),
    Example("The quick brown fox", [" jumps over the lazy dog", " sleeps"], 0),
    Example("hello wor", ["ld", "ld, hello world again"], 1),  # a BPE merge would cross the boundary
    Example("Water boils at one hundred degrees and freezes at zero degrees. The quick brown fox jumps over",
            [" the lazy dog near the river bank.", " zero"], 0),  # long: truncated on the left
]


def reference_logprob(model, tok, context, choice):
    """The straightforward way: one sequence, full logits, sum the choice tokens' log-probs."""
    ctx = tok.encode(context, add_special_tokens=False).ids
    cont = tok.encode(choice, add_special_tokens=False).ids
    seq = (ctx + cont)[-(model.cfg.max_seq_len + 1):]
    with torch.no_grad():
        logp = model(torch.tensor([seq[:-1]])).float().log_softmax(-1)[0]  # (T, V)
    T = len(seq) - 1
    return sum(logp[t, seq[t + 1]].item() for t in range(T - len(cont), T))


def test_batched_matches_one_at_a_time_on_a_real_model(real):
    tok, model = real
    lp, nt, trunc = loglikelihoods(model, tok, REAL_EXAMPLES, batch_size=4)
    assert trunc >= 1
    for ex, row, nrow in zip(REAL_EXAMPLES, lp, nt):
        want = [reference_logprob(model, tok, ex.context, c) for c in ex.choices]
        assert row == pytest.approx(want, abs=1e-4)
        assert nrow == [len(tok.encode(c, add_special_tokens=False).ids) for c in ex.choices]
    assert len({round(v, 3) for row in lp for v in row}) > 5  # not a degenerate model


def test_batch_size_does_not_change_results(real):
    tok, model = real
    base = loglikelihoods(model, tok, REAL_EXAMPLES, batch_size=1)
    for bs in (2, 3, 64):
        lp, nt, trunc = loglikelihoods(model, tok, REAL_EXAMPLES, batch_size=bs)
        assert (nt, trunc) == (base[1], base[2])
        for a, b in zip(lp, base[0]):
            assert a == pytest.approx(b, abs=1e-4)
    s1 = {k: v for k, v in score(model, tok, REAL_EXAMPLES, batch_size=1).items() }
    s7 = {k: v for k, v in score(model, tok, REAL_EXAMPLES, batch_size=7).items() }
    assert s1 == s7


def test_choice_tokens_are_encoded_separately(real):
    """Across "hello wor" + "ld" a joint encoding would merge "world"; the scorer feeds the
    separately encoded ids, and scores exactly encode("ld")."""
    tok, model = real
    ctx = tok.encode("hello wor", add_special_tokens=False).ids
    cont = tok.encode("ld", add_special_tokens=False).ids
    assert tok.encode("hello world", add_special_tokens=False).ids != ctx + cont  # the case is real
    fed = []
    hook = model.tok_emb.register_forward_hook(lambda m, inp, out: fed.append(inp[0].tolist()))
    try:
        _, nt, _ = loglikelihoods(model, tok, [Example("hello wor", ["ld"], 0)])
    finally:
        hook.remove()
    assert fed == [[(ctx + cont)[:-1]]] and nt == [[len(cont)]]


def test_evaluate_tasks_local_files(real, tmp_path):
    tok, model = real
    arc_p = write_jsonl(tmp_path / "arc.jsonl", [arc(i, "Which gas do plants take in?", ["carbon dioxide", "oxygen"],
                                                     "A") for i in range(3)])
    piqa_p = write_parquet(tmp_path / "piqa.parquet", [piqa("hello", "world", "dog", 0)] * 3)
    res = evaluate_tasks(model, tok, ["arc_easy", "piqa"], paths={"arc_easy": str(arc_p), "piqa": str(piqa_p)},
                         limit=2, batch_size=3)
    assert list(res) == ["arc_easy", "piqa"]
    for name, p in (("arc_easy", arc_p), ("piqa", piqa_p)):
        r = res[name]
        assert r["n"] == 2 and r["random"] == 0.5 and r["source"] == str(p)
        assert r["acc"] in (0.0, 1.0)  # identical examples: all right or all wrong
    with pytest.raises(TaskError, match="valid tasks"):
        evaluate_tasks(model, tok, ["arc_easy", "mmlu"], paths={"arc_easy": str(arc_p)})


# --------------------------------------------------------------------------- custom tasks (issue 19)

def test_custom_task_plain_and_builtin_forms(tmp_path):
    """Any name with a file is a task: the plain form (choices appended as written) and a
    built-in's form, recognised per record; no `datasets` needed for JSON Lines."""
    p = write_jsonl(tmp_path / "mine.jsonl", [
        {"context": "2 + 2 =", "choices": [" 4", " 5"], "label": 0},
        {"context": "Capital of France:", "choices": [" Paris", " Rome", " Oslo"], "label": "0"},
        arc(3, "Q?", ["a", "b"], "B"),
        piqa("g", "s", "t", 1),
    ])
    ex = load_task("my_quiz", p)
    assert [e.choices for e in ex[:2]] == [[" 4", " 5"], [" Paris", " Rome", " Oslo"]]
    assert [e.label for e in ex] == [0, 0, 1, 1] and ex[2].context == "Question: Q?\nAnswer:"
    assert len(load_task("my_quiz", p, limit=1)) == 1


@pytest.mark.parametrize("text,want", [
    ('{"context": "a", "choices": [" x", " y"], "label": 0}\n\n{not json\n', ["line 3", "not valid JSON"]),
    ('{"context": "a", "choices": [" x", " y"], "label": 0}\n{"context": "b", "choices": [" x"], "label": 0}\n',
     ["line 2", "'choices'", "at least 2"]),
    ('{"context": "a", "choices": [" x", " y"], "label": 2}\n', ["line 1", "'label'", "range"]),
    ('{"question_text": "a"}\n', ["line 1", "not a multiple-choice record", "question_text"]),
    ('[1, 2]\n', ["line 1", "not an object"]),
])
def test_custom_task_errors_name_file_and_line(tmp_path, text, want):
    p = tmp_path / "bad.jsonl"
    p.write_text(text)
    with pytest.raises(TaskError) as e:
        load_task("my_quiz", p)
    msg = str(e.value)
    assert str(p) in msg and all(w in msg for w in want), msg


def test_custom_task_missing_file_and_unknown_name(tmp_path):
    with pytest.raises(TaskError) as e:
        load_task("my_quiz", tmp_path / "nope.jsonl")
    assert "my_quiz" in str(e.value) and str(tmp_path / "nope.jsonl") in str(e.value) and "no such file" in str(e.value)
    with pytest.raises(TaskError, match="--task-data my_quiz=FILE.jsonl"):
        load_task("my_quiz")


def test_evaluate_tasks_custom_task(real, tmp_path):
    tok, model = real
    p = write_jsonl(tmp_path / "q.jsonl", [{"context": "hello", "choices": [" world", " dog"], "label": 0}] * 3)
    res = evaluate_tasks(model, tok, ["my_quiz"], paths={"my_quiz": str(p)}, batch_size=2)
    assert res["my_quiz"]["n"] == 3 and res["my_quiz"]["source"] == str(p) and res["my_quiz"]["random"] == 0.5
    with pytest.raises(TaskError, match="needs its file"):
        evaluate_tasks(model, tok, ["my_quiz"])
