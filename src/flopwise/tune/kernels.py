"""The traced step as a list of GPU kernels: what the step-time model (``plan/steptime.py``) reads.

:class:`KernelLog` is a dispatch mode on the dry run's reported eager step (``tune/worker.py``).
Each aten op the step dispatches on the fake GPU becomes one record -- a kernel as an eager CUDA
run launches it -- with what the time model needs and nothing it does not:

- its kind: ``mm`` (a matrix multiply: M, N, K, batch, dtype), ``attn`` (an SDPA kernel: which one,
  forward or backward, its shapes and causality), ``coll`` (a collective: its bytes, its group's size and ranks),
  ``sync`` (a host read of device data: the host waits for the GPU), ``mem`` (anything else: it
  moves bytes);
- the values it reads and writes, each ``[id, bytes]``: each storage's writes are numbered, so a
  later op reading a value names the op that made it. The model fuses the step's elementwise ops
  under compile by that (a fused region reads what comes from outside it and writes what is read
  outside it), and it makes a compute op wait for the collective whose output it reads;
- the phase (``forward``, ``backward`` -- autograd is running a node --, ``step``: the optimizer
  and the rest) and the micro-batch it belongs to;
- ``graph``: whether the run launches it from a compiled graph (:meth:`KernelLog.compiled_region`:
  the blocks under ``compile=blocks``, the loss function under ``compile=model``) or eagerly (the
  loss after compiled blocks, DDP's and FSDP2's hooks, gradient accumulation, the optimizer). Only
  a graph's elementwise ops are fused, and only its kernels launch without Python's dispatch;
- ``host``: the ops the host dispatched for it, views and allocations included (they cost host
  time and launch nothing).

Views, allocations and the trace's own random batches (a real run copies them in from the host)
launch no kernel. Nothing here is a time: the arithmetic is ``plan/steptime.py``'s.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

ATTENTION = {
    "_scaled_dot_product_flash_attention": ("flash", "fwd"),
    "_scaled_dot_product_flash_attention_backward": ("flash", "bwd"),
    "_scaled_dot_product_efficient_attention": ("efficient", "fwd"),
    "_scaled_dot_product_efficient_attention_backward": ("efficient", "bwd"),
    "_scaled_dot_product_cudnn_attention": ("cudnn", "fwd"),
    "_scaled_dot_product_cudnn_attention_backward": ("cudnn", "bwd"),
    "_flash_attention_forward": ("flash", "fwd"),
    "_flash_attention_backward": ("flash", "bwd"),
    "_efficient_attention_forward": ("efficient", "fwd"),
    "_efficient_attention_backward": ("efficient", "bwd"),
}
# matrix multiplies, in place (``addmm_``: a sum of products into its first argument) included
# (``_scaled_mm``: fp8 inputs with their scales, what torchao's float8 linears run)
MATMUL = frozenset({"mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "addmm_", "baddbmm_", "_scaled_mm"})
# ops that make a tensor without writing it, or only describe another's storage: no kernel
NO_KERNEL = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh",
                       "_local_scalar_dense", "is_same_size", "set_", "resize_", "record_stream", "wait_tensor",
                       "randint", "_to_copy_host"})
SYNCING = frozenset({"_local_scalar_dense", "item", "nonzero", "masked_select", "unique_consecutive", "_unique2",
                     "equal", "is_nonzero"})
WRITE_ONLY = frozenset({"copy_", "fill_", "zero_", "uniform_", "normal_", "random_", "full", "zeros", "ones",
                        "zeros_like", "ones_like", "full_like", "fill"})


def _tensors(x: Any) -> list[torch.Tensor]:
    out, stack = [], [x]
    while stack:
        a = stack.pop()
        if isinstance(a, (list, tuple)):
            stack.extend(a)
        elif isinstance(a, dict):
            stack.extend(a.values())
        elif isinstance(a, torch.Tensor):
            out.append(a)
    return out


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


# Tensor types whose ops are recorded as they come (DTensor's are skipped in _record, its local ops
# recorded); any other subclass handles its ops itself, with the log on (KernelLog.__torch_dispatch__).
PASS_THROUGH = frozenset({"FakeTensor", "DTensor", "Tensor", "Parameter", "FunctionalTensor"})


class KernelLog(TorchDispatchMode):
    """The records of the ops dispatched while it is on the stack (see the module docstring).
    ``phase`` is set by the caller around the forward (``"forward"``); ``micro`` counts forwards."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[dict[str, Any]] = []
        self.phase = "step"
        self.micro = 0
        self._version: dict[int, int] = {}  # storage -> the id of the value it holds now
        self._next_id = 0
        self._host = 0  # ops dispatched since the last record
        self._graph_depth = 0  # compiled regions the forward is inside now

    # -------------------------------------------------------------- compiled regions

    def compiled_region(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` (a module's forward call, or the whole loss function) marked as one region the run
        compiles: the ops its forward dispatches are the graph's, and so are those of the autograd
        nodes it made -- its backward -- which the backward finds by a flag in each node's
        ``metadata``. What runs in the region's backward from nodes made outside it (gradient
        accumulation, DDP's and FSDP2's hooks) is not."""
        def region(*args: Any, **kwargs: Any) -> Any:
            bounds = {id(t.grad_fn) for t in _tensors((args, kwargs)) if t.grad_fn is not None}
            self._graph_depth += 1
            try:
                out = fn(*args, **kwargs)
            finally:
                self._graph_depth -= 1
            _mark_graph_nodes([t.grad_fn for t in _tensors(out) if t.grad_fn is not None], bounds)
            return out
        return region

    def start_forward(self) -> None:
        self.micro += 1
        self.phase = "forward"

    def end_forward(self) -> None:
        self.phase = "step"

    def __torch_dispatch__(self, func: Any, types_: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if any(t.__name__ not in PASS_THROUGH for t in types_):
            # a tensor subclass that runs other ops for this one (torchao's float8 tensors: mm ->
            # casts and _scaled_mm): it handles the op with this mode still on, so those come here
            return NotImplemented
        out = func(*args, **kwargs)
        try:
            self._record(func, args, kwargs, out)
        except Exception:  # noqa: BLE001 - a record it cannot make is a host op, never the step's failure
            self._host += 1
        return out

    # -------------------------------------------------------------- one op

    def _value(self, t: torch.Tensor, write: bool) -> int:
        key = t.untyped_storage()._cdata
        if write or key not in self._version:
            self._version[key] = self._next_id
            self._next_id += 1
        return self._version[key]

    def _record(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        if func.namespace not in ("aten", "c10d", "_c10d_functional"):
            return  # prim.device and the like: a question about a tensor, no op
        self._host += 1
        name = func.__name__.split(".")[0] if hasattr(func, "__name__") else str(func)
        packet = func._overloadpacket.__name__ if hasattr(func, "_overloadpacket") else name
        ins = [t for t in _tensors((args, kwargs)) if t.device.type == "cuda"]
        outs = [t for t in _tensors(out) if t.device.type == "cuda"]
        if any(type(t) is not FakeTensor for t in (*ins, *outs)):
            self._host -= 1  # a DTensor's op: what it runs on its local shards comes through here too
            return
        if packet in NO_KERNEL or (not ins and not outs):
            return
        if func.namespace in ("c10d", "_c10d_functional"):
            self._add("coll", packet, ins, outs, {"bytes": max(map(_nbytes, ins + outs), default=0),
                                                  **_group(args)})
            return
        if packet in SYNCING:
            self._add("sync", packet, ins, [], {})
            return
        if packet in ("_to_copy", "copy_") and _to_host(packet, args, kwargs):
            self._add("sync" if _waits(packet, args, kwargs) else "mem", packet, ins, [], {})
            return
        mutated = _mutated(func, args, kwargs)
        written = _written_only(func, args, kwargs)  # an out= argument: written, never read
        if written:
            ins = [t for t in ins if all(t is not w for w in written)]
        ins_storages = {t.untyped_storage()._cdata for t in ins}
        if (outs and not mutated and not packet.endswith("_")
                and all(t.untyped_storage()._cdata in ins_storages for t in outs)):
            return  # a view of an input: no kernel (an op writing into an argument is no view)
        if packet in MATMUL:
            self._add("mm", packet, ins, outs, _mm_shape(packet, args, func, kwargs, out), mutated)
        elif packet in ATTENTION:
            self._add("attn", packet, ins, outs, _attention(packet, args, kwargs, func, out), mutated)
        else:
            self._add("mem", packet, ins, outs, {}, mutated)

    def _add(self, kind: str, op: str, ins: list[torch.Tensor], outs: list[torch.Tensor],
             detail: dict[str, Any], mutated: list[torch.Tensor] | None = None) -> None:
        """One record. An op that only writes (``copy_``'s destination, ``fill_``, a factory) does
        not read what it overwrites; an in-place op reads and writes its mutated arguments."""
        mutated = [t for t in (mutated or []) if t.device.type == "cuda"]
        skip = {id(t) for t in mutated} if op in WRITE_ONLY else set()
        read = [t for t in ins if id(t) not in skip]
        reads = {self._value(t, False): _nbytes(t) for t in read}  # a value read twice is read once
        written = list({id(t): t for t in (*outs, *mutated)}.values())
        writes = {self._value(t, True): _nbytes(t) for t in written}
        record = {"kind": kind, "op": op, "reads": [[v, n] for v, n in reads.items()],
                  "writes": [[v, n] for v, n in writes.items()], "phase": self._phase(), "micro": self.micro,
                  "host": self._host, "graph": self._in_graph()}
        record.update(detail)
        self.records.append(record)
        self._host = 0

    def _phase(self) -> str:
        return "backward" if torch._C._current_autograd_node() is not None else self.phase

    def _in_graph(self) -> bool:
        node = torch._C._current_autograd_node()
        if node is not None:
            return bool(getattr(node, "metadata", {}).get(GRAPH_FLAG))  # a dict (torch's stub: a method)
        return self._graph_depth > 0

    def tail(self) -> int:
        """Host ops dispatched after the last record (views at the step's end)."""
        return self._host


GRAPH_FLAG = "flopwise_compiled"  # set in the metadata of an autograd node a compiled region made


def _mark_graph_nodes(roots: list[Any], bounds: set[int]) -> None:
    """Flag the autograd nodes a compiled region made: every node reachable from its outputs'
    ``roots`` without passing a node its inputs came from (``bounds``, by id) or a leaf's
    gradient accumulator (accumulation runs eagerly, after the graph's backward)."""
    stack, seen = list(roots), set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen or id(node) in bounds:
            continue
        seen.add(id(node))
        if node.name().endswith("AccumulateGrad") or node.metadata.get(GRAPH_FLAG):
            continue
        node.metadata[GRAPH_FLAG] = True
        stack.extend(n for n, _ in node.next_functions)


def _mutated(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors an op writes in place, by its schema (``Tensor(a!)``): all of a list's."""
    out = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            out += _tensors(value)
    return out


def _written_only(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The ``out=`` arguments of an op (``torch.mm(a, b, out=z)``): what it writes without
    reading them (an in-place op's ``self`` it both reads and writes)."""
    out = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.is_out:
            out += _tensors(args[i] if i < len(args) else kwargs.get(arg.name))
    return out


def _group(args: tuple) -> dict[str, Any]:
    """A collective's process group: ``group``, its size, and ``ranks``, its members' global ranks
    (whether it crosses nodes: DiLoCo's outer group is 2 ranks on 2 nodes). A c10d op carries the
    group boxed (a ScriptObject, whose ``size`` Python cannot see: unboxed here), a functional one
    by name; the whole world when neither resolves."""
    for a in args:
        group: Any = None
        if isinstance(a, torch.ScriptObject):
            try:
                group = dist.ProcessGroup.unbox(a)
            except Exception:  # noqa: BLE001 - another boxed argument (the ReduceOp)
                continue
        elif isinstance(a, str):
            try:
                group = dist.distributed_c10d._resolve_process_group(a)  # type: ignore[arg-type]  # a name
            except Exception:  # noqa: BLE001 - a name not a group's: the next argument
                continue
        elif isinstance(a, dist.ProcessGroup):
            group = a
        if group is not None:
            try:
                ranks = [int(r) for r in dist.get_process_group_ranks(group)]
            except Exception:  # noqa: BLE001 - a group the default one does not know: its size alone
                return {"group": int(group.size())}
            return {"group": len(ranks), "ranks": ranks}
    world = dist.get_world_size() if dist.is_initialized() else 1
    return {"group": world, "ranks": list(range(world))}


def _to_host(packet: str, args: tuple, kwargs: dict) -> bool:
    if packet == "copy_":
        return isinstance(args[0], torch.Tensor) and args[0].device.type == "cpu"
    device = kwargs.get("device")
    return device is not None and torch.device(device).type == "cpu"


def _waits(packet: str, args: tuple, kwargs: dict) -> bool:
    """A copy to the host the host waits for (not ``non_blocking`` into pinned memory)."""
    if packet == "copy_":
        return not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
    return not kwargs.get("non_blocking", False)


def _flops(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    """torch's own FLOP count of an op (FlopCounterMode's formulas); 0 for one it has none for."""
    formula = flop_registry.get(func._overloadpacket)
    return int(formula(*args, **kwargs, out_val=out)) if formula is not None else 0


def _mm_shape(packet: str, args: tuple, func: Any, kwargs: dict, out: Any) -> dict[str, Any]:
    """M, N, K and batch of a matrix multiply, its FLOPs (torch's own count) and its input dtype."""
    a, b = (args[1], args[2]) if packet.rstrip("_") in ("addmm", "baddbmm") else (args[0], args[1])
    flops = _flops(func, args, kwargs, out)
    if packet == "_grouped_mm":  # (S, K) x (G, K, N): the experts' rows as one M
        m, k = (a.shape[-2], a.shape[-1])
        n = b.shape[-1]
        # each row meets one expert's weights: 2·M·N·K, as the dry run's FlopCounterMode counts it
        # (tune/worker.py GROUPED_MM_FLOPS; torch's own formula, where it has one, counts every group)
        return {"m": int(m), "n": int(n), "k": int(k), "batch": 1, "flops": 2 * int(m) * int(n) * int(k),
                "dtype": _dtype(a)}
    batch = a.shape[0] if a.dim() == 3 else 1
    return {"m": int(a.shape[-2]), "n": int(b.shape[-1]), "k": int(a.shape[-1]), "batch": int(batch),
            "flops": flops, "dtype": _dtype(a)}


def _attention(packet: str, args: tuple, kwargs: dict, func: Any, out: Any) -> dict[str, Any]:
    """Which SDPA kernel, forward or backward, its shapes, causality and FLOPs (torch's count: the
    whole score matrix; a causal kernel skips the masked half, which the time model takes off)."""
    kernel, way = ATTENTION[packet]
    q, k = (args[1], args[2]) if way == "bwd" else (args[0], args[1])
    schema_args = {a.name: (args[i] if i < len(args) else kwargs.get(a.name))
                   for i, a in enumerate(func._schema.arguments)}
    causal = bool(schema_args.get("is_causal") or schema_args.get("causal")
                  or schema_args.get("custom_mask_type"))  # the raw efficient kernel's 1 and 2 are causal
    flops = _flops(func, args, kwargs, out)
    if packet.startswith("_scaled_dot_product"):  # (B, H, T, D)
        batch, heads, kv_heads, q_len, k_len = q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    elif q.dim() == 4:  # the raw kernels: (B, T, H, D)
        batch, heads, kv_heads, q_len, k_len = q.shape[0], q.shape[2], k.shape[2], q.shape[1], k.shape[1]
    else:  # varlen (total, H, D): sequences of at most max_q tokens, priced as if each were that long
        longest = int(schema_args.get("max_q") or schema_args.get("max_seqlen_q") or q.shape[0])
        batch, heads, kv_heads = max(1, q.shape[0] // max(longest, 1)), q.shape[1], k.shape[1]
        q_len = k_len = min(longest, q.shape[0])
    return {"kernel": kernel, "way": way, "batch": int(batch), "heads": int(heads), "kv_heads": int(kv_heads),
            "q_len": int(q_len), "k_len": int(k_len), "head_dim": int(q.shape[-1]), "causal": causal,
            "flops": flops, "dtype": _dtype(q)}
