"""Issue 45, item 11: preflight's words on a long step -- the estimate before it (from the step's
FLOPs and a rate, labelled as an estimate and by where the rate came from) and the progress
within it (throttled by an injected clock, never the wall clock)."""

import torch

from flopwise.config import build_config
from flopwise.measure.ceiling import Ceiling
from flopwise.measure.timing import StepTimer, micro_batch_progress
from flopwise.plan.flops import flops_per_token
from flopwise.tune.progress import StepProgress
from flopwise.tune.request import Bench


class Clock:
    """Read as set: the test moves it."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def smollm_on_a_cpu():
    cfg = build_config(preset="smollm-360m")
    return cfg, Bench(torch.device("cpu"), fpt=flops_per_token(cfg.model, cfg.train.seq_len))


def test_a_long_step_on_a_cpu_is_estimated_from_its_flops_at_the_measured_matmul_rate(monkeypatch):
    cfg, bench = smollm_on_a_cpu()
    calls = []

    def gemms(g, device, dtype, **kw):  # this CPU's matmuls at 200 GFLOP/s
        calls.append(sum(x.flops for x in g))
        return Ceiling(2e11, 0.01, [], str(dtype))

    monkeypatch.setattr("flopwise.tune.progress.measure_ceiling", gemms)
    progress = StepProgress(cfg, bench, lambda s: None, Clock())
    said = progress.estimate(cfg.tokens_per_step)
    seconds = bench.fpt * cfg.tokens_per_step / 2e11  # ~1.9e15 FLOPs: hours
    assert seconds > 3600
    hours, rest = divmod(round(seconds), 3600)
    assert said.startswith(f"about {hours}h{rest // 60:02d}m") and "an estimate" in said, said
    assert "matmul rate" in said and "likely longer" in said, said
    progress.estimate(cfg.tokens_per_step)
    assert len(calls) == 1  # measured once, on a few hundred tokens' GEMMs, not a step's
    assert calls[0] < bench.fpt * 1024


def test_a_short_step_says_nothing_and_measures_nothing(monkeypatch, tiny_overrides):
    monkeypatch.setattr("flopwise.tune.progress.measure_ceiling", lambda *a, **k: 1 / 0)
    cfg = build_config(overrides=tiny_overrides)
    bench = Bench(torch.device("cpu"), fpt=flops_per_token(cfg.model, cfg.train.seq_len))
    assert StepProgress(cfg, bench, lambda s: None, Clock()).estimate(cfg.tokens_per_step) == ""


def test_progress_within_a_step_waits_for_the_step_to_be_long_then_says_at_most_every_few_seconds():
    cfg, bench = smollm_on_a_cpu()
    clock, lines = Clock(), []
    progress = StepProgress(cfg, bench, lines.append, clock)
    progress.begin("end-to-end check", 4, cfg.tokens_per_step)
    timer = StepTimer(torch.device("cpu"))
    with micro_batch_progress(progress):
        for _ in timer.timed_batches(lambda: clock.__setattr__("now", clock.now + 1.0), 32):  # 1 s each
            pass
    # 32 micro-batches of 1 s: nothing in the first 5 s, then a line every 5 s, and the step's end
    done = [int(x.split("micro-batch ")[1].split("/")[0]) for x in lines]
    assert done == [5, 10, 15, 20, 25, 30], lines
    assert lines[0] == ("preflight: end-to-end check step 1/4: micro-batch 5/32 · 0m05s in · "
                        "~0m27s left in this step (measured: 0m01s a micro-batch)"), lines[0]
    said = progress.estimate(cfg.tokens_per_step)  # the next estimate uses the step just measured
    assert said.startswith("about 0m32s a step here") and "measured on the end-to-end check's step 1" in said, said


def test_outside_micro_batch_progress_a_step_tells_no_one():
    timer, seen = StepTimer(torch.device("cpu")), []
    with micro_batch_progress(lambda done, of: seen.append((done, of))):
        list(timer.timed_batches(lambda: None, 2))
    list(timer.timed_batches(lambda: None, 2))
    assert seen == [(0, 2), (1, 2), (2, 2)]
