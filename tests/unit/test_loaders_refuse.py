"""Malformed files a user may have been sent are refused by the loaders themselves: a
:class:`~flopwise.errors.FlopwiseError` naming the file (and the key or value at fault), raised
before anything is allocated -- never a ``RecursionError``, ``UnicodeDecodeError``,
``ZeroDivisionError``, a validation traceback of another library or an allocator's failure.

Each case writes the file for real and calls the real loader (a few go through the command
line). Every file is tiny: the deepest is 100 KB of ``[``, the "too large" model is a
config.json whose sizes say so, never a tensor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import run_flopwise

from flopwise.config import ConfigError, ModelConfig, build_config, load_run_config, model_problems
from flopwise.errors import FlopwiseError
from flopwise.fsio import MAX_JSON_DEPTH, FileFormatError, loads_json, read_json

NESTED = "[" * 100_000  # json.loads: RecursionError, without the depth check
NESTED_CLOSED = "[" * 100_000 + "]" * 100_000

# A Llama config.json of a model of 1,680 parameters, as a user would be sent one.
TINY_HF = {"model_type": "llama", "vocab_size": 64, "hidden_size": 16, "num_hidden_layers": 1,
           "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 32,
           "max_position_embeddings": 16, "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True}


def one_line(e: BaseException) -> str:
    text = str(e)
    assert "\n" not in text, text
    return text


# --------------------------------------------------------------------------- the JSON reader

def test_read_json_bounds_nesting_before_parsing(tmp_path):
    f = tmp_path / "x.json"
    for text in (NESTED, NESTED_CLOSED, '{"a":' * 50_000):
        f.write_text(text)
        with pytest.raises(FileFormatError) as e:
            read_json(f)
        assert one_line(e.value) == f"{f}: not valid JSON: nested deeper than {MAX_JSON_DEPTH} levels"
    ok = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    assert loads_json(ok, "w") is not None
    with pytest.raises(FileFormatError, match="nested deeper"):
        loads_json("[" + ok + "]", "w")
    # brackets inside strings (escaped quotes too) are text, not nesting
    assert loads_json(json.dumps({"s": "[" * 1000 + '\\"' + "{" * 1000}), "w")["s"].startswith("[[")


def test_read_json_names_the_place_of_a_syntax_error_a_bad_byte_and_a_size(tmp_path):
    f = tmp_path / "x.json"
    f.write_text('{\n  "a": 1,\n  "b" 2\n}')
    with pytest.raises(FileFormatError) as e:
        read_json(f)
    assert one_line(e.value) == f"{f}: not valid JSON: line 3 column 7: Expecting ':' delimiter"
    f.write_bytes(b'{"a": "\xff"}')
    with pytest.raises(FileFormatError, match=r"x\.json: not UTF-8 text: byte 7 is 0xff"):
        read_json(f)
    f.write_bytes(b"[" + b"1," * 1000 + b"1]")
    with pytest.raises(FileFormatError, match=r"x\.json: 2,003 bytes or more, larger than the 1,000 bytes"):
        read_json(f, max_bytes=1000)
    f.write_text('{"n": ' + "9" * 5000 + "}")  # Python refuses to convert so many digits
    with pytest.raises(FileFormatError, match=r"x\.json: not valid JSON: Exceeds the limit"):
        read_json(f)
    f.write_bytes(b'\xef\xbb\xbf{"a": 1}')  # a byte-order mark is no error
    assert read_json(f) == {"a": 1}


# --------------------------------------------------------------------------- every loader of JSON a user sends

def _data_dir(tmp_path: Path) -> tuple[object, Path]:
    from flopwise.data.datadir import DataDir

    (tmp_path / "meta.json").write_text(NESTED)
    return lambda: DataDir(tmp_path), tmp_path / "meta.json"


def _task_file(tmp_path: Path):
    from flopwise.evaluate.tasks import load_task

    f = tmp_path / "mine.jsonl"
    f.write_text(json.dumps({"context": "a", "choices": [" x", " y"], "label": 0}) + "\n" + NESTED + "\n")
    return lambda: load_task("mine", path=f), f


def _hf_config(tmp_path: Path):
    from flopwise.model.hf import read_hf_config

    (tmp_path / "config.json").write_text(NESTED)
    return lambda: read_hf_config(str(tmp_path)), tmp_path / "config.json"


def _hf_dir(tmp_path: Path):  # flopwise eval / generate / export / flopwise.load
    from flopwise.model.io import resolve

    (tmp_path / "config.json").write_text(NESTED_CLOSED)
    return lambda: resolve(tmp_path), tmp_path / "config.json"


def _safetensors_index(tmp_path: Path):
    from flopwise.model.io import read_safetensors_dir

    (tmp_path / "model.safetensors.index.json").write_text(NESTED)
    return lambda: read_safetensors_dir(tmp_path), tmp_path / "model.safetensors.index.json"


def _state_json(tmp_path: Path):
    from flopwise.checkpoints import read_state

    (tmp_path / "state.json").write_text(NESTED)
    return lambda: read_state(tmp_path), tmp_path / "state.json"


def _manifest(tmp_path: Path):
    from flopwise.checkpoints import verify_checkpoint

    (tmp_path / "COMPLETE").write_text(NESTED)
    return lambda: verify_checkpoint(tmp_path), tmp_path / "COMPLETE"


def _run_metrics(tmp_path: Path):
    from flopwise.report.runs import load_run

    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "loss": 5.0}) + "\n" + NESTED + "\n"
                                            + json.dumps({"step": 1, "loss": 4.0}) + "\n")
    return lambda: load_run(tmp_path), tmp_path / "metrics.jsonl"


def _run_plan(tmp_path: Path):
    from flopwise.report.runs import load_run

    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "loss": 5.0}) + "\n")
    (tmp_path / "plan.json").write_text(NESTED)
    return lambda: load_run(tmp_path), tmp_path / "plan.json"


@pytest.mark.parametrize("make", [_data_dir, _task_file, _hf_config, _hf_dir, _safetensors_index, _state_json,
                                  _manifest, _run_metrics, _run_plan], ids=lambda f: f.__name__.strip("_"))
def test_deeply_nested_json_is_refused_by_every_loader_naming_the_file(tmp_path, make):
    load, file = make(tmp_path)
    with pytest.raises(FlopwiseError) as e:
        load()
    assert str(file) in one_line(e.value) and "nested deeper than 64 levels" in str(e.value)


# --------------------------------------------------------------------------- tokenizer.json

BAD_TOKENIZER = '{"model": {"type": "BPE", "vocab": 3}}'


def test_a_malformed_tokenizer_json_is_named_with_the_parsers_message(tmp_path):
    from flopwise.data.tokenizer import load_tokenizer

    f = tmp_path / "tokenizer.json"
    for text in (BAD_TOKENIZER, NESTED, "not json at all " * 100):
        f.write_text(text)
        with pytest.raises(FlopwiseError) as e:
            load_tokenizer(f)
        assert one_line(e.value).startswith(f"{f}: cannot load tokenizer: ") and len(str(e.value)) < 400
    f.write_text(BAD_TOKENIZER)
    with pytest.raises(FileFormatError, match="invalid type: integer `3`, expected a map at line 1 column 38"):
        load_tokenizer(f)


def test_flopwise_load_names_a_malformed_tokenizer_beside_a_good_model(tmp_path):
    from safetensors.torch import save_file

    import flopwise
    from flopwise.model.hf import read_hf_config, to_hf_state_dict
    from flopwise.model.transformer import build_model

    (tmp_path / "config.json").write_text(json.dumps(TINY_HF))
    sd = to_hf_state_dict(build_model(read_hf_config(str(tmp_path))))
    sd.pop("lm_head.weight")  # tied: the embedding
    save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp_path / "model.safetensors"))
    assert flopwise.load(tmp_path)[1] is None  # the model alone loads
    (tmp_path / "tokenizer.json").write_text(BAD_TOKENIZER)
    with pytest.raises(FlopwiseError, match=r"tokenizer\.json: cannot load tokenizer: invalid type"):
        flopwise.load(tmp_path)


# --------------------------------------------------------------------------- YAML configs

def test_a_config_yaml_that_is_not_utf8_names_the_file_and_the_byte(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_bytes(b"train:\n  seed: \xff\xfe\n")
    with pytest.raises(ConfigError) as e:
        build_config(config_file=f)
    assert e.value.problems == [f"config file {str(f)!r}: not UTF-8 text: byte 15 is 0xff (invalid start byte)"]
    with pytest.raises(ConfigError) as e:  # a run directory's config.yaml
        load_run_config(f)
    assert e.value.problems == [f"{f}: not UTF-8 text: byte 15 is 0xff (invalid start byte)"]


def test_a_yaml_syntax_error_is_a_config_error_of_one_line_with_its_place(tmp_path):
    f = tmp_path / "broken.yaml"
    f.write_text("train: [1, 2\n  seed: {")
    for load, label in ((lambda: build_config(config_file=f), f"config file {str(f)!r}"),
                        (lambda: load_run_config(f), str(f))):
        with pytest.raises(ConfigError) as e:
            load()
        assert e.value.problems == [f"{label}: not valid YAML: line 2 column 7: expected ',' or ']', but got ':' "
                                    "(while parsing a flow sequence)"]
    f.write_text("train: " + "[" * 1000 + "]" * 1000)  # PyYAML composes recursively
    with pytest.raises(ConfigError, match="broken.yaml': not valid YAML: nested too deeply to read"):
        build_config(config_file=f)


def test_train_with_a_config_that_is_not_utf8_is_one_clear_error_through_the_real_cli(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_bytes(b"train:\n  seed: \xff\xfe\n")
    run = run_flopwise(["train", "--config", str(f)], cwd=tmp_path, timeout=120)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    first, *rest = run.stderr.splitlines()
    assert first.startswith("flopwise train: ") and all(line.startswith("  - ") for line in rest), run.stderr
    assert f"{f}': not UTF-8 text: byte 15" in run.stderr


# --------------------------------------------------------------------------- impossible model configs

def _hf(tmp_path: Path, name: str = "hf", **changes) -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**TINY_HF, **changes}))
    return d


IMPOSSIBLE = {  # config.json changes -> what the one line must say
    "zero heads": (dict(num_attention_heads=0), "num_attention_heads must be > 0, got 0"),
    "width a string": (dict(hidden_size="64"), "hidden_size: expected an integer, got '64'"),
    "layers a bool": (dict(num_hidden_layers=True), "num_hidden_layers: expected an integer, got True"),
    "ffn a float": (dict(intermediate_size=32.0), "intermediate_size: expected an integer, got 32.0"),
    "vocab null": (dict(vocab_size=None), "vocab_size: expected an integer, got None"),
    "negative eps": (dict(rms_norm_eps=-1e-5), "rms_norm_eps must be > 0, got -1e-05"),
    "rope_theta NaN": (dict(rope_theta=float("nan")), "rope_theta must be a finite number, got nan"),
    "rope_theta NaN in rope_parameters": (dict(rope_parameters={"rope_type": "default", "rope_theta": float("nan")}),
                                          "rope_theta must be a finite number, got nan"),
    "kv heads not dividing": (dict(num_attention_heads=4, num_key_value_heads=3),
                              "num_attention_heads (4) must be divisible by num_key_value_heads (3)"),
    "256 TB of weights": (dict(hidden_size=2**22, intermediate_size=2**24, num_hidden_layers=4096),
                          "the model would hold 1.08e+18 parameters"),
    "a rotary table of 2^50 positions": (dict(max_position_embeddings=2**50), "rotary-table entries"),
}


@pytest.mark.parametrize("name", IMPOSSIBLE)
def test_an_impossible_hf_config_is_refused_naming_the_file_and_key(tmp_path, name):
    from flopwise.model.hf import HFMappingError, read_hf_config
    from flopwise.model.io import resolve

    changes, says = IMPOSSIBLE[name]
    d = _hf(tmp_path, **changes)
    for load in (lambda: read_hf_config(str(d)), lambda: resolve(d)):  # model.hf_config=; eval/generate/export/load
        with pytest.raises(HFMappingError) as e:
            load()
        assert one_line(e.value).startswith(f"{d / 'config.json'}: ") and says in str(e.value)


def test_train_with_an_impossible_hf_config_is_a_config_error_naming_it(tmp_path):
    from flopwise.model.hf import read_hf_config

    d = _hf(tmp_path, num_attention_heads=0)
    with pytest.raises(ConfigError) as e:
        build_config(overrides=[f"model.hf_config={d}"], read_hf_config=read_hf_config)
    assert e.value.problems == [f"model.hf_config {str(d)!r}: {d / 'config.json'}: num_attention_heads must be > 0, "
                                "got 0"]


def test_eval_of_an_hf_directory_with_zero_heads_is_one_line_from_the_cli(tmp_path, capsys):
    from flopwise.cli import main

    d = _hf(tmp_path, num_attention_heads=0)
    for command in (["eval", str(d)], ["generate", str(d), "--max-tokens", "2"], ["export", str(d), str(tmp_path / "o")]):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert err == f"flopwise {command[0]}: {d / 'config.json'}: num_attention_heads must be > 0, got 0\n"
    assert not (tmp_path / "o").exists()


def test_a_run_whose_config_yaml_describes_an_absurd_model_is_refused_before_building(tmp_path):
    from flopwise.model.io import ModelSourceError, resolve

    cfg = build_config(overrides=["model.d_model=4194304", "model.ffn_hidden=16777216", "model.n_layers=4096",
                                  "model.n_heads=4", "model.n_kv_heads=4"])
    ckpt = tmp_path / "checkpoints" / "step-0000001"
    ckpt.mkdir(parents=True)
    (ckpt / "model.pt").write_bytes(b"")  # never opened
    (ckpt / "config.yaml").write_text(cfg.to_yaml())
    with pytest.raises(ModelSourceError) as e:
        resolve(ckpt)
    assert one_line(e.value).startswith(f"{ckpt / 'config.yaml'}: the model would hold ")
    assert "parameters" in str(e.value) and "more than the 2e+12 flopwise builds" in str(e.value)


def test_one_model_validation_types_and_values_without_a_type_error():
    """ModelConfig.problems() (what validate() runs for a run) checks types first, so a value
    mapped from another format is named rather than crashing the arithmetic after it."""
    assert ModelConfig(d_model="64", n_heads=0).problems() == ["model.d_model: expected an integer, got '64'",
                                                               "model.n_heads must be > 0, got 0"]
    assert model_problems(ModelConfig(rope_theta=float("nan"))) == ["model.rope_theta must be a finite number, got nan"]
    assert ModelConfig(rope_theta=float("nan")).problems() == []  # validate() names it, once
    assert model_problems(ModelConfig()) == []


@pytest.mark.parametrize("name", ["../elsewhere/x.safetensors", "/tmp/x.safetensors", "link.safetensors"])
def test_an_index_naming_a_shard_outside_its_directory_is_refused(tmp_path, name):
    """A Hugging Face directory's index may name '../elsewhere/x.safetensors' (or a link that
    leads out): flopwise reads a directory it was given only inside itself."""
    import torch
    from safetensors.torch import save_file

    from flopwise.model.io import ModelSourceError, read_safetensors_dir

    (tmp_path / "elsewhere").mkdir()
    save_file({"w": torch.zeros(2)}, str(tmp_path / "elsewhere" / "x.safetensors"))
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "link.safetensors").symlink_to(tmp_path / "elsewhere" / "x.safetensors")
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": name}}))
    with pytest.raises(ModelSourceError, match="names a file outside"):
        read_safetensors_dir(hf)
    save_file({"w": torch.ones(2)}, str(hf / "inside.safetensors"))
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "inside.safetensors"}}))
    assert read_safetensors_dir(hf)["w"].sum() == 2
