"""The outer loop resumed on another schedule while a fragment is in flight (issue 44, item 11),
one process, one group (no collectives): the in-flight fragment was sent on the old schedule,
and the new one would send it again before it lands. Refused, naming the fields and values;
the 2-rank checks through ``flopwise train`` are tests/distributed/test_diloco_resume_guard.py."""

from __future__ import annotations

import pytest
import torch

from flopwise.config import ConfigError, ParallelConfig
from flopwise.parallel.diloco import DiLoCo, Groups, leave_diloco


def outer(inner_steps: int, overlap_steps: int) -> DiLoCo:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5))]
    pc = ParallelConfig(strategy="diloco", inner_steps=inner_steps, overlap_steps=overlap_steps)
    return DiLoCo(params, pc, Groups(), torch.device("cpu"))


def test_another_schedule_with_a_fragment_in_flight_is_refused_not_sent_twice():
    saved = outer(inner_steps=4, overlap_steps=3)
    saved.after_step(4)  # fragment 0 sent, landing after step 7
    state, group = saved.state_dict(), saved.group_state()
    resumed = outer(inner_steps=2, overlap_steps=1)
    try:
        resumed.load_state_dict(state, group, "step-0000004")
    except ConfigError as e:
        text = str(e)
        assert "parallel.inner_steps=4 (this launch: parallel.inner_steps=2)" in text, text
        assert "parallel.overlap_steps=3 (this launch: parallel.overlap_steps=1)" in text, text
        assert "fragment 0 sent after step 4" in text and "Resume with the recorded values" in text, text
        return
    for step in (5, 6):
        resumed.after_step(step)
    pytest.fail(f"resumed on the new schedule: fragments in flight after step 6: {[f.fragment for f in resumed.inflight]}")


def test_the_same_schedule_or_nothing_in_flight_resumes():
    saved = outer(inner_steps=4, overlap_steps=3)
    saved.after_step(4)
    outer(inner_steps=4, overlap_steps=3).load_state_dict(saved.state_dict(), saved.group_state(), "step-4")
    saved.after_step(7)  # landed: nothing in flight, the next sync may follow another schedule
    outer(inner_steps=2, overlap_steps=1).load_state_dict(saved.state_dict(), saved.group_state(), "step-7")


def test_leaving_diloco_is_refused_between_syncs_and_noted_at_one():
    run = outer(inner_steps=2, overlap_steps=0)
    run.after_step(1)  # between syncs
    with pytest.raises(ConfigError, match="between outer syncs"):
        leave_diloco(run.state_dict(), run.group_state(), 1, "run/checkpoints/step-0000001", "ddp")
    run.after_step(2)  # synced, nothing in flight
    note = leave_diloco(run.state_dict(), run.group_state(), 2, "run/checkpoints/step-0000002", "ddp")
    assert "step-0000002" in note and "outer momentum is left behind" in note
