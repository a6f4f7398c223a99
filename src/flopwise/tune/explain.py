"""``flopwise train --explain``: the graphs, graph breaks and their reasons when dynamo traces
the training loss on one real micro-batch of the run's configuration. Trains nothing."""

from __future__ import annotations

from typing import Any, Callable

import torch

from flopwise.config import RunConfig
from flopwise.model import build_model, configure_attention
from flopwise.model.loss import make_loss_fn
from flopwise.parallel.distributed import resolve_device
from flopwise.train.defaults import resolve_speed
from flopwise.train.precision import autocast_factory
from flopwise.train.precision import resolve as resolve_precision
from flopwise.train.setup import open_data, train_loader
from flopwise.train.wrap import apply_activation_checkpointing, explain


def explain_run(cfg: RunConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    device = resolve_device(cfg.train.device)
    prec = resolve_precision(cfg.train.precision, device)
    cfg, _ = resolve_speed(cfg, device, prec.name, 1)
    data = open_data(cfg, log)
    m, t = cfg.model, cfg.train
    loader = train_loader(cfg, data, device)
    model = build_model(m, device=device, seed=t.seed)
    configure_attention(model, device, prec.autocast_dtype or torch.float32)
    apply_activation_checkpointing(model, t.activation_checkpointing, t.activation_checkpointing_every)
    loss_fn = make_loss_fn(model, t.loss, t.loss_chunk_tokens)
    batch = loader.next_batch()
    loader.close()  # one batch is all it needs: stop a prefetch thread
    with autocast_factory(device, prec.autocast_dtype)():
        report = explain(lambda *b: loss_fn(*b)[0], *batch)
    log(f"explain: {report['graphs']} graph(s), {report['graph_breaks']} graph break(s) for one training "
        f"micro-batch ({t.micro_batch_size} x {t.seq_len}) of {cfg.preset}")
    for r in report["reasons"]:
        log(f"  break: {r}")
    if not report["graph_breaks"]:
        log("  no graph breaks: train.compile=model compiles the step as one graph")
    return report
