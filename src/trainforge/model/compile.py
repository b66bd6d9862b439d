"""torch.compile where it pays off, with a clean fallback to eager when it fails."""

from __future__ import annotations

from collections.abc import Callable

import torch

# Assumptions of the `auto` rule for a config never compiled on this machine (engine/compile_auto.py
# uses measured figures once it has them). CPU, from this project's benchmark model: the decoder ran
# 1.9x faster compiled on a 2-core CPU after ~70 s of compiling. CUDA: regional compile compiles one
# decoder layer whatever the depth; ~40 s is the order torch's regional-compilation recipe reports for
# LLM decoder layers (not yet measured here: benchmarks/bench_compile.py --device cuda does). Conservative:
# a smaller speed-up than measured.
ASSUMED_SPEEDUP = 1.3
ASSUMED_COMPILE_S = {"cpu": 90.0, "cuda": 40.0}
PROBE_STEPS = 4  # eager steps timed before `auto` decides (the first one warms up and is not counted)


def repeated_layers(stack: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of a layer stack: the members of its largest ModuleList whose members all
    share one class (decoder layers; T5's blocks); empty when there is none."""
    lists = [m for m in stack.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 0]
    lists = [m for m in lists if len({type(layer) for layer in m}) == 1]
    return list(max(lists, key=len)) if lists else []


def compile_decoder(
    model: torch.nn.Module, warn: Callable[[str], None], regional: bool = True, backend: str | Callable = "inductor"
) -> bool:
    """Compile the transformer stack in place (the loss head stays eager: it is chunked by hand).

    ``regional``: compile each repeated layer (torch's regional compilation): layers of one class share
    one compiled graph, so compile time does not grow with depth; the embedding and final norm stay
    eager. An encoder-decoder's encoder layers are compiled too. Without repeated layers, or with
    ``regional=False``, the whole decoder stack is one graph."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else None
    if decoder is None:
        warn("compile: this model exposes no decoder stack; training eager")
        return False
    import torch._dynamo

    from .packed_attention import NAME

    if getattr(base.config, "_attn_implementation", None) == NAME and hasattr(base, "set_attn_implementation"):
        base.set_attn_implementation("sdpa")  # its per-document Python loop would break the compiled graph
    # trainforge_varlen / trainforge_flex (doc_attention.py) stay: their per-forward planning is kept
    # out of the graph and the kernel call compiles

    # a graph that fails to compile runs eagerly (dynamo logs why) instead of killing the run
    torch._dynamo.config.suppress_errors = True
    encoder = base.get_encoder() if getattr(base.config, "is_encoder_decoder", False) and hasattr(base, "get_encoder") else None
    layers = [layer for stack in (encoder, decoder) if stack is not None for layer in repeated_layers(stack)]
    try:
        if regional and layers:
            inputs_need_grad(base)
            for layer in layers:
                layer.compile(backend=backend)
        else:
            decoder.compile(backend=backend)
    except Exception as e:  # noqa: BLE001 - any failure here only costs speed
        warn(f"compile failed ({type(e).__name__}: {e}); training eager")
        return False
    return True


def inputs_need_grad(base: torch.nn.Module) -> None:
    """Make a frozen embedding's output require grad (LoRA, QLoRA), so that the first layer's input
    needs a gradient like every other layer's. Otherwise dynamo guards on it and compiles the layer
    twice: a whole second compile, against the extra input-gradient of one layer's q/k/v (~0.2% of an
    8B LoRA step)."""
    embeddings = base.get_input_embeddings() if hasattr(base, "get_input_embeddings") else None
    weight = getattr(embeddings, "weight", None)
    if isinstance(weight, torch.Tensor) and not weight.requires_grad and hasattr(base, "enable_input_require_grads"):
        base.enable_input_require_grads()
