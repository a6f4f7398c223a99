"""W&B online without an API key (issue 45, item 8): ``flopwise train`` refuses in one line that
names ``wandb login`` and ``tracking.wandb_mode=offline``, before the run directory exists.

The key is looked for where wandb looks (``WANDB_API_KEY``, then the netrc file -- ``$NETRC`` or
``~/.netrc`` -- for the host of ``WANDB_BASE_URL``), in a HOME the test makes. ``wandb`` itself is
optional: the command runs against the real package where it is installed, and otherwise against a
stand-in whose ``init`` fails as wandb's does without a key in a process with no terminal."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from flopwise.config import TrackingConfig
from flopwise.deps import available
from flopwise.measure.tracking import WandbLoginError, check_wandb_login, wandb_login_problem

# wandb.init(mode="online") in a process without a terminal and without a key (wandb 0.2x)
STAND_IN = '''
class UsageError(Exception):
    pass


def init(**kwargs):
    raise UsageError("api_key not configured (no-tty). call wandb.login(key=[your_api_key])")
'''


def _env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_") and k != "NETRC"}
    return {**env, "HOME": str(home), **extra}


def _online(mode: str = "online") -> TrackingConfig:
    return TrackingConfig(wandb=True, wandb_mode=mode)


def _netrc(home: Path, host: str, password: str = "k" * 40) -> Path:
    f = home / ".netrc"
    f.write_text(f"machine {host}\n  login user\n  password {password}\n")
    f.chmod(0o600)
    return f


def test_no_key_in_the_environment_or_netrc_is_a_problem(tmp_path):
    problem = wandb_login_problem(_online(), _env(tmp_path))
    assert "WANDB_API_KEY is unset" in problem and str(tmp_path / ".netrc") in problem
    assert "`wandb login`" in problem and "tracking.wandb_mode=offline" in problem and "\n" not in problem
    _netrc(tmp_path, "example.com")  # an entry for another host is not W&B's
    assert "has no entry for api.wandb.ai" in wandb_login_problem(_online(), _env(tmp_path))


def test_a_key_where_wandb_looks_is_enough(tmp_path):
    assert wandb_login_problem(_online(), _env(tmp_path, WANDB_API_KEY="k" * 40)) == ""
    _netrc(tmp_path, "api.wandb.ai")
    assert wandb_login_problem(_online(), _env(tmp_path)) == ""
    assert wandb_login_problem(_online(), _env(tmp_path / "none", WANDB_IDENTITY_TOKEN_FILE="/t")) == ""
    settings = tmp_path / "config"
    settings.mkdir()
    (settings / "settings").write_text("[default]\napi_key = " + "k" * 40 + "\n")
    assert wandb_login_problem(_online(), _env(tmp_path / "none", WANDB_CONFIG_DIR=str(settings))) == ""
    # a W&B server of one's own: the entry of its host
    assert "no entry for wandb.corp.example:8443" in wandb_login_problem(
        _online(), _env(tmp_path, WANDB_BASE_URL="https://wandb.corp.example:8443"))
    other = tmp_path / "elsewhere"
    other.mkdir()
    netrc = _netrc(other, "wandb.corp.example")
    assert wandb_login_problem(_online(), _env(tmp_path, WANDB_BASE_URL="https://wandb.corp.example:8443",
                                               NETRC=str(netrc))) == ""


def test_the_refusal_travels_to_every_rank_as_one_line(tmp_path, monkeypatch):
    """Rank 0 checks; DistEnv.on_main hands its exception to the other ranks pickled."""
    for name in [k for k in os.environ if k.startswith("WANDB_")] + ["NETRC"]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(WandbLoginError) as e:
        check_wandb_login(_online())
    again = pickle.loads(pickle.dumps(e.value))
    assert type(again) is WandbLoginError and str(again) == str(e.value) == again.problems[0]
    assert "\n" not in str(again) and "`wandb login`" in str(again)


def test_offline_or_no_wandb_needs_no_key(tmp_path):
    assert wandb_login_problem(_online("offline"), _env(tmp_path)) == ""
    assert wandb_login_problem(TrackingConfig(wandb=False), _env(tmp_path)) == ""


def test_an_unreadable_netrc_is_named(tmp_path):
    (tmp_path / ".netrc").write_text("api.wandb.ai user key\n")  # not netrc's machine/login/password
    problem = wandb_login_problem(_online(), _env(tmp_path))
    assert f"{tmp_path / '.netrc'} cannot be read (line 1: bad toplevel token" in problem
    assert "`wandb login`" in problem and "\n" not in problem


@pytest.mark.parametrize("wandb", ["stand-in", pytest.param("installed", marks=pytest.mark.skipif(
    not available("wandb"), reason="wandb is not installed (the stand-in case covers the refusal)"))])
def test_train_with_wandb_online_and_no_key_refuses_before_the_run_directory(wandb, tiny_overrides, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    env = _env(home)
    if wandb == "stand-in":
        site = tmp_path / "site"
        (site / "wandb").mkdir(parents=True)
        (site / "wandb" / "__init__.py").write_text(textwrap.dedent(STAND_IN))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH")) if p)
    run_dir = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "flopwise", "train", *tiny_overrides, "train.max_steps=2",
                           "tracking.wandb=true", "tracking.wandb_mode=online", "tracking.tensorboard=false"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    err = done.stderr.strip()
    assert done.returncode == 2, err[-3000:]
    assert "Traceback" not in err and len(err.splitlines()) == 1, err[-3000:]
    assert "`wandb login`" in err and "tracking.wandb_mode=offline" in err and "WANDB_API_KEY" in err
    assert not run_dir.exists()
