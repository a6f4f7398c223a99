"""Config: presets, layering, coercion, unknown keys, validation errors reported together."""

import dataclasses
import typing

import pytest
import yaml

from flopwise.config import (
    SECTIONS,
    ConfigError,
    DataConfig,
    RunConfig,
    build_config,
    load_run_config,
    parse_override,
    preset_names,
    validate,
)


def test_every_issue_preset_is_shipped():
    assert {"tiny", "smollm-135m", "smollm-360m", "llama3.2-1b", "qwen3-1.8b"} <= set(preset_names())


def test_default_is_tiny_and_runs_a_bounded_number_of_steps():
    cfg = build_config()
    assert cfg.preset == "tiny"
    assert cfg.total_steps() == cfg.train.max_steps > 0


def test_overrides_are_coerced_to_field_types():
    cfg = build_config(overrides=[
        "model.n_layers=3", "optim.lr=1e-3", "train.max_tokens=1e6", "model.qk_norm=true",
        "model.head_dim=32", "optim.fused=false", "data.path=/some/dir", "train.max_steps=2_000",
    ])
    assert cfg.model.n_layers == 3 and isinstance(cfg.model.n_layers, int)
    assert cfg.optim.lr == pytest.approx(1e-3) and isinstance(cfg.optim.lr, float)
    assert cfg.train.max_tokens == 1_000_000 and isinstance(cfg.train.max_tokens, int)
    assert cfg.model.qk_norm is True
    assert cfg.model.head_dim == 32
    assert cfg.optim.fused == "false"
    assert cfg.data.path == "/some/dir"
    assert cfg.train.max_steps == 2000


def test_optional_field_accepts_none():
    cfg = build_config(overrides=["model.head_dim=32", ])
    assert cfg.model.head_dim == 32
    cfg = build_config(overrides=["model.head_dim=null"])
    assert cfg.model.head_dim is None


def test_layering_preset_then_file_then_overrides(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text(yaml.safe_dump({"model": {"n_layers": 6, "d_model": 256}, "optim": {"lr": 5e-4}}))
    cfg = build_config(preset="tiny", config_file=f, overrides=["model.n_layers=4", "optim.lr=1e-3"])
    assert cfg.model.d_model == 256  # from the file
    assert cfg.model.n_layers == 4  # override beats file
    assert cfg.optim.lr == pytest.approx(1e-3)
    assert cfg.model.vocab_size == 8192  # from the preset


def test_config_file_can_name_its_preset(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("preset: smollm-135m\ntrain:\n  micro_batch_size: 4\n")
    cfg = build_config(config_file=f)
    assert cfg.preset == "smollm-135m" and cfg.model.d_model == 576 and cfg.train.micro_batch_size == 4


def test_unknown_keys_get_did_you_mean():
    with pytest.raises(ConfigError) as err:
        build_config(overrides=["model.n_layer=3", "optimm.lr=1", "train.micro_batch=4"])
    text = str(err.value)
    assert "unknown key model.n_layer (did you mean 'n_layers'?)" in text
    assert "unknown section 'optimm' (did you mean 'optim'?)" in text
    assert "did you mean 'micro_batch_size'?" in text
    assert len(err.value.problems) == 3


def test_unknown_key_in_file_names_the_file(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("model:\n  d_modle: 64\n")
    with pytest.raises(ConfigError) as err:
        build_config(config_file=f)
    assert str(f) in str(err.value) and "d_modle" in str(err.value) and "d_model" in str(err.value)


def test_all_validation_errors_are_reported_together():
    with pytest.raises(ConfigError) as err:
        build_config(overrides=[
            "train.global_batch_size=30", "train.micro_batch_size=8",   # not divisible
            "train.seq_len=4096",                                      # > max_seq_len 512
            "model.n_heads=4", "model.n_kv_heads=3",                   # GQA groups
            "optim.lr=abc",                                            # bad type
        ])
    problems = err.value.problems
    joined = "\n".join(problems)
    assert "global_batch_size (30) must be divisible by train.micro_batch_size (8)" in joined
    assert "train.seq_len (4096) exceeds model.max_seq_len (512)" in joined
    assert "model.n_heads (4) must be divisible by model.n_kv_heads (3)" in joined
    assert "optim.lr: expected a number, got 'abc'" in joined
    assert len(problems) == 4


def test_bad_values_named():
    with pytest.raises(ConfigError) as err:
        build_config(overrides=["train.max_steps=0", "train.max_tokens=0", "model.qk_norm=maybe",
                                "train.precision=fp8", "model.arch=gpt5"])
    joined = "\n".join(err.value.problems)
    assert "set train.max_steps, train.max_tokens or train.max_hours (all are 0)" in joined
    assert "model.qk_norm: expected true/false, got 'maybe'" in joined
    assert "train.precision 'fp8'" in joined
    assert "model.arch 'gpt5'" in joined


def test_malformed_override_and_unknown_preset():
    with pytest.raises(ConfigError, match="expected section.key=value"):
        parse_override("lr=1e-3")
    with pytest.raises(ConfigError, match="unknown preset 'smollm-36m' \\(did you mean 'smollm-360m'\\?\\)"):
        build_config(preset="smollm-36m")
    with pytest.raises(ConfigError, match="does not exist"):
        build_config(config_file="/nonexistent/run.yaml")


def test_total_steps_first_limit_wins():
    cfg = build_config(overrides=["train.max_steps=100", "train.max_tokens=40960"])  # 4096 tokens/step
    assert cfg.tokens_per_step == 32 * 128
    assert cfg.total_steps() == 10
    cfg = build_config(overrides=["train.max_steps=0", "train.max_tokens=40961"])
    assert cfg.total_steps() == 11  # rounds up: the token budget is met, not cut short


def test_resolved_config_round_trips(tmp_path):
    cfg = build_config(preset="qwen3-1.8b", overrides=["train.micro_batch_size=2"])
    path = tmp_path / "config.yaml"
    path.write_text(cfg.to_yaml())
    again = load_run_config(path)
    assert again == cfg


def test_configs_of_earlier_versions_still_load(tmp_path):
    old = tmp_path / "config.yaml"
    old.write_text("model:\n  d_model: 128\ntrain:\n  save_every: 250\n  max_steps: 1000\n")
    assert load_run_config(old).train.checkpoint_every == 250


def problems_of(overrides: list[str]) -> list[str]:
    with pytest.raises(ConfigError) as err:
        build_config(overrides=overrides)
    return err.value.problems


def _float_fields() -> list[str]:
    cfg = RunConfig()
    return [f"{s}.{f.name}" for s in SECTIONS for f in dataclasses.fields(getattr(cfg, s))
            if typing.get_type_hints(type(getattr(cfg, s)))[f.name] is float]


def test_every_float_field_refuses_inf_and_nan_by_name_with_the_other_errors():
    fields = _float_fields()
    assert "optim.lr" in fields and "model.rope_theta" in fields and "parallel.timeout_min" in fields
    values = ["inf", "-inf", "nan", ".inf", "1e999", "-.inf"]  # words, YAML's spellings, an overflow
    overrides = [f"{name}={values[i % len(values)]}" for i, name in enumerate(fields)]
    with pytest.raises(ConfigError) as err:
        build_config(overrides=overrides + ["train.seq_len=4096"])
    problems = err.value.problems
    assert len(problems) == len(fields) + 1 and "train.seq_len (4096) exceeds model.max_seq_len" in problems[-1]
    for name, text, problem in zip(fields, overrides, problems):
        assert f"override {text!r}: {name}: expected a finite number, got " in problem
    assert problems_of(["optim.lr=inf"]) == ["override 'optim.lr=inf': optim.lr: expected a finite number, got 'inf'"]


def test_inf_and_nan_in_a_yaml_file_are_refused_naming_the_file(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("optim:\n  lr: .inf\n  eps: .nan\nmodel:\n  rope_theta: -.inf\ntrain:\n  max_hours: 1.0e+999\n")
    with pytest.raises(ConfigError) as err:
        build_config(config_file=f)
    joined = "\n".join(err.value.problems)
    assert len(err.value.problems) == 4
    assert f"{f}: optim.lr: expected a finite number, got inf" in joined
    assert f"{f}: optim.eps: expected a finite number, got nan" in joined
    assert f"{f}: model.rope_theta: expected a finite number, got -inf" in joined
    assert f"{f}: train.max_hours: expected a finite number, got inf" in joined


def test_inf_set_in_python_is_refused_once_by_validate():
    cfg = build_config()
    cfg.optim.lr, cfg.eval.temperature = float("inf"), float("nan")
    problems = validate(cfg)
    assert problems == ["optim.lr must be a finite number, got inf",
                        "eval.temperature must be a finite number, got nan"]


def test_nonfinite_bounds_and_collapse_steps_are_validated():
    problems = problems_of(["train.nonfinite_max_skips=0", "train.nonfinite_max_rollbacks=-1",
                                     "train.nonfinite_max_rollbacks_per_checkpoint=0", "train.collapse_steps=-2"])
    assert problems == ["train.collapse_steps must be >= 0, got -2", "train.nonfinite_max_skips must be > 0, got 0",
                        "train.nonfinite_max_rollbacks must be > 0, got -1",
                        "train.nonfinite_max_rollbacks_per_checkpoint must be > 0, got 0"]
    t = build_config(overrides=["train.collapse_steps=0"]).train  # 0 = the collapse check off
    assert (t.nonfinite_max_skips, t.nonfinite_max_rollbacks, t.nonfinite_max_rollbacks_per_checkpoint) == (20, 5, 2)


def test_the_epoch_loader_is_the_default_and_a_run_written_with_random_keeps_it(tmp_path):
    assert RunConfig().data.loader == "epoch" and build_config().data.loader == "epoch"
    old = tmp_path / "config.yaml"  # what an older run directory holds: every field, written out
    old.write_text(build_config(overrides=["data.loader=random"]).to_yaml())
    assert load_run_config(old).data.loader == "random"


# --------------------------------------------------------------------------- choices, sections, renames

def test_a_choice_outside_its_literal_is_refused_where_it_is_read(tmp_path):
    problems = problems_of(["train.compile=fast", "parallel.strategy=fsdp", "train.precision=BF16"])
    assert problems == [
        "override 'train.compile=fast': train.compile 'fast': choose auto, off, model, blocks",
        "override 'parallel.strategy=fsdp': parallel.strategy 'fsdp' (did you mean 'fsdp2'?): "
        "choose auto, single, ddp, zero1, fsdp2, hsdp, diloco",
        "override 'train.precision=BF16': train.precision 'BF16' (did you mean 'bf16'?): "
        "choose auto, bf16, bf16-pure, fp16, float32",
    ]
    f = tmp_path / "run.yaml"
    f.write_text("train:\n  activation_checkpointing: selctive\n")
    with pytest.raises(ConfigError) as err:
        build_config(config_file=f)
    assert err.value.problems == [f"{f}: train.activation_checkpointing 'selctive' (did you mean 'selective'?): "
                                  "choose none, full, selective, selective_op"]


def test_yaml_booleans_become_the_choices_words(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("train:\n  compile: off\noptim:\n  fused: no\ntracking:\n  tensorboard: yes\n")
    cfg = build_config(config_file=f, overrides=["train.compile=off"])
    assert (cfg.train.compile, cfg.optim.fused, cfg.tracking.tensorboard) == ("off", "false", "true")


def test_validation_changes_nothing_and_catches_choices_set_in_python():
    cfg = build_config()
    before = cfg.to_dict()
    cfg.train.compile = "false"  # loading would have read it as off; set in Python it is only refused
    problems = validate(cfg)
    assert problems == ["train.compile 'false': choose auto, off, model, blocks"]
    assert cfg.train.compile == "false"
    assert {**before, "train": {**before["train"], "compile": "false"}} == cfg.to_dict()


def test_each_section_checks_itself():
    from flopwise.config import ModelConfig, OptimConfig, TrainConfig

    assert ModelConfig().problems() == [] and OptimConfig().problems() == []
    assert ModelConfig(n_heads=4, n_kv_heads=3).problems() == ["model.n_heads (4) must be divisible by "
                                                                "model.n_kv_heads (3)"]
    assert TrainConfig(max_steps=10, activation_checkpointing_every=0).problems() == [
        "train.activation_checkpointing_every must be > 0, got 0"]
    assert TrainConfig().problems() == ["set train.max_steps, train.max_tokens or train.max_hours (all are 0): a run "
                                        "needs a length or a time budget"]


def test_renamed_keys_load_with_a_note_once(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("train:\n  checkpoint_every_k: 3\n  save_every: 100\n")
    cfg = build_config(config_file=f, overrides=["train.checkpoint_every_k=4"])
    assert cfg.train.activation_checkpointing_every == 4 and cfg.train.checkpoint_every == 100
    assert cfg.notes == ["train.checkpoint_every_k is now train.activation_checkpointing_every",
                         "train.save_every is now train.checkpoint_every"]
    assert "notes" not in cfg.to_dict() and "checkpoint_every_k" not in cfg.to_yaml()
    assert build_config().notes == [] and cfg == build_config(overrides=[
        "train.activation_checkpointing_every=4", "train.checkpoint_every=100"])
    old = tmp_path / "config.yaml"
    data = build_config().to_dict()
    data["train"]["checkpoint_every_k"] = data["train"].pop("activation_checkpointing_every")
    old.write_text(yaml.safe_dump(data))
    assert load_run_config(old).notes == ["train.checkpoint_every_k is now train.activation_checkpointing_every"]


def test_hf_config_is_read_by_the_reader_the_caller_gives(tmp_path):
    from flopwise.config import ModelConfig

    def reader(path):
        if path == "bad":
            raise ValueError("bad is not valid JSON")
        return ModelConfig(arch="qwen3", d_model=96, n_heads=4, n_kv_heads=4, qk_norm=True, max_seq_len=2048)

    cfg = build_config(overrides=["model.hf_config=pub", "train.seq_len=2048", "model.attention=eager"],
                       read_hf_config=reader)
    m = cfg.model
    assert (m.arch, m.d_model, m.qk_norm, m.max_seq_len, m.attention) == ("qwen3", 96, True, 2048, "eager")
    assert problems_of(["model.hf_config=pub"]) == [
        "model.hf_config 'pub': this configuration was built without a Hugging Face config reader "
        "(pass read_hf_config=flopwise.model.hf.read_hf_config to build_config)"]
    with pytest.raises(ConfigError, match="model.hf_config 'bad': bad is not valid JSON"):
        build_config(overrides=["model.hf_config=bad"], read_hf_config=reader)


def test_config_is_the_lowest_layer():
    import subprocess
    import sys

    code = ("import sys, flopwise.config; "
            "assert not [m for m in sys.modules if m.startswith(('flopwise.model', 'flopwise.plan', 'torch'))]")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_quoted_boolean_word_is_the_choices_word_too(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("train:\n  compile: 'false'\ntracking:\n  tensorboard: 'off'\n")
    cfg = build_config(config_file=f)
    assert (cfg.train.compile, cfg.tracking.tensorboard) == ("off", "false")


@pytest.mark.parametrize("value", ["-1", "9"])
def test_config_refuses_prefetch_out_of_range(value):
    with pytest.raises(ConfigError) as err:
        build_config(overrides=[f"data.prefetch={value}"])
    assert err.value.problems == [f"data.prefetch must be in [0, 8], got {value}"]
    assert DataConfig(prefetch=int(value)).problems() == [f"data.prefetch must be in [0, 8], got {value}"]


def test_config_prefetch_and_pin_memory_defaults_and_bounds():
    assert (DataConfig().prefetch, DataConfig().pin_memory) == (0, True)
    for value in (0, 8):
        assert DataConfig(prefetch=value).problems() == []
    cfg = build_config(overrides=["data.prefetch=8", "data.pin_memory=false"])
    assert cfg.data.prefetch == 8 and cfg.data.pin_memory is False


def test_an_integer_beyond_64_bits_is_named_before_it_overflows_in_c():
    """train.seed=10**23 ended in "Overflow when unpacking long long" from torch.manual_seed."""
    with pytest.raises(ConfigError) as e:
        build_config(preset="tiny", overrides=["train.seed=99999999999999999999999"])
    assert "train.seed must be within ±(2^63 - 1), got 99999999999999999999999" in str(e.value)
    assert build_config(preset="tiny", overrides=[f"train.seed={2**63 - 1}"]).train.seed == 2**63 - 1


def test_a_yaml_alias_bomb_is_refused_at_once_and_an_error_shows_a_bounded_value(tmp_path):
    """A 497-byte config of nested aliases ran past 60 s and printed 312 MB of error text."""
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 11)]
    for where, value in (("train", "seed: *a10"), ("nowhere", "x: *a10")):
        path = tmp_path / f"{where}.yaml"
        path.write_text("\n".join(lines) + f"\n{where}:\n  {value}\n")
        with pytest.raises(ConfigError) as e:
            build_config(config_file=path)
        assert "aliases expand to more than 100,000 values" in str(e.value) and len(str(e.value)) < 400
    few = tmp_path / "few.yaml"  # aliases that expand to little are fine
    few.write_text("base: &b 3\ntrain:\n  seed: *b\n")
    with pytest.raises(ConfigError) as e:  # 'base' is no section: the message shows it, bounded
        build_config(config_file=few)
    assert "base" in str(e.value)
    from flopwise.errors import shown

    assert len(shown([[i] * 1000 for i in range(1000)])) <= 200 and len(shown("x" * 10**7)) < 260


def test_a_path_component_past_the_filesystem_limit_is_named_before_any_work(tmp_path):
    """train.run_dir with a 300-byte name ended in a raw 'File name too long' traceback."""
    long = "r" * 300
    with pytest.raises(ConfigError) as e:
        build_config(preset="tiny", overrides=[f"train.run_dir={tmp_path / long}"])
    assert "train.run_dir: the path component" in str(e.value) and "300 bytes" in str(e.value)
    with pytest.raises(OSError):  # what the filesystem itself says of it
        (tmp_path / long).mkdir()
    assert build_config(preset="tiny", overrides=[f"train.run_dir={tmp_path / ('r' * 255)}"])
