"""Attention for packed rows without a row-sized mask: SDPA per document.

transformers' stock SDPA path isolates packed documents with a dense block-diagonal
(T x T) mask, which costs attention over the whole row and loses SDPA's causal fast path.
Here each document of a row (found where ``position_ids`` restart at 0) gets its own
causal SDPA call: the work is the sum of the documents' squared lengths, and no mask is
built at all. Rows that hold one document take a single call. Used on CPU, where no
varlen kernel (flash-attention) exists.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NAME = "trainforge_packed_sdpa"


def _segments(position_ids: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per row, [start, end) of each document: a new one begins wherever the position is 0."""
    rows = []
    for row in position_ids.tolist():
        starts = [i for i, p in enumerate(row) if p == 0] or [0]
        rows.append(list(zip(starts, starts[1:] + [len(row)])))
    return rows


def packed_sdpa_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """query (B, H, Tq, D), key/value (B, Hkv, Tk, D) -> (B, Tq, H, D), as transformers expects."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    position_ids = kwargs.get("position_ids")
    if position_ids is None or query.shape[2] != key.shape[2] or attention_mask is not None:
        # generation with a KV cache, or a caller-provided mask: the stock path is right there
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # grouped-query attention: share each key/value head across its query heads
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    segments = _segments(position_ids.expand(query.shape[0], -1))
    rows = []
    for b, segs in enumerate(segments):
        parts = [
            F.scaled_dot_product_attention(
                query[b : b + 1, :, s:e], key[b : b + 1, :, s:e], value[b : b + 1, :, s:e],
                dropout_p=dropout if module.training else 0.0, is_causal=True, scale=scaling,
            )
            for s, e in segs
        ]
        rows.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=2))
    out = torch.cat(rows, dim=0)
    return out.transpose(1, 2).contiguous(), None


def _no_mask(*args, **kwargs):
    return None  # documents are separated by the attention function itself


def register() -> str:
    """Make ``attn_implementation=NAME`` available to transformers models; returns NAME."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, packed_sdpa_forward)
    AttentionMaskInterface.register(NAME, _no_mask)
    return NAME
