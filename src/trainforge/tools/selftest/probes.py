"""What the checks measure with: a masked packed batch, a device's attention paths, the packed-row gap.

``masked_batch``: two packed rows with masked positions; ``attention_implementations``: the
attention paths a packed row takes on a device; ``packed_attention_gap``: packed rows against each
document run alone."""

from __future__ import annotations

import torch

from .assets import MODEL_INIT, rng_kept


def masked_batch(vocab: int, device: torch.device):
    """Two packed rows: documents of several lengths, masked prompts, a fully masked document, padding."""
    from ...data.formats import IGNORE
    from ...data.loader import Batch

    gen = torch.Generator().manual_seed(0)
    docs_per_row = [[(12, 5), (30, 0), (7, 6), (9, 9)], [(20, 3), (25, 25), (11, 0)]]  # (length, prompt tokens)
    width = 64
    ids, pos = torch.zeros(2, width, dtype=torch.long), torch.zeros(2, width, dtype=torch.long)
    labels = torch.full((2, width), IGNORE, dtype=torch.long)
    for r, docs in enumerate(docs_per_row):
        at = 0
        for n, prompt in docs:
            toks = torch.randint(2, vocab, (n,), generator=gen)
            ids[r, at : at + n], pos[r, at : at + n] = toks, torch.arange(n)
            target = toks[1:].clone()
            target[: max(prompt - 1, 0)] = IGNORE
            labels[r, at : at + n - 1] = target  # a document's last token predicts nothing
            at += n
        pos[r, at:] = torch.arange(width - at)  # padding: a "document" of its own, no targets
    return Batch(ids, labels, pos, int(ids.numel()), int((labels != IGNORE).sum()), [0, 1]).to(device)


PAIR_DOCS = [[(12, 5), (14, 5), (9, 3), (7, 3)], [(20, 4), (16, 4)]]
"""Two packed rows of preference pairs, as (length, prompt tokens) per document: chosen, rejected, chosen, ..."""


def pair_documents(vocab: int) -> list[list[torch.Tensor]]:
    """The token ids of each row's documents in ``PAIR_DOCS`` (a pair shares its prompt)."""
    gen = torch.Generator().manual_seed(1)
    rows = []
    for docs in PAIR_DOCS:
        row = []
        for k, (n, prompt) in enumerate(docs):
            toks = torch.randint(2, vocab, (n,), generator=gen)
            if k % 2:
                toks[:prompt] = row[-1][:prompt]  # the rejected side repeats its chosen side's prompt
            row.append(toks)
        rows.append(row)
    return rows


def pair_batch(vocab: int, device: torch.device):
    """``PAIR_DOCS`` collated as training collates ``pair_rows``: per-document positions, prompts masked, padding."""
    from ...data.formats import IGNORE
    from ...data.loader import Batch

    width = 64
    ids, pos = torch.zeros(2, width, dtype=torch.long), torch.zeros(2, width, dtype=torch.long)
    labels = torch.full((2, width), IGNORE, dtype=torch.long)
    for r, (docs, toks_of) in enumerate(zip(PAIR_DOCS, pair_documents(vocab))):
        at = 0
        for (n, prompt), toks in zip(docs, toks_of):
            ids[r, at : at + n - 1], pos[r, at : at + n - 1] = toks[:-1], torch.arange(n - 1)
            target = toks[1:].clone()
            target[: prompt - 1] = IGNORE
            labels[r, at : at + n - 1] = target
            at += n - 1
        pos[r, at:] = torch.arange(width - at)  # the padding tail: a document of its own, no targets
    n_docs = sum(len(d) for d in PAIR_DOCS)
    desirable = torch.tensor([k % 2 == 0 for k in range(n_docs // 2)])  # KTO reads the pairs as (example, KL sample)
    return Batch(ids, labels, pos, int(sum(n - 1 for d in PAIR_DOCS for n, _ in d)), int((labels != IGNORE).sum()), [0, 1],
                 n_documents=n_docs, desirable=desirable).to(device)


def attention_implementations(device: torch.device) -> list[str]:
    """The attention paths a packed row takes on this device: per-document SDPA (CPU default),
    stock SDPA (a block-diagonal mask from position_ids); on CUDA FlexAttention with a document mask,
    torch's Flash varlen kernel (sm80+) and flash-attention's (when installed)."""
    import importlib.util

    from ...model import doc_attention
    from ...model.packed_attention import register

    impls = [register(), "sdpa"]
    if device.type == "cuda":
        impls.append(doc_attention.register(doc_attention.FLEX_NAME))
        if doc_attention.has_varlen() and torch.cuda.get_device_capability(device) >= doc_attention.VARLEN_MIN_CAPABILITY:
            impls.append(doc_attention.register(doc_attention.VARLEN_NAME))
        if importlib.util.find_spec("flash_attn") is not None:
            impls.append("flash_attention_2")
    return impls


def packed_attention_gap(impl: str, precision, device: torch.device) -> tuple[float, float]:
    """(gap, leak): max |logits of packed rows - logits of each document alone| / max |reference|,
    the packed rows under ``precision``, the reference in fp32 one document at a time through stock
    SDPA (for flash-attention in its half dtype): the flash kernels (torch's varlen, flash-attention)
    refuse fp32, and a single document needs no document kernel; ``leak``: the same measure for the
    rows run without document boundaries, which is what a broken mask would give."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    # 16-wide heads: FlexAttention's CUDA kernel refuses narrower ones (the training cases' 8-wide heads take
    # packed SDPA there), so this check runs the kernel itself
    fields = {k: v for k, v in MODEL_INIT.items() if k != "architecture"} | {"head_dim": 16}
    lengths = [[7, 12, 1, 20, 8], [30, 18]]  # documents per row; a one-token document too
    width = max(sum(r) for r in lengths)
    with rng_kept():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=96, **fields), attn_implementation=impl)
        ids = torch.randint(0, 96, (len(lengths), width))
    with torch.no_grad():
        for p in model.parameters():  # larger than the init: attention far from uniform, so a leak shows
            if p.ndim > 1:
                p.mul_(4.0)
    model = model.to(device).eval()
    if impl == "flash_attention_2":
        model = model.to(precision.autocast_dtype)
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
    ids, pos = ids.to(device), pos.to(device)
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        reference = []
        for b, row in enumerate(lengths):
            starts = [sum(row[:i]) for i in range(len(row))]
            docs = [model(input_ids=ids[b : b + 1, s : s + n], use_cache=False).logits.float() for s, n in zip(starts, row)]
            reference.append(torch.cat(docs, dim=1))
        reference = torch.cat(reference)
        model.set_attn_implementation(impl)
        with precision.autocast(device):
            packed = model(input_ids=ids, position_ids=pos, use_cache=False).logits.float()
            leaky = model(input_ids=ids, use_cache=False).logits.float()
    scale = reference.abs().max()
    return float((packed - reference).abs().max() / scale), float((leaky - reference).abs().max() / scale)
