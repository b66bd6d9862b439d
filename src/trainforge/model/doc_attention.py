"""Attention over packed documents on CUDA without the flash-attn package and without a row x row mask.

Two transformers attention functions, chosen by ``model.attention: auto`` on CUDA (see ``choose``):

- ``trainforge_varlen``: torch's own Flash Attention variable-length kernel
  (``torch.nn.attention.varlen.varlen_attn``, sm80+, bf16/fp16). All rows' tokens are laid end to
  end and each document attends causally within itself, given by cumulative document offsets.
  The work is the sum of the documents' squared lengths, as with flash-attn's varlen.
- ``trainforge_flex``: FlexAttention with a causal document mask (``create_block_mask``), for the
  GPUs and precisions the flash kernel refuses (below sm80, fp32). Blocks that cross a document
  boundary or lie above the diagonal are skipped, so its cost also follows the documents' lengths.

Documents are found where ``position_ids`` restart at 0 (each row starts one), as in
``packed_attention``. Both plan the documents once per forward pass and reuse the plan in every
layer; the planning runs outside compiled graphs (``torch.compiler.disable``), so a compiled decoder
layer holds only the kernel call. Generation with a KV cache, a caller's mask or attention dropout
take the paths that handle them (stock SDPA, per-document SDPA).
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

from ..hf_dir import attention_of

VARLEN_NAME = "trainforge_varlen"
FLEX_NAME = "trainforge_flex"
VARLEN_MIN_CAPABILITY = (8, 0)  # Flash Attention 2's kernels: Ampere and newer


def choose(requested: str, device_type: str, capability: tuple[int, int] | None, half_precision: bool, has_varlen: bool) -> str:
    """The attention a decoder-only model trains with on CUDA, for ``model.attention: requested``.

    ``auto``: torch's varlen Flash kernel on sm80+ in bf16/fp16 (it has no fp32), FlexAttention with a
    document mask elsewhere on CUDA. Neither builds a row x row mask. Other requests pass through.
    Callers handle CPU (``packed_attention``) and encoder-decoders before this."""
    if requested != "auto" or device_type != "cuda":
        return requested
    if has_varlen and half_precision and capability is not None and capability >= VARLEN_MIN_CAPABILITY:
        return VARLEN_NAME
    return FLEX_NAME


def uncovered_attention(config: Any) -> tuple[str, str] | None:
    """What a model's attention does that the document kernels (varlen, flex, packed_sdpa) do not: logit
    soft-capping (Gemma 2), attention layers that take no function by name (Falcon: ``hf_dir.fixed_attention``; then
    its SDPA where transformers gives it one), or anything for which transformers gives its model class no SDPA path
    (GPT-OSS's attention sinks). Returns (the stock implementation that computes it, and why), or None where the
    kernels are exact. Packed rows on it rely on the mask transformers builds, which separates documents only where
    the model hands it the position_ids (Gemma 2, Falcon; not GPT-OSS): ``engine/packing_check`` measures it."""
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap:
        return "eager", f"its attention logits are soft-capped at {softcap:g}"
    model = _causal_lm_class(config)
    stock = "sdpa" if model is None or getattr(model, "_supports_sdpa", True) else "eager"  # HY-V4: no SDPA path
    if "indexed_attention" in (getattr(config, "layer_types", None) or ()):
        # DeepSeek sparse attention: each layer's indexer scores the keys against the causal mask itself and keeps
        # each query's top ones; the kernels hand the layer no mask (they separate documents on their own)
        return stock, "its sparse attention's indexer picks each query's keys from the causal mask it reads"
    fixed = attention_of(config.to_dict())
    if fixed:  # its own implementation; whether its mask keeps packed documents apart is measured (engine/packing_check)
        return ("sdpa" if getattr(model, "_supports_sdpa", False) else "eager"), fixed
    if model is not None and not getattr(model, "_supports_sdpa", True):
        # the kernels compute what SDPA computes: what transformers keeps from SDPA (GPT-OSS's attention sinks,
        # passed as an extra argument a kernel would silently drop) they cannot compute either
        return "eager", f"transformers gives {model.__name__} no SDPA attention: it computes more, as GPT-OSS's sinks"
    if model is not None and _adds_to_its_mask(model):
        # the kernels' mask function builds no mask (they separate documents themselves): such a model would add its
        # terms onto nothing and hand the kernel a mask without the causal part, which then attends to later tokens
        # (Doge), or find no mask to read (Qwen4-Exp's indexer)
        return stock, f"{model.__name__} works on its causal mask itself (as Doge adds its dynamic mask to it)"
    return None  # sliding windows (Mistral, Gemma 2/3, OLMo 3) the kernels apply: transformers passes them per layer


_ALWAYS_MASK = re.compile(r"""allow_is_causal_skip["']?\s*[=:]\s*False""")  # as an argument or a dict entry


@lru_cache(maxsize=None)  # reads the modeling file's source: once per class
def _adds_to_its_mask(model: type) -> bool:
    """Whether transformers' modeling code of ``model`` asks for its causal mask always materialized
    (``allow_is_causal_skip=False``): it adds terms of its own onto the mask (Doge's dynamic mask, ALiBi) or reads
    it (Qwen4-Exp's token indexer)."""
    import sys

    try:
        return _ALWAYS_MASK.search(inspect.getsource(sys.modules[model.__module__])) is not None
    except (OSError, TypeError, KeyError):  # no source shipped: nothing known against the kernels
        return False


def _causal_lm_class(config: Any) -> type | None:
    """The transformers class ``AutoModelForCausalLM`` builds for ``config``; None where it has none."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except (KeyError, ValueError):
        return None


def has_varlen() -> bool:
    """This torch ships ``torch.nn.attention.varlen.varlen_attn`` (2.10 and later)."""
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class DocumentPlan:
    """Where the documents of a batch of packed rows are, built once per forward pass."""

    cu_seqlens: torch.Tensor  # (documents + 1,) int32 offsets into the rows' tokens laid end to end
    max_len: int  # the longest document (the varlen kernel sizes its grid by it)
    doc_ids: torch.Tensor  # (rows, T) a batch-wide document number per token (FlexAttention's mask)


@torch.compiler.disable  # host-side planning with one sync: kept out of compiled layers
def plan_documents(position_ids: torch.Tensor, rows: int) -> DocumentPlan:
    """Documents of ``rows`` packed rows from their ``position_ids`` (a row always starts a document,
    so no document crosses a row)."""
    pos = position_ids.expand(rows, -1)
    starts = pos == 0
    starts[:, 0] = True
    flat = starts.flatten()
    offsets = flat.nonzero().flatten()
    total = torch.tensor([flat.numel()], device=flat.device, dtype=offsets.dtype)
    cu = torch.cat([offsets, total]).to(torch.int32)
    max_len = int((cu[1:] - cu[:-1]).max())  # the one host sync per forward
    doc_ids = flat.cumsum(0).view(pos.shape)
    return DocumentPlan(cu, max_len, doc_ids)


_cache: tuple[torch.Tensor, int, DocumentPlan] | None = None


@torch.compiler.disable
def cached_plan(position_ids: torch.Tensor, rows: int) -> DocumentPlan:
    """Every layer of one forward gets the same ``position_ids`` tensor: plan once, reuse per layer.
    The cache holds the tensor itself, so its memory cannot be reused by another batch meanwhile."""
    global _cache
    if _cache is None or _cache[0] is not position_ids or _cache[1] != rows:
        _cache = (position_ids, rows, plan_documents(position_ids, rows))
    return _cache[2]


def _fallback(module, query, key, value, attention_mask, dropout, scaling, **kwargs):
    """The stock path for what these kernels do not cover: a KV cache, a caller's mask, no position_ids
    (stock SDPA), or attention dropout in training (per-document SDPA, which applies it)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from .packed_attention import _attend

    if dropout and module.training and kwargs.get("position_ids") is not None and attention_mask is None:
        return _attend(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def _packed_call(query: torch.Tensor, key: torch.Tensor, attention_mask: Any, dropout: float, module, kwargs: dict) -> bool:
    """Training on packed rows: the case these kernels serve."""
    return (
        kwargs.get("position_ids") is not None
        and attention_mask is None
        and query.shape[2] == key.shape[2]
        and not (dropout and module.training)
    )


_VARLEN_ARGS: dict[str, Any] | None = None


def _varlen_args() -> dict[str, Any]:
    """Keyword arguments for a causal call of this torch's ``varlen_attn``: torch 2.10 takes
    ``is_causal``, 2.11 and later ``window_size`` (``(-1, 0)``: causal); whether it takes ``scale``
    (2.11+) and ``enable_gqa`` (later) is kept under those names as booleans."""
    global _VARLEN_ARGS
    if _VARLEN_ARGS is None:
        from torch.nn.attention.varlen import varlen_attn

        params = inspect.signature(varlen_attn).parameters
        args: dict[str, Any] = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
        args["enable_gqa"] = "enable_gqa" in params
        args["scale"] = "scale" in params
        _VARLEN_ARGS = args
    return _VARLEN_ARGS


VARLEN_DTYPES = (torch.bfloat16, torch.float16)  # what the flash kernel computes in (tests' CPU stand-in: fp32 too)


def varlen_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int, scale: float | None) -> torch.Tensor:
    """Causal varlen attention: q (N, H, D), k/v (N, Hkv, D) -> (N, H, D). Tests replace it on CPU."""
    from torch.nn.attention.varlen import varlen_attn

    args = dict(_varlen_args())
    # grouped key/value heads go in uncopied: the flash kernel under every torch's varlen_attn takes
    # Hkv dividing H (as SDPA's flash path does); 2.12+ asks for the flag, 2.10/2.11 have no check to pass
    if args.pop("enable_gqa") and q.shape[1] != k.shape[1]:
        args["enable_gqa"] = True
    if args.pop("scale"):
        args["scale"] = scale
    elif scale is not None and scale != q.shape[-1] ** -0.5:
        # torch 2.10's kernel always scales by 1/sqrt(head_dim): fold the model's own scale into q
        q = q * (scale * q.shape[-1] ** 0.5)
    return varlen_attn(q, k, v, cu, cu, max_len, max_len, **args)


def _autocast_dtype(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tensors`` in the autocast dtype of their device where autocast is on, else in the first one's dtype.
    Under autocast with fp32 master weights RoPE hands back fp32 queries and keys (cos/sin follow the
    fp32 residual stream) beside autocast-dtype values: the flash kernel computes in bf16/fp16 only,
    and FlexAttention before torch 2.11 refuses mixed dtypes."""
    device_type = tensors[0].device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else tensors[0].dtype
    return tuple(t.to(dtype) for t in tensors)


def varlen_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """query (B, H, T, D), key/value (B, Hkv, T, D) -> (B, T, H, D), as transformers expects."""
    if not _packed_call(query, key, attention_mask, dropout, module, kwargs):
        return _fallback(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    window = kwargs.get("sliding_window")
    if window and window < query.shape[2]:  # a sliding-window layer: FlexAttention masks the window as well
        return flex_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    query, key, value = _autocast_dtype(query, key, value)
    if query.dtype not in VARLEN_DTYPES:
        # the flash kernel under varlen_attn computes in bf16/fp16 only: an fp32 forward (outside autocast: the
        # fused head's probe at set-up, an fp32 eval) attends per document with SDPA, which is exact there (before
        # this, the probe failed on CUDA and every fp32-weight run quietly lost the fused head: H200, 2026-11-28)
        from .packed_attention import packed_sdpa_forward

        return packed_sdpa_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    b, h, t, d = query.shape
    plan = cached_plan(kwargs["position_ids"], b)
    # (B, H, T, D) -> every row's tokens end to end, (B*T, H, D); contiguous as the kernel requires
    q, k, v = (x.transpose(1, 2).reshape(b * t, x.shape[1], d) for x in (query, key, value))
    out = varlen_kernel(q, k, v, plan.cu_seqlens, plan.max_len, scaling)
    return out.view(b, t, h, d), None


_flex = None  # FlexAttention, compiled on CUDA (uncompiled it materializes the scores and is slow)
_masks: tuple[torch.Tensor, Any] | None = None


def _flex_fn():
    global _flex
    if _flex is None:
        from torch.nn.attention.flex_attention import flex_attention

        _flex = torch.compile(flex_attention, dynamic=False) if torch.cuda.is_available() else flex_attention
    return _flex


_block_mask = None


def _compiled_block_mask():
    global _block_mask
    if _block_mask is None:
        from torch.nn.attention.flex_attention import create_block_mask

        _block_mask = torch.compile(create_block_mask, dynamic=False)
    return _block_mask


@torch.compiler.disable
def document_block_mask(doc_ids: torch.Tensor, window: int | None = None):
    """A causal document mask for FlexAttention (within the last ``window`` tokens, for a sliding-window
    layer), built once per forward pass and kind of layer (cached on ``doc_ids``)."""
    global _masks
    if _masks is None or _masks[0] is not doc_ids:
        _masks = (doc_ids, {})
    if window in _masks[1]:
        return _masks[1][window]
    from torch.nn.attention.flex_attention import create_block_mask

    def same_document_causal(b, h, q_idx, kv_idx):
        return (doc_ids[b, q_idx] == doc_ids[b, kv_idx]) & (q_idx >= kv_idx)

    def same_document_window(b, h, q_idx, kv_idx):
        return same_document_causal(b, h, q_idx, kv_idx) & (q_idx - kv_idx < window)

    rows, t = doc_ids.shape
    # compiled on CUDA, as torch recommends: the mask is then built block by block, never as a rows x T x T tensor
    build = _compiled_block_mask() if doc_ids.is_cuda else create_block_mask
    rule = same_document_window if window and window < t else same_document_causal
    mask = _masks[1][window] = build(rule, rows, None, t, t, device=doc_ids.device)
    return mask


FLEX_MIN_HEAD_DIM = 16  # FlexAttention's CUDA kernel (Triton's tl.dot) refuses smaller heads ("NYI")


def flex_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """query (B, H, T, D), key/value (B, Hkv, T, D) -> (B, T, H, D), as transformers expects."""
    if not _packed_call(query, key, attention_mask, dropout, module, kwargs):
        return _fallback(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if query.is_cuda and min(query.shape[-1], value.shape[-1]) < FLEX_MIN_HEAD_DIM:
        from .packed_attention import packed_sdpa_forward  # documents batched by length, one SDPA call each

        return packed_sdpa_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    plan = cached_plan(kwargs["position_ids"], query.shape[0])
    mask = document_block_mask(plan.doc_ids, kwargs.get("sliding_window"))
    gqa = query.shape[1] != key.shape[1]
    query, key, value = _autocast_dtype(query, key, value)
    out = _flex_fn()(query, key, value, block_mask=mask, scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2), None


def _no_mask(*args, **kwargs):
    return None  # documents are separated by the attention function itself


def register(name: str) -> str:
    """Make ``attn_implementation=name`` (VARLEN_NAME or FLEX_NAME) available to transformers; returns it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, {VARLEN_NAME: varlen_forward, FLEX_NAME: flex_forward}[name])
    AttentionMaskInterface.register(name, _no_mask)
    return name
