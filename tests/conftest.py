"""Shared fixtures: a small prepared slice of the embedded corpus, made once per session,
and the command line as a user runs it."""

import os
import subprocess
import sys

import pytest


def _run_cli(*args, cwd=None):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "flopwise", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=600)


@pytest.fixture
def cli():
    """``cli("train", ...)`` runs ``python -m flopwise`` and returns the CompletedProcess."""
    return _run_cli


@pytest.fixture(scope="session")
def small_builtin(tmp_path_factory):
    """The embedded corpus capped at 0.6 MB of source, a 512-token BPE: a real data directory."""
    from flopwise.data.builtin import prepare_builtin

    cache = tmp_path_factory.mktemp("flopwise-cache")
    path = prepare_builtin(cache, vocab_size=512, max_mb=0.6, log=lambda s: None)
    return cache, path


@pytest.fixture
def tiny_overrides(small_builtin, tmp_path):
    """Overrides for a seconds-long CPU run on the small corpus, in a fresh run directory."""
    cache, _ = small_builtin
    return [
        f"data.cache_dir={cache}", "data.builtin_vocab_size=512", "data.builtin_max_mb=0.6",
        "model.vocab_size=512", "model.d_model=64", "model.n_layers=2", "model.n_heads=4",
        "model.n_kv_heads=2", "model.ffn_hidden=192", "model.max_seq_len=64",
        "train.seq_len=64", "train.micro_batch_size=8", "train.global_batch_size=16",
        "train.log_every=5", "eval.every=10", "eval.batches=2", "eval.sample_tokens=16",
        "optim.warmup_steps=5", f"train.run_dir={tmp_path / 'run'}",
    ]


def _saved_bytes(fn) -> int:
    """Bytes of every tensor autograd saves for backward while ``fn`` runs (no de-duplication)."""
    import torch

    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total


@pytest.fixture
def saved_bytes():
    """``saved_bytes(fn)``: what autograd saves for backward while ``fn`` runs, in bytes."""
    return _saved_bytes
