"""The ``flopwise`` command: one entry point, a subcommand per stage. Thin: parse, call, print."""

from __future__ import annotations

import argparse
import sys

from flopwise import __version__
from flopwise.config import DEFAULT_PRESET, ConfigError, build_config, preset_names

OVERRIDE_HELP = "section.key=value overrides, e.g. model.n_layers=4 optim.lr=1e-3 data.path=DIR"


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", help=f"named preset ({', '.join(preset_names())}); default {DEFAULT_PRESET}")
    p.add_argument("--config", help="YAML file with sections model/data/optim/train/eval")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help=OVERRIDE_HELP)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flopwise",
        description="Pretrain language models with performance discipline.",
    )
    parser.add_argument("--version", action="version", version=f"flopwise {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("train", help="train a model (no arguments: the tiny preset on the embedded corpus)")
    _add_config_args(p)
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("presets", help="list the shipped presets")
    p.set_defaults(func=cmd_presets)
    return parser


def cmd_train(args: argparse.Namespace) -> int:
    cfg = build_config(preset=args.preset, config_file=args.config, overrides=args.overrides)
    if args.print_config:
        print(cfg.to_yaml(), end="")
        return 0
    from flopwise.train.trainer import train  # imports torch: keep --help fast

    train(cfg, log=lambda s: print(s, flush=True))
    return 0


def cmd_presets(args: argparse.Namespace) -> int:
    from flopwise.plan.flops import param_counts

    for name in preset_names():
        m = build_config(preset=name).model
        n = param_counts(m)["total"]
        print(f"{name:<14} {m.arch:<6} {n / 1e6:>9.1f}M params · {m.n_layers} layers · d_model {m.d_model}"
              f" · heads {m.n_heads}/{m.n_kv_heads} · vocab {m.vocab_size:,}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"flopwise {args.command}: {e}", file=sys.stderr)
        return 2
    except ValueError as e:  # data errors (DataDirError, ShardError) name the file and the problem
        from flopwise.data import DataDirError, ShardError

        if not isinstance(e, (DataDirError, ShardError)):
            raise
        print(f"flopwise {args.command}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("flopwise: interrupted", file=sys.stderr)
        return 130
