"""Comparisons shared by the tests (``from helpers import ...``: tests/ is on ``sys.path``
through its conftest.py, as tests/parity/test_hf_io.py relies on for its own folder).

Two models trained apart -- one process against two ranks, DDP against FSDP2, a resumed run
against an uninterrupted one -- agree only up to the order of floating-point sums: an
all-reduce, a sharded norm or another CPU's kernels add the same numbers in another order.
AdamW then amplifies that noise on near-zero gradients (``m / sqrt(v)`` is of order one
whatever the gradient's size, so a gradient element that is mostly rounding steps by up to
the learning rate in either direction). An absolute tolerance per element therefore fails
on another machine (an AMD EPYC gave 4e-6 ... 9e-6 against ``atol=1e-6``), while a real
defect -- a missed gradient sync, a skipped micro-batch, a wrong learning rate -- moves the
whole tensor. So each tensor is compared by the norm of its difference relative to its own
norm.

``WEIGHT_REL``: measured on this project's 2-core x86 development machine (torch 2.13 CPU;
tests/distributed/test_data_parallel.py: 8 AdamW steps of a 2-layer d_model=64 model, peak
lr 3e-3), the largest relative difference over every tensor: 2 ranks vs 1 process 1.5e-7
(DDP, ZeRO-1 and FSDP2 alike), resumed at the other world size 1.5e-7, the batch ramp
1.9e-7, ZeRO-1/FSDP2 vs DDP 0; the largest absolute difference of any element 3.4e-7. The
AMD EPYC's elements differed 25x more (up to 9e-6, in tensors of norm ~1 ... 8: a few 1e-6
relative at most). 1e-4 leaves a factor ~500 over this machine and ~20 over that one, while
a defect moves the weights by far more (an estimate: a missed gradient sync or a skipped
micro-batch changes AdamW's update of every element by O(1), i.e. steps x lr ~ 1e-2 against
weights initialised at std 0.02: 1e-1 ... 1 of the norm); a perturbation of 1e-3 of one tensor's norm (max |diff| 8e-5) fails with its name. A change of
the gradient's scale alone (a sum where a mean belongs) barely moves AdamW's weights (its
update is scale-free up to eps and clipping): :func:`assert_grad_norms_close` compares the
logged gradient norms for that.

``GRAD_NORM_REL``: the logged norm is of the gradient before clipping, one sum over every
gradient, at weights that already differ by the noise above: the same runs agree to 6.3e-7
relative here (worst step: FSDP2's sharded norm, the batch ramp), and on the EPYC the loss
curves held their 2e-6 (the weight check after them is what failed). 1e-4 as for the weights; a sum-for-mean defect is a factor 2, a
skipped micro-batch several percent.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

WEIGHT_REL = 1e-4
GRAD_NORM_REL = 1e-4
_TINY = 1e-12  # a norm floor: an all-zero reference tensor compares by the absolute norm of the difference


def weight_differences(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]) -> list[dict]:
    """Per tensor of ``want``: ``{"name", "rel", "max_abs", "norm"}`` with ``rel`` =
    ||got - want|| / max(||want||, tiny) and ``norm`` = ||want|| (in float64)."""
    rows = []
    for name, w in want.items():
        g = got[name]
        w64, g64 = w.detach().double().cpu(), g.detach().double().cpu()
        if g64.shape != w64.shape:
            rows.append({"name": name, "rel": math.inf, "max_abs": math.inf, "norm": float(w64.norm()),
                         "shape": (tuple(g64.shape), tuple(w64.shape))})
            continue
        diff = g64 - w64
        norm = float(w64.norm())
        d = float(diff.norm())
        rel = d / max(norm, _TINY) if math.isfinite(d) else math.inf
        rows.append({"name": name, "rel": rel, "max_abs": float(diff.abs().max()) if diff.numel() else 0.0,
                     "norm": norm})
    return rows


def assert_weights_close(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor], rel: float = WEIGHT_REL,
                         what: str = "") -> None:
    """Every tensor of ``got`` within ``rel`` of ``want`` relative to its norm (both state
    dicts: the same names). On failure the message lists every offending tensor with its
    relative and largest absolute difference and its norm, worst first."""
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    where = f"{what}: " if what else ""
    assert not missing and not extra, f"{where}tensors missing {missing}, unexpected {extra}"
    rows = weight_differences(got, want)
    bad = sorted((r for r in rows if not r["rel"] <= rel), key=lambda r: -r["rel"])
    if bad:
        lines = [f"  {r['name']}: rel {r['rel']:.2e}  max|diff| {r['max_abs']:.2e}  ||want|| {r['norm']:.3g}"
                 + (f"  shapes got {r['shape'][0]} want {r['shape'][1]}" if "shape" in r else "") for r in bad]
        worst_ok = max((r["rel"] for r in rows if r["rel"] <= rel), default=0.0)
        raise AssertionError(f"{where}{len(bad)} of {len(rows)} tensors differ by more than {rel:.0e} of their norm "
                             f"(the others: at most {worst_ok:.1e}):\n" + "\n".join(lines))


def grad_norms(rows: Iterable[Mapping]) -> dict[int, float]:
    """step -> logged ``grad_norm`` from ``metrics.jsonl`` rows (steps that logged one)."""
    return {r["step"]: r["grad_norm"] for r in rows if r.get("grad_norm") is not None and "step" in r}


def assert_grad_norms_close(got: Mapping[int, float], want: Mapping[int, float], rel: float = GRAD_NORM_REL,
                            what: str = "") -> None:
    """The same steps logged a gradient norm in both runs, each within ``rel`` of ``want``'s;
    on failure every offending step with both values and their relative difference."""
    where = f"{what}: " if what else ""
    assert got and sorted(got) == sorted(want), f"{where}steps with a grad norm differ: {sorted(got)} vs {sorted(want)}"
    bad = [(s, got[s], want[s], abs(got[s] - want[s]) / max(abs(want[s]), _TINY)) for s in sorted(want)]
    bad = [b for b in bad if not b[3] <= rel]
    assert not bad, (f"{where}grad norm differs by more than {rel:.0e} at {len(bad)} of {len(want)} steps:\n"
                     + "\n".join(f"  step {s}: {g:.9g} vs {w:.9g} (rel {r:.2e})" for s, g, w, r in bad))


def torchrun_children(parent: int) -> dict[int, int]:
    """``{rank: pid}`` of the processes torchrun (pid ``parent``) started, read from /proc."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid != parent:
                continue
            env = dict(kv.split("=", 1) for kv in (entry / "environ").read_text().split("\0") if "=" in kv)
        except (OSError, ValueError, IndexError):
            continue
        if "RANK" in env:
            found[int(env["RANK"])] = int(entry.name)
    return found


def tiny_model_overrides(cache) -> list[str]:
    """The tiny model on the small corpus cached in ``cache`` (no run directory, no logging)."""
    return [
        f"data.cache_dir={cache}", "data.builtin_vocab_size=512", "data.builtin_max_mb=0.6",
        "model.vocab_size=512", "model.d_model=64", "model.n_layers=2", "model.n_heads=4",
        "model.n_kv_heads=2", "model.ffn_hidden=192", "model.max_seq_len=64",
        "train.seq_len=64", "train.micro_batch_size=8", "train.global_batch_size=16",
        "eval.windows=16", "optim.warmup_steps=5",
    ]


def spawn_ranks(fn, args: tuple, nprocs: int) -> None:
    """``torch.multiprocessing.spawn(fn, args, nprocs)``, the processes forked from a forkserver
    that imported torch once, instead of each one importing it for itself (about 5 s of CPU a
    process here: most of what these tests spend). It is the forkserver preflight's trials use,
    with the same imports (``flopwise.tune.trial.FORKSERVER_PRELOAD``; that module's doc says
    why nothing else). Each rank is still a new process with its own torch state -- nothing ran
    in the forkserver but imports -- and its own process group; the test function is imported
    from its module as with spawn."""
    import torch.multiprocessing as mp

    from flopwise.tune.trial import FORKSERVER_PRELOAD

    mp.set_forkserver_preload(FORKSERVER_PRELOAD)  # read when the forkserver starts: the first call in this worker
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")


def _flopwise_command(argv: list[str], cwd: str, env: dict[str, str], out: str, err: str) -> None:
    """In a process forked by :func:`run_flopwise`: what ``python -m flopwise ARGV`` does in
    ``cwd`` with ``env``, its stdout and stderr into the files ``out`` and ``err``."""
    import atexit
    import os
    import sys
    import traceback

    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out), (2, err)):
        file = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(file, fd)
        os.close(file)
    import flopwise

    sys.argv = [str(Path(flopwise.__file__).with_name("__main__.py")), *argv]  # as -m sets it (run.json records it)
    try:
        from flopwise.cli import main

        code = main(argv)
    except SystemExit as e:  # argparse's usage errors and --help, as the interpreter ends on them
        code = e.code
    except BaseException:  # a bug: its traceback and status 1, as the interpreter's
        traceback.print_exc()
        code = 1
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


def run_flopwise(args: list[str], cwd=None, env: dict[str, str] | None = None, timeout: float = 600):
    """``subprocess.run([python, "-m", "flopwise", *args], cwd=cwd, env=env, capture_output=True,
    text=True, timeout=timeout)``, the process forked from the forkserver :func:`spawn_ranks` and
    preflight's trials use (torch, dynamo and torch.distributed imported once) rather than a new
    interpreter importing them again: about 4 s of CPU a command here. The command is still a
    process of its own, nothing run in it before -- its own directory, environment, argv, exit
    status and output; what it does not repeat is ``python -m flopwise``'s start, which the docs
    lane's ``python`` commands, the README's main job and the tests that signal or watch a CLI
    process (``subprocess``, the console script) keep running for real."""
    import os
    import subprocess
    import tempfile

    import torch.multiprocessing as mp

    from flopwise.tune.trial import FORKSERVER_PRELOAD

    mp.set_forkserver_preload(FORKSERVER_PRELOAD)  # read when the forkserver starts: the first call in this worker
    argv = [str(a) for a in args]
    with tempfile.TemporaryDirectory(prefix="flopwise-cli-") as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        proc = mp.get_context("forkserver").Process(target=_flopwise_command, args=(
            argv, str(cwd or os.getcwd()), dict(os.environ if env is None else env), out, err))
        proc.start()
        proc.join(timeout)
        if proc.exitcode is None:
            proc.kill()
            proc.join()
            raise subprocess.TimeoutExpired(["flopwise", *argv], timeout)
        read = [Path(p).read_text(errors="replace") if Path(p).exists() else "" for p in (out, err)]
    return subprocess.CompletedProcess(["flopwise", *argv], proc.exitcode, read[0], read[1])


def cli_once():
    """``run(*argv)``: ``flopwise ARGV``'s (status, stdout, stderr), run in this process once per
    argv (a module's tests read the same output without running the command again)."""
    import contextlib
    import io

    from flopwise.cli import main

    done: dict[tuple[str, ...], tuple[int, str, str]] = {}

    def run(*argv: str) -> tuple[int, str, str]:
        if argv not in done:
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = main(list(argv))
            done[argv] = (code, out.getvalue(), err.getvalue())
        return done[argv]

    return run


def traces_kept():
    """A generator for a module fixture: while it is suspended, the dry run traces each
    configuration once (``tune.dryrun._trace`` by config and request) and hands later asks a copy;
    it yields ``{"kept": {(config, request): result}, "traced": [config of every ask]}``."""
    import copy
    import json

    import pytest

    from flopwise.tune import dryrun

    real, kept, traced = dryrun._trace, {}, []

    def once(cfg, request, *args, **kwargs):
        traced.append(copy.deepcopy(cfg))
        key = (cfg.to_yaml(), json.dumps(request, sort_keys=True))
        if key not in kept:
            kept[key] = real(cfg, request, *args, **kwargs)
        return copy.deepcopy(kept[key])

    patch = pytest.MonkeyPatch()
    patch.setattr(dryrun, "_trace", once)
    yield {"kept": kept, "traced": traced}
    patch.undo()


def token_batch(seed: int = 0, B: int = 2, T: int = 16, V: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """A seeded (inputs, targets) pair of random token ids, (B, T) each."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)


def grads_of(model, loss_fn=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss and every parameter's gradient of one forward and backward on :func:`token_batch`."""
    from flopwise.train.train_step import forward_backward

    x, y = token_batch()
    model.zero_grad(set_to_none=True)
    loss = forward_backward(model, [(x, y)], x.numel(), loss_fn=loss_fn)
    return loss, {n: p.grad.clone() for n, p in model.named_parameters()}


def matmul_result(gpu: str, dtype: str = "bfloat16", size: int = 4096, n: int = 4) -> dict:
    """A dry-run worker result by hand (what tune/worker.py writes): ``n`` matrix multiplies of
    ``size``³ in ``dtype`` (an fp8 dtype: torchao's ``_scaled_mm``) on ``gpu``, for the predictor."""
    mm = {"kind": "mm", "op": "_scaled_mm" if dtype.startswith("float8") else "mm", "reads": [[1, 0]],
          "writes": [[2, 0]], "phase": "forward", "micro": 1, "host": 1, "m": size, "n": size, "k": size,
          "batch": 1, "dtype": dtype}
    kernels = {"records": [mm] * n, "tail_host": 0, "traced_accum": 1, "run_accum": 1, "micro_batch": 8,
               "seq_len": 1024, "world": 1}
    return {"request": {"gpu": {"spec": gpu}, "nproc_per_node": 1}, "precision": "bf16", "compile": "off",
            "loss": "plain", "strategy": "single", "micro_batch": 8,
            "trace": {"kernels": kernels, "memory": {"peak_gib": 1.0}, "flops": {}}}
