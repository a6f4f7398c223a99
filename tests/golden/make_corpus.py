"""Write the golden test's corpus and tokenizer (tests/integration/test_golden.py says when).

    python tests/golden/make_corpus.py

- ``corpus.jsonl``: 160 documents of generated text (a seeded ``random.Random``; no outside
  text), one JSON object per line with a ``text`` field, about 150 KB: short English-like
  sentences about invented things, arithmetic with correct answers and small Python
  functions, so that a tiny model has something to learn in a few steps.
- ``tokenizer.json``: flopwise's byte-level BPE of 512 tokens trained on that corpus
  (:func:`flopwise.data.tokenizer.train_bpe`). It is shipped rather than trained by the
  test: BPE training may break ties differently in another ``tokenizers`` release, while
  encoding with a given merge list is stable.

The test only reads the two files: rerunning this script is a deliberate change, followed
by re-recording the golden numbers.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
SEED = 20261122
N_DOCS = 160
VOCAB_SIZE = 512

NOUNS = ["river", "stone", "lantern", "garden", "engine", "ladder", "market", "bridge", "letter", "kettle",
         "forest", "window", "harbor", "candle", "wagon", "basket", "tower", "meadow", "anchor", "mirror"]
ADJECTIVES = ["red", "quiet", "heavy", "bright", "old", "narrow", "warm", "hollow", "round", "early"]
VERBS = ["carries", "follows", "paints", "counts", "repairs", "opens", "measures", "lifts", "watches", "builds"]
NAMES = ["Ada", "Bram", "Cleo", "Dov", "Esme", "Finn", "Gala", "Hugo", "Iris", "Jory", "Kai", "Lena"]
PLACES = ["north", "south", "east", "west"]


def sentence(r: random.Random) -> str:
    n, m = r.choice(NOUNS), r.choice(NOUNS)
    kind = r.randrange(4)
    if kind == 0:
        return f"{r.choice(NAMES)} {r.choice(VERBS)} the {r.choice(ADJECTIVES)} {n} near the {m}."
    if kind == 1:
        k = r.randrange(2, 20)
        return f"There are {k} {n}s by the {r.choice(PLACES)} {m}, and {r.choice(NAMES)} {r.choice(VERBS)} them."
    if kind == 2:
        a, b = r.randrange(1, 50), r.randrange(1, 50)
        return f"{r.choice(NAMES)} had {a} {n}s and found {b} more, so now there are {a + b}."
    return f"The {n} is {r.choice(ADJECTIVES)} in the morning and {r.choice(ADJECTIVES)} at night."


def function(r: random.Random) -> str:
    name = f"{r.choice(VERBS)[:-1]}_{r.choice(NOUNS)}"
    a, b = r.randrange(2, 10), r.randrange(1, 30)
    op = r.choice(["+", "-", "*"])
    total = {"+": b + 1 + b, "-": 1, "*": (b + 1) * b}[op]  # the function's total at count = b + 1
    lines = [f"def {name}(count, scale={a}):",
             f'    """Return how many {r.choice(NOUNS)}s the {r.choice(ADJECTIVES)} {r.choice(NOUNS)} needs."""',
             f"    total = count {op} {b}",
             "    if total < 0:",
             "        return 0",
             "    return total * scale",
             "",
             f"assert {name}({b + 1}) == {total * a}"]
    return "\n".join(lines)


def document(r: random.Random, i: int) -> str:
    parts = [f"# Notes {i}: the {r.choice(ADJECTIVES)} {r.choice(NOUNS)}", ""]
    for _ in range(r.randrange(3, 7)):
        if r.random() < 0.3:
            parts += [function(r), ""]
        else:
            parts += [" ".join(sentence(r) for _ in range(r.randrange(2, 6))), ""]
    return "\n".join(parts).rstrip() + "\n"


def main() -> None:
    from flopwise.data.tokenizer import train_bpe

    r = random.Random(SEED)
    docs = [document(r, i) for i in range(N_DOCS)]
    (HERE / "corpus.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tok = train_bpe(docs, VOCAB_SIZE)
    (HERE / "tokenizer.json").write_text(tok.to_str(pretty=True))
    print(f"{len(docs)} documents, {sum(map(len, docs)):,} characters, vocab {tok.get_vocab_size()}")


if __name__ == "__main__":
    main()
