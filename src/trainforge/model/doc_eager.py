"""Packed documents apart on a model's own eager attention, for models whose stock mask lets them meet.

transformers builds a per-document mask from the restarting ``position_ids`` only where the model's code hands
them to its mask creation; GPT-OSS's does not, and its eager attention (with its attention sinks, which no
trainforge kernel computes) then let packed documents attend to each other. ``trainforge_doc_eager`` runs the
model's own ``eager_attention_forward`` (sinks, soft-capping, whatever it computes) once per document, on the
document's diagonal block of the row's mask (its causal and sliding-window part, as transformers built it): the
same function on each document as on that document alone. Rows without a position reset (generation, one example
per row) take the model's eager function on the whole row, unchanged. ``model/packing_probe`` checks the result.
"""

from __future__ import annotations

import sys

import torch

NAME = "trainforge_doc_eager"


def _model_eager(module: torch.nn.Module):
    """The eager attention function of ``module``'s modeling file (where its ``eager`` implementation lives)."""
    found = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if found is None:
        raise NotImplementedError(f"{type(module).__module__} has no eager_attention_forward to run per document")
    return found


@torch.compiler.disable  # host-side document offsets: one sync per layer and row
def _documents(position_ids: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Each row's documents as (start, end): a document starts where position_ids restart at 0 (and at 0)."""
    out = []
    for row in position_ids.tolist():
        starts = [0] + [i for i, p in enumerate(row) if p == 0 and i > 0]
        out.append(list(zip(starts, starts[1:] + [len(row)])))
    return out


@torch.compiler.disable  # a loop over documents of data-dependent lengths: kept out of compiled layers (no recompiles)
def doc_eager_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """query (B, H, T, D), key/value (B, Hkv, T, D) -> ((B, T, H, D), None), as transformers expects."""
    eager = _model_eager(module)
    positions = kwargs.get("position_ids")
    b, t = query.shape[0], query.shape[2]
    if positions is None or key.shape[2] != t or not bool((positions[..., 1:] == 0).any()):
        return eager(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    rows = _documents(positions.expand(b, -1))
    if attention_mask is None:  # eager_mask always builds one; stay causal should a caller hand none
        attention_mask = torch.full((t, t), torch.finfo(query.dtype).min, device=query.device, dtype=query.dtype).triu(1)[None, None]
    outputs = []
    for r, docs in enumerate(rows):
        mask = attention_mask[r if attention_mask.shape[0] > 1 else 0][None]
        parts = [eager(module, query[r:r + 1, :, s:e], key[r:r + 1, :, s:e], value[r:r + 1, :, s:e],
                       mask[..., s:e, s:e], dropout=dropout, scaling=scaling, **kwargs)[0] for s, e in docs]
        outputs.append(torch.cat(parts, dim=1))
    return torch.cat(outputs, dim=0), None


def register() -> str:
    """Make ``attn_implementation=NAME`` available to transformers, with eager's mask; returns NAME."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(NAME, doc_eager_forward)
    AttentionMaskInterface.register(NAME, eager_mask)
    return NAME


def candidate(stock: str) -> str | None:
    """The attention to try where ``stock`` lets packed documents meet: the per-document eager for eager."""
    return register() if stock == "eager" else None

