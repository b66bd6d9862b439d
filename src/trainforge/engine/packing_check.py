"""``data.packing`` settled against the attention the run will use, before any data is packed.

trainforge's document kernels keep packed documents apart themselves. Where the run trains on transformers' stock
attention instead (``model/doc_attention.uncovered_attention``: soft-capping, sinks, layers that take no attention
function by name; or ``model.attention: eager|sdpa`` asked for), transformers' mask is all that separates them,
and whether it does is measured (``model/packing_probe``) on a tiny random copy of the run's config:

- it does (Gemma 2, Falcon, GPT-Neo): packing stays on;
- eager does not, but the model's eager function run per document does (GPT-OSS, under ``auto``: ``doc_eager``):
  packing stays on, and ``model/load.exact_attention`` takes that path;
- nothing does (DeepSeek-V4, Bloom, MPT; GPT-OSS on ``eager`` asked for): an unset ``data.packing`` resolves to false, said once on the console;
  ``data.packing: true`` given is refused (exit 2) naming why, and so are the objectives that pack whatever
  ``data.packing`` says (DPO's pairs, GRPO's rollouts).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..config.errors import ConfigError
from ..config.run import RunConfig

STOCK = ("eager", "sdpa")  # transformers' implementations the probe can run on the CPU


def settle_packing(cfg: RunConfig, tokenizer: Any, device: torch.device | None, info: Callable[[str], None]) -> RunConfig:
    """``cfg``, with ``data.packing`` false where it was left unset and the run's attention on ``device`` (None: a GPU
    planned for) would let packed documents read each other; raises ConfigError where ``data.packing: true`` was
    given for such a run, or its objective packs documents whatever data.packing says."""
    kind, objective = cfg.model.kind, cfg.train.objective
    if kind.encoder_decoder or kind.recurrent or (objective == "sft" and cfg.data.packing is not True):
        return cfg  # nothing packed into one row as separate documents (or the config already refused it)
    attn = run_attention(cfg, tokenizer, device)
    if attn is None:
        return cfg
    stock, config = attn
    from ..model.load import model_class
    from ..model.packing_probe import config_leak, packing_attention

    # auto may take the model's eager attention per document where its stock mask leaks (model/load.exact_attention
    # chooses the same); eager or sdpa asked for by name is what the run takes
    cls = model_class(cfg.model)
    why = packing_attention(config, stock, cls)[1] if cfg.model.attention == "auto" else config_leak(config, stock, cls)
    if why is None:
        return cfg
    if objective != "sft":  # packs whatever data.packing says: DPO's pairs as two documents, GRPO's rollouts
        what = "its rollouts" if objective == "grpo" else "a pair's chosen and rejected sides"
        raise ConfigError(
            f"train.objective: {objective} packs {what} into one row as separate documents, but "
            f"{why}; this model trains train.objective: sft here (one example per row)"
        )
    if "packing" in cfg.data.model_fields_set:
        raise ConfigError(
            f"data.packing: true, but {why}; set data.packing: false (one example per row, batches "
            "grouped by length) or leave it unset; 'concat' (text as one stream, for pretraining) is fine"
        )
    info(f"data.packing false: {why}; one example per row, batches grouped by length")
    return cfg.model_copy(update={"data": cfg.data.model_copy(update={"packing": False})})


def run_attention(cfg: RunConfig, tokenizer: Any, device: torch.device | None, half_precision: bool = True) -> tuple[str, Any] | None:
    """The stock attention (``eager``/``sdpa``) the run's model will train with on ``device`` (None: a GPU planned
    for), and its transformers config; None where it trains on a trainforge document kernel (which separates
    documents itself) or another implementation. As ``model/load.attention_implementation`` and ``exact_attention``
    choose, without registering anything: the kernels' names stand for themselves here."""
    from ..model.doc_attention import uncovered_attention
    from ..model.load import init_config

    requested = cfg.model.attention
    if requested == "auto" and device is not None and device.type not in ("cpu", "cuda"):
        requested = "sdpa"  # MPS: stock SDPA (attention_implementation)
    if requested not in (*STOCK, "auto", "packed_sdpa", "varlen", "flex"):
        return None  # flash_attention_2 (needs CUDA and its package): documents from position_ids in its varlen call
    if cfg.model.init is not None:
        config = init_config(cfg.model.init, tokenizer)
    else:
        from transformers import AutoConfig

        from ..hf_dir import refuse_adapter, refuse_custom_code

        refuse_adapter(cfg.model.path)  # a LoRA run's final/: "merge it first", not transformers' "Unrecognized model"
        refuse_custom_code(cfg.model.path, "model.path")
        config = AutoConfig.from_pretrained(str(cfg.model.path.resolve()), trust_remote_code=False)
    if requested in STOCK:
        return requested, config
    uncovered = uncovered_attention(config)
    # a kernel named where it cannot compute the model is refused when the model is built (exact_attention)
    return (uncovered[0], config) if uncovered is not None and requested == "auto" else None

