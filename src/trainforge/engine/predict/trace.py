"""One training step run on fake tensors: its peak memory by kind, and every op it dispatches.

No weights are loaded and nothing is computed: the model is built on the meta device, moved
to fake storage (``FakeTensorMode``), and the run's own step code (``loss_sum``, backward,
``optimizer_step``) runs once to set up the optimizer state and once more under ``StepTracer``,
which sees every tensor the step allocates and frees. That second step is the steady state:
weights, optimizer state and (with accumulation) the gradients of earlier micro-batches already
exist when it starts. The same approach as torch's ``MemTracker`` (torchtitan's memory
estimator), in a lighter form: ``MemTracker`` snapshots every module at every op, which took
12 s per step on a 98M model here; this tracer keeps five counters and took under 2 s.

The batch is the worst case: full rows of ``data.max_length`` tokens (grpo: + completion), every position a target.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map_only

from ...hardware.heap import GLIBC_MAX_MMAP_THRESHOLD
from .qlora_standin import quantize_base_4bit
from .trace_cache import remembered

if TYPE_CHECKING:
    from ...config.run import RunConfig
    from ...hardware.device import Precision

KINDS = ("weights", "grads", "optimizer", "activations", "temporaries")
FLOAT8_TENSOR = "Float8TrainingTensor"  # torchao's FP8 operand (train.fp8): its ops are priced at the FP8 rate

# ops that only relabel memory (views) or cost nothing worth timing
_FREE_OPS = {
    getattr(torch.ops.aten, n)
    for n in (
        "view", "_unsafe_view", "t", "transpose", "permute", "expand", "expand_as", "unsqueeze", "squeeze",
        "select", "slice", "split", "split_with_sizes", "unbind", "as_strided", "detach", "alias", "lift_fresh",
        "view_as", "unflatten", "chunk", "diagonal", "_reshape_alias", "reshape", "narrow", "empty", "empty_like",
        "empty_strided", "new_empty", "new_empty_strided", "scalar_tensor", "arange", "_local_scalar_dense",
        "is_same_size", "set_",
    )
    if hasattr(torch.ops.aten, n)
}
# SDPA kernels torch's FLOP counter leaves out: the CPU flash kernel a plan's fake-tensor trace runs, for
# every device it plans for; the value: its FLOPs over the forward's (backward: dQ, dK, dV, dP and the
# scores recomputed, five products to the forward's two)
ATTENTION_OPS = {"_scaled_dot_product_flash_attention_for_cpu": 1.0, "_scaled_dot_product_flash_attention_for_cpu_backward": 2.5}
# a random draw, and a comparison of one: LayerDrop's ``torch.rand([]) < layerdrop`` in BART, Whisper and kin
_RANDOM_DRAWS = {torch.ops.aten.rand, torch.ops.aten.uniform, torch.ops.aten.uniform_}
_COMPARISONS = {torch.ops.aten.lt, torch.ops.aten.le, torch.ops.aten.gt, torch.ops.aten.ge}


@dataclass(frozen=True)
class TensorSpec:
    """Shape, strides and dtype of a traced tensor: enough to make a real one and time the op."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    def materialize(self) -> torch.Tensor:
        t = torch.empty_strided(self.shape, self.stride, dtype=self.dtype)
        return t.normal_() if t.is_floating_point() else t.zero_()  # zeros: valid indices for any gather


@dataclass(frozen=True)
class OpRecord:
    """One dispatched op: what it computes and moves, for the time model."""

    name: str
    flops: float
    bytes: int  # read + written
    dtype: str  # of its first floating input: which peak FLOP/s applies
    phase: str  # forward | backward | optimizer
    func: object = None  # the aten overload, with ``args``: replayable on real tensors (see engine/timing.py)
    args: object = None  # (args, kwargs) with tensors as TensorSpec
    key: str = ""  # equal for ops that do the same work on the same shapes


@dataclass
class StepTrace:
    """Peak memory of one step split by kind (bytes, at the moment of the peak), and its ops."""

    peak: int
    parts: dict[str, int]
    ops: list[OpRecord] = field(default_factory=list)
    tokens: int = 0  # tokens of the traced micro-batch
    largest_layer: int = 0  # bytes of the largest decoder layer's weights (FSDP gathers one at a time)
    trainable_grads: int = 0  # bytes of all gradients (DDP keeps a second copy in its buckets)
    fewer_ops: list[OpRecord] | None = None  # a deep model: ops of the shallower trace (``ops``: the deeper)
    extrapolate: float = 0.0  # ... and the model's depth beyond the deeper trace, in units of their difference
    mapped: int = 0  # bytes at the peak in storages of 32 MiB or more: a CPU heap (glibc) maps each on its own, keeps none

    @property
    def flops(self) -> float:
        deep = sum(o.flops for o in self.ops)
        return deep + self.extrapolate * (deep - sum(o.flops for o in self.fewer_ops or ()))


def _storages(out: object) -> Iterator[torch.UntypedStorage]:
    for t in tree_flatten(out)[0]:
        if isinstance(t, torch.Tensor):
            try:
                yield t.untyped_storage()
            except (NotImplementedError, RuntimeError):  # a tensor subclass without a plain storage
                continue


class StepTracer(TorchDispatchMode):
    """Counts live tensor bytes by kind while a step runs; records each op's FLOPs and bytes.

    Tensors that exist before the trace are registered with ``track``; every tensor an op
    creates counts as an activation (forward), a temporary (backward, optimizer) or, once
    accumulated into ``.grad``, a gradient. Each storage counts once, however many views it has.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[str, int]] = {}  # id(storage) -> (kind, bytes)
        self.current = dict.fromkeys(KINDS, 0)
        self.peak, self.peak_parts = 0, dict(self.current)
        self.mapped = self.peak_mapped = 0  # live bytes in storages glibc always maps (GLIBC_MAX_MMAP_THRESHOLD and up)
        self.phase = "forward"
        self.ops: list[OpRecord] = []
        self.tile_ops = self.ops  # the tiled MLP traces a few tiles and records the rest's ops here (model/tiled_mlp.py)
        self._hooks: list = []
        self._draws: dict[int, weakref.ref] = {}  # id -> scalar tensor drawn at random (or compared with one)

    # -------------------------------------------------------------- bookkeeping
    def _add(self, st: torch.UntypedStorage, kind: str) -> None:
        key = id(st)
        if key in self.live:
            return
        n = st.nbytes()
        self.live[key] = (kind, n)
        self.current[kind] += n
        self.mapped += n if n >= GLIBC_MAX_MMAP_THRESHOLD else 0
        weakref.finalize(st, self._release, key)

    def _release(self, key: int) -> None:
        kind, n = self.live.pop(key, (None, 0))
        if kind is not None:
            self.current[kind] -= n
            self.mapped -= n if n >= GLIBC_MAX_MMAP_THRESHOLD else 0

    def _relabel(self, st: torch.UntypedStorage, kind: str) -> None:
        old = self.live.get(id(st))
        if old is None:
            self._add(st, kind)
        elif old[0] != kind:
            self.current[old[0]] -= old[1]
            self.current[kind] += old[1]
            self.live[id(st)] = (kind, old[1])

    def _note_peak(self) -> None:
        total = sum(self.current.values())
        if total > self.peak:
            self.peak, self.peak_parts, self.peak_mapped = total, dict(self.current), self.mapped

    def track(self, tensors: object, kind: str) -> None:
        """Count tensors that exist before the traced step (weights, optimizer state, earlier gradients)."""
        for st in _storages(tensors):
            self._add(st, kind)
        self._note_peak()

    def watch_grads(self, params: list[torch.nn.Parameter]) -> None:
        """Count a parameter's gradient as ``grads`` once backward has accumulated it."""
        for p in params:
            if p.requires_grad:
                self._hooks.append(p.register_post_accumulate_grad_hook(lambda q: self._relabel(q.grad.untyped_storage(), "grads")))

    def track_training_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, params: list) -> None:
        """Count what a step starts with: weights and buffers, gradients left by earlier micro-batches,
        optimizer state; and each gradient backward accumulates from here on."""
        self.track([*model.parameters(), *model.buffers()], "weights")
        self.track([p.grad for p in params if p.grad is not None], "grads")
        self.track([v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)], "optimizer")
        self.watch_grads(params)

    @contextlib.contextmanager
    def in_phase(self, phase: str) -> Iterator[None]:
        before, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = before

    def close(self) -> None:
        for h in self._hooks:
            h.remove()

    # -------------------------------------------------------------- dispatch
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - the dispatcher's signature
        kwargs = kwargs or {}
        packet = func._overloadpacket
        if func is torch.ops.aten._local_scalar_dense.default and self._is_fake_draw(args[0]):
            # a fake tensor has no value to branch on: LayerDrop's coin reads "keep the layer", the full step
            return False
        out = func(*args, **kwargs)
        if packet in _RANDOM_DRAWS or (packet in _COMPARISONS and any(self._is_draw(a) for a in args)):
            if isinstance(out, torch.Tensor) and out.dim() == 0:
                self._draws[id(out)] = weakref.ref(out)
        kind = "activations" if self.phase == "forward" else "temporaries"
        for st in _storages(out):
            self._add(st, kind)
        self._note_peak()
        if packet not in _FREE_OPS and func.namespace != "prim":  # prim ops (device, layout queries) do no work
            self.ops.append(self._record(func, packet, args, kwargs, out))
        return out

    def _is_draw(self, t: object) -> bool:
        ref = self._draws.get(id(t))  # by id: == on tensors is elementwise, and on fake ones has no answer
        return ref is not None and ref() is t

    def _is_fake_draw(self, t: object) -> bool:
        from torch._subclasses.fake_tensor import FakeTensor

        return isinstance(t, FakeTensor) and t.dtype == torch.bool and self._is_draw(t)

    def _record(self, func, packet, args, kwargs, out) -> OpRecord:  # noqa: ANN001
        from torch.utils.flop_counter import flop_registry  # here, not at the top: it imports triton (~1 s of start-up)

        flops = 0.0
        name = str(packet).removeprefix("aten.")
        counter = flop_registry.get(packet)
        if name in ATTENTION_OPS:
            flops = attention_flops(func, args, kwargs) * ATTENTION_OPS[name]
        elif counter is not None:
            try:
                flops = float(counter(*args, **kwargs, out_val=out))
            except Exception:  # a formula that does not take this overload: time it by its bytes
                flops = 0.0
        given = {k: v for k, v in kwargs.items() if k != "out"}  # an out= tensor is the result: counted once, as written
        tensors = [t for t in tree_flatten((args, given, out))[0] if isinstance(t, torch.Tensor)]
        moved = sum(t.numel() * t.element_size() for t in tensors)
        # a GEMM runs at its operands' rate: the narrowest floating input (an fp32-accumulating addmm of bf16
        # operands is a bf16 GEMM); elementwise ops are priced by their bytes, whatever this says
        operands = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
        floats = [t.dtype for t in tensors if t.is_floating_point()]
        narrowest = min(operands, key=lambda t: t.element_size()).dtype if operands else (floats[0] if floats else None)
        dtype = str(narrowest).removeprefix("torch.") if narrowest is not None else "none"
        if any(type(t).__name__ == FLOAT8_TENSOR for t in tensors):
            dtype = "float8"  # torchao's FP8 operands report their original dtype; the matmul runs at the FP8 rate
        spec = tree_map_only(torch.Tensor, lambda t: TensorSpec(tuple(t.shape), tuple(t.stride()), t.dtype), (args, kwargs))
        return OpRecord(name, flops, moved, dtype, self.phase, func, spec, f"{func}{spec}")


def attention_flops(func, args: tuple, kwargs: dict) -> float:  # noqa: ANN001 - an OpOverload
    """Forward FLOPs of one of ``ATTENTION_OPS``: Q K^T and P V over (batch, heads, queries, keys), halved
    where the kernel is causal with no mask (flash kernels skip the masked blocks)."""
    named = {a.name: v for a, v in zip(func._schema.arguments, args)} | kwargs
    q, k, v = named["query"], named["key"], named["value"]
    *lead, queries, head_dim = q.shape
    pairs = math.prod(lead) * queries * k.shape[-2]
    flops = 2.0 * pairs * (head_dim + v.shape[-1])
    return flops / 2 if named.get("is_causal") and named.get("attn_mask") is None else flops


# ---------------------------------------------------------------------------------- the traced step
FEW_LAYERS = (1, 2)  # deeper models are traced at these depths and extrapolated per layer (exact: tests)
# with activation offload the boundary below the one in backward is brought back early (engine/offload.py): two are
# on the device from two layers on, so the per-layer slope is measured where both depths hold two
OFFLOAD_FEW_LAYERS = (2, 3)


def trace_training_step(
    cfg: "RunConfig",
    tokenizer,
    precision: "Precision",
    micro_batch_size: int,
    activation_checkpointing: bool,
    grad_accum: int = 1,
    device_type: str = "cpu",
    kernels: str = "torch",
) -> StepTrace:
    """Peak memory and ops of one steady-state training step of ``cfg`` at this micro-batch size.

    ``device_type``: the device the plan is for; the step is traced on fake CPU tensors either
    way, with that device's loss chunking. With ``grad_accum`` > 1 the traced micro-batch is a
    later one: the gradients of the earlier ones already exist. ``kernels``: ``liger`` traces Liger's
    RMSNorm and SwiGLU through stand-ins that keep what they keep (kernel_standins.py).

    A model deeper than ``FEW_LAYERS[1]`` is traced at two small depths and each part of its peak
    extrapolated linearly in the number of layers (every layer holds the same weights, state and
    saved activations; embeddings, head and loss do not grow): a 32-layer model costs two shallow
    traces instead of one deep one. ``layers``/``fewer_ops`` let the time model extrapolate alike.
    An encoder-decoder's two stacks shrink and grow together (one step adds an encoder and a decoder
    layer); its batch is the worst case of both sides: ``max_length`` source and ``max_target_length``
    target tokens in every row.
    """
    # the settings that decide the trace: the whole config, the tokenizer (kept alive by the key), the rest
    key = (cfg.model_dump_json(), tokenizer, precision.name, micro_batch_size, activation_checkpointing, grad_accum,
           device_type, kernels)
    return remembered(key, lambda: _trace_step(cfg, tokenizer, precision, micro_batch_size, activation_checkpointing,
                                               grad_accum, device_type, kernels))


def _trace_step(cfg, tokenizer, precision, micro_batch_size, activation_checkpointing, grad_accum, device_type, kernels):
    from ...model.load import model_depth

    known = model_depth(cfg.model)
    depth = known[1] if known else None
    few = OFFLOAD_FEW_LAYERS if activation_checkpointing and cfg.train.activation_offload is True else FEW_LAYERS
    if depth is None or depth <= few[1]:
        return _trace(cfg, tokenizer, precision, micro_batch_size, activation_checkpointing, grad_accum, device_type, None, kernels)
    a, b = (_trace(cfg, tokenizer, precision, micro_batch_size, activation_checkpointing, grad_accum, device_type, n, kernels)
            for n in few)
    scale = (depth - few[1]) / (few[1] - few[0])
    parts = {k: int(round(b.parts[k] + scale * (b.parts[k] - a.parts[k]))) for k in b.parts}
    grads = int(round(b.trainable_grads + scale * (b.trainable_grads - a.trainable_grads)))
    mapped = max(0, int(round(b.mapped + scale * (b.mapped - a.mapped))))  # fit.predict_memory keeps it within the tensors
    return StepTrace(sum(parts.values()), parts, b.ops, b.tokens, b.largest_layer, grads, fewer_ops=a.ops, extrapolate=scale,
                     mapped=mapped)


def _trace(
    cfg: "RunConfig",
    tokenizer,
    precision: "Precision",
    micro_batch_size: int,
    activation_checkpointing: bool,
    grad_accum: int,
    device_type: str,
    layers: int | None,
    kernels: str = "torch",
) -> StepTrace:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ...data.loader import Batch, padded_width
    from ...model.load import build_model_skeleton
    from ..loss import chunk_as
    from ..optim import build_optimizer, optimizer_state_bytes
    from ...model.fp8 import apply_fp8, fp8_recipe
    from ..step import loss_sum, optimizer_step
    from .kernel_standins import use_liger_stand_ins
    from .moe import nf4_experts_priced, trace_experts

    cpu = torch.device("cpu")
    skeleton = build_model_skeleton(cfg.model, tokenizer, precision.autocast_dtype, activation_checkpointing, layers)
    # a decoder's row: data.max_length (+ a grpo completion); an encoder-decoder's target side is its own
    rows, length = micro_batch_size, cfg.data.max_length if cfg.model.kind.encoder_decoder else cfg.row_tokens()
    if cfg.data.packing is False:  # one example per row, padded to a multiple of PAD_MULTIPLE (the collators)
        length = padded_width(length)
    with FakeTensorMode(allow_non_fake_inputs=True), chunk_as(device_type), _quiet_warnings():
        model = to_empty_keeping_ties(skeleton, cpu)
        if cfg.model.method == "qlora":
            quantize_base_4bit(model, precision.autocast_dtype or torch.float32)
        if kernels == "liger":
            use_liger_stand_ins(model)
        trace_experts(model, cfg.model.experts_implementation, device_type, precision.autocast_dtype)  # MoE: static routing (moe.py)
        if fp8_recipe(cfg.train.fp8) and cfg.model.method != "qlora":
            apply_fp8(model, fp8_recipe(cfg.train.fp8))  # torchao's layers run on fake tensors: their casts are traced
        apply_traced_levers(model, cfg, activation_checkpointing, device_type)
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        # torch's AdamW stands in for every optim.name (low-bit kernels do not run on fake tensors); its
        # fp32 state is replaced below by the configured optimizer's bytes, which exist the whole step
        optimizer = build_optimizer(model, cfg.optim.model_copy(update={"name": "adamw", "offload": "none"}), cpu)
        ids = torch.zeros((rows, length), dtype=torch.long)
        if cfg.model.kind.encoder_decoder:  # source into the encoder (a padding mask, as batches have), target out
            target = torch.zeros((rows, padded_width(cfg.data.target_limit())), dtype=torch.long)
            batch = Batch(ids, target, None, ids.numel() + target.numel(), target.numel(), list(range(rows)),
                          torch.ones_like(ids), target)
        else:
            batch = Batch(ids, ids, None, rows * length, rows * length, list(range(rows)))
        fused = cfg.train.fused_loss

        def leave_gradients() -> None:
            # what a backward leaves on each trainable weight (its own dtype and shape), without running one:
            # an untraced forward and backward here would cost as much as the traced step itself
            for p in params:
                p.grad = torch.zeros_like(p)

        leave_gradients()
        optimizer_step(params, optimizer, cfg.optim.max_grad_norm, None, None)  # untraced: creates the optimizer state
        if grad_accum > 1:
            leave_gradients()  # the gradients earlier micro-batches leave behind
        tracer = StepTracer()
        tracer.track_training_state(model, optimizer, params)
        try:
            with tracer:
                with tracer.in_phase("forward"):
                    loss = loss_sum(model, batch, precision, fused)
                with tracer.in_phase("backward"):
                    (loss / batch.n_targets).backward()
                    del loss
                with tracer.in_phase("optimizer"):
                    optimizer_step(params, optimizer, cfg.optim.max_grad_norm, None, None)
        finally:
            tracer.close()
    layers = [m for m in model.modules() if type(m).__name__.endswith(("DecoderLayer", "EncoderLayer", "Block"))]
    largest = max((sum(_bytes(p) for p in m.parameters()) for m in layers), default=0)
    grads = sum(_bytes(p) for p in params)
    parts, peak = dict(tracer.peak_parts), tracer.peak
    if cfg.optim.name != "adamw" or cfg.optim.offload != "none":  # adamw: the traced state is the real one
        on_device, _ = optimizer_state_bytes(params, cfg.optim)
        peak += on_device - parts["optimizer"]
        parts["optimizer"] = on_device
    if cfg.model.method == "qlora":  # MoE: the routed experts in NF4, each dequantized for its GEMM (nf4_experts.py)
        peak = nf4_experts_priced(model, parts, peak, precision.autocast_dtype or torch.float32)
    return StepTrace(peak, parts, tracer.ops, batch.n_tokens, largest, grads, mapped=tracer.peak_mapped)


def apply_traced_levers(model: torch.nn.Module, cfg: "RunConfig", activation_checkpointing: bool, device_type: str) -> None:
    """The long-context levers ``cfg`` sets to true, as the run applies them: the tiled MLP as it is, activation
    offload (planned for a GPU, with checkpointing) as a stand-in whose boundaries leave the device."""
    if cfg.train.tiled_mlp is True:
        from ...model.tiled_mlp import apply_tiled_mlp

        apply_tiled_mlp(model)
    if cfg.train.activation_offload is True and activation_checkpointing and device_type == "cuda":
        from ..offload import TracedOffload, install_offload

        install_offload(model, TracedOffload())


def to_empty_keeping_ties(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """``Module.to_empty``, with parameters shared between modules still shared afterwards (tied input
    embeddings and LM head; T5 and BART share one embedding among encoder, decoder and head).
    ``to_empty`` gives every module a fresh tensor of its own, which unties them: a tied 128k-vocabulary
    head would be counted twice, with its gradient and optimizer state."""
    owners: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                owners.setdefault(id(param), []).append((module, name))
    model.to_empty(device=device)
    for (first, first_name), *others in owners.values():
        for module, name in others:
            module._parameters[name] = first._parameters[first_name]
    return model


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@contextlib.contextmanager
def _quiet_warnings() -> Iterator[None]:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
