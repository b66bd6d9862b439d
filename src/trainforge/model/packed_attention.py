"""Attention for packed rows without a row-sized mask: documents batched by length.

transformers' stock SDPA path isolates packed documents with a dense block-diagonal
(T x T) mask, which costs attention over the whole row and loses SDPA's causal fast path.
Here the documents of all rows (found where ``position_ids`` restart at 0) are gathered
into a few batches of similar length, right-padded, and each batch takes one causal SDPA
call. Right padding needs no mask under causal attention: a real query never sees a key
after it, and the padded queries' outputs are dropped (their gradient is zero, so they
add nothing to the keys' and values' gradients either). The work is about the sum of
the documents' squared lengths (padding within a bucket costs at most ``BUCKET_GROWTH``^2),
in a handful of kernel calls instead of one per document. Used on CPU, where no varlen
kernel (flash-attention) exists.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

NAME = "trainforge_packed_sdpa"
BUCKET_GROWTH = 1.25  # a bucket holds documents within this length ratio of its longest


@dataclass
class _Plan:
    """Where each document's tokens go. All buckets' slots are laid end to end: ``slot_token[j]``
    is the token (row-major index into rows x T) at slot j, ``token_slot[t]`` the slot of token t.
    Padding slots read token 0: only padded queries can see them (causal), and those outputs are
    dropped, so their values never matter and their gradient is zero."""

    shapes: list[tuple[int, int]]  # per bucket: (documents, padded length)
    slot_token: torch.Tensor  # (slots,) token read by each slot; padding: token 0
    slot_grad: torch.Tensor  # (slots,) as slot_token, but padding points one past the last token (a zero row)
    token_slot: torch.Tensor  # (rows x T,) slot holding each token


class _Gather(torch.autograd.Function):
    """``x.index_select(0, index)`` where every source row is read by at most one output row that
    matters: its backward is another gather (``grad.index_select(0, inverse)``) instead of
    index_select's scatter-add, which is slow on CPU. ``inverse`` may point one past the end of
    ``grad`` for rows whose gradient is zero."""

    @staticmethod
    def forward(ctx, x, index, inverse, zero_row):
        ctx.save_for_backward(inverse)
        ctx.zero_row = zero_row
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        if ctx.zero_row:  # some rows take a zero gradient: ``inverse`` points them one past the end
            grad = torch.cat([grad, grad.new_zeros(1, *grad.shape[1:])])
        return grad.index_select(0, inverse), None, None, None


def _plan(position_ids: torch.Tensor) -> _Plan:
    """Documents of every row, bucketed by length; built once per forward pass (see ``_cached_plan``)."""
    rows, width = position_ids.shape
    starts_mask = position_ids == 0
    starts_mask[:, 0] = True  # a row always begins a document
    flat_starts = starts_mask.flatten().nonzero().flatten().tolist()  # one host sync per forward, not per layer
    ends = flat_starts[1:] + [rows * width]
    docs = []
    for s, e in zip(flat_starts, ends):
        row_end = (s // width + 1) * width  # a document never crosses its row's end
        docs.append((s, min(e, row_end) - s))
    docs.sort(key=lambda d: -d[1])
    pad = rows * width
    shapes, order, i = [], [], 0
    while i < len(docs):  # longest first: a bucket takes every document within BUCKET_GROWTH of its first
        longest = docs[i][1]
        j = i
        while j < len(docs) and docs[j][1] * BUCKET_GROWTH >= longest:
            j += 1
        idx = torch.full((j - i, longest), pad, dtype=torch.long)
        for k, (s, n) in enumerate(docs[i:j]):
            idx[k, :n] = torch.arange(s, s + n)
        shapes.append((j - i, longest))
        order.append(idx.flatten())
        i = j
    slot_grad = torch.cat(order)
    real = slot_grad != pad
    token_slot = torch.empty(pad, dtype=torch.long)
    token_slot[slot_grad[real]] = real.nonzero().flatten()
    device = position_ids.device
    slot_token = slot_grad.masked_fill(~real, 0)
    return _Plan(shapes, slot_token.to(device), slot_grad.to(device), token_slot.to(device))


_cache: tuple[torch.Tensor, _Plan] | None = None


def _cached_plan(position_ids: torch.Tensor, rows: int) -> _Plan:
    """Every layer of one forward gets the same ``position_ids`` tensor: plan once, reuse per layer.
    The cache holds the tensor itself, so its memory cannot be reused by another batch meanwhile."""
    global _cache
    if _cache is None or _cache[0] is not position_ids:
        _cache = (position_ids, _plan(position_ids.expand(rows, -1)))
    return _cache[1]


def packed_sdpa_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """query (B, H, Tq, D), key/value (B, Hkv, Tk, D) -> (B, Tq, H, D), as transformers expects."""
    out_dtype = query.dtype
    if query.device.type != "cpu" or out_dtype == torch.float32:
        return _attend(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    # CPU SDPA kernels are no faster in bf16 than in fp32, and up to 2-3x slower on short documents
    # (measured fwd+bwd, 32 x 128 tokens: fp32 22 ms, bf16 40 ms): attend in fp32, hand back bf16
    with torch.autocast("cpu", enabled=False):  # autocast would cast SDPA's inputs back down
        out, weights = _attend(module, query.float(), key.float(), value.float(), attention_mask, dropout, scaling, **kwargs)
    return out.to(out_dtype), weights


def _attend(module, query, key, value, attention_mask, dropout, scaling, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    position_ids = kwargs.get("position_ids")
    if position_ids is None or query.shape[2] != key.shape[2] or attention_mask is not None:
        # generation with a KV cache, or a caller-provided mask: the stock path is right there
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    b, h, t, _ = query.shape
    plan = _cached_plan(position_ids, b)
    groups = h // key.shape[1]
    if groups > 1:  # grouped-query attention: share each key/value head across its query heads
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)

    def slots(x: torch.Tensor) -> list[torch.Tensor]:
        # (B, H, T, D) -> one row per token (a view for HF's layout) -> all documents' slots -> per bucket;
        # D is each tensor's own: multi-head latent attention (DeepSeek) has values narrower than queries and keys
        d = x.shape[-1]
        flat = _Gather.apply(x.transpose(1, 2).reshape(b * t, h, d), plan.slot_token, plan.token_slot, False)
        return [part.view(n, length, h, d).transpose(1, 2) for part, (n, length) in zip(flat.split([n * m for n, m in plan.shapes]), plan.shapes)]

    window = kwargs.get("sliding_window")  # Mistral, Gemma 2/3's local layers: each token sees the last `window`
    p = dropout if module.training else 0.0

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        length = q.shape[2]
        if window and window < length:  # causal within the window, as transformers' sliding_window_overlay
            i = torch.arange(length, device=q.device)
            band = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < window)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=band, dropout_p=p, scale=scaling)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True, scale=scaling)

    dv = value.shape[-1]
    outs = [attend(q, k, v).transpose(1, 2).reshape(-1, h, dv) for q, k, v in zip(slots(query), slots(key), slots(value))]
    out = _Gather.apply(torch.cat(outs), plan.token_slot, plan.slot_grad, True)  # token order; padded outputs dropped
    return out.view(b, t, h, dv), None


def _no_mask(*args, **kwargs):
    return None  # documents are separated by the attention function itself


def register() -> str:
    """Make ``attn_implementation=NAME`` available to transformers models; returns NAME."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, packed_sdpa_forward)
    AttentionMaskInterface.register(NAME, _no_mask)
    return NAME


CAUSAL_NAME = "trainforge_causal_sdpa"


def causal_sdpa_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Each row one causal document, no mask built: the worst case a plan traces (attention memory
    linear in the row length, as flash-attention's), with no host-side planning of documents."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(query, key, value, dropout_p=dropout if module.training else 0.0, is_causal=True, scale=scaling)
    return out.transpose(1, 2), None


def register_causal() -> str:
    """``attn_implementation=CAUSAL_NAME`` for the plan's traced models; returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(CAUSAL_NAME, causal_sdpa_forward)
    AttentionMaskInterface.register(CAUSAL_NAME, _no_mask)
    return CAUSAL_NAME
