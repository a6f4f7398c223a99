"""Issue 54 (the fourth list), item 11: a RUN/tensorboard that is a file or a dangling link gave
a raw traceback (TensorBoard's makedirs), even under the default tracking.tensorboard=auto.
Under auto the run goes on without TensorBoard and says so once; under true it stops in one
line before any step. Real files and real links, through the real `flopwise train`."""

from __future__ import annotations

import importlib.util

import pytest

# TensorBoard's sink is what meets the file (pip install 'flopwise[track]')
needs_tensorboard = pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None,
                                       reason="tensorboard is not installed: its sink is what meets the file")


def _run_dir(tiny_overrides) -> str:
    return next(o for o in tiny_overrides if o.startswith("train.run_dir=")).split("=", 1)[1]


@needs_tensorboard
@pytest.mark.parametrize("what", ["file", "dangling link"])
def test_auto_goes_on_without_tensorboard_and_says_why(cli, tiny_overrides, tmp_path, what):
    from pathlib import Path

    run = Path(_run_dir(tiny_overrides))
    run.mkdir(parents=True)
    if what == "file":
        (run / "tensorboard").write_text("mine\n")
    else:
        (run / "tensorboard").symlink_to(tmp_path / "nowhere")
    proc = cli("train", *tiny_overrides, "train.max_steps=2", "eval.every=0")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "FileExistsError" not in proc.stderr
    note = [line for line in proc.stdout.splitlines() if "TensorBoard off:" in line]
    assert len(note) == 1, proc.stdout
    assert ("is a file, not a directory" if what == "file" else "which does not exist") in note[0]
    assert (run / "metrics.jsonl").read_text().count('"step"') >= 2
    if what == "file":
        assert (run / "tensorboard").read_text() == "mine\n"  # left as it was
    else:
        assert (run / "tensorboard").is_symlink()


@needs_tensorboard
def test_true_stops_in_one_line_before_any_step(cli, tiny_overrides):
    from pathlib import Path

    run = Path(_run_dir(tiny_overrides))
    run.mkdir(parents=True)
    (run / "tensorboard").write_text("mine\n")
    proc = cli("train", *tiny_overrides, "train.max_steps=2", "tracking.tensorboard=true")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "tracking.tensorboard=true:" in proc.stderr and "is a file, not a directory" in proc.stderr
    assert not (run / "checkpoints").exists() and (run / "tensorboard").read_text() == "mine\n"


# ---------------------------------------------------------------- item 12: a W&B server that cannot be reached
def _closed_port() -> int:
    """A local port nothing listens on: bound, then closed (a connect is refused at once)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_server_is_named_before_any_wait(tmp_path):
    from flopwise.config import TrackingConfig
    from flopwise.measure.tracking import wandb_server_problem

    online = TrackingConfig(wandb=True, wandb_mode="online")
    url = f"http://127.0.0.1:{_closed_port()}"
    problem = wandb_server_problem(online, {"WANDB_BASE_URL": url, "WANDB_API_KEY": "k" * 40})
    assert f"the W&B server {url} cannot be reached" in problem and "tracking.wandb_mode=offline" in problem
    assert wandb_server_problem(TrackingConfig(wandb=True, wandb_mode="offline"), {"WANDB_BASE_URL": url}) == ""
    # one that answers is not a problem: a real listening socket
    import socket

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        up = f"http://127.0.0.1:{server.getsockname()[1]}"
        assert wandb_server_problem(online, {"WANDB_BASE_URL": up}) == ""


def test_the_check_goes_where_wandb_would_through_a_proxy():
    """Behind a proxy, wandb's HTTP client reaches its server through the proxy, not directly: the
    check connects to the proxy (a real listening socket), and names it when that is down."""
    import socket

    from flopwise.config import TrackingConfig
    from flopwise.measure.tracking import wandb_server_problem

    online = TrackingConfig(wandb=True, wandb_mode="online")
    url = f"http://127.0.0.1:{_closed_port()}"  # not reachable directly
    with socket.socket() as proxy:
        proxy.bind(("127.0.0.1", 0))
        proxy.listen()
        up = f"http://127.0.0.1:{proxy.getsockname()[1]}"
        assert wandb_server_problem(online, {"WANDB_BASE_URL": url, "HTTP_PROXY": up}) == ""
        # NO_PROXY naming the host: the server is reached directly, and it is down
        direct = wandb_server_problem(online, {"WANDB_BASE_URL": url, "HTTP_PROXY": up, "NO_PROXY": "127.0.0.1"})
        assert "cannot be reached (" in direct and "proxy" not in direct
    down = f"http://127.0.0.1:{_closed_port()}"
    problem = wandb_server_problem(online, {"WANDB_BASE_URL": url, "http_proxy": down})
    assert f"cannot be reached through the proxy {down}" in problem, problem
    assert "FLOPWISE_WANDB_CONNECT_TIMEOUT='soon': not a number" in wandb_server_problem(
        online, {"WANDB_BASE_URL": url, "FLOPWISE_WANDB_CONNECT_TIMEOUT": "soon"})


def test_train_refuses_in_one_line_before_the_run_directory(cli_env, tiny_overrides, tmp_path):
    """With a key but no reachable server, wandb's init waited ~113 s and raised CommError, leaving
    a run directory with no checkpoint. A stand-in `wandb` package here records whether its init
    was called: it must not be -- the refusal comes first."""
    from pathlib import Path

    stub = tmp_path / "stub" / "wandb"
    stub.mkdir(parents=True)
    called = tmp_path / "init-called"
    (stub / "__init__.py").write_text(f"def init(**kw):\n    open({str(called)!r}, 'w').write('yes')\n"
                                      "    raise RuntimeError('stand-in')\n")
    env = {"PYTHONPATH": str(stub.parent), "WANDB_API_KEY": "k" * 40,
           "WANDB_BASE_URL": f"http://127.0.0.1:{_closed_port()}"}
    proc = cli_env(env, "train", *tiny_overrides, "train.max_steps=2", "tracking.wandb=true",
                   "tracking.wandb_mode=online", "tracking.tensorboard=false")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "cannot be reached" in proc.stderr, proc.stderr
    assert len([line for line in proc.stderr.splitlines() if line.strip()]) == 1, proc.stderr
    assert not called.exists()
    run = Path(next(o for o in tiny_overrides if o.startswith("train.run_dir=")).split("=", 1)[1])
    assert not run.exists()


@pytest.fixture
def cli_env():
    """``python -m flopwise`` in a new interpreter (not the tests' forkserver: its sys.path is set
    already), with ``env`` over this one's; PYTHONPATH put first."""
    import os
    import subprocess
    import sys

    def run(env, *args):
        merged = {**os.environ, "PYTHONUNBUFFERED": "1", **env}
        merged["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), os.environ.get("PYTHONPATH")) if p)
        return subprocess.run([sys.executable, "-m", "flopwise", *args], env=merged, capture_output=True, text=True,
                              timeout=600)
    return run
