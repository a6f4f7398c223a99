"""Typed run configuration: one dataclass per concern, presets, overrides, validation.

A run is described by a :class:`RunConfig` made of sections (``model``, ``data``,
``optim``, ``train``, ``eval``).  It is assembled in layers, each overriding the last:

1. the dataclass defaults,
2. a named preset shipped in ``flopwise/presets/NAME.yaml`` (``--preset``),
3. a user YAML file (``--config run.yaml``),
4. ``section.key=value`` overrides from the command line.

Unknown keys are errors with a did-you-mean; values are coerced to the field's type;
all problems are collected and reported together by :class:`ConfigError` before
anything is allocated.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """One or more configuration problems, each naming where it came from."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid configuration ({len(self.problems)} problem(s)):\n{lines}")


@dataclass
class ModelConfig:
    """A decoder-only Llama-family transformer."""

    arch: str = "llama"  # llama | qwen3 (qwen3 = llama + QK-norm); more families in later releases
    vocab_size: int = 8192
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2  # grouped-query attention: n_heads % n_kv_heads == 0
    head_dim: int | None = None  # default d_model // n_heads
    ffn_hidden: int = 384  # SwiGLU hidden width
    max_seq_len: int = 1024  # RoPE table length; train.seq_len must not exceed it
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    qk_norm: bool = False  # RMSNorm on per-head queries and keys (Qwen3)
    tie_embeddings: bool = True
    init_std: float = 0.02
    # Mixture of experts (0 experts = a dense SwiGLU MLP). Counted by the planner now;
    # the trainer's MoE layer comes with the model-zoo work.
    n_experts: int = 0
    moe_top_k: int = 0  # experts active per token
    moe_ffn_hidden: int = 0  # each expert's SwiGLU hidden width (0 = ffn_hidden)

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    @property
    def expert_ffn_hidden(self) -> int:
        return self.moe_ffn_hidden or self.ffn_hidden

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads


@dataclass
class DataConfig:
    # A directory written by ``flopwise prepare`` (tokenizer.json, meta.json, *.bin shards).
    # Empty: the embedded corpus (the Python standard library's source), prepared once
    # into ``cache_dir``.
    path: str = ""
    cache_dir: str = "~/.cache/flopwise"
    builtin_vocab_size: int = 8192  # BPE vocabulary trained for the embedded corpus
    builtin_max_mb: float = 0.0  # cap on the embedded corpus' source text (0 = all of it)
    # random: seeded random windows (fast start, sampled with replacement);
    # epoch: a shuffled pass over packed sequences, every token a target once per epoch.
    loader: str = "random"


@dataclass
class OptimConfig:
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 20
    schedule: str = "cosine"  # cosine | constant (after warmup)
    weight_decay: float = 0.1  # applied to 2-D weights only
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # global-norm clipping; 0 disables
    fused: str = "auto"  # auto (fused AdamW on CUDA) | true | false


@dataclass
class TrainConfig:
    run_dir: str = ""  # default: runs/<preset>-<timestamp>
    seq_len: int = 128
    micro_batch_size: int = 16
    global_batch_size: int = 32  # sequences per optimizer step (all micro-batches, all ranks)
    max_steps: int = 0  # 0 = no step limit (then max_tokens must be set)
    max_tokens: int = 0  # 0 = no token limit; with both set, the first reached ends the run
    seed: int = 1337
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    precision: str = "auto"  # auto (bf16 autocast on CUDA with bf16, else float32) | bf16 | float32
    log_every: int = 10
    save_every: int = 0  # 0 = save only at the end
    warmup_log_steps: int = 3  # first steps excluded from throughput averages
    peak_tflops: float = 0.0  # dense peak of one device for MFU; 0 = from the hardware table


@dataclass
class EvalConfig:
    every: int = 50  # validation every N steps (and at the end); 0 = only at the end
    batches: int = 8  # fixed held-out subset: batches x micro_batch_size windows
    sample_tokens: int = 120  # length of the text sample written at the end; 0 = none
    sample_prompt: str = "def "
    temperature: float = 0.8
    top_k: int = 50


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    preset: str = ""  # the preset this config started from, for naming and the record

    # Derived quantities used across the trainer and the planner.
    def grad_accum_steps(self, world_size: int = 1) -> int:
        return self.train.global_batch_size // (self.train.micro_batch_size * world_size)

    @property
    def tokens_per_step(self) -> int:
        return self.train.global_batch_size * self.train.seq_len

    def total_steps(self) -> int:
        """Optimizer steps planned: the first of max_steps and max_tokens to be reached."""
        limits = []
        if self.train.max_steps > 0:
            limits.append(self.train.max_steps)
        if self.train.max_tokens > 0:
            limits.append(-(-self.train.max_tokens // self.tokens_per_step))
        return min(limits) if limits else 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


SECTIONS = ("model", "data", "optim", "train", "eval")
DEFAULT_PRESET = "tiny"


# --------------------------------------------------------------------------- presets

def preset_names() -> list[str]:
    root = resources.files("flopwise") / "presets"
    return sorted(p.name[: -len(".yaml")] for p in root.iterdir() if p.name.endswith(".yaml"))


def load_preset(name: str) -> dict[str, Any]:
    names = preset_names()
    if name not in names:
        hint = _did_you_mean(name, names)
        raise ConfigError([f"unknown preset {name!r}{hint}; available: {', '.join(names)}"])
    text = (resources.files("flopwise") / "presets" / f"{name}.yaml").read_text()
    return yaml.safe_load(text) or {}


# --------------------------------------------------------------------------- building

def _did_you_mean(word: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Coerce ``value`` (from YAML or a command-line string) to the annotated type ``tp``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null", "")):
            return None
        return _coerce(value, args[0], where)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "yes", "on", "1"):
            return True
        if isinstance(value, str) and value.lower() in ("false", "no", "off", "0"):
            return False
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        raise ValueError(f"{where}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ValueError(f"{where}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                f = float(value.replace("_", ""))  # accepts 1e6 and 1_000_000
            except ValueError:
                pass
            else:
                if f.is_integer():
                    return int(f)
        raise ValueError(f"{where}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, bool):
            raise ValueError(f"{where}: expected a number, got {value!r}")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ValueError(f"{where}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, bool):  # YAML reads "true" as a bool; keep the word
            return "true" if value else "false"
        if isinstance(value, (dict, list)):
            raise ValueError(f"{where}: expected a string, got {value!r}")
        return "" if value is None else str(value)
    return value


def _apply_mapping(cfg: RunConfig, mapping: dict[str, Any], source: str, problems: list[str]) -> None:
    """Overlay a nested mapping ``{section: {key: value}}`` onto ``cfg``, collecting problems."""
    if not isinstance(mapping, dict):
        problems.append(f"{source}: expected a mapping of sections, got {type(mapping).__name__}")
        return
    for section, values in mapping.items():
        if section == "preset":
            cfg.preset = str(values)
            continue
        if section not in SECTIONS:
            problems.append(f"{source}: unknown section {section!r}{_did_you_mean(str(section), list(SECTIONS))}")
            continue
        if not isinstance(values, dict):
            problems.append(f"{source}: section {section!r} must be a mapping, got {values!r}")
            continue
        for key, value in values.items():
            _set(cfg, section, str(key), value, source, problems)


def _set(cfg: RunConfig, section: str, key: str, value: Any, source: str, problems: list[str]) -> None:
    obj = getattr(cfg, section)
    types_ = _field_types(type(obj))
    if key not in types_:
        hint = _did_you_mean(key, list(types_))
        problems.append(f"{source}: unknown key {section}.{key}{hint}")
        return
    try:
        setattr(obj, key, _coerce(value, types_[key], f"{source}: {section}.{key}"))
    except ValueError as e:
        problems.append(str(e))


def parse_override(text: str) -> tuple[str, str, Any]:
    """``"optim.lr=1e-3"`` -> ``("optim", "lr", 0.001)``; the value is read as YAML."""
    if "=" not in text:
        raise ConfigError([f"override {text!r}: expected section.key=value"])
    dotted, raw = text.split("=", 1)
    parts = dotted.strip().split(".")
    if len(parts) != 2 or not all(parts):
        raise ConfigError([f"override {text!r}: expected section.key=value (e.g. optim.lr=1e-3)"])
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return parts[0], parts[1], value


def build_config(
    preset: str | None = None,
    config_file: str | Path | None = None,
    overrides: list[str] | None = None,
) -> RunConfig:
    """Defaults <- preset <- YAML file <- overrides; then validate. Raises ConfigError."""
    cfg = RunConfig()
    problems: list[str] = []
    file_data: dict[str, Any] = {}
    if config_file is not None:
        path = Path(config_file)
        try:
            file_data = yaml.safe_load(path.read_text()) or {}
        except FileNotFoundError:
            raise ConfigError([f"config file {str(path)!r} does not exist"]) from None
        except yaml.YAMLError as e:
            raise ConfigError([f"config file {str(path)!r} is not valid YAML: {e}"]) from None
        if not isinstance(file_data, dict):
            raise ConfigError([f"config file {str(path)!r}: expected a mapping of sections"])

    name = preset or file_data.get("preset") or DEFAULT_PRESET
    _apply_mapping(cfg, load_preset(str(name)), f"preset {name}", problems)
    cfg.preset = str(name)
    if file_data:
        _apply_mapping(cfg, file_data, str(config_file), problems)
        cfg.preset = str(name)
    for text in overrides or []:
        try:
            section, key, value = parse_override(text)
        except ConfigError as e:
            problems.extend(e.problems)
            continue
        if section not in SECTIONS:
            problems.append(
                f"override {text!r}: unknown section {section!r}{_did_you_mean(section, list(SECTIONS))}"
            )
            continue
        _set(cfg, section, key, value, f"override {text!r}", problems)

    problems.extend(validate(cfg))
    if problems:
        raise ConfigError(problems)
    return cfg


def load_run_config(path: str | Path) -> RunConfig:
    """Read a resolved ``config.yaml`` (as written into a run directory) back."""
    data = yaml.safe_load(Path(path).read_text()) or {}
    cfg = RunConfig()
    problems: list[str] = []
    _apply_mapping(cfg, data, str(path), problems)
    problems.extend(validate(cfg))
    if problems:
        raise ConfigError(problems)
    return cfg


# --------------------------------------------------------------------------- validation

def validate(cfg: RunConfig) -> list[str]:
    """Every problem in the config, as readable strings naming the fields involved."""
    p: list[str] = []
    m, t, o, e, d = cfg.model, cfg.train, cfg.optim, cfg.eval, cfg.data

    def positive(section: str, name: str, value: float, allow_zero: bool = False) -> bool:
        ok = value >= 0 if allow_zero else value > 0
        if not ok:
            p.append(f"{section}.{name} must be {'>= 0' if allow_zero else '> 0'}, got {value}")
        return ok

    if m.arch not in ("llama", "qwen3"):
        p.append(f"model.arch {m.arch!r} is not supported; choose llama or qwen3")
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "max_seq_len"):
        positive("model", name, getattr(m, name))
    positive("model", "rope_theta", m.rope_theta)
    positive("model", "norm_eps", m.norm_eps)
    positive("model", "init_std", m.init_std)
    if m.n_heads > 0 and m.n_kv_heads > 0 and m.n_heads % m.n_kv_heads:
        p.append(f"model.n_heads ({m.n_heads}) must be divisible by model.n_kv_heads ({m.n_kv_heads})")
    if m.head_dim is None:
        if m.n_heads > 0 and m.d_model % m.n_heads:
            p.append(
                f"model.d_model ({m.d_model}) must be divisible by model.n_heads ({m.n_heads}) "
                "unless model.head_dim is set"
            )
    elif m.head_dim <= 0:
        p.append(f"model.head_dim must be > 0, got {m.head_dim}")
    if m.n_experts < 0 or m.moe_ffn_hidden < 0:
        p.append("model.n_experts and model.moe_ffn_hidden must be >= 0")
    elif m.n_experts > 0 and not 1 <= m.moe_top_k <= m.n_experts:
        p.append(f"model.moe_top_k must be in [1, model.n_experts={m.n_experts}], got {m.moe_top_k}")
    elif m.n_experts == 0 and m.moe_top_k:
        p.append(f"model.moe_top_k={m.moe_top_k} needs model.n_experts > 0")
    hd = m.resolved_head_dim if m.n_heads > 0 else 0
    if hd > 0 and hd % 2:
        p.append(f"head dimension {hd} must be even for rotary embeddings (model.head_dim / d_model / n_heads)")

    for name in ("seq_len", "micro_batch_size", "global_batch_size", "log_every"):
        positive("train", name, getattr(t, name))
    for name in ("max_steps", "max_tokens", "save_every", "warmup_log_steps", "seed"):
        positive("train", name, getattr(t, name), allow_zero=True)
    positive("train", "peak_tflops", t.peak_tflops, allow_zero=True)
    if t.seq_len > m.max_seq_len > 0:
        p.append(f"train.seq_len ({t.seq_len}) exceeds model.max_seq_len ({m.max_seq_len})")
    if t.micro_batch_size > 0 and t.global_batch_size % t.micro_batch_size:
        p.append(
            f"train.global_batch_size ({t.global_batch_size}) must be divisible by "
            f"train.micro_batch_size ({t.micro_batch_size})"
        )
    if t.max_steps <= 0 and t.max_tokens <= 0:
        p.append("set train.max_steps or train.max_tokens (both are 0)")
    if t.precision not in ("auto", "bf16", "float32"):
        p.append(f"train.precision {t.precision!r}: choose auto, bf16 or float32")
    if not (t.device in ("auto", "cpu", "cuda") or t.device.startswith("cuda:")):
        p.append(f"train.device {t.device!r}: choose auto, cpu, cuda or cuda:N")

    positive("optim", "lr", o.lr)
    if not 0 <= o.min_lr_ratio <= 1:
        p.append(f"optim.min_lr_ratio must be in [0, 1], got {o.min_lr_ratio}")
    positive("optim", "warmup_steps", o.warmup_steps, allow_zero=True)
    positive("optim", "weight_decay", o.weight_decay, allow_zero=True)
    positive("optim", "grad_clip", o.grad_clip, allow_zero=True)
    for name in ("beta1", "beta2"):
        if not 0 <= getattr(o, name) < 1:
            p.append(f"optim.{name} must be in [0, 1), got {getattr(o, name)}")
    positive("optim", "eps", o.eps)
    if o.schedule not in ("cosine", "constant"):
        p.append(f"optim.schedule {o.schedule!r}: choose cosine or constant")
    if o.fused not in ("auto", "true", "false"):
        p.append(f"optim.fused {o.fused!r}: choose auto, true or false")

    for name in ("every", "sample_tokens"):
        positive("eval", name, getattr(e, name), allow_zero=True)
    positive("eval", "batches", e.batches)
    positive("eval", "temperature", e.temperature, allow_zero=True)
    positive("eval", "top_k", e.top_k, allow_zero=True)

    if d.loader not in ("random", "epoch"):
        p.append(f"data.loader {d.loader!r}: choose random or epoch")
    positive("data", "builtin_vocab_size", d.builtin_vocab_size)
    positive("data", "builtin_max_mb", d.builtin_max_mb, allow_zero=True)
    if not d.path and d.builtin_vocab_size > m.vocab_size > 0:
        p.append(
            f"data.builtin_vocab_size ({d.builtin_vocab_size}) exceeds model.vocab_size "
            f"({m.vocab_size}): the embedding could not hold every token id"
        )
    return p
