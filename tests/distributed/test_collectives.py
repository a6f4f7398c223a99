"""The pieces of data parallelism inside 2 spawned gloo processes: the launch environment,
gradient sync only on the last micro-batch, agreed stop decisions, the data split."""

from __future__ import annotations

import os
import traceback
from pathlib import Path

import pytest
import torch
from helpers import spawn_ranks

from flopwise.config import ConfigError, build_config
from flopwise.parallel.distributed import init_distributed, read_launch_env
from flopwise.tune.trial import free_port

WORLD = 2


def _as_rank(rank: int, port: int) -> None:
    """This spawned process as torchrun would start rank ``rank`` of WORLD (one thread)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)


def _spawn(fn, out_dir: Path, *args) -> None:
    """``fn(rank, port, out_dir, *args)`` on WORLD processes; the traceback of any rank that
    wrote ``rank*.err`` fails the test."""
    spawn_ranks(fn, (free_port(), str(out_dir), *args), WORLD)
    errors = [p.read_text() for p in sorted(out_dir.glob("rank*.err"))]
    assert not errors, "\n".join(errors)


def _worker(rank: int, port: int, out_dir: str, fn_name: str, arg) -> None:
    _as_rank(rank, port)
    try:
        env, device = init_distributed("auto", "cpu")
        try:
            result = globals()[fn_name](env, device, arg)
            if torch.distributed.is_initialized():  # (not after a test that closed it itself)
                env.barrier()
        finally:
            env.close()
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    except Exception:  # noqa: BLE001 - reported by the parent
        (Path(out_dir) / f"rank{rank}.err").write_text(traceback.format_exc())


def spawn(fn_name: str, tmp_path: Path, arg=None) -> list:
    _spawn(_worker, tmp_path, fn_name, arg)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


# ------------------------------------------------------------------ the launch environment

def _threads_after_close(env, device, _):
    import torch._dynamo  # noqa: F401 - as a training run does (compile; nn.init on the meta device)

    env.close()
    return sorted({(Path("/proc/self/task") / t / "comm").read_text().strip() for t in os.listdir("/proc/self/task")})


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads thread names from /proc")
@pytest.mark.slow
def test_close_frees_the_group_even_after_torch_dynamo_was_imported(tmp_path):
    """Regression: a group that outlives close() kept gloo's threads running into interpreter
    exit, where one could abort a process whose run had succeeded (SIGABRT, ~1 in 10)."""
    for threads in spawn("_threads_after_close", tmp_path):
        assert not [t for t in threads if t.startswith(("pt_gloo", "gloo_"))], threads


def _train_owning_the_group(rank: int, port: int, out_dir: str, overrides: list[str], fail: bool) -> None:
    """A rank as torchrun starts it: train() creates the group and tears it down; what DDP
    wrappers are still alive when it does is recorded. ``fail``: every rank's run raises after
    its last step, as an error at the end of a run would."""
    import gc
    import json

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from flopwise.train.trainer import train

    _as_rank(rank, port)
    real, alive = dist.destroy_process_group, []

    def destroy(*args, **kwargs):
        alive.append(sum(isinstance(o, DistributedDataParallel) for o in gc.get_objects()))
        return real(*args, **kwargs)

    dist.destroy_process_group = destroy
    if fail:
        import flopwise.train.hooks

        def finish(*args, **kwargs):
            raise ValueError("the end of the run failed")

        flopwise.train.hooks.finish = finish
    try:
        try:
            train(build_config(overrides=overrides), log=lambda s: None)
        except ValueError as err:
            if not fail or "the end of the run failed" not in str(err):
                raise
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(alive))
    except Exception:  # noqa: BLE001 - reported by the parent
        (Path(out_dir) / f"rank{rank}.err").write_text(traceback.format_exc())


@pytest.mark.slow
@pytest.mark.parametrize("ending", ["success", "error"])
def test_the_group_is_torn_down_after_the_ddp_wrapper_is_gone(tiny_overrides, tmp_path, ending):
    """Regression: the group torn down while the run's DDP wrapper lived left the wrapper's
    reducer its last holder; freed later with the GIL held, its destructor joined gloo's threads
    while one waited for the GIL (rank 0 of a 4-process ddp run hung after its last line). On
    an error the traceback's frames held the wrapper past the teardown."""
    import json

    out = tmp_path / "out"
    out.mkdir()
    overrides = tiny_overrides + ["parallel.strategy=ddp", "train.max_steps=2", "train.micro_batch_size=2",
                                  "train.global_batch_size=4", "eval.every=0", "eval.sample_tokens=0",
                                  "tracking.tensorboard=false"]
    _spawn(_train_owning_the_group, out, overrides, ending == "error")
    alive = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    assert alive == [[0], [0]], f"DDP wrappers alive when each rank destroyed its group: {alive}"


def test_launch_environment_half_set_is_refused_by_name():
    assert read_launch_env({}) is None
    with pytest.raises(ConfigError, match="RANK, WORLD_SIZE set but LOCAL_RANK, MASTER_ADDR, MASTER_PORT not"):
        read_launch_env({"RANK": "0", "WORLD_SIZE": "2"})
    full = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "29500"}
    assert read_launch_env(full) == (1, 1, 2)
    with pytest.raises(ConfigError, match="RANK=2 with WORLD_SIZE=2"):
        read_launch_env({**full, "RANK": "2"})
    with pytest.raises(ConfigError, match="MASTER_PORT='x' is not an integer"):
        read_launch_env({**full, "MASTER_PORT": "x"})
    with pytest.raises(ConfigError, match="parallel.strategy=single but 2 processes were launched"):
        init_distributed("single", "cpu", environ=full)


def test_strategy_single_process_and_refusals():
    from flopwise.parallel.distributed import DistEnv
    from flopwise.parallel.strategy import resolve_strategy

    cfg = build_config(preset="llama3.2-1b", overrides=["train.micro_batch_size=4"])
    cpu = torch.device("cpu")
    assert resolve_strategy(cfg, DistEnv(), cpu, "bf16", "chunked").name == "single"
    eight = DistEnv(world_size=8, backend="nccl")
    picks = {gb: resolve_strategy(cfg, eight, cpu, "bf16", "chunked", capacity=gb * 2**30) for gb in (141, 40, 24)}
    assert [picks[g].name for g in (141, 40, 24)] == ["ddp", "zero1", "fsdp2"], {g: p.why for g, p in picks.items()}
    assert "zero1" in picks[24].why and "GiB" in picks[24].why
    muon = build_config(preset="llama3.2-1b", overrides=["optim.name=muon", "parallel.strategy=fsdp2"])
    with pytest.raises(ConfigError, match="fsdp2 with optim.name=muon"):
        resolve_strategy(muon, eight, cpu, "bf16", "chunked")
    auto_muon = build_config(preset="llama3.2-1b", overrides=["optim.name=muon"])
    assert resolve_strategy(auto_muon, eight, cpu, "bf16", "chunked", capacity=24 * 2**30).name == "ddp"


# ------------------------------------------------------------------ gradient sync

def _count_allreduces(env, device, accum):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from flopwise.parallel.strategy import apply_data_parallel, grad_sync
    from flopwise.model.loss import make_loss_fn
    from flopwise.train.train_step import forward_backward
    from flopwise.model import build_model

    cfg = build_config(preset="tiny", overrides=["model.n_layers=1", "model.vocab_size=256",
                                                    "data.builtin_vocab_size=256"])
    model = build_model(cfg.model, device=device, seed=0)
    ddp, _ = apply_data_parallel(model, "ddp", env, device, cfg, None)
    calls = []

    def counting(state, bucket):
        calls.append(bucket.index())
        return allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, counting)
    g = torch.Generator().manual_seed(env.rank)
    micro = [(torch.randint(0, 256, (2, 8), generator=g), torch.randint(0, 256, (2, 8), generator=g))
             for _ in range(accum)]
    forward_backward(ddp, micro, 2 * 8 * accum, loss_fn=make_loss_fn(ddp, "chunked"),
                     sync=grad_sync(ddp, "ddp", accum))
    synced_buckets = len(calls)
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    return synced_buckets, grads


@pytest.mark.slow
def test_ddp_reduces_gradients_once_per_step_not_per_micro_batch(tmp_path):
    (buckets0, g0), (buckets1, g1) = spawn("_count_allreduces", tmp_path, 3)
    one_step_buckets = buckets0
    (tmp_path / "one").mkdir()
    (b_single, _), _ = spawn("_count_allreduces", tmp_path / "one", 1)
    assert buckets0 == buckets1 == b_single == one_step_buckets  # 3 micro-batches, one round of buckets
    torch.testing.assert_close(g0, g1)  # and every rank holds the averaged gradients


# ------------------------------------------------------------------ agreed stops

def _agree(env, device, case):
    from flopwise.train.stopping import Deadline
    from flopwise.train.stopping import stop_reason, stop_votes
    from flopwise.train.train_step import step_values

    class Signals:
        requested = case == "signal" and env.rank == 1
        name = "SIGTERM"

    loss = torch.tensor(float("nan") if case == "nan" and env.rank == 1 else 2.0 + env.rank)
    deadline = Deadline(0.0, 0.0, 0)
    # the step's one all-reduce carries the loss and the ranks' stop votes; read as the loop reads it
    values = step_values(env, loss, torch.tensor(1.5), True, stop_votes(env, Signals(), deadline, None))
    loss_f, gnorm_f, bad, *agreed = values.tolist()
    return loss_f, gnorm_f, stop_reason(env, Signals(), deadline, None, agreed), bad


def _fit_progress(env, device, _):
    import time

    from flopwise.train.stopping import Deadline
    from flopwise.train.stopping import TimeFit, stop_reason, stop_votes
    from flopwise.train.train_step import step_values

    class Signals:
        requested, name = False, "SIGTERM"

    deadline = Deadline(30.0 / 3600, time.perf_counter(), 0)  # a half-minute budget
    fit = TimeFit(deadline)
    seen = []
    for _ in range(3):
        votes = stop_votes(env, Signals(), deadline, fit)
        agreed = step_values(env, torch.tensor(1.0), torch.tensor(1.0), True, votes).tolist()[3:]
        stop_reason(env, Signals(), deadline, fit, agreed)
        seen.append(fit.progress())
        time.sleep(0.2)
    return seen


@pytest.mark.slow
def test_a_time_fitted_schedule_follows_rank_0s_clock_as_it_advances(tmp_path):
    r0, r1 = spawn("_fit_progress", tmp_path)
    assert r0 == r1  # every rank sets the same learning rate
    assert r0[0] < r0[1] < r0[2]  # and it moves with time


@pytest.mark.parametrize("case", ["none", "signal", "nan"])
@pytest.mark.slow
def test_every_rank_takes_the_same_decision(case, tmp_path):
    r0, r1 = spawn("_agree", tmp_path, case)
    assert r0[1] == r1[1] == pytest.approx(1.5) and bool(r0[2]) == bool(r1[2]) == (case == "signal")
    if case == "none":
        assert r0 == r1 == (2.5, 1.5, "", 0.0)  # the mean of the ranks' losses, a good step
    if case == "signal":  # each rank says why it stops
        assert (r0[2], r1[2]) == ("a signal received by another rank", "SIGTERM received")
    if case == "nan":
        assert r0[0] != r0[0] and r1[0] != r1[0]  # NaN on one rank is NaN everywhere: both skip/stop
        assert r0[3] == r1[3] == 1.0  # and the device's verdict, which skips the update, is bad on both


# ------------------------------------------------------------------ the data split

def _epoch_samples(env, device, data_path):
    from flopwise.data.datadir import DataDir
    from flopwise.data.loader import LoaderOptions, make_loader

    loader = make_loader("epoch", DataDir(data_path), "train",
                         LoaderOptions(32, 4, seed=5, rank=env.rank, world_size=env.world_size, step_samples=16))
    seen: list[int] = []
    locate = loader.sample_location

    def recording(index):  # the global sample indices each batch is read from
        seen.extend(int(i) for i in index)
        return locate(index)

    loader.sample_location = recording
    for _ in range(loader.batches_per_epoch):
        loader.next_batch()
    return seen, loader.num_samples, loader.dropped_samples_per_epoch, loader.epoch


@pytest.mark.slow
def test_ranks_read_disjoint_samples_that_cover_the_epoch(small_builtin, tmp_path):
    _, data = small_builtin
    (s0, n, dropped, epoch), (s1, _, _, _) = spawn("_epoch_samples", tmp_path, str(data))
    assert len(s0) == len(s1) > 0
    assert not set(s0) & set(s1)  # disjoint
    assert len(set(s0) | set(s1)) == len(s0) + len(s1) == n - dropped  # complete but the partial last step
    assert dropped < 16 and epoch == 1


# ------------------------------------------------------------------ a NaN on one rank, end to end

def _train_with_nan_on_rank_1(env, device, arg):
    """The real trainer inside the 2-rank group; rank 1's loss is NaN on the 3rd step."""
    import flopwise.train.train_step as train_step
    from flopwise.train.stopping import NonFiniteError
    from flopwise.train.trainer import train

    overrides, policy = arg
    real, calls = train_step.forward_backward, {"n": 0}

    def poisoned(*a, **kw):
        loss = real(*a, **kw)
        calls["n"] += 1
        return loss * float("nan") if env.rank == 1 and calls["n"] == 3 else loss

    train_step.forward_backward = poisoned
    cfg = build_config(overrides=overrides + [f"train.nonfinite={policy}"])
    try:
        result = train(cfg, log=lambda s: None)
    except NonFiniteError as e:
        return ("stopped", str(e))
    finally:
        train_step.forward_backward = real
    model_sd = torch.load(result.checkpoint / "model.pt", weights_only=True)
    return ("done", result.steps, float(model_sd["tok_emb.weight"].sum()))


@pytest.mark.parametrize("policy", ["stop", "rollback"])
@pytest.mark.slow
def test_a_nan_on_one_rank_is_handled_by_every_rank(policy, tiny_overrides, tmp_path):
    overrides = tiny_overrides + ["train.max_steps=6", "train.checkpoint_every=2", "train.micro_batch_size=4",
                                  "eval.every=0", "eval.sample_tokens=0", "train.log_every=1",
                                  "tracking.tensorboard=false", "train.nonfinite_patience=3"]
    (tmp_path / "out").mkdir()
    r0, r1 = spawn("_train_with_nan_on_rank_1", tmp_path / "out", (overrides, policy))
    if policy == "stop":
        assert r0[0] == r1[0] == "stopped" and "at step 3" in r0[1] and "at step 3" in r1[1]
        assert [p.name for p in (tmp_path / "run").glob("nonfinite-*.json")] == ["nonfinite-step-0000003.json"]
    else:
        assert r0 == r1 and r0[:2] == ("done", 6)  # same steps, the same final weights on both ranks
        import json

        rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows if r.get("event") == "nonfinite"] == [3]  # written once, by rank 0
        assert rows[-1].get("rollbacks") == 1


# ------------------------------------------------------------------ multiple-choice tasks, shared out

def _task_logprobs(env, device, arg):
    from flopwise.data.datadir import DataDir
    from flopwise.evaluate.loss import Shard
    from flopwise.evaluate.tasks import Example, loglikelihoods
    from flopwise.model import build_model
    from flopwise.parallel.strategy import apply_data_parallel

    data_path, strategy = arg
    cfg = build_config(overrides=["model.vocab_size=512", "model.d_model=64", "model.n_layers=2", "model.n_heads=4",
                                  "model.n_kv_heads=2", "model.ffn_hidden=192", "model.max_seq_len=64",
                                  "data.builtin_vocab_size=512", "train.seq_len=64"])
    model = build_model(cfg.model, device=device, seed=3)
    words = ["def", "class", "import", "yield", "with", "try", "pass"]  # 7 examples, 2-4 choices: 20 requests
    examples = [Example(f"question {i}: what does {w} do?",
                        [" it runs", " a loop" * (i % 3 + 1), " nothing", "?"][: 2 + i % 3], 0)
                for i, w in enumerate(words)]
    tokenizer = DataDir(data_path).tokenizer
    whole = loglikelihoods(model, tokenizer, examples, device, batch_size=2)  # every rank, unsharded
    if strategy == "fsdp2":
        apply_data_parallel(model, "fsdp2", env, device, cfg, None)
    shared = loglikelihoods(model, tokenizer, examples, device, batch_size=2,
                            shard=Shard(env.rank, env.world_size, lambda v: env.sum(v, device)))
    return whole, shared


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
@pytest.mark.slow
def test_task_scoring_is_shared_out_and_every_rank_gets_the_whole_answer(strategy, small_builtin, tmp_path):
    _, data = small_builtin
    (whole0, shared0), (whole1, shared1) = spawn("_task_logprobs", tmp_path, (str(data), strategy))
    assert shared0 == shared1  # the same answer on both ranks
    assert shared0[1] == whole0[1] and shared0[2] == whole0[2]  # token counts, truncations
    for a, b in zip(shared0[0], whole0[0]):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-5)


# ------------------------------------------------------------------ the bad step, skipped on the device

def _skip_on_device(env, device, strategies):
    return {s: _skip_on_device_under(env, device, s) for s in strategies}  # one spawn for all: ~5 s each


def _skip_on_device_under(env, device, strategy):
    """Four steps of the run's own ``train_step`` at 2 ranks under ``strategy``; step 3's gradients
    turn NaN in the backward on rank 1 only. Returns, per rank, whether the weights after step 3
    are those after step 2 (bitwise), whether step 4 moved them, the device's verdicts, and the
    optimizer's step counts."""
    from flopwise.train.precision import resolve
    from flopwise.train.setup import build_step
    from flopwise.train.train_step import StepOnly, train_step

    cfg = build_config(overrides=["model.vocab_size=64", "model.d_model=32", "model.n_layers=2", "model.n_heads=4",
                              "model.n_kv_heads=2", "model.ffn_hidden=64", "model.max_seq_len=16",
                              "train.seq_len=16", "train.micro_batch_size=2", "train.global_batch_size=4",
                              "train.precision=float32", "data.builtin_vocab_size=64", f"parallel.strategy={strategy}", "train.compile=off"])
    gen = torch.Generator().manual_seed(env.rank)

    class Batches:
        def next_batch(self):
            seq = torch.randint(0, 64, (2, 17), generator=gen)
            return seq[:, :-1], seq[:, 1:]

        def state_dict(self):
            return {}

    prec = resolve("float32", device)
    torch.manual_seed(0)
    parts = build_step(cfg, strategy, env, device, prec)
    step = StepOnly.of(cfg, parts, env, device, prec, strategy, Batches())
    poisoned = {"on": False}
    linear = next(m for m in parts.model.modules() if isinstance(m, torch.nn.Linear))

    def poison(module, inputs, output):  # NaN made in the backward: the loss stays finite
        if poisoned["on"] and env.rank == 1:
            output.register_hook(lambda g: g * float("nan"))

    linear.register_forward_hook(poison)

    def snapshot():
        return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                for p in parts.model.parameters()]

    verdicts = []
    train_step(step, 0, 1, 4 * 16, 1e-3)
    verdicts.append(train_step(step, 1, 1, 4 * 16, 1e-3).read().bad)
    before = snapshot()
    poisoned["on"] = True
    verdicts.append(train_step(step, 2, 1, 4 * 16, 1e-3).read().bad)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, snapshot()))
    poisoned["on"] = False
    verdicts.append(train_step(step, 3, 1, 4 * 16, 1e-3).read().bad)
    moved = not all(torch.equal(a, b) for a, b in zip(before, snapshot()))
    inner = parts.optimizer.optim if strategy == "zero1" else parts.optimizer
    steps = sorted({float(s["step"]) for s in inner.state.values()})
    return unchanged, moved, verdicts, steps


@pytest.mark.slow
def test_a_nan_gradient_on_one_rank_skips_the_update_on_every_rank_on_the_device(tmp_path):
    """No host read decides it: fused AdamW gets the verdict as ``found_inf`` (ZeRO-1: its local
    optimizer; FSDP2: on DTensor shards), and leaves weights, moments and step count as they were."""
    strategies = ["ddp", "zero1", "fsdp2"]
    for rank in spawn("_skip_on_device", tmp_path, strategies):
        assert sorted(rank) == sorted(strategies)
        for strategy, (unchanged, moved, verdicts, steps) in rank.items():
            assert verdicts == ["", "nonfinite", ""], (strategy, verdicts)
            assert unchanged and moved, (strategy, unchanged, moved)
            assert steps == [3.0], (strategy, steps)  # 4 steps issued, the bad one not counted
