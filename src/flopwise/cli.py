"""The ``flopwise`` command: one entry point, a subcommand per stage. Thin: parse, call, print.

Each subcommand imports the modules that need torch (or numpy) inside itself, marked
``# lazy:``, so that ``flopwise --help`` and ``flopwise plan`` never import torch."""

from __future__ import annotations

import argparse
import dataclasses
import errno
import json
import math
import os
import re
import sys
from typing import Any

from flopwise import __version__, deps
from flopwise.config import (
    DEFAULT_PRESET,
    Compile,
    ConfigError,
    ParallelConfig,
    TrainConfig,
    build_config,
    preset_names,
)
from flopwise.errors import FlopwiseError, is_out_of_memory
from flopwise.fsio import is_disk_full, write_json
from flopwise.plan import hardware, steptime
from flopwise.plan.budget import (
    NOMINAL_MFU,
    PlanError,
    PlanInputs,
    build_plan,
    peak_dtype,
    plan_inputs_for_run,
    planned_loss,
)
from flopwise.plan.flops import param_counts
from flopwise.plan.memory import MemorySettings, current_name
from flopwise.plan.render import format_gpu_table, format_plan
from flopwise.report import ReportError, build_report
from flopwise.train.defaults import resolve_compile, step_wrapper
from flopwise.tune.dryrun import DEFAULT_GPU, DryRunFailed, dry_run, for_json, network_problem, render
from flopwise.tune.shim import DryRunUnavailable
from flopwise.tune.virtual import render as render_virtual
from flopwise.tune.virtual import virtual_preflight

DEBUG_ENV = "FLOPWISE_DEBUG"  # set (not 0): errors show their traceback too, as --debug
OVERRIDE_HELP = "section.key=value overrides, e.g. model.n_layers=4 optim.lr=1e-3 data.path=DIR"
# The least --shard-tokens: the loader memory-maps every shard of a split at once (one mapping
# each, of the 65,530 a Linux process has by default) and every shard is a file with its own
# header, checksum and manifest entry. Below a million tokens (2 MB of uint16) a shard only adds
# files and mappings; `--shard-tokens 1` made a file per token. (PrepareOptions takes any size:
# tests roll shards over on corpora of a few thousand tokens.)
MIN_SHARD_TOKENS = 1_000_000


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", help=f"named preset ({', '.join(preset_names())}); default {DEFAULT_PRESET}")
    p.add_argument("--config", help="YAML file with sections model/data/optim/train/eval")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help=OVERRIDE_HELP)


class _Parser(argparse.ArgumentParser):
    """A usage error in one line, as every other flopwise error: what is wrong and where the
    help is (argparse's default is the whole usage, then the error)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


class _AnyOrder(_Parser):
    """A subcommand's parser that takes its options anywhere, between or after its positionals
    (``export RUN --format hf OUT``): argparse's intermixed parsing, used where the top-level
    parser hands a subcommand its arguments."""

    _inside = False

    def parse_known_args(self, args=None, namespace=None):
        if self._inside:  # parse_known_intermixed_args calls back here, in its two passes
            return super().parse_known_args(args, namespace)
        self._inside = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._inside = False


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="flopwise",
        description="Pretrain language models with performance discipline.",
    )
    parser.add_argument("--version", action="version", version=f"flopwise {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_AnyOrder)
    sub.required = True
    for add in (_train_parser, _prepare_parser, _preflight_parser, _eval_parser, _generate_parser,  # --help's order
                _report_parser, _export_parser, _checkpoint_parser, _plan_parser, _presets_parser):
        add(sub)  # one function per command
    for p in sub.choices.values():
        p.add_argument("--debug", action="store_true",
                       help=f"on an error, show its traceback too (or set {DEBUG_ENV}=1)")
    parser.set_defaults(_commands=sub.choices)
    return parser


def _train_parser(sub: "argparse._SubParsersAction") -> None:
    p = sub.add_parser("train", help="train a model (no arguments: the tiny preset on the embedded corpus)")
    _add_config_args(p)
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("--strict", action="store_true",
                   help="fail instead of falling back when model.attention names an unavailable backend")
    p.add_argument("--explain", action="store_true",
                   help="report torch.compile graphs and graph breaks (with reasons) for one micro-batch, then exit")
    p.add_argument("--fresh", action="store_true",
                   help="start over in a run directory that holds a run (the old one is renamed aside) "
                        "instead of resuming it")
    p.set_defaults(func=cmd_train)


def _prepare_parser(sub: "argparse._SubParsersAction") -> None:
    p = sub.add_parser(
        "prepare",
        help="text -> tokenizer -> validated token shards (a data directory for data.path)",
        description="Tokenize a source into a data directory: tokenizer.json, SPLIT-NNNNN.bin shards, meta.json.",
    )
    p.add_argument("source", nargs="?", help="a file or folder (.txt, .jsonl, .json, .parquet, optionally .gz/.zst), "
                   "'builtin' (Python's stdlib source) or hf:NAME[:CONFIG] (a Hugging Face dataset, streamed)")
    p.add_argument("--out", help="the data directory to write")
    p.add_argument("--verify", metavar="DIR", help="check every shard of DIR (checksums, id range) and exit")
    g = p.add_argument_group("tokenizer (one of)")
    g.add_argument("--tokenizer", default="", help="a tokenizer.json to load (e.g. SmolLM's, Llama-3's, Qwen's)")
    g.add_argument("--vocab-size", type=count(), default=0,
                   help="train a byte-level BPE of this size on the source")
    g.add_argument("--tokenizer-sample-mb", type=number(0, low_open=True), default=100.0,
                   help="text to train the BPE on (default 100)")
    g = p.add_argument_group("budget (tokens; 0 = the whole source)")
    g.add_argument("--train-tokens", type=count(), default=0)
    g.add_argument("--val-tokens", type=count(), default=0,
                   help="default: --val-fraction of the train tokens (or of the source, without --train-tokens)")
    g.add_argument("--test-tokens", type=count(), default=0)
    g.add_argument("--val-fraction", type=number(0, 1, high_open=True), default=None,
                   help="validation's share (default 0.005, raised to what the default eval needs, see docs/data.md)")
    g = p.add_argument_group("source options")
    g.add_argument("--text-field", default="text", help="field of .jsonl/.json/.parquet/hf records (default text)")
    g.add_argument("--hf-split", default="train", help="split of a Hugging Face dataset (default train)")
    g.add_argument("--data-files", nargs="*", default=[], help="hf: data files (e.g. hf:json --data-files a.jsonl)")
    g.add_argument("--shuffle-buffer", type=count(), default=0, help="hf: streaming shuffle buffer (default off)")
    g.add_argument("--seed", type=whole(0, 2**32 - 1), default=0)  # numpy and datasets seeds
    g.add_argument("--follow-links", action="store_true",
                   help="also read symbolic links that lead out of a SOURCE folder (default: skipped and listed)")
    g = p.add_argument_group("performance and output")
    g.add_argument("--workers", type=whole(0, 4096), default=0,
                   help="tokenizer processes (default: from cores and memory)")
    g.add_argument("--shard-tokens", type=count(MIN_SHARD_TOKENS), default=100_000_000,
                   help=f"tokens per shard (default 100M, at least {MIN_SHARD_TOKENS:,})")
    g.add_argument("--overwrite", action="store_true", help="replace --out if it holds other data")
    p.set_defaults(func=cmd_prepare)


def _preflight_parser(sub: "argparse._SubParsersAction") -> None:
    p = sub.add_parser(
        "preflight",
        help="short trial runs: end-to-end check, compile report, micro-batch search or the optimization ladder, "
             "prediction",
        description="Fit the run to this machine before spending the budget: a few real steps, the graph-break "
                    "report, the fastest micro-batch that fits, data starvation, and the full run's predicted "
                    "time. Writes preflight.json and preflight.yaml (flopwise train --config preflight.yaml).",
    )
    _add_config_args(p)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--tokens", type=count(), default=0, help="the run's token budget (default: the config's)")
    g.add_argument("--hours", type=number(0), default=0.0, help="the run's time budget instead")
    p.add_argument("--memory-gb", type=number(0), default=0.0,
                   help="device memory to fit into (default: the GPU's; on a CPU, simulates one)")
    p.add_argument("--headroom", type=number(0, 1, low_open=True), default=0.9,
                   help="fraction of the memory a micro-batch may use")
    p.add_argument("--warmup", type=whole(0), default=2, help="steps before timing each micro-batch")
    p.add_argument("--steps", type=whole(1), default=3,
                   help="timed steps per micro-batch (at least 3, each timed on its own)")
    p.add_argument("--price-per-gpu-hour", type=number(0), default=0.0)
    p.add_argument("--out", default="", help="where preflight.json/.yaml go (default runs/PRESET-preflight)")
    p.add_argument("--ladder", action="store_true",
                   help="climb the optimization ladder instead of the micro-batch search: precision, attention, "
                        "compile, loss, micro-batch, checkpointing, loader, one change at a time, each kept only when "
                        "faster beyond the noise with the same first-step loss")
    p.add_argument("--budget-minutes", type=number(0, low_open=True), default=15.0,
                   help="time the micro-batch search (with its re-measures of tied sizes) or the ladder may spend "
                        "(default 15)")
    p.add_argument("--ladder-fp8", action="store_true", help="let the ladder keep fp8 (it changes numerics)")
    p.add_argument("--isolation", "--ladder-isolation", dest="isolation", choices=("auto", "reset", "process"),
                   default="auto",
                   help="how trials (of the search or the ladder) are kept apart: a reset compiler and allocator in "
                        "this process, or a fresh process each (auto: process on a GPU, reset on a CPU)")
    p.add_argument("--nproc-per-node", type=whole(1, 4096), default=1,
                   help="with --ladder: scale the climbed configuration out to N ranks on this machine and climb "
                        "the data-parallel strategy and bucket size there; with --dry-run: the GPUs per node traced "
                        "(default 1)")
    g = p.add_argument_group("dry run: the CUDA step traced on fake tensors, on any machine (no GPU needed)")
    g.add_argument("--dry-run", action="store_true",
                   help="trace the step a CUDA run of this config builds, on --gpu at --nproc-per-node x --nnodes "
                        "ranks: whether it runs, per-rank memory by kind beside the planner's, the largest "
                        "micro-batch that fits, host syncs, FLOPs, graph breaks and collectives (all traced, "
                        "none measured)")
    g.add_argument("--gpu", default=None, help=f"the GPU to trace for, from flopwise plan --list-gpus "
                                               f"(default {DEFAULT_GPU})")
    g.add_argument("--nnodes", type=whole(1, 4096), default=1, help="nodes to trace for (default 1)")
    g.add_argument("--network", default=None,
                   help=f"link between the nodes, per GPU, that the step time is predicted over (default "
                        f"{hardware.DEFAULT_NETWORK}, as flopwise plan): a name from flopwise plan --list-gpus or "
                        "<N>gbit, N Gbit/s (25gbit is eth-25g)")
    g.add_argument("--json", action="store_true", help="print the dry run's result as JSON")
    g.add_argument("--rank", action="store_true",
                   help="the virtual preflight: trace the candidates a preflight on the GPU would try (micro-batch, "
                        "checkpointing, loss, compile, strategy at N ranks) and rank those that fit by predicted "
                        "tokens/s per GPU, with the predicted time and cost of the run; writes virtual.json to --out "
                        "when given (nothing ran: no preflight.yaml)")
    p.set_defaults(func=cmd_preflight)


def _eval_parser(sub: "argparse._SubParsersAction") -> None:
    p = sub.add_parser(
        "eval",
        help="validation loss, perplexity, bits per byte and multiple-choice tasks of a run or model",
        description="Evaluate a run directory (its latest checkpoint), a checkpoint or a Hugging Face model "
                    "directory. Results of runs are appended to the run's evals.jsonl, which the report shows.",
    )
    p.add_argument("source", help="a run directory, a checkpoints/step-N directory or a Hugging Face model directory")
    p.add_argument("--tasks", default="", help="comma-separated: arc_easy, arc_challenge, openbookqa, hellaswag, piqa, "
                   "and any custom task named in --task-data")
    p.add_argument("--task-data", nargs="*", default=[], metavar="TASK=PATH",
                   help="local files of a task instead of the hub: a built-in task's files in its Hugging Face "
                        "format, or a custom task of any NAME (JSONL: context/choices/label, or a built-in's form); "
                        "a custom task given here is evaluated even if --tasks does not name it")
    p.add_argument("--limit", type=whole(0), default=0, help="first N examples of each task (0 = all)")
    p.add_argument("--data", default="", help="data directory for the validation loss (default: the run's; a "
                   "copy elsewhere, e.g. on another machine, is checked against the run's data fingerprint)")
    p.add_argument("--other-data", action="store_true",
                   help="with --data: evaluate on a data directory that is not the one the run trained on")
    p.add_argument("--windows", type=whole(0, 1 << 20), default=0,  # runner.MAX_WINDOWS (runner imports torch)
                   help="validation windows (default: the run's, eval.windows or what its checkpoint validated on, "
                        "also for a Hugging Face directory flopwise exported; else 64)")
    p.add_argument("--seq-len", type=whole(0, 1 << 20), default=0,
                   help="validation window length (default: the run's train.seq_len; else min(max_seq_len, 1024))")
    p.add_argument("--batch-size", type=whole(1, 65536), default=8)
    p.add_argument("--device", type=device_name, default="auto",
                   help="auto (CUDA when there is one), cpu, cuda, cuda:N")
    p.add_argument("--watch", action="store_true",
                   help="keep evaluating each new checkpoint of the run until the run has finished")
    p.add_argument("--poll", type=number(0, low_open=True), default=30.0,
                   help="--watch: seconds between looks (default 30)")
    p.add_argument("--timeout", type=number(0), default=0.0,
                   help="--watch: give up after this many seconds (0 = never)")
    p.set_defaults(func=cmd_eval)


def _generate_parser(sub: "argparse._SubParsersAction") -> None:
    p = sub.add_parser("generate", help="sample text from a run, a checkpoint or a Hugging Face model directory")
    p.add_argument("source", help="a run directory, a checkpoints/step-N directory or a Hugging Face model directory")
    p.add_argument("--prompt", default="", help="text to continue (default: the tokenizer's BOS or EOS)")
    p.add_argument("--max-tokens", "--max-new-tokens", dest="max_tokens", type=whole(1), default=200,
                   help="tokens to generate after the prompt (default 200)")
    p.add_argument("--temperature", type=number(0), default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=whole(0), default=50, help="0 = off")
    p.add_argument("--top-p", type=number(0, 1, low_open=True), default=1.0,
                   help="nucleus sampling, in (0, 1]; 1 = off")
    p.add_argument("--seed", type=whole(0), default=0)
    p.add_argument("--num-samples", type=whole(1, 4096), default=1)
    p.add_argument("--no-cache", action="store_true", help="recompute the whole context every token (reference)")
    p.add_argument("--device", type=device_name, default="auto",
                   help="auto (CUDA when there is one), cpu, cuda, cuda:N")
    p.set_defaults(func=cmd_generate)


def _report_parser(sub: "argparse._SubParsersAction") -> None:
    p = sub.add_parser("report", help="a self-contained HTML page (and PNG figures) of one or several runs",
                       description="Loss, throughput, MFU, memory, LR, gradient norm, step-time breakdown, "
                                   "evaluations and plan vs preflight vs actual; several runs overlaid. "
                                   "Readable offline: no scripts, no CDN.")
    p.add_argument("runs", nargs="+", help="run directories")
    p.add_argument("--out", default=None, help="the HTML file to write (default: FIRST_RUN/report.html)")
    p.add_argument("--no-png", action="store_true", help="skip the PNG copies of the figures")
    p.set_defaults(func=cmd_report)


def _export_parser(sub: "argparse._SubParsersAction") -> None:
    p = sub.add_parser(
        "export",
        help="write a run or checkpoint as a Hugging Face model directory (or one consolidated file)",
        description="Export a run directory (its latest checkpoint) or a checkpoint directory as a model "
                    "transformers loads with AutoModelForCausalLM.from_pretrained(OUT): config.json, "
                    "model.safetensors, generation_config.json, tokenizer.json, and flopwise.json (the run's "
                    "step and validation windows, which flopwise eval reuses). --format pt writes one "
                    "model.pt (+ config.yaml, tokenizer.json) instead, for any architecture; both "
                    "consolidate a checkpoint that FSDP2 ranks wrote in shards.",
    )
    p.add_argument("source", help="a run directory or a checkpoints/step-NNNNNNN directory")
    p.add_argument("out", nargs="?", help="the directory to write (or --out, as prepare and preflight spell it)")
    p.add_argument("--out", dest="out_flag", metavar="OUT", help="the directory to write")
    p.add_argument("--format", default="hf", choices=["hf", "pt"],
                   help="hf: Hugging Face transformers (default); pt: one flopwise model.pt")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it is not empty")
    p.set_defaults(func=cmd_export)


def _checkpoint_parser(sub: "argparse._SubParsersAction") -> None:
    p = sub.add_parser(
        "checkpoint",
        help="verify a checkpoint against its manifest, or adopt one that has none",
        description="verify: check every file of a checkpoint against its COMPLETE manifest (sizes, CRC32s, "
                    "state.json, tensors only). adopt: a checkpoint without the marker (written by a flopwise "
                    "older than markers) is not loaded until you vouch for it; adopt checks its state.json and "
                    "tensors (no code can run from them) and writes its manifest.",
    )
    p.add_argument("action", choices=["verify", "adopt"])
    p.add_argument("path", help="a checkpoints/step-NNNNNNN directory")
    p.set_defaults(func=cmd_checkpoint)


def _plan_parser(sub: "argparse._SubParsersAction") -> None:
    p = sub.add_parser(
        "plan",
        help="FLOPs, memory, time, cost, Chinchilla sizing and scaling, before any GPU time is spent",
        description="Plan a run: parameters, FLOPs, memory per GPU, time, cost, Chinchilla, batch, scaling.",
    )
    g = p.add_argument_group("model (one of)")
    g.add_argument("--model", "--preset", dest="model",
                   help=f"a preset ({', '.join(preset_names())}); --preset is the same, as train spells it")
    g.add_argument("--config", help="a run config YAML or a run directory (its config.yaml): plans that run as "
                   "configured -- model, seq_len, micro-batch, global batch, token budget, precision, loss, "
                   "activation checkpointing, attention, strategy; the flags below override it")
    g.add_argument("--params", type=count(), default=0, help="a raw parameter count, e.g. 8e9 or 8B (6N FLOPs only)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help=f"{OVERRIDE_HELP}; as train takes them: the plan is then of the run train would run with "
                        "them (on --config, --model, or the default preset when neither is given)")
    g = p.add_argument_group("hardware")
    g.add_argument("--gpu", help="a GPU from the table (--list-gpus), e.g. h100, 'h100 pcie', 'a100 40gb', l4, "
                   "'rtx 4090'; matched exactly (case, spaces, dashes, 'GB' ignored), unknown names are refused")
    g.add_argument("--peak-tflops", type=number(0), default=0.0, help="dense peak TFLOP/s of one GPU (overrides --gpu)")
    g.add_argument("--memory-gb", type=number(0), default=0.0, help="memory of one GPU in GiB (overrides --gpu)")
    g.add_argument("--dtype", default=None,
                   help="which peak: bf16, fp16, fp8, tf32, fp32 (default: the precision's; fp32 for float32)")
    g.add_argument("--gpus", type=whole(1), default=1, help="number of GPUs (default 1)")
    g.add_argument("--gpus-per-node", type=whole(1), default=8)
    g.add_argument("--mfu", type=number(0, 1, low_open=True), default=None,
                   help=f"assumed MFU, 0-1 (default {NOMINAL_MFU:.2f}); with --trace the traced step's predicted MFU "
                        "prices the run instead, and --mfu is refused unless the GPU gets no prediction")
    g.add_argument("--list-gpus", action="store_true", help="print the hardware table and exit")
    g = p.add_argument_group("budget (one of)")
    g.add_argument("--tokens", type=count(), default=0, help="training tokens, e.g. 6e9 or 6B")
    g.add_argument("--hours", type=number(0), default=0.0, help="wall-clock hours available")
    g.add_argument("--chinchilla", action="store_true", help="20 tokens per parameter")
    p.add_argument("--price-per-gpu-hour", type=number(0), default=0.0, help="$ per GPU-hour for the cost")
    p.add_argument("--flops-formula", default=None,
                   help="palm (6·N_matmul + attention; the default with a model) or 6n (the default with --params)")
    g = p.add_argument_group("memory and batch")
    g.add_argument("--seq-len", type=whole(0), default=0, help="sequence length (default: the preset's or 2048)")
    g.add_argument("--micro-batch", type=whole(0), default=0, help="micro-batch per GPU (default: largest that fits)")
    g.add_argument("--grad-accum", type=whole(0), default=0, help="accumulation steps (default: to reach the target)")
    g.add_argument("--target-batch-tokens", type=count(1), default=524_288, help="tokens per step to aim for")
    g.add_argument("--headroom", type=number(0, 1, low_open=True), default=0.9,
                   help="fraction of GPU memory to plan for (default 0.9)")
    g.add_argument("--precision", default=None,
                   help="as train.precision: bf16 (autocast over fp32 weights, the default), bf16-pure (bf16 "
                        "weights), fp16 (autocast over fp32 weights), float32")
    g.add_argument("--no-master-weights", action="store_true", help="bf16-pure without an fp32 master copy")
    g.add_argument("--attention", default=None, help="as model.attention: auto (the default), flash, sdpa, flex "
                   "(no score matrix), or eager (S×S scores)")
    g.add_argument("--checkpointing", default=None,
                   help="as train.activation_checkpointing: none (default), full, or selective (blocks 0, k, 2k, ...)")
    g.add_argument("--checkpointing-every", type=whole(0), default=0,
                   help="k of --checkpointing selective, as train.activation_checkpointing_every (default 2)")
    g.add_argument("--loss", default=None, help="as train.loss: plain (full logits, the default), chunked, or fused "
                   "(Liger's kernel: no full logits, planned as chunked)")
    g.add_argument("--strategy", default="", help="as parallel.strategy: single, ddp, zero1, fsdp2, hsdp, diloco "
                        "(default: single, ddp with --gpus>1, or the first of zero1/fsdp2 that fits when ddp does not; "
                        "hsdp and diloco only when asked)")
    g = p.add_argument_group("scaling")
    g.add_argument("--interconnect", default="", help="link within a node (default: the GPU's usual one)")
    g.add_argument("--network", default=None, help=f"link between nodes, per GPU (default "
                   f"{hardware.DEFAULT_NETWORK}): a name from --list-gpus or <N>gbit, N Gbit/s (25gbit is eth-25g); "
                   "also what --trace predicts the step over")
    g = p.add_argument_group("DiLoCo (--strategy diloco: worker groups sync every H inner steps)")
    g.add_argument("--inner-steps", type=whole(1), default=None, help="H, inner steps between outer syncs, as "
                   f"parallel.inner_steps (default {ParallelConfig.inner_steps})")
    g.add_argument("--outer-dtype", default=None, help="fp32 or bf16: the pseudo-gradient's all-reduce dtype, as "
                   "parallel.outer_dtype (default fp32)")
    g.add_argument("--inner-strategy", default=None, help="ddp or fsdp2 inside a worker group, as "
                   "parallel.inner_strategy (default ddp)")
    g.add_argument("--group-size", type=whole(0), default=None, help="GPUs per worker group (diloco) or shard group "
                   "(--strategy hsdp), as parallel.group_size (default: --gpus-per-node)")
    g.add_argument("--comm-share", type=number(0, 1, low_open=True, high_open=True), default=None,
                   help="the share of step time communication should stay "
                   "under: the plan names the smallest H that does (default 0.05)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--trace", action="store_true",
                   help="also trace the planned step on fake tensors (flopwise preflight --dry-run; needs a C++ "
                        "compiler, no GPU), with the step flags given (--precision, --attention, --checkpointing, "
                        "--loss, DiLoCo's): whether it runs, its traced memory, the largest micro-batch that fits, "
                        "and the time and cost at its predicted MFU, with the range that prediction is likely in")
    p.set_defaults(func=cmd_plan)


def _presets_parser(sub: "argparse._SubParsersAction") -> None:
    p = sub.add_parser("presets", help="list the shipped presets")
    p.set_defaults(func=cmd_presets)


def cmd_train(args: argparse.Namespace) -> int:
    overrides = list(args.overrides) + (["model.attention_strict=true"] if args.strict else [])
    cfg = build_config(preset=args.preset, config_file=args.config, overrides=overrides,
                       read_hf_config=_read_hf_config)
    _print_notes("train", cfg.notes)
    if args.print_config:
        print(cfg.to_yaml(), end="")
        return 0
    from flopwise.train.stopping import NonFiniteError  # lazy: torch
    from flopwise.train.trainer import train  # lazy: torch

    if args.explain:
        from flopwise.tune.explain import explain_run  # lazy: torch

        _one_process_only("train --explain")
        explain_run(cfg, log=lambda s: print(s, flush=True))
        return 0
    try:
        train(cfg, log=lambda s: print(s, flush=True), fresh=args.fresh)
    except NonFiniteError as e:
        print(f"flopwise train: {e}", file=sys.stderr)
        return 3
    # a failed save (CheckpointError) or write (WriteError) names its file and the checkpoint that is
    # intact; main's one boundary prints it
    return 0


def cmd_checkpoint(args: argparse.Namespace) -> int:
    from pathlib import Path

    from flopwise.checkpoints import adopt_checkpoint, read_state, verify_checkpoint  # lazy: torch

    path = Path(args.path)
    if not path.is_dir():
        raise ConfigError([f"{path}: no such checkpoint directory"])
    if args.action == "adopt":
        manifest = adopt_checkpoint(path)
        print(f"adopted {path}: {len(manifest['files'])} files checked and recorded in its manifest")
        return 0
    manifest = verify_checkpoint(path)
    state = read_state(path)
    print(f"{path}: {len(manifest['files'])} files match the manifest · step {state['step']:,} · "
          f"{state['tokens']:,} tokens")
    return 0


def _one_process_only(what: str) -> None:
    """Trial runs measure one GPU; under a multi-process launch they would race on its files."""
    world = os.environ.get("WORLD_SIZE", "")
    if world not in ("", "1"):
        raise ConfigError([f"flopwise {what} runs in one process (WORLD_SIZE={world}): run it without torchrun "
                           "on one GPU; its micro-batch holds per GPU under DDP, ZeRO-1 and (more) FSDP2"])


def _bounded(parse, low: float, high: float, low_open: bool = False, high_open: bool = False):
    """``parse`` with its range attached as ``bounds``: every number flag has one (a test walks the
    parser and fails on a flag without it)."""
    parse.bounds = (low, high, low_open, high_open)
    return parse


def whole(low: int, high: int = 2**63 - 1):
    """An argparse type: an integer in [low, high], refused in one line before any work (argparse
    names the flag: "argument --steps: -1 is out of range ...")."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text[:80]!r} is not a whole number") from None
        if not low <= value <= high:
            bound = f"{low} to {high:,}" if high < 2**63 - 1 else f"a whole number >= {low}"
            raise argparse.ArgumentTypeError(f"{value} is out of range: give {bound}")
        return value
    return _bounded(parse, low, high)


def number(low: float, high: float = math.inf, low_open: bool = False, high_open: bool = False):
    """An argparse type: a finite number >= low (> low with ``low_open``) and <= high (< high with
    ``high_open``): NaN and the infinities never pass, whatever the bounds."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text[:80]!r} is not a number") from None
        if (not math.isfinite(value) or value < low or (low_open and value == low) or value > high
                or (high_open and value == high)):
            bound = f"{'>' if low_open else '>='} {low:g}"
            if high < math.inf:
                bound += f" and {'<' if high_open else '<='} {high:g}"
            raise argparse.ArgumentTypeError(f"{value} is out of range: give a finite number {bound}")
        return value
    return _bounded(parse, low, high, low_open, high_open)


def device_name(text: str) -> str:
    """An argparse type: a device flopwise can run on, by name (torch is not imported to check)."""
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", text):
        raise argparse.ArgumentTypeError(f"{text[:80]!r}: give auto, cpu, cuda or cuda:N")
    return text


def count(low: int = 0):
    """An argparse type: a whole count >= ``low``, written as 6e9, 6_000_000_000, 6B, 360M, 1.5T or 250K."""
    def parse(text: str) -> int:
        t = text.strip().replace("_", "").replace(",", "")
        scale = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}.get(t[-1:].lower(), 1)
        if scale != 1:
            t = t[:-1]
        try:
            value = float(t) * scale
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text[:80]!r} is not a number (e.g. 6e9, 6B, 360M)") from None
        if not math.isfinite(value) or value < low:  # int() of NaN or inf would raise, not refuse
            raise argparse.ArgumentTypeError(f"{text[:80]} is out of range: give a whole number >= {low:,}")
        if value != int(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number")
        return int(value)
    return _bounded(parse, low, math.inf)


def cmd_prepare(args: argparse.Namespace) -> int:
    from flopwise.data.prepare import PrepareError, PrepareOptions, prepare, verify  # lazy: numpy

    log = lambda line: print(line, flush=True)  # noqa: E731
    if args.verify:
        verify(args.verify, log=log)
        return 0
    if not args.source:
        raise PrepareError("give a SOURCE (a file or folder, builtin, or hf:NAME[:CONFIG]) or --verify DIR")
    opts = PrepareOptions(
        source=args.source, out=args.out or "", tokenizer=args.tokenizer, vocab_size=args.vocab_size,
        train_tokens=args.train_tokens, val_tokens=args.val_tokens, test_tokens=args.test_tokens,
        val_fraction=args.val_fraction, workers=args.workers, text_field=args.text_field, hf_split=args.hf_split,
        shuffle_buffer=args.shuffle_buffer, seed=args.seed, tokenizer_sample_mb=args.tokenizer_sample_mb,
        shard_tokens=args.shard_tokens, overwrite=args.overwrite, data_files=args.data_files,
        follow_links=args.follow_links,
    )
    out = prepare(opts, log=log)
    print(f"train on it with: flopwise train data.path={out}")
    return 0


# Flags of a measured preflight that a dry run (which times nothing) has no use for
_MEASURING_FLAGS = (("--warmup", "warmup"), ("--steps", "steps"), ("--budget-minutes", "budget_minutes"),
                    ("--isolation", "isolation"), ("--ladder-fp8", "ladder_fp8"))
# Flags only --dry-run --rank uses among the dry runs: it prices the run's budget and writes virtual.json
_RANK_FLAGS = (("--tokens", "tokens"), ("--hours", "hours"), ("--price-per-gpu-hour", "price_per_gpu_hour"),
               ("--out", "out"))


def _preflight_flag_problems(args: argparse.Namespace) -> list[str]:
    """Flags given that the preflight asked for would drop without a word: each named with the
    mode that uses it. A --out that is a file, not a directory, is named too (before any work)."""
    from pathlib import Path

    problems = []
    if args.out and Path(args.out).exists() and not Path(args.out).is_dir():
        problems.append(f"--out {args.out}: a file is there; give a directory (preflight writes its files into it)")
    if not args.dry_run:
        return problems
    defaults = args._commands["preflight"]

    def given(name: str) -> bool:  # set to other than the parser's default
        return getattr(args, name) != defaults.get_default(name)

    measuring = [flag for flag, name in _MEASURING_FLAGS if given(name)]
    if measuring:
        problems.append(f"{', '.join(measuring)}: a dry run times nothing (these set how a measured preflight "
                        "times its trials): drop --dry-run to measure on the device at hand, or drop them")
    rank_only = [flag for flag, name in _RANK_FLAGS if given(name)]
    if rank_only and not args.rank:
        problems.append(f"{', '.join(rank_only)}: a plain dry run prices no budget and writes no file; add --rank "
                        "(it ranks the candidates, prices the budget and writes virtual.json to --out), or price "
                        "the planned step with flopwise plan --trace --tokens/--hours")
    return problems


def cmd_preflight(args: argparse.Namespace) -> int:
    cfg = build_config(preset=args.preset, config_file=args.config, overrides=args.overrides,
                       read_hf_config=_read_hf_config)
    _print_notes("preflight", cfg.notes)
    _one_process_only("preflight")
    problems = _preflight_flag_problems(args)
    if problems:
        raise ConfigError(problems)
    if args.dry_run:
        return _dry_run(cfg, args)
    if args.gpu is not None or args.nnodes != 1 or args.network is not None or args.json or args.rank:
        raise ConfigError(["--gpu, --nnodes, --network, --json and --rank go with --dry-run (a preflight without it "
                           "measures the device at hand)"])
    from flopwise.tune.preflight import Interrupted, preflight  # lazy: torch
    from flopwise.tune.request import TuneRequest  # lazy: torch

    request = TuneRequest(ladder=args.ladder, ladder_fp8=args.ladder_fp8, tokens=args.tokens, hours=args.hours,
                          price_per_gpu_hour=args.price_per_gpu_hour, memory_gb=args.memory_gb,
                          headroom=args.headroom, warmup=args.warmup, steps=args.steps,
                          budget_minutes=args.budget_minutes, isolation=args.isolation, world=args.nproc_per_node,
                          out_dir=args.out, log=lambda s: print(s, flush=True))
    try:
        preflight(cfg, request)
    except Interrupted as e:  # its scratch run and trials are cleaned up by now
        print(f"flopwise preflight: stopped by {e.name}: nothing written (its scratch run and trial directories "
              "are removed)", file=sys.stderr)
        return 128 + e.signum  # as a shell reports a process ended by the signal: 130, 143
    return 0


def _dry_run(cfg, args: argparse.Namespace) -> int:
    if args.ladder:
        raise ConfigError(["--dry-run traces one configuration; --ladder measures on the device at hand: "
                           "choose one"])
    say = (lambda s: print(s, file=sys.stderr, flush=True)) if args.json else (lambda s: print(s, flush=True))
    if args.network is not None and args.nnodes == 1 and not network_problem(args.network):
        _print_notes("preflight", [f"--network {args.network}: one node (--nnodes 1) crosses no network"])
    if args.rank:
        return _virtual_preflight(cfg, args, say)
    try:
        result = dry_run(cfg, gpu=args.gpu, nproc_per_node=args.nproc_per_node, nnodes=args.nnodes,
                         memory_gb=args.memory_gb, headroom=args.headroom, network=args.network, log=say)
    except (DryRunUnavailable, DryRunFailed) as e:
        print(f"flopwise preflight --dry-run: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json_text(for_json(result)))
    else:
        print("\n".join(render(result)))
    return 0


def _virtual_preflight(cfg, args: argparse.Namespace, say) -> int:
    """``preflight --dry-run --rank``: the candidates traced and ranked by predicted tokens/s
    (tune/virtual.py); virtual.json in ``--out`` when one is given."""
    from pathlib import Path

    if args.out:  # one that cannot be made fails before any trace
        Path(args.out).mkdir(parents=True, exist_ok=True)
    tracer = {"gpu": args.gpu, "nproc_per_node": args.nproc_per_node, "nnodes": args.nnodes,
              "memory_gb": args.memory_gb, "headroom": args.headroom, "network": args.network}
    try:
        result = virtual_preflight(cfg, tracer, tokens=args.tokens, hours=args.hours,
                                   price_per_gpu_hour=args.price_per_gpu_hour, log=say)
    except (DryRunUnavailable, DryRunFailed) as e:
        print(f"flopwise preflight --dry-run --rank: {e}", file=sys.stderr)
        return 1
    source = [f"--config {args.config}"] if args.config else [f"--preset {args.preset}"] if args.preset else []
    if args.out:
        write_json(Path(args.out) / "virtual.json", json_figures({"virtual": result}))
    if args.json:
        print(json_text({"virtual": result}))
    else:
        print("\n".join(render_virtual(result, source + list(args.overrides))))
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from pathlib import Path

    from flopwise.evaluate import runner  # lazy: torch
    from flopwise.model.io import resolve  # lazy: torch

    log = lambda line: print(line, flush=True)  # noqa: E731
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    task_paths = {}
    for item in args.task_data:
        name, sep, path = item.partition("=")
        name, path = name.strip(), path.strip()
        if not sep or not name or not path:
            raise ConfigError([f"--task-data {item!r}: expected TASK=PATH (a built-in task or a name of your own)"])
        task_paths[name] = path
        if name not in tasks:  # a file given is a task to evaluate
            tasks.append(name)
    deps.require(deps.missing_for_eval(tasks, task_paths))  # before the model is loaded or the validation runs
    if task_paths:
        import difflib

        from flopwise.evaluate.tasks import TASKS  # lazy: torch

        for name in task_paths:
            close = difflib.get_close_matches(name, list(TASKS), n=1, cutoff=0.8)
            if name not in TASKS and close:
                log(f"eval: {name!r} is a custom task (read from {task_paths[name]}); did you mean {close[0]!r}?")
    if args.other_data and not args.data:  # before the model is loaded, and before --watch waits for one
        raise ConfigError(["--other-data: only with --data DIR (it allows evaluating on a data directory that is "
                           "not the one the run trained on)"])
    options = runner.EvalOptions(data=args.data, other_data=args.other_data, tasks=tasks, task_paths=task_paths,
                                 limit=args.limit, windows=args.windows, seq_len=args.seq_len,
                                 batch_size=args.batch_size, device=args.device)
    if args.watch:
        n = runner.watch(args.source, options, poll_s=args.poll, timeout_s=args.timeout, log=log)
        log(f"eval: {n} checkpoint(s) evaluated; results in {Path(args.source) / runner.EVALS_FILE}")
        return 0
    src = resolve(args.source)
    log(f"eval: {src.kind} {src.path}")
    result = runner.evaluate(args.source, options, log=log)
    run_dir = runner.run_of(src.path) if src.kind != "hf" else None
    if run_dir is not None:
        runner.record(run_dir, result)
        log(f"eval: appended to {run_dir / runner.EVALS_FILE}")
    elif src.kind != "hf":  # an export or a copied checkpoint: the folder two up is not its run's
        log(f"eval: not recorded: {src.path} is not a checkpoint inside a run directory (RUN/checkpoints/step-N), "
            "so there is no evals.jsonl of its run to append to; the scores are the lines above")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from flopwise import load  # lazy: torch
    from flopwise.data.tokenizer import special_ids  # lazy: numpy
    from flopwise.evaluate.generate import Sampling, generate  # lazy: torch
    from flopwise.model.io import ModelSourceError  # lazy: torch

    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError([f"--device {args.device}: no CUDA device here"])
    model, tok = load(args.source, device=device)
    if tok is None:
        raise ModelSourceError(f"{args.source}: no tokenizer.json to encode the prompt with")
    ids = special_ids(tok)
    start = tok.encode(args.prompt, add_special_tokens=False).ids if args.prompt else []
    if ids["bos_id"] is not None:
        start = [ids["bos_id"]] + start
    start = start or [ids["eos_id"]]
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    prompt = torch.tensor([start] * args.num_samples, device=device)
    sampling = Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, generator=gen)
    out = generate(model, prompt, args.max_tokens, model.cfg.max_seq_len, sampling, eos_id=ids["eos_id"],
                   use_cache=not args.no_cache)
    for i, row in enumerate(out.tolist()):
        if args.num_samples > 1:
            print(f"--- sample {i + 1}")
        print(tok.decode(row, skip_special_tokens=True))
    return 0


def cmd_report(args: argparse.Namespace) -> int:

    try:
        path = build_report(args.runs, out=args.out, png=not args.no_png)
    except ReportError as e:
        print(f"flopwise report: {e}", file=sys.stderr)
        return 2
    print(f"report: {path}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from flopwise.model.io import export_consolidated, export_hf  # lazy: torch

    if (args.out is None) == (args.out_flag is None):
        print("flopwise export: give the directory to write once: as OUT or as --out OUT", file=sys.stderr)
        return 2
    write = export_consolidated if args.format == "pt" else export_hf
    write(args.source, args.out or args.out_flag, overwrite=args.overwrite, log=lambda line: print(line, flush=True))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from dataclasses import replace

    if args.list_gpus:
        print(format_gpu_table())
        return 0
    if args.model and args.config:
        raise PlanError("--model and --config both name the model: give one")
    notes: list[str] = []
    precision = strategy = ""
    if args.precision:  # train.precision's names; the planner's old ones still work, with a note
        precision, note = current_name("precision", args.precision, "--precision")
        if args.precision == "bf16":
            note = ("--precision bf16 is bf16 autocast over fp32 weights, as train.precision=bf16 (pure bf16 "
                    "weights, what it meant before, are --precision bf16-pure)")
        notes += [note] if note else []
    if args.strategy and args.strategy != "auto":  # auto: the planner's choice, as the trainer's
        strategy, note = current_name("strategy", args.strategy, "--strategy")
        notes += [note] if note else []
    gpu = hardware.find(args.gpu) if args.gpu is not None else None  # exact on the normalised name
    if args.gpu is not None:  # given, if empty: an error, never no GPU (nor a similar card)
        if gpu is None:
            raise PlanError(hardware.unknown_gpu_message(args.gpu))
    if precision == "auto":  # as the trainer resolves it on a GPU: bf16 where the card has it
        precision = "fp16" if gpu is not None and gpu.bf16 is None else "bf16"
        notes.append(f"--precision auto is {precision} on {gpu.name if gpu else 'a GPU with bf16'}")
    model, name = None, ""
    run: dict[str, Any] = {}
    cfg, source = _plan_config(args)
    # without --config: the step a default `train` takes on a GPU (compile, loss, attention as auto resolves them)
    cfg, speed, respeed = (cfg, {}, None) if cfg is None or args.config else _default_step(cfg, strategy, args)
    if cfg is not None and (args.config or args.overrides):  # the run as configured: every setting it models
        run, run_notes = plan_inputs_for_run(cfg, gpus=args.gpus, gpu=gpu, strategy=strategy,
                                             gpus_per_node=args.gpus_per_node)
        name = f"{args.config} ({cfg.preset})" if args.config else cfg.preset
        model, notes = cfg.model, notes + cfg.notes + run_notes
        name += f" {' '.join(args.overrides)}" if args.overrides else ""
    elif cfg is not None:  # --model alone: the preset's model, the batch the planner recommends
        model, name, run = cfg.model, args.model, {"seq_len": cfg.train.seq_len}
    data = _plan_data(cfg, notes)
    mode: Compile = cfg.train.compile if cfg is not None else "off"  # as _default_step resolved it
    memory = run.get("memory") or MemorySettings(strategy=strategy or ("ddp" if args.gpus > 1 else "single"),
                                                 n_gpus=args.gpus, compiled=mode != "off",
                                                 loss_in_graph=mode == "model")
    loss = args.loss
    if loss in ("auto", "fused"):  # train.loss's names; the memory model knows plain and chunked
        loss, note = planned_loss(TrainConfig(loss=loss, compile=mode if cfg is not None else "auto"))
        notes.append(note)
    elif loss is None and "loss" in speed:  # --model alone: train.loss=auto, as compiled or not
        loss = planned_loss(TrainConfig(loss="auto", compile=mode))[0]
    flags = {"precision": precision, "attention": args.attention, "activation_checkpointing": args.checkpointing,
             "activation_checkpointing_every": args.checkpointing_every, "loss": loss}
    memory = replace(memory, **{k: v for k, v in flags.items() if v},
                     **({"master_weights": False} if args.no_master_weights else {}),
                     **({"grad_accum": args.grad_accum} if args.grad_accum > 0 else {}))
    _refuse_diloco_flags(args, memory.strategy)
    memory = replace(memory, **{k: v for k, v in (("inner_strategy", args.inner_strategy),
                                                  ("outer_dtype", args.outer_dtype),
                                                  ("group_size", args.group_size)) if v is not None})
    budget_given = args.tokens or args.hours or args.chinchilla
    inp = PlanInputs(
        model=model, model_name=name, params=args.params, gpu=gpu,
        peak_tflops=args.peak_tflops or run.get("peak_tflops", 0), dtype=args.dtype or peak_dtype(memory.precision),
        memory_gb=args.memory_gb, gpus=args.gpus, gpus_per_node=args.gpus_per_node,
        mfu=NOMINAL_MFU if args.mfu is None else args.mfu,
        tokens=args.tokens or (0 if budget_given else run.get("tokens", 0)), hours=args.hours,
        limit="" if budget_given else run.get("limit", ""),
        max_hours=0.0 if budget_given else run.get("max_hours", 0.0),
        chinchilla=args.chinchilla, price_per_gpu_hour=args.price_per_gpu_hour,
        flops_formula=args.flops_formula or ("palm" if model is not None else "6n"),
        seq_len=args.seq_len or run.get("seq_len", 2048), micro_batch=args.micro_batch or run.get("micro_batch", 0),
        grad_accum=args.grad_accum or run.get("grad_accum", 0), target_batch_tokens=args.target_batch_tokens,
        headroom=args.headroom, memory=memory, interconnect=args.interconnect, network=args.network or "",
        auto_strategy=not strategy and run.get("auto_strategy", True),
        inner_steps=run.get("inner_steps", ParallelConfig.inner_steps) if args.inner_steps is None
        else args.inner_steps,
        comm_share=args.comm_share if args.comm_share is not None else 0.05, defaults=respeed, **data,
    )
    if args.trace and (gpu is None or model is None):
        raise PlanError("--trace traces the planned step: it needs --gpu and --model (or --config)")
    # before any trace: the step flags it takes, and what it cannot take refused
    step = _asked_step(args, precision, gpu, cfg) if args.trace and gpu is not None else []
    plan = build_plan(inp)
    plan["notes"], plan["defaults"] = notes, speed
    _print_notes("plan", notes)
    trace = _trace_plan(source, plan, args, step) if args.trace else None
    if trace:
        plan = _priced_by_trace(inp, plan, (trace or {}).get("prediction") or {}, args)
        plan["notes"], plan["defaults"] = notes, speed
    if args.json:
        print(json_text({**plan, **({"trace": for_json(trace)} if trace else {})}))
        return 0
    print(format_plan(plan))
    if trace:
        print("\n".join(["", "trace of the planned step (flopwise preflight --dry-run):", *render(trace)[1:]]))
    return 0


def _refuse_diloco_flags(args: argparse.Namespace, strategy: str) -> None:
    """A PlanError naming DiLoCo's flags given for another ``strategy`` (``--group-size`` is hsdp's too)."""
    diloco = {"--inner-steps": args.inner_steps, "--outer-dtype": args.outer_dtype, "--comm-share": args.comm_share,
              "--inner-strategy": args.inner_strategy, "--group-size": args.group_size}
    given = [flag for flag, value in diloco.items() if value is not None
             and not (flag == "--group-size" and strategy == "hsdp")]  # hsdp's shard group
    if given and strategy != "diloco":
        which = "diloco or hsdp" if given == ["--group-size"] else "diloco"
        raise PlanError(f"{', '.join(given)} {'is a DiLoCo setting' if len(given) == 1 else 'are DiLoCo settings'}"
                        f"{' (and an HSDP one)' if which != 'diloco' else ''}: give --strategy {which} (or a --config "
                        f"with parallel.strategy={which.replace(' or ', ' or parallel.strategy=')})")


def _priced_by_trace(inp: PlanInputs, plan: dict[str, Any], prediction: dict[str, Any],
                     args: argparse.Namespace) -> dict[str, Any]:
    """``plan`` priced at the traced step's predicted MFU, in the range its held-out errors support;
    ``plan`` as it is, with a note, when the trace predicted no step time."""
    if not (prediction.get("predicted") and prediction.get("mfu")):
        why = prediction.get("why") or "no MFU against the GPU's peak"
        assumed = "--mfu" if args.mfu is not None else "the default; --mfu to change"
        _print_notes("plan", [f"--trace: no step time predicted ({why}): the time and cost are at the assumed MFU "
                              f"{100 * inp.mfu:g}% ({assumed})"])
        return plan
    over = f" over {prediction['between_nodes']['name']}" if prediction.get("between_nodes") else ""
    how = (f"{100 * prediction['mfu']:.1f}% for the planned step on {prediction['gpu']}{over}, from its traced "
           "kernels (flopwise preflight --dry-run)")
    # the scaling rows add their own (unoverlapped) communication to compute: the step less its exposed comm
    compute = prediction["step_s"] - prediction["breakdown"].get("exposed_comm", 0.0)
    mfu_compute = prediction["mfu"] * prediction["step_s"] / compute if compute > 0 else prediction["mfu"]
    return build_plan(dataclasses.replace(inp, mfu=min(1.0, prediction["mfu"]), mfu_predicted_by=how,
                                          mfu_compute=min(1.0, mfu_compute), mfu_band=prediction.get("band")))


def _plan_config(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    """``(config, build_config's arguments)`` of what plan is asked, built as train builds it:
    ``--config`` (a file, or a run directory's config.yaml), else ``--model`` -- or, with
    KEY=VALUE overrides alone, the default preset --, the overrides on top. ``(None, {})``
    without any of them (``--params``: a raw size, no config to override)."""
    from pathlib import Path

    overrides = list(args.overrides)
    if overrides and args.params:
        raise PlanError(f"{' '.join(overrides)}: KEY=VALUE overrides change a run's config, and --params gives "
                        "no config: give --model or --config (or neither: the default preset, as train) instead")
    if args.config:
        path = Path(args.config)
        source: dict[str, Any] = {"config_file": path / "config.yaml" if path.is_dir() else path}
    elif args.model or overrides:
        source = {"preset": args.model}
    else:
        return None, {}
    source["overrides"] = overrides
    return build_config(**source, read_hf_config=_read_hf_config), source


def _default_step(cfg: Any, strategy: str, args: argparse.Namespace) -> tuple[Any, dict[str, str], Any]:
    """``cfg`` with ``train.compile`` as ``auto`` resolves it on a GPU (``--gpu``'s, or any) for the
    run of ``strategy`` (the planner's choice where empty) over ``--gpus``, by train/defaults.py's
    rule -- the one the trainer and the dry run apply --; the plan's ``defaults``: what each
    ``auto`` of the step became (``compile``; ``loss`` and ``attention`` where neither the config
    nor a flag names them), for the settings line; and ``PlanInputs.defaults``, the same rule for
    the memory settings of another strategy or GPU count (the plan's suggestions)."""
    import copy

    def compile_for(strategy: str, gpus: int, inner: str | None, group: int | None) -> tuple[Compile, str]:
        layout = copy.deepcopy(cfg)  # the layout the wrapper is decided for
        pc = layout.parallel
        pc.strategy = strategy or ("auto" if pc.strategy == "single" and gpus > 1 else pc.strategy)
        pc.inner_strategy = inner or pc.inner_strategy
        pc.group_size = pc.group_size if group is None else group
        return resolve_compile(cfg.train.compile, "cuda", step_wrapper(layout, gpus))

    def respeed(mem: MemorySettings) -> MemorySettings:
        mode = compile_for(mem.strategy, mem.n_gpus, mem.inner_strategy, mem.group_size)[0]
        loss = planned_loss(TrainConfig(loss="auto", compile=mode))[0] if "loss" in speed else mem.loss
        return dataclasses.replace(mem, compiled=mode != "off", loss_in_graph=mode == "model", loss=loss)

    out = copy.deepcopy(cfg)
    out.train.compile, why = compile_for(strategy, args.gpus, args.inner_strategy, args.group_size)
    speed = {"compile": f"auto -> {out.train.compile} ({why})" if why else out.train.compile}
    if cfg.train.loss == "auto" and not args.loss:
        speed["loss"] = f"auto -> {planned_loss(out.train)[0]}"
    if cfg.model.attention == "auto" and not args.attention:
        speed["attention"] = "auto -> flash or SDPA, as the GPU's install has them (planned alike)"
    return out, speed, respeed


def _plan_data(cfg: Any, notes: list[str]) -> dict[str, Any]:
    """``PlanInputs``' data fields: the train tokens of the config's ``data.path``, read as train
    opens it (meta.json and the shards' headers; no token is read). Data that is not here is a
    note, not an error: a plan is often made away from the machine that holds the data."""
    if cfg is None or not cfg.data.path:
        return {}
    from flopwise.data.datadir import DataDir, DataDirError, resolve_data_dir  # lazy: numpy, tokenizers

    path = resolve_data_dir(cfg.data)
    try:
        train_tokens = DataDir(path).num_tokens("train")
    except DataDirError as e:
        notes.append(f"data.path {cfg.data.path}: epochs not counted: {e}")
        return {}
    return {"data_path": str(path), "data_train_tokens": train_tokens}


# plan's flags that shape the step, and the run config's key for each: what --trace traces them as
STEP_FLAGS = (("precision", "train.precision"), ("attention", "model.attention"),
              ("checkpointing", "train.activation_checkpointing"),
              ("checkpointing_every", "train.activation_checkpointing_every"), ("loss", "train.loss"),
              ("inner_steps", "parallel.inner_steps"), ("outer_dtype", "parallel.outer_dtype"),
              ("inner_strategy", "parallel.inner_strategy"), ("group_size", "parallel.group_size"))


def _asked_step(args: argparse.Namespace, precision: str, gpu: hardware.DeviceSpec, cfg: Any) -> list[str]:
    """The overrides that make ``--trace``'s step the one plan was asked for: each step flag given
    (:data:`STEP_FLAGS`; ``precision`` as the plan resolved it), as ``train`` spells it. What the
    trace cannot take is a PlanError in one line, before anything is traced."""
    if args.no_master_weights:
        raise PlanError("--trace traces the step train runs, and train keeps bf16-pure's fp32 master weights (it has "
                        "no setting without them): drop --no-master-weights or --trace")
    if args.loss == "fused":
        raise PlanError("--trace: --loss fused (Liger's Triton kernel) cannot be traced on fake tensors; plan prices "
                        "it as chunked: trace --loss chunked")
    if args.mfu is not None and _predicts(gpu, cfg):
        raise PlanError(f"--mfu assumes the MFU that --trace predicts for the planned step on {gpu.name}: give one "
                        "(--trace alone prices the run at the traced step's predicted MFU)")
    given = {**vars(args), "precision": precision}
    return [f"{key}={given[flag]}" for flag, key in STEP_FLAGS if given[flag] not in (None, "", 0)]


def _predicts(gpu: hardware.DeviceSpec, cfg: Any) -> bool:
    """Whether a dry run of ``cfg`` on ``gpu`` predicts a step time (tune/predict.py): the step
    model has the GPU's constants, and the step is not fp8."""
    try:
        steptime.gpu(gpu.name)
    except steptime.Unpredictable:
        return False
    return not (cfg is not None and cfg.train.fp8)


def _trace_plan(source: dict, plan: dict, args: argparse.Namespace, step: list[str]) -> dict:
    """``flopwise preflight --dry-run`` of the step the plan recommends: its batch and strategy
    on ``--gpus`` of ``--gpu`` (``--gpus-per-node`` to a node), with the ``step`` overrides
    (:func:`_asked_step`)."""
    gpus, per_node = args.gpus, args.gpus_per_node
    if gpus > per_node and gpus % per_node:
        raise PlanError(f"--trace: --gpus {gpus} is not whole nodes of --gpus-per-node {per_node}")
    traced = planned_step_config({**source, "overrides": [*source.get("overrides", []), *step]}, plan, gpus)

    def say(s: str) -> None:
        print(s, file=sys.stderr, flush=True)

    return dry_run(traced, gpu=args.gpu, nproc_per_node=min(gpus, per_node), nnodes=max(1, gpus // per_node),
                   memory_gb=args.memory_gb, headroom=args.headroom, network=args.network, log=say)


def planned_step_config(source: dict, plan: dict, gpus: int) -> Any:
    """The run config of the step ``plan`` recommends (its batch and strategy over ``gpus``), built
    from ``source`` (:func:`_plan_config`'s) as train builds it: what ``--trace`` traces."""
    b = plan["batch"]
    strategy = plan["fit"]["strategy"] if isinstance(plan.get("fit"), dict) else "auto"
    return build_config(**{**source, "overrides": [  # the user's overrides, then the planned step's
        *source.get("overrides", []), f"train.seq_len={b['seq_len']}", f"train.micro_batch_size={b['micro_batch']}",
        f"train.global_batch_size={b['global_batch']}", f"parallel.strategy={strategy if gpus > 1 else 'single'}"]},
        read_hf_config=_read_hf_config)


def _read_hf_config(path: str):
    """``flopwise.model.hf.read_hf_config``, imported (with torch) only for a config that
    names a Hugging Face ``model.hf_config``."""
    from flopwise.model.hf import read_hf_config  # lazy: torch

    return read_hf_config(path)


# Significant digits of a fraction in --json: far below what any figure there is accurate to, above
# float noise (a cap of 0.9 x 96 GiB printed as 86.3999999994412: 86.4), and enough that the figures
# still recompose (tokens x FLOPs per token = total FLOPs) to 1e-9.
JSON_DIGITS = 10


def json_figures(value: Any) -> Any:
    """``value`` with every float that is not a whole number rounded to :data:`JSON_DIGITS`
    significant digits (86.3999999994412 -> 86.4), as plan, the dry run and its --rank print and
    write their JSON; whole numbers (token and byte counts), strings and the rest as they are. The
    arithmetic behind the figures keeps its precision."""
    if isinstance(value, float):
        return value if value.is_integer() or not math.isfinite(value) else float(f"{value:.{JSON_DIGITS}g}")
    if isinstance(value, dict):
        return {k: json_figures(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_figures(v) for v in value]
    return value


def json_text(value: Any) -> str:
    """What ``--json`` prints: :func:`json_figures` of ``value``, indented."""
    return json.dumps(json_figures(value), indent=2, default=str)


def _print_notes(command: str, notes: list[str]) -> None:
    """One line each on stderr (rank 0 only): renamed keys and flags, how an auto was resolved."""
    if os.environ.get("RANK", "0") in ("", "0"):
        for note in notes:
            print(f"flopwise {command}: note: {note}", file=sys.stderr, flush=True)


def cmd_presets(args: argparse.Namespace) -> int:

    names = preset_names()
    width = max(map(len, names))
    for name in names:
        m = build_config(preset=name).model
        c = param_counts(m)
        active = f" ({c['active'] / 1e6:.1f}M active)" if m.is_moe else ""
        print(f"{name:<{width}}  {m.arch:<9} {c['total'] / 1e6:>7.1f}M params{active} · {m.n_layers} layers"
              f" · d_model {m.d_model} · heads {m.n_heads}/{m.n_kv_heads} · {m.mlp} · vocab {m.vocab_size:,}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run one command. The error boundary: a :class:`FlopwiseError` (bad input, a fault the
    user can fix) or a fault of the machine (a full or read-only disk, too little memory) ends
    in one line, ``flopwise COMMAND: what and where``, and exit status 2 -- its traceback only
    with ``--debug`` or ``FLOPWISE_DEBUG=1``. Anything else is a bug and keeps its traceback."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # said by the subcommand's parser: "flopwise train: unrecognized arguments: ..."
        args._commands[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    debug = args.debug or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("flopwise: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        line = user_error(e)
        if line is None or debug:
            raise
        # an error every rank of a torchrun job meets alike (a config, a plan too big): rank 0 says it once
        if not getattr(e, "every_rank", False) or os.environ.get("RANK", "0") in ("", "0"):
            print(f"flopwise {args.command}: {line}", file=sys.stderr)
        return 2


# errno -> what a write or a read of the file ran into: faults of the machine, not bugs
_FILE_FAULTS = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded",
                errno.EFBIG: "file too large for the filesystem", errno.EROFS: "read-only file system",
                errno.EACCES: "permission denied", errno.EPERM: "operation not permitted",
                errno.ENAMETOOLONG: "file name too long", errno.EIO: "input/output error"}


def user_error(e: BaseException) -> str | None:
    """The one line a user gets for ``e``, or None for a bug (whose traceback is shown)."""
    if isinstance(e, FlopwiseError):
        return " ".join(str(e).split("\n")) if not isinstance(e, ConfigError) else str(e)
    if isinstance(e, OSError) and e.errno in _FILE_FAULTS:
        where = e.filename if e.filename is not None else "a file"
        also = f" -> {e.filename2}" if getattr(e, "filename2", None) else ""
        return f"{where}{also}: {_FILE_FAULTS[e.errno]}"
    if is_disk_full(e):  # torch.save's zip writer: no errno, no file name
        return "no space left on the device (torch.save's writer failed)"
    text = str(e)
    if is_out_of_memory(e):
        first = text.strip().splitlines()[0][:300] if text.strip() else type(e).__name__
        return (f"out of memory: {first} (flopwise plan --config ... shows what fits; "
                "a smaller train.micro_batch_size or train.activation_checkpointing=full needs less)")
    return None
