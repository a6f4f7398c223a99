"""Tokenization throughput of `flopwise prepare` against plain `Tokenizer.encode_batch`.

Baseline: the same documents, already in memory, encoded by one `Tokenizer.encode_batch`
(and `encode_batch_fast`, without character offsets) call per 1,024 documents in this
process (the tokenizers library parallelises it over all cores), ids read back -- the
raw tokenizer speed, with no reading or writing. Ratios are against the faster one.
Project: `flopwise.data.prepare.prepare` end to end -- reading the source files,
encoding, routing and writing checksummed shards -- with 1 worker (encoding in-process,
the tokenizer's own threads on all cores) and 2, ... worker processes (one core each).
The speed-up column is against the raw call on one core (TOKENIZERS_PARALLELISM=false).
Both use the embedded corpus (Python's stdlib source) and its 8,192-token BPE. The
contenders take turns within each repeat; each keeps its best time.

    python benchmarks/tokenization.py [--max-mb 0] [--workers 1 2]

Prints a table and writes benchmarks/results/tokenization-<device>-<date>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import tokenizers
from _results import cores as n_cores  # benchmarks/ is on sys.path when a script runs
from _results import cpu_label, save_result

from flopwise.data.builtin import list_stdlib_files, prepare_builtin, select_files
from flopwise.data.prepare import PrepareOptions, prepare


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-mb", type=float, default=0.0, help="cap on the corpus (0 = all of it)")
    ap.add_argument("--workers", type=int, nargs="*", default=None, help="worker counts (default 1..cores)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    cores = n_cores()
    workers = args.workers or sorted({1, 2, cores})

    cache = Path("~/.cache/flopwise").expanduser()
    tok_path = prepare_builtin(cache, vocab_size=8192, max_mb=0.0, log=lambda s: None) / "tokenizer.json"
    tok = tokenizers.Tokenizer.from_file(str(tok_path))
    files = select_files(list_stdlib_files(), args.max_mb)
    texts = [f.path.read_bytes().decode("utf-8", errors="replace") for f in files]
    chars = sum(map(len, texts))

    def baseline(method: str) -> tuple[float, int]:
        one_core = method.endswith(":1")
        encode = getattr(tok, method.removesuffix(":1"))
        if one_core:  # the tokenizers library reads this at every call
            os.environ["TOKENIZERS_PARALLELISM"] = "false"
        t = time.perf_counter()
        n = 0
        for i in range(0, len(texts), 1024):
            for enc in encode(texts[i : i + 1024], add_special_tokens=False):
                n += len(enc.ids)
        sec = time.perf_counter() - t
        if one_core:
            os.environ.pop("TOKENIZERS_PARALLELISM")
        return sec, n

    # The ratio is taken against the faster of the two raw calls (encode_batch_fast skips
    # character offsets, which prepare does not need either). This machine's speed drifts
    # over a minute (shared cores), so the contenders take turns within each repeat and
    # each keeps its best time.
    methods = ["encode_batch"] + (["encode_batch_fast"] if hasattr(tok, "encode_batch_fast") else [])
    one_core = methods[-1] + ":1"  # the speed-up reference for the worker counts, not a ratio baseline
    source = "builtin" if args.max_mb == 0 else None
    tmp = Path(tempfile.mkdtemp(prefix="flopwise-bench-"))
    raw_times: dict[str, list[float]] = {m: [] for m in methods + [one_core]}
    raw_tokens: dict[str, int] = {}
    prep_times: dict[int, list[float]] = {w: [] for w in workers}
    prep_tokens = 0
    try:
        if source is None:  # a capped corpus: copy the selected files into a folder source
            folder = tmp / "src"
            for f in files:
                dest = folder / (f.rel.replace("/", "__") + ".txt")
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes(f.path.read_bytes())
            source = str(folder)
        for r in range(args.repeats):
            for m in methods + [one_core]:
                sec, raw_tokens[m] = baseline(m)
                raw_times[m].append(sec)
            for w in workers:
                out = tmp / f"out-{w}-{r}"
                t = time.perf_counter()
                prepare(PrepareOptions(source=source, out=str(out), tokenizer=str(tok_path), workers=w,
                                       val_fraction=0.005), log=lambda s: None)
                prep_times[w].append(time.perf_counter() - t)
                meta = json.loads((out / "meta.json").read_text())
                # Framing EOS tokens are not part of the baseline's count.
                prep_tokens = sum(s["tokens"] - s["documents"] for s in meta["splits"].values())
                shutil.rmtree(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    base_tps = max(raw_tokens[m] / min(raw_times[m]) for m in methods)
    rows = [{"what": f"Tokenizer.{m} (in memory, all cores)", "workers": None, "seconds": min(raw_times[m]),
             "all_seconds": raw_times[m], "tokens": raw_tokens[m], "tok_per_s": raw_tokens[m] / min(raw_times[m]),
             "ratio": raw_tokens[m] / min(raw_times[m]) / base_tps} for m in methods]
    one_core_tps = raw_tokens[one_core] / min(raw_times[one_core])
    rows.append({"what": f"Tokenizer.{one_core[:-2]} (in memory, one core)", "workers": None,
                 "seconds": min(raw_times[one_core]), "all_seconds": raw_times[one_core], "tokens": raw_tokens[one_core],
                 "tok_per_s": one_core_tps, "ratio": one_core_tps / base_tps})
    rows += [{"what": "flopwise prepare (read + encode + write)", "workers": w, "seconds": min(prep_times[w]),
              "all_seconds": prep_times[w], "tokens": prep_tokens, "tok_per_s": prep_tokens / min(prep_times[w]),
              "ratio": prep_tokens / min(prep_times[w]) / base_tps,
              "speedup_vs_one_core": prep_tokens / min(prep_times[w]) / one_core_tps} for w in workers]
    print(f"corpus: {len(texts)} files, {chars / 1e6:.1f}M characters; {cores} cores; best of {args.repeats}")
    print(f"{'what':<48} {'workers':>7} {'seconds':>8} {'Mtok/s':>8} {'ratio':>6} {'x 1 core':>8}")
    for row in rows:
        w = "-" if row["workers"] is None else row["workers"]
        speedup = f"{row['speedup_vs_one_core']:>8.2f}" if "speedup_vs_one_core" in row else f"{'':>8}"
        print(f"{row['what']:<48} {w:>7} {row['seconds']:>8.2f} {row['tok_per_s'] / 1e6:>8.2f} "
              f"{row['ratio']:>6.2f} {speedup}")

    result = {
        "tokenizers": tokenizers.__version__,
        "corpus": {"files": len(texts), "characters": chars, "max_mb": args.max_mb},
        "baseline": "the faster of Tokenizer.encode_batch / encode_batch_fast, in memory, all cores",
        "rows": rows,
    }
    save_result("tokenization", f"cpu{cores}", cpu_label(), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
