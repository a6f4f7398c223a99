"""The network between nodes, named (issue 51, item 3): one default, ``hardware.DEFAULT_NETWORK``,
for ``plan``, ``plan --trace``, ``preflight --dry-run`` and its ``--rank``; ``--network`` changes
every multi-node prediction, and each says which network it assumed and whether by default.

The commands run in this process, as a user runs them (``flopwise.cli.main``). A trace does not
depend on the network -- only the prediction made from it does -- so :func:`traces` keeps the
worker's result of each configuration and hands a copy to the next dry run of the same one: the
four-node step and the planned step are each traced once, through the fake-CUDA shim.
"""

from __future__ import annotations

import json

import pytest
from helpers import cli_once, traces_kept

from flopwise.plan import hardware
from flopwise.plan.render import network_text
from flopwise.tune import dryrun, virtual

SHAPE = ["train.seq_len=128", "train.micro_batch_size=4", "train.global_batch_size=128"]
FOUR_NODES = ("preflight", "--dry-run", "--preset", "tiny", "--gpu", "h100", "--nproc-per-node", "8", "--nnodes", "4",
              *SHAPE)
PLAN = ("plan", "--model", "tiny", "--gpu", "h100", "--gpus", "32", "--seq-len", "128", "--tokens", "1e9")
DEFAULT_TEXT = network_text(hardware.network_facts(None) or {})


@pytest.fixture(scope="module")
def traces(fake_cuda_shim):
    """Each configuration's trace, kept by (config, request): a dry run of one already traced
    predicts from a copy of its result (with the network it is given)."""
    yield from (t["kept"] for t in traces_kept())


@pytest.fixture(scope="module")
def ran(traces):
    """``ran(*argv)``: ``flopwise ARGV``'s (status, stdout, stderr), run once per argv."""
    return cli_once()


def as_json(result: tuple[int, str, str]) -> dict:
    code, out, err = result
    assert code == 0, err[-3000:]
    return json.loads(out)


def text(result: tuple[int, str, str]) -> str:
    code, out, err = result
    assert code == 0, err[-3000:]
    return out


def floats(value) -> list[float]:
    if isinstance(value, float):
        return [value]
    if isinstance(value, dict):
        return [f for v in value.values() for f in floats(v)]
    if isinstance(value, list):
        return [f for v in value for f in floats(v)]
    return []


def noisy(value) -> list[float]:
    """The fractions in ``value`` with more than 10 significant digits (whole numbers are counts)."""
    return [x for x in floats(value) if not x.is_integer() and float(f"{x:.10g}") != x]


def test_a_four_node_prediction_is_slower_over_a_slower_network(ran, traces):
    fast = as_json(ran(*FOUR_NODES, "--network", "ib-ndr", "--json"))
    kept = len(traces)
    slow = as_json(ran(*FOUR_NODES, "--network", "25gbit", "--json"))
    assert len(traces) == kept, "the second network traced again: the trace should not depend on it"
    ps, pf = slow["prediction"], fast["prediction"]
    assert ps["predicted"] and pf["predicted"]
    assert ps["step_s"] > pf["step_s"] and ps["tokens_per_s_per_gpu"] < pf["tokens_per_s_per_gpu"]
    assert ps["breakdown"]["exposed_comm"] > pf["breakdown"]["exposed_comm"]
    assert ps["between_nodes"] == {"name": "eth-25g", "gbit_per_s": 25.0, "gb_per_s": 3.125, "default": False,
                                  "nic": "shared by the node"}
    assert pf["between_nodes"]["name"] == "ib-ndr" and pf["between_nodes"]["default"] is False
    # --json's figures are rounded (10 significant digits), not float noise such as 86.3999999994412
    assert not noisy(slow), noisy(slow)


def test_plan_trace_predicts_over_the_network_it_is_given(ran):
    slow = as_json(ran(*PLAN, "--trace", "--json", "--network", "25gbit"))
    fast = as_json(ran(*PLAN, "--trace", "--json", "--network", "ib-ndr"))
    ps, pf = slow["trace"]["prediction"], fast["trace"]["prediction"]
    assert ps["step_s"] > pf["step_s"] and ps["breakdown"]["exposed_comm"] > pf["breakdown"]["exposed_comm"]
    assert ps["between_nodes"]["name"] == "eth-25g" and pf["between_nodes"]["name"] == "ib-ndr"
    # the plan's time and cost are at the traced step's predicted MFU, over the network given
    assert slow["mfu"] == pytest.approx(ps["mfu"], rel=1e-5) and slow["mfu"] < fast["mfu"]
    assert slow["hours"] > fast["hours"]
    assert "over eth-25g" in slow["mfu_source"] and "over ib-ndr" in fast["mfu_source"]
    # its scaling table is over the same network, and its compute per step is the predicted step's, less the
    # communication the prediction left exposed (the table adds its own, not overlapped)
    assert slow["scaling"]["network"]["name"] == "eth-25g" and slow["scaling"]["at_gpus"]["link"] == "eth-25g"
    for plan, p in ((slow, ps), (fast, pf)):
        assert plan["scaling"]["at_gpus"]["compute_s"] == pytest.approx(p["step_s"] - p["breakdown"]["exposed_comm"],
                                                                          rel=1e-6)
    assert fast["scaling"]["network"]["name"] == "ib-ndr"
    assert not noisy(slow), noisy(slow)


def test_one_default_named_in_every_multi_node_prediction(ran):
    default = hardware.find_network(None)
    assert default is not None and default.name == hardware.DEFAULT_NETWORK
    named = {**(hardware.network_facts(hardware.DEFAULT_NETWORK) or {}), "default": True}
    # preflight --dry-run: the default network, named as the default, in --json and in the text
    dry = as_json(ran(*FOUR_NODES, "--json"))
    assert dry["prediction"]["between_nodes"] == named
    explicit = as_json(ran(*FOUR_NODES, "--network", hardware.DEFAULT_NETWORK, "--json"))
    assert dry["prediction"]["step_s"] == explicit["prediction"]["step_s"]
    lines = text(ran(*FOUR_NODES)).splitlines()
    assert any(ln.strip() == f"predicted over the {DEFAULT_TEXT}" for ln in lines), lines
    assert "(default; --network to change)" in DEFAULT_TEXT and default.name in DEFAULT_TEXT
    # plan and plan --trace: the same default, in the plan's scaling and time and in the traced prediction
    plan = as_json(ran(*PLAN, "--trace", "--json"))
    assert {k: plan["scaling"]["network"][k] for k in named} == named
    assert plan["trace"]["prediction"]["between_nodes"] == named
    assert plan["hours"] == as_json(ran(*PLAN, "--trace", "--json", "--network", hardware.DEFAULT_NETWORK))["hours"]
    shown = text(ran(*PLAN, "--trace"))
    assert f"predicted over the {DEFAULT_TEXT}" in shown and f"cross nodes: {DEFAULT_TEXT}" in shown, shown
    time_row = next(ln for ln in shown.splitlines() if ln.strip().startswith("network "))
    assert default.name in time_row and "(default; --network to change)" in time_row
    untraced = as_json(ran(*PLAN, "--json"))  # plain plan: the same default
    assert {k: untraced["scaling"]["network"][k] for k in named} == named
    assert untraced["scaling"]["at_gpus"]["link"] == default.name  # nvlink4 in a node, the network across


def test_rank_predicts_over_the_same_network(ran, traces, monkeypatch, capsys):
    """The virtual preflight's first candidate is the dry run's own step (kept by ``traces``); its
    further candidates' batch traces are stood in for, recording the network they are asked for."""
    from flopwise.cli import main

    asked = []

    def batch(cfgs, **kwargs):
        asked.append(kwargs.get("network"))
        return []

    monkeypatch.setattr(virtual, "dry_run_batch", batch)
    single = as_json(ran(*FOUR_NODES, "--network", "25gbit", "--json"))
    assert main([*FOUR_NODES, "--rank", "--network", "25gbit", "--json"]) == 0
    v = json.loads(capsys.readouterr().out)["virtual"]
    assert asked and set(asked) == {"25gbit"}
    assert v["network"]["name"] == "eth-25g" and v["network"]["default"] is False
    first = v["candidates"][0]["prediction"]
    assert first["between_nodes"]["name"] == "eth-25g" and first["step_s"] == single["prediction"]["step_s"]

    asked.clear()
    assert main([*FOUR_NODES, "--rank"]) == 0
    out = capsys.readouterr().out
    assert asked and set(asked) == {None}  # None: dry_run's default, hardware.DEFAULT_NETWORK
    assert f"every prediction below is over the {DEFAULT_TEXT}" in out, out
    assert f"virtual preflight on 32 × H100 SXM ({DEFAULT_TEXT})" in out


def test_the_default_is_one_constant_for_the_plan_and_the_step_model():
    from flopwise.plan import steptime
    from flopwise.plan.budget import PlanInputs, build_plan
    from flopwise.plan.memory import MemorySettings

    link = hardware.LINKS[hardware.DEFAULT_NETWORK]
    assert steptime.gpu("h100").network_bytes_s == link.gb_per_s * 1e9  # the dry run's step model
    plan = build_plan(PlanInputs(params=10**8, flops_formula="6n", gpu=hardware.find("h100"), gpus=16, tokens=10**9,
                                 memory=MemorySettings(strategy="ddp", n_gpus=16)))
    assert plan["scaling"]["at_gpus"]["link"] == link.name and plan["scaling"]["network"]["default"] is True
    one_node = build_plan(PlanInputs(params=10**8, flops_formula="6n", gpu=hardware.find("h100"), gpus=8,
                                     tokens=10**9, memory=MemorySettings(strategy="ddp", n_gpus=8)))
    assert "network" not in one_node["scaling"]  # nothing crosses nodes: nothing is named


def test_a_bad_network_is_one_line_before_any_trace(monkeypatch, capsys):
    from flopwise.cli import main

    def no_trace(*args, **kwargs):
        raise AssertionError("traced")

    monkeypatch.setattr(dryrun, "_trace", no_trace)
    monkeypatch.setattr(dryrun, "ensure_shim", no_trace)
    monkeypatch.setattr(virtual, "dry_run", no_trace)
    for argv in ([*FOUR_NODES, "--network", "25gbps"], [*FOUR_NODES, "--network", "25gbps", "--json"],
                 [*FOUR_NODES, "--network", "25gbps", "--rank"], [*PLAN, "--trace", "--network", "25gbps"]):
        assert main(argv) == 2, argv
        got = capsys.readouterr()
        err = got.err.strip().splitlines()
        assert len(err) == 1 and "--network '25gbps' is not known; choose one of" in err[0], (argv, err)
        assert "ib-ndr" in err[0] and "<N>gbit" in err[0] and got.out == "", (argv, got.out)
    # without --dry-run there is nothing to predict over a network
    assert main(["preflight", "--preset", "tiny", "--network", "ib-ndr"]) == 2
    err = capsys.readouterr().err
    assert "--network" in err and "--dry-run" in err, err
