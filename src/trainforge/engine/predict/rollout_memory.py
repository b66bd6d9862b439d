"""The rollout phase of a grpo step, priced: before the step learns, the policy samples the step's completions
(rl/rollout.py) in one batch with a KV cache. What it holds at its peak:

- what persists between steps: the weights, the optimizer state, a frozen reference, DDP's gradient buckets (the
  gradients of the previous step are freed: ``zero_grad(set_to_none=True)``);
- ``weight_casts``: a full fine-tune's fp32 weights in half precision, cast by autocast at their first matmul and
  cached until sampling ends (a LoRA base is stored in the compute dtype already);
- ``kv_cache``: keys and values of every layer for every row and position sampled so far, in the compute dtype:
  rows x tokens x layers x 2 x kv_heads x head_dim x bytes. Rows are the step's completions on this process
  (prompts x rl.num_generations); at the end of decoding each holds its prompt (left-padded to the longest, at most
  data.max_length) and rl.max_completion_length new tokens. Finished rows leave the batch early; the worst case is
  that none does. Sliding-window layers are counted whole (an overestimate for models that have them);
- ``temporaries``: the largest of the prefill (one forward over the prompts, each once whatever rl.num_generations:
  a layer's projections and MLP intermediates, the 4D padding mask, the last position's logits) with the prompts'
  cache, the repeat of that cache to every completion (both copies alive, the logits repeated too), and a decode
  step at the full cache (its logits in fp32 as the sampler filters and draws from them, one layer's keys and values copied
  while the cache grows, the attention scores).

Nothing is traced: the figures come from the architecture's fields, so ``fit.py`` prices every micro-batch the
auto pick considers at no cost.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .memory import mlp_width

PERSISTENT = ("weights", "optimizer", "reference", "ddp_buckets")
"""Parts of the learning step's prediction that also exist while the rollout samples."""


@dataclass(frozen=True)
class DecoderShape:
    """The architecture fields the rollout's memory depends on."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int


def decoder_shape(cfg: Any, tokenizer) -> DecoderShape:
    """The shape of the model ``cfg.model`` names (``model.init`` or the directory's config.json; an image-text
    model's language model), with transformers' defaults for the fields a config leaves out."""
    from ...model.load import check_model_dir, init_config

    if cfg.model.init is not None:
        config = init_config(cfg.model.init, tokenizer)
    else:
        from transformers import AutoConfig

        check_model_dir(cfg.model.path)
        config = AutoConfig.from_pretrained(str(cfg.model.path.resolve()), trust_remote_code=False)
    text = config.get_text_config()
    hidden, heads = text.hidden_size, text.num_attention_heads
    return DecoderShape(
        layers=text.num_hidden_layers, hidden=hidden, heads=heads,
        kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or hidden // heads,
        intermediate=mlp_width(text, hidden),
        vocab=max(text.vocab_size, len(tokenizer)),
    )


def kv_cache_bytes(shape: DecoderShape, rows: int, tokens: int, dtype_bytes: int) -> int:
    """Keys and values of every layer for ``rows`` rows of ``tokens`` positions."""
    return rows * tokens * shape.layers * 2 * shape.kv_heads * shape.head_dim * dtype_bytes


def generation_rows(cfg: Any, micro_batch_size: int, grad_accum: int, world_size: int = 1) -> int:
    """Completions one process samples at once: the step's (its share of ``train.global_batch_size``, else
    micro-batch x accumulation), every prompt's ``rl.num_generations`` together."""
    g = cfg.train.global_batch_size
    return g // world_size if g else micro_batch_size * grad_accum


def sampler_logit_bytes(cfg: Any, rows: int, vocab: int, dtype_bytes: int) -> int:
    """One draw's logits: the model's (compute dtype), their fp32 copy, scaled by the temperature, and the
    probabilities; top_k, min_p and top_p each add the buffers ``rollout.filter_logits`` makes."""
    s = cfg.rl
    per = dtype_bytes + 3 * 4
    if s.top_k:
        per += 4  # the masked copy
    if s.min_p > 0:
        per += 4 + 4 + 1  # probabilities, the masked copy, the mask
    if s.top_p < 1:
        per += 4 + 8 + 4 + 4 + 4 + 1 + 1  # sorted values and order, two softmaxes, the cumulative mass, the masks
    return rows * vocab * per


def rollout_parts(cfg: Any, shape: DecoderShape, dtype_bytes: int, rows: int, learning: dict[str, int]) -> dict[str, int]:
    """The rollout phase's peak by part: ``PERSISTENT`` from the learning step's ``learning`` parts, ``kv_cache``
    and ``temporaries`` at whichever of the prefill and the last decode step holds more (module docstring)."""
    prompt, total = cfg.data.max_length, cfg.data.max_length + cfg.rl.max_completion_length
    logits = sampler_logit_bytes(cfg, rows, shape.vocab, dtype_bytes)
    # the prefill: one layer at a time over rows x prompt tokens (the residual stream, norms, projections and their
    # casts; the MLP's gate, up, activation and product) with the 4D masks of the left padding (boolean, a few at
    # once while they are combined); then, the layers' temporaries freed, the last position's logits
    per_token = 8 * shape.hidden + 4 * shape.intermediate
    group = cfg.rl.num_generations if rows % cfg.rl.num_generations == 0 else 1
    prompts = rows // group  # each prompt prefilled once, then its cache repeated to its completions
    prefill_tmp = max(prompts * prompt * per_token * dtype_bytes + 3 * prompts * prompt * prompt, logits)
    prefill_kv = kv_cache_bytes(shape, prompts, prompt, dtype_bytes)
    candidates = [(prefill_kv, prefill_tmp)]
    if group > 1:  # the repeat: the prompts' cache and every completion's copy of it, with the repeated logits
        candidates.append((kv_cache_bytes(shape, rows, prompt, dtype_bytes) + prefill_kv, logits))
    # a decode step at the full cache: in a layer, its keys and values copied while torch.cat grows them, or repeated
    # to every query head (transformers' SDPA path takes no GQA kernel with a padding mask), the attention scores
    # (fp32) and one token's activations; then the draw's logits
    full_kv = kv_cache_bytes(shape, rows, total, dtype_bytes)
    repeat = max(1.0, shape.heads / shape.kv_heads)
    decode_tmp = max(int(full_kv // shape.layers * repeat) + rows * shape.heads * total * 4 + rows * per_token * dtype_bytes,
                     logits)
    kv, tmp = max([(full_kv, decode_tmp), *candidates], key=sum)
    parts = {k: learning[k] for k in PERSISTENT if k in learning}
    if cfg.model.method == "full" and dtype_bytes == 2:
        # fp32 weights under autocast: each matmul's half-precision copy is cached until sampling ends
        parts["weight_casts"] = learning.get("weights", 0) // 2
    return {**parts, "kv_cache": kv, "temporaries": tmp}


def predict_rollout(cfg: Any, tokenizer, precision: Any, micro_batch_size: int, grad_accum: int, world_size: int,
                    learning: dict[str, int]) -> tuple[dict[str, int], int] | None:
    """(the rollout phase's parts, the completions it samples) of a grpo run at these settings; None for other
    objectives. ``learning``: the learning step's parts (what persists is taken from them)."""
    if cfg.train.objective != "grpo":
        return None
    rows = generation_rows(cfg, micro_batch_size, grad_accum, world_size)
    dtype_bytes = 4 if precision.autocast_dtype is None else 2  # the cache holds the projections' outputs
    return rollout_parts(cfg, decoder_shape(cfg, tokenizer), dtype_bytes, rows, learning), rows


def micro_batch_unit(cfg: Any) -> int:
    """What an auto micro-batch must be a multiple of: a grpo step's completions (micro-batch x train.grad_accum)
    make whole groups of rl.num_generations, unless train.global_batch_size sets the step's completions; else 1."""
    if cfg.train.objective != "grpo" or cfg.train.global_batch_size:
        return 1
    g = cfg.rl.num_generations
    return g // math.gcd(g, cfg.train.grad_accum)


def rows_that_fit(a: Any, b: Any, budget: float) -> tuple[int, int]:
    """(the largest micro-batch at which every phase of the step stays within ``budget`` process bytes, the
    steepest phase's bytes per row), each phase on the line through two predictions (``fit.MemoryPrediction``)
    at different micro-batches: both the learning step and the rollout grow linearly in rows, at rates of their own."""
    largest, steepest = None, 1
    rows_a, rows_b = a.micro_batch_size, b.micro_batch_size
    for phase, tensors in a.phases.items():
        at_a = a.process_of(tensors)
        # 1: a rollout whose size the global batch sets
        per_row = max((b.process_of(b.phases[phase]) - at_a) // (rows_b - rows_a), 1)
        n = rows_a + int((budget - at_a) // per_row)
        largest, steepest = n if largest is None else min(largest, n), max(steepest, per_row)
    return largest, steepest
