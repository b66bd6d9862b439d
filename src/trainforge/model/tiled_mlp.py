"""Tiled MLP: a decoder layer's MLP run over the sequence in tiles, each tile's intermediate recomputed
in backward, so the MLP never holds more than one tile's intermediate (``train.tiled_mlp``).

A gated MLP (gate/up/down: Llama, Qwen2/3, Mistral, Gemma, Phi-3) keeps, per token, four vectors of
the intermediate size for backward (gate, up, the activation and the product): at long lengths and an
intermediate 3-4x the hidden size, that is most of a layer's activations, and with activation
checkpointing it is most of the one layer being recomputed. The MLP works on each token alone, so
the tokens can be cut into tiles: the forward runs tile by tile without keeping anything but the
input; the backward runs each tile's forward again under autograd and its backward at once. The
output and gradients are the untiled MLP's (up to the summation order of the weight gradients over
tiles). The same idea as ALST's TiledMLP (Arctic Long Sequence Training), written here for this
project: the weight gradients are summed over tiles and returned by the autograd function, so
autograd accumulates them once (hooks on ``.grad``, DDP's and the plan's tracer, fire once).

The MLP module keeps its class as its base (names, ``state_dict`` and PEFT's LoRA layers inside it
are untouched); its parameters are read at each call, so LoRA adapters added after tiling take part.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

from ..errors import TrainforgeError
from .subclass import forward_subclass

# model_type -> the decoder MLP is a position-wise gated MLP in ``layer.mlp`` (Gemma 3's text tower
# reports gemma3_text; Qwen3's dense models qwen3: the MoE families are not position-wise per tile budget)
TILED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3")
MIN_TILE_TOKENS = 64


class TiledMLPUnsupported(TrainforgeError, ValueError):
    """``train.tiled_mlp: true`` on a model whose MLP is not one the tiling covers."""


def tile_tokens(hidden_size: int) -> int:
    """Tokens per tile: the hidden size (one tile's intermediate is then as large as one MLP weight
    matrix, whatever the sequence length; ALST's rule), at least ``MIN_TILE_TOKENS``."""
    return max(MIN_TILE_TOKENS, hidden_size)


class _TiledMLP(torch.autograd.Function):
    """``mlp(x)`` tile by tile over the flattened tokens, keeping only ``x`` for backward."""

    @staticmethod
    def forward(ctx, fn: Callable, tile: int, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        ctx.fn, ctx.tile, ctx.params = fn, tile, params
        ctx.device_type = x.device.type
        ctx.autocast = torch.is_autocast_enabled(ctx.device_type)
        ctx.autocast_dtype = torch.get_autocast_dtype(ctx.device_type)
        # the RNG as it is before the first tile: backward replays the tiles in order from here (LoRA dropout)
        ctx.cpu_rng = torch.get_rng_state()
        ctx.cuda_rng = torch.cuda.get_rng_state(x.device) if x.is_cuda else None
        ctx.save_for_backward(x)
        flat = x.reshape(-1, x.shape[-1])
        parts = flat.split(tile)
        out: list[torch.Tensor] = []

        def one_tile(i: int) -> None:
            y = fn(parts[i])
            if not out:  # written in place tile by tile: the output and one tile's, never all tiles' outputs twice
                out.append(y.new_empty((flat.shape[0], y.shape[-1])))
            out[0][i * tile:i * tile + y.shape[0]] = y

        with torch.no_grad():
            run_tiles(len(parts), one_tile)
        return out[0].view(*x.shape[:-1], out[0].shape[-1])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001
        (x,) = ctx.saved_tensors
        params = ctx.params
        wanted = [p for p, need in zip(params, ctx.needs_input_grad[3:]) if need]
        flat, grad_flat = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
        x_grad = torch.empty_like(flat) if ctx.needs_input_grad[2] else None
        sums: list[torch.Tensor | None] = [None] * len(wanted)
        devices = [x.device] if ctx.cuda_rng is not None else []
        with torch.random.fork_rng(devices=devices, device_type=ctx.device_type), torch.enable_grad(), \
                torch.autocast(ctx.device_type, dtype=ctx.autocast_dtype, enabled=ctx.autocast):
            torch.set_rng_state(ctx.cpu_rng)
            if ctx.cuda_rng is not None:
                torch.cuda.set_rng_state(ctx.cuda_rng, x.device)
            parts, part_grads = flat.split(ctx.tile), grad_flat.split(ctx.tile)

            def one_tile(k: int) -> None:
                part = parts[k].detach().requires_grad_(x_grad is not None)
                out = ctx.fn(part)
                inputs = ([part] if x_grad is not None else []) + wanted
                grads = torch.autograd.grad(out, inputs, part_grads[k], allow_unused=True) if inputs else ()
                if x_grad is not None:
                    x_grad[k * ctx.tile:k * ctx.tile + part.shape[0]] = grads[0]
                    grads = grads[1:]
                for i, g in enumerate(grads):
                    if g is not None:
                        sums[i] = g if sums[i] is None else sums[i].add_(g)

            run_tiles(len(parts), one_tile)
        by_param = dict(zip(map(id, wanted), sums))
        param_grads = [by_param.get(id(p)) for p in params]
        return (None, None, x_grad.view_as(x) if x_grad is not None else None, *param_grads)


def run_tiles(n: int, one_tile: Callable[[int], None]) -> None:
    """``one_tile(i)`` for every tile in order; under the plan's tracer (a dispatch mode with ``tile_ops``: its list
    of recorded ops), tiles 0, 1 and the last only, the ops of tile 1 recorded again for each tile in between.
    Every tile but the last does the same work on the same shapes and reaches the same peak, so the trace's
    memory and FLOPs are the full loop's, at a cost that does not grow with the row length. The chunked head's
    loops (engine/loss.py) run their chunks through it too: a tile's work must write only into buffers made
    before the loop (its memory is then one tile's), so that leaving the middle tiles untraced changes nothing."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    ops = next((m.tile_ops for m in _get_current_dispatch_mode_stack() if hasattr(m, "tile_ops")), None)
    if ops is None or n <= 3:
        for i in range(n):
            one_tile(i)
        return
    one_tile(0)
    start = len(ops)
    one_tile(1)
    ops.extend(ops[start:] * (n - 3))  # tiles 2 .. n-2
    one_tile(n - 1)


def tiled_forward(module: torch.nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """The MLP's output, in tiles when it trains under autograd and the input spans more than one tile."""
    base = module._untiled_forward  # bound: the MLP class's own forward
    tile = module.trainforge_tile_tokens
    if args or kwargs or not torch.is_grad_enabled() or x.numel() // x.shape[-1] <= tile:
        return base(x, *args, **kwargs)
    params = [p for p in module.parameters() if p.requires_grad]
    # the parameters are inputs of the function: autograd hands each its gradient summed over the tiles
    return _TiledMLP.apply(base, tile, x, *params)


_TILED: dict[type, type] = {}


def tiled_class(cls: type) -> type:
    """A subclass of the MLP class ``cls`` whose forward runs in tiles (one per class)."""
    return forward_subclass(cls, _TILED, "Tiled", tiled_forward, "_untiled_forward",
                            f"{cls.__name__} run over the sequence in tiles (trainforge.model.tiled_mlp).")


def supports_tiled_mlp(model: torch.nn.Module) -> bool:
    """Whether the model's family is one whose decoder MLP the tiling covers."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    return getattr(text, "model_type", None) in TILED_FAMILIES


def decoder_mlps(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The ``mlp`` of every decoder layer (``...Layers.N.mlp``)."""
    return [m for name, m in model.named_modules() if name.endswith(".mlp") and ".layers." in f".{name}"]


def apply_tiled_mlp(model: torch.nn.Module, tile: int | None = None) -> int:
    """Run every decoder layer's MLP in tiles of ``tile`` tokens (default: ``tile_tokens``), in place.
    Returns how many MLPs changed; raises ``TiledMLPUnsupported`` for a family the tiling does not cover."""
    if not supports_tiled_mlp(model):
        kind = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        raise TiledMLPUnsupported(
            f"train.tiled_mlp: true is for the decoder MLPs of {', '.join(TILED_FAMILIES)}; this model is {kind}. "
            "Set train.tiled_mlp: auto or false"
        )
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    size = tile or tile_tokens(config.hidden_size)
    mlps = decoder_mlps(model)
    for mlp in mlps:
        own = mlp.__dict__.pop("forward", None)  # a forward set on the instance (the plan's Liger stand-ins)
        if own is not None:
            mlp._untiled_forward = own  # tiled_forward runs it per tile, as it would the class's
        if not type(mlp).__name__.startswith("Tiled"):
            mlp.__class__ = tiled_class(type(mlp))
        mlp.trainforge_tile_tokens = size
    return len(mlps)


@contextlib.contextmanager
def untiled(model: torch.nn.Module):
    """The model with its MLPs untiled for the duration (a comparison in a test, a benchmark)."""
    tiled = [m for m in decoder_mlps(model) if type(m).__name__.startswith("Tiled")]
    for m in tiled:
        m.__class__ = type(m).__mro__[1]
    try:
        yield model
    finally:
        for m in tiled:
            m.__class__ = tiled_class(type(m))
