"""torch.compile where it pays off, with a clean fallback to eager when it fails."""

from __future__ import annotations

from collections.abc import Callable

import torch

# Assumptions of the `auto` rule for a config never compiled on this machine (engine/compile_auto.py
# uses measured figures once it has them), from this project's benchmark model: the decoder ran
# 1.9x faster compiled on a 2-core CPU after ~70 s of compiling; GPUs compile faster. Conservative:
# a smaller speed-up than measured.
ASSUMED_SPEEDUP = 1.3
ASSUMED_COMPILE_S = {"cpu": 90.0, "cuda": 60.0}
PROBE_STEPS = 4  # eager steps timed before `auto` decides (the first one warms up and is not counted)


def compile_decoder(model: torch.nn.Module, warn: Callable[[str], None]) -> bool:
    """Compile the transformer stack in place (the loss head stays eager: it is chunked by hand)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else None
    if decoder is None:
        warn("compile: this model exposes no decoder stack; training eager")
        return False
    import torch._dynamo

    from .packed_attention import NAME

    if getattr(base.config, "_attn_implementation", None) == NAME and hasattr(base, "set_attn_implementation"):
        base.set_attn_implementation("sdpa")  # its per-document Python loop would break the compiled graph

    # a graph that fails to compile runs eagerly (dynamo logs why) instead of killing the run
    torch._dynamo.config.suppress_errors = True
    try:
        decoder.compile()
    except Exception as e:  # noqa: BLE001 - any failure here only costs speed
        warn(f"compile failed ({type(e).__name__}: {e}); training eager")
        return False
    return True
