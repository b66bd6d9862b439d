"""Whether a model's logits are exactly ``lm_head(decoder(...).last_hidden_state)``, decided once per model.

The fused chunked head (``loss.fused_head``) calls the decoder and the output embedding apart. That is the
model's own computation only where nothing stands between them: ELECTRA, RemBERT and RoFormer put a dense +
activation + norm transform there (of another width, or, worse, of the same width: a wrong loss with no error),
ModernBERT's decoder and BLT have their own heads, Llama 4's ``get_decoder`` is the whole causal LM. Config fields
(soft-capping, logit scales) are read by ``kernels.transforms_logits``; the rest is found here:

- a real model runs a probe: a few tokens, once, through the model and through decoder + head (eval mode, no
  gradient, no autocast (bf16 autocast where fp32 adapters sit on a bf16 base: as it trains), compiled layers eager, the random state kept), and the two logits must agree;
- a model on fake or meta tensors (a plan's traced step) cannot compute: there the parameters decide, and any
  parameter outside the decoder, the head and an image-text model's non-text parts means "not exact".

The answer is kept per model (weakly) and per (decoder, head) pair, so every caller gets the same one.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake

PROBE_TOKENS = 16  # enough positions to compare, few enough to cost nothing on a large model (FP8 needs multiples of 16)
# relative to the largest logit. The two paths run the same kernels: an exact decomposition differs by nothing or by
# rounding; RecurrentGemma's soft-capping at 30 moved a tiny random model's logits by only 1.1e-3
PROBE_TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-9}
HALF_TOLERANCE = 1e-2  # bf16 / fp16 weights: half a unit in the last place of the largest logit

_DECIDED: weakref.WeakKeyDictionary[torch.nn.Module, tuple[Any, Any, str | None]] = weakref.WeakKeyDictionary()


def head_mismatch(base: torch.nn.Module, decoder: torch.nn.Module, head: torch.nn.Linear) -> str | None:
    """None when ``base``'s logits are ``head(decoder(...).last_hidden_state)``, else why not (a short phrase)."""
    seen = _DECIDED.get(base)
    if seen is not None and seen[0]() is decoder and seen[1]() is head:
        return seen[2]
    why = _structure(base, decoder, head)
    if not _abstract(head.weight):  # the numbers decide where they can be computed; the layout names the culprit
        probed = _probe(base, decoder, head)
        why = None if probed is None else f"{why} ({probed})" if why else probed
    _DECIDED[base] = (weakref.ref(decoder), weakref.ref(head), why)
    return why


def decoder_stack(base: torch.nn.Module, head: torch.nn.Linear) -> torch.nn.Module | None:
    """The module whose ``last_hidden_state`` the head reads: ``get_decoder()``, or where that returns a whole causal
    LM (it holds the head: Llama 4's), that module's ``model``, the name transformers gives the stack beside
    ``lm_head``. None when the model has no ``get_decoder``."""
    get_decoder = getattr(base, "get_decoder", None)
    decoder = get_decoder() if get_decoder is not None else None
    inner = getattr(decoder, "model", None)
    if isinstance(decoder, torch.nn.Module) and _holds(decoder, head) and isinstance(inner, torch.nn.Module):
        return inner if not _holds(inner, head) else decoder
    return decoder


def _holds(module: torch.nn.Module, head: torch.nn.Module) -> bool:
    return any(m is head for m in module.modules())


def _abstract(t: torch.Tensor) -> bool:
    """A tensor with no values to compute with: fake (a plan's trace) or on the meta device."""
    return is_fake(t) or t.is_meta


def _structure(base: torch.nn.Module, decoder: torch.nn.Module, head: torch.nn.Linear) -> str | None:
    """Why the module layout rules the decomposition out, or None where it allows it."""
    if decoder is base or _holds(decoder, head):
        return f"its get_decoder() is {type(decoder).__name__}, which holds the head itself"
    if isinstance(decoder, torch.nn.Linear):
        return f"its get_decoder() is a {type(decoder).__name__}, not the transformer stack"
    extra = _modules_beside(base, decoder, head)
    return f"{', '.join(extra)} between the decoder and the head" if extra else None


def _modules_beside(base: torch.nn.Module, decoder: torch.nn.Module, head: torch.nn.Linear) -> list[str]:
    """The submodules of ``base`` holding parameters that are neither the decoder's nor the head's (nor those of an
    image-text model's vision tower and projector, which text rows never run), one name per top-level child: the
    deepest module holding all of that child's such parameters (``cls.predictions.transform``)."""
    from ..model.multimodal import non_text_parts

    covered = {id(p) for m in (decoder, head) for p in m.parameters()}
    skipped = tuple(f"{part}." for part in non_text_parts(base))
    groups: dict[str, list[str]] = {}
    for name, p in base.named_parameters():
        if id(p) not in covered and not name.startswith(skipped):
            path = name.split(".")[:-1] or [name]
            groups.setdefault(path[0], []).append(path)
    names = [".".join(functools.reduce(_common_prefix, paths)) for paths in groups.values()]
    return names[:4] + ([f"{len(names) - 4} more"] if len(names) > 4 else [])


def _common_prefix(a: list[str], b: list[str]) -> list[str]:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def _probe(base: torch.nn.Module, decoder: torch.nn.Module, head: torch.nn.Linear) -> str | None:
    """Run ``PROBE_TOKENS`` tokens through the model and through decoder + head; why they differ, or None."""
    device, vocab = head.weight.device, head.out_features
    ids = ((torch.arange(PROBE_TOKENS, device=device) * 7 + 3) % vocab)[None]  # arbitrary, not only low ids
    positions = torch.arange(PROBE_TOKENS, device=device)[None]
    modes = {m: m.training for m in base.modules()}
    devices = [device] if device.type == "cuda" else []
    # a LoRA on a bf16 frozen base holds fp32 adapters beside bf16 weights: it runs under autocast only, as it trains
    floats = {p.dtype for p in base.parameters() if p.is_floating_point()}
    half = next((d for d in (torch.bfloat16, torch.float16) if d in floats), None)
    mixed = half is not None and len(floats) > 1
    step = "the model's own forward"
    try:
        base.eval()  # no dropout: the two forwards must see the same function
        # fork_rng: a forward in eval mode should draw nothing, but the run's random stream must not move if one does
        # (a resumed run probes at another point of it); force_eager: compiled layers would compile an eval graph
        with torch.random.fork_rng(devices=devices), torch.no_grad(), torch.autocast(device.type, dtype=half, enabled=mixed), \
                torch.compiler.set_stance("force_eager"):
            want = base(input_ids=ids, position_ids=positions, use_cache=False).logits.float()
            step = "decoder + head"
            got = head(decoder(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state).float()
    except Exception as e:  # noqa: BLE001 - a failure of the split path means: not this model's computation
        error = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}"
        # an error in the modeling code's Python (Llama 4's image-text forward reads an attribute its language model
        # never returns) fails every training step the same way: stop before any; a tensor error may be the probe's
        if step == "the model's own forward" and not isinstance(e, RuntimeError):
            from ..hf_dir import UnsupportedModelDir

            raise UnsupportedModelDir(
                f"model.path: transformers' {type(base).__name__}.forward fails on text input ({error}): this "
                "transformers version cannot train it on text; a text-only checkpoint of the family, or another "
                "transformers version, may") from e
        return f"{step} failed on a probe: {error}"
    finally:
        for m, training in modes.items():
            m.training = training
    if got.shape != want.shape:
        return f"decoder + head give logits of shape {tuple(got.shape)}, the model {tuple(want.shape)}"
    gap = ((got - want).abs().max() / want.abs().max().clamp_min(1e-6)).item()
    if gap > (HALF_TOLERANCE if mixed else PROBE_TOLERANCE.get(head.weight.dtype, HALF_TOLERANCE)):
        return f"decoder + head give other logits than the model (relative gap {gap:.2g})"
    return None
