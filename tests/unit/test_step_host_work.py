"""The step does only its work (issue 43): what set-up fixed is decided once, what is due after a
step is one record, the loader's state is taken only when read, Muon updates in place when no
flag asks for the old values, and fp16's skip goes through GradScaler's public calls alone."""

import dataclasses
import inspect
import itertools
import math

import pytest
import torch

from flopwise.config import build_config
from flopwise.parallel.distributed import DistEnv
from flopwise.train import hooks
from flopwise.train import train_step as ts
from flopwise.train.optim import Muon, muon_lr_scale, newton_schulz
from flopwise.train.precision import Precision, resolve
from flopwise.train.setup import build_step

CPU = torch.device("cpu")
TINY = ["model.vocab_size=64", "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1",
        "model.ffn_hidden=64", "model.max_seq_len=16", "train.seq_len=16", "train.micro_batch_size=2",
        "train.global_batch_size=2", "train.compile=off", "data.builtin_vocab_size=64"]


class Batches:
    """Seeded random windows; counts what it hands out and what its state was asked for."""

    def __init__(self):
        self.gen = torch.Generator().manual_seed(0)
        self.batches = 0
        self.states = 0

    def next_batch(self):
        self.batches += 1
        seq = torch.randint(0, 64, (2, 17), generator=self.gen)
        return seq[:, :-1], seq[:, 1:]

    def state_dict(self):
        self.states += 1
        return {"batches": self.batches}


def step_only(prec: Precision) -> ts.StepOnly:
    """A one-rank StepOnly of the tiny model."""
    cfg = build_config(overrides=[*TINY, f"train.precision={prec.name}"])
    torch.manual_seed(0)
    parts = build_step(cfg, "single", DistEnv(), CPU, prec)
    return ts.StepOnly.of(cfg, parts, DistEnv(), CPU, prec, "single", Batches())


def weights(step: ts.StepOnly) -> list[torch.Tensor]:
    return [p.detach().clone() for p in step.state_model.parameters()]


# --------------------------------------------------------------------------- decided once

def test_what_set_up_fixed_is_decided_once_not_every_step(monkeypatch):
    step = step_only(resolve("float32", CPU))
    assert step.fixed == ts.StepFixed(on_device=True, fp16=False, set_to_none=True)

    def decided_again(_):
        raise AssertionError("skips_on_device decided again in a step")

    monkeypatch.setattr(ts, "skips_on_device", decided_again)
    for i in range(3):
        ts.train_step(step, i, 1, 32, 1e-3).read()


# --------------------------------------------------------------------------- the loader's state

def test_the_loader_state_is_taken_only_when_read_and_is_the_state_after_its_step():
    step = step_only(resolve("float32", CPU))
    loader = step.train_loader
    first = ts.train_step(step, 0, 2, 64, 1e-3)
    assert first.read().bad == "" and loader.states == 0  # a good step read: nothing taken
    assert first.read().loader_state == {"batches": 2}  # asked for: where the loader stands after step 1
    second = ts.train_step(step, 1, 2, 64, 1e-3)
    second.keep_loader_state()  # what the loop does for a step it reads late, before the next one draws
    ts.train_step(step, 2, 2, 64, 1e-3)
    assert second.read().loader_state == {"batches": 4} and loader.states == 2
    third = ts.train_step(step, 3, 2, 64, 1e-3)
    ts.train_step(step, 4, 2, 64, 1e-3)
    with pytest.raises(RuntimeError, match="asked for after the loader moved on"):
        third.read().loader_state  # noqa: B018  # not kept: a wrong state is refused, not returned


# --------------------------------------------------------------------------- one record of what is due

def _old_conditions(run, step: int) -> dict[str, bool]:
    """What hooks.py tested before the record, condition by condition (reads_now, _logs,
    _samples, after_step's, log_step's tasks)."""
    t, e, tr = run.cfg.train, run.cfg.eval, run.cfg.tracking
    is_last = step == run.total_steps
    logs = step % t.log_every == 0 or is_last or (e.every > 0 and step % e.every == 0)
    samples = e.sample_every > 0 and e.sample_tokens > 0 and step % e.sample_every == 0 and step != run.total_steps
    stats = tr.grad_norms_every > 0 and step % tr.grad_norms_every == 0
    save = is_last or (t.checkpoint_every > 0 and step % t.checkpoint_every == 0)
    return {"read_now": logs or (t.checkpoint_every > 0 and step % t.checkpoint_every == 0) or stats or samples,
            "log": logs, "val": is_last or (e.every > 0 and step % e.every == 0), "save": save, "sample": samples,
            "tasks": bool(run.task_names) and (is_last or (e.tasks_every > 0 and step % e.tasks_every == 0)),
            "layer_stats": stats, "last": is_last}


@pytest.mark.parametrize("log_every,val_every,ckpt,sample_every,stats_every,tasks_every",
                         [(1, 0, 0, 0, 0, 0), (5, 10, 4, 6, 3, 10), (7, 0, 5, 0, 0, 0), (3, 4, 0, 5, 2, 0)])
def test_the_due_record_says_what_each_hook_tested_before(log_every, val_every, ckpt, sample_every, stats_every,
                                                          tasks_every):
    cfg = build_config(overrides=[*TINY, f"train.log_every={log_every}", f"eval.every={val_every}",
                                  f"train.checkpoint_every={ckpt}", f"eval.sample_every={sample_every}",
                                  "eval.sample_tokens=8", f"tracking.grad_norms_every={stats_every}",
                                  f"eval.tasks_every={tasks_every}"])
    for total, tasks in itertools.product((23, 30), ([], ["hellaswag"])):
        run = type("R", (), {"cfg": cfg, "total_steps": total, "task_names": tasks})()
        for step in range(1, total + 1):
            due = hooks.due(run, step)  # type: ignore[arg-type]  # what due() reads of a Run
            got = {k: getattr(due, k) for k in ("read_now", "log", "val", "save", "sample", "tasks", "layer_stats",
                                                "last")}
            assert got == _old_conditions(run, step), (step, total, tasks)
    with pytest.raises(dataclasses.FrozenInstanceError):
        due.log = True  # type: ignore[misc]  # made once per step, read by all


# --------------------------------------------------------------------------- Muon in place

def _muon_reference(ps, grads, bufs, lr, wd, mu, nesterov, keep):
    """The update with every value a temporary (the code before the in-place path)."""
    for p, g, buf in zip(ps, grads, bufs):
        new_buf = buf.lerp(g, 1 - mu)
        update = g.lerp(new_buf, mu) if nesterov else new_buf
        new_p = p.mul(1 - lr * wd).add_(newton_schulz(update), alpha=-lr * muon_lr_scale(p.shape))
        buf.copy_(new_buf if keep is None else torch.where(keep, buf, new_buf))
        p.copy_(new_p if keep is None else torch.where(keep, p, new_p))


@pytest.mark.parametrize("nesterov,wd", [(True, 0.0), (True, 0.1), (False, 0.1)])
def test_muon_in_place_is_bitwise_the_update_made_of_temporaries(nesterov, wd):
    gen = torch.Generator().manual_seed(3)
    shapes = [(8, 5), (6, 12)]
    ps = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    ref = [p.detach().clone() for p in ps]
    bufs = [torch.zeros(s) for s in shapes]
    opt = Muon(ps, lr=0.02, weight_decay=wd, nesterov=nesterov)
    storage = [p.data_ptr() for p in ps]
    for i in range(5):
        grads = [torch.randn(s, generator=gen) for s in shapes]
        flag = None if i < 2 else torch.tensor(1.0 if i == 3 else 0.0)  # no flag, then the device's skip
        if i == 3:
            grads[0][0, 0] = math.nan
        for p, g in zip(ps, grads):
            p.grad = g.clone()
        if flag is not None:
            opt.found_inf = flag  # type: ignore[attr-defined]
        opt.step()
        if flag is not None:
            del opt.found_inf  # type: ignore[attr-defined]
        _muon_reference(ref, grads, bufs, 0.02, wd, 0.95, nesterov, None if flag is None else flag != 0)
        for p, r, b in zip(ps, ref, bufs):
            assert torch.equal(p.detach(), r) and torch.equal(opt.state[p]["momentum_buffer"], b), i
    assert [p.data_ptr() for p in ps] == storage  # the weights were written where they live


# --------------------------------------------------------------------------- fp16 through the scaler's public calls

def test_fp16_a_nonfinite_loss_skips_the_update_and_lowers_the_scale_through_the_scaler():
    """A loss that is not finite over finite gradients: the scaler finds the gradients non-finite
    itself (forward_backward made them NaN), skips the update and halves its scale; the guard
    reads the step as bad. A finite step after it updates as usual. Nothing reaches into the
    scaler's per-optimizer record."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1000)
    prec = Precision("fp16", None, torch.float32, scaler)
    step = step_only(prec)
    assert step.fixed == ts.StepFixed(on_device=True, fp16=True, set_to_none=True)
    real, shifts = step.loss_fn, [math.nan]

    def shifted(x, y, doc_ids=None):  # a constant added after the graph: the value changes, not the gradients
        s, aux = real(x, y, doc_ids)
        return s + (shifts.pop(0) if shifts else 0.0), aux

    step.loss_fn = shifted
    before = weights(step)
    out = ts.train_step(step, 0, 1, 32, 1e-3).read()
    assert out.bad == "nonfinite" and math.isnan(out.loss)
    assert all(torch.equal(a, b) for a, b in zip(before, weights(step))), "the bad step's update was made"
    assert scaler.get_scale() == 2.0 ** 9
    assert not step.optimizer.state or all(float(s["step"]) == 0 for s in step.optimizer.state.values())
    out = ts.train_step(step, 1, 1, 32, 1e-3).read()
    assert out.bad == "" and math.isfinite(out.loss) and scaler.get_scale() == 2.0 ** 9
    assert not all(torch.equal(a, b) for a, b in zip(before, weights(step))), "a good step's update was not made"
    assert {float(s["step"]) for s in step.optimizer.state.values()} == {1.0}
    shifts[:] = [math.inf, 0.0]  # two micro-batches, the first one's loss not finite: the step is checked once, whole
    before = weights(step)
    out = ts.train_step(step, 2, 2, 64, 1e-3).read()
    assert out.bad == "nonfinite" and scaler.get_scale() == 2.0 ** 8
    assert all(torch.equal(a, b) for a, b in zip(before, weights(step))), "the bad step's update was made"
    assert "_per_optimizer_states" not in inspect.getsource(ts)  # torch's private record, written no more
