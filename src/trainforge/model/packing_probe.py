"""Whether packed documents stay apart under transformers' stock attention (``eager``, ``sdpa``), measured.

trainforge's document kernels (``packed_attention``, ``doc_attention``) separate the documents of a packed row
themselves. Where a model trains on transformers' stock attention instead (what the kernels cannot compute:
Gemma 2's soft-capping, GPT-OSS's sinks; layers that take no attention function by name: Falcon, GPT-Neo), only
the mask transformers builds keeps them apart, and it builds a per-document mask from ``position_ids`` only
where the model's code hands them to the mask creation: Gemma 2 and Falcon do, GPT-OSS does not (its documents
read each other). Nothing of that is assumed here: a model of the run's architecture and attention settings runs
two short documents packed into one row (positions restarting) and each alone, and the logits must agree.

The probe model is random and tiny (the run's config with its sizes shrunk): the mask is the modeling code's,
not the weights', and the decision is needed before the data is packed, so before the real model is loaded.
It runs once per (config, attention) in a process: eval mode, no gradient, fp32 on the CPU, the random state kept.
Where the stock eager attention leaks, the model's own eager function run per document (``doc_eager``) is measured
next: GPT-OSS packs on it, its sinks intact.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

DOC_LENGTHS = (5, 7)  # two documents: the second's first tokens would read the first one's if the mask leaked
TOLERANCE = 1e-4  # relative to the largest logit, fp32: the same kernels on the same tokens, rounding at most

_DECIDED: dict[tuple[str, str, str], str | None] = {}


def packing_attention(config: Any, stock: str, model_class: Any) -> tuple[str, str | None]:
    """The attention a model of ``config`` trains packed rows with where trainforge's kernels leave it ``stock``:
    ``stock`` where its mask keeps packed documents apart, else the model's own eager attention run per document
    (``doc_eager``: GPT-OSS) where that does; and why neither does (None where one does)."""
    from .doc_eager import candidate

    why = config_leak(config, stock, model_class)
    other = candidate(stock) if why is not None else None
    if other is not None and config_leak(config, other, model_class) is None:
        return other, None
    return stock, why


def config_leak(config: Any, attn: str, model_class: Any) -> str | None:
    """``packing_leak`` of a tiny copy of ``config`` (``tools/family_shrink.shrink_config``: the config's own
    fields, tiny sizes)."""
    # a pure function of a config: tools/family_shrink imports nothing of trainforge
    from ..tools.family_shrink import shrink_config

    try:
        tiny = shrink_config(config)
    except Exception as e:  # noqa: BLE001 - a config the shrinker cannot rebuild: nothing measured
        return f"a packing probe could not shrink the model's config ({type(e).__name__}: {str(e)[:120]})"
    return packing_leak(tiny, attn, model_class)


def packing_leak(tiny_config: Any, attn: str, model_class: Any) -> str | None:
    """None when ``model_class`` built from ``tiny_config`` with ``attn_implementation=attn`` gives each of two
    documents packed into one row the logits it gives alone; else why not (a short phrase)."""
    key = (type(tiny_config).__name__, tiny_config.to_json_string(use_diff=False), attn)
    if key not in _DECIDED:
        _DECIDED[key] = _probe(tiny_config, attn, model_class)
    return _DECIDED[key]


def _probe(config: Any, attn: str, model_class: Any) -> str | None:
    vocab = int(getattr(config.get_text_config(), "vocab_size", 64) or 64)
    docs = [(torch.arange(n) * 7 + 3 + 11 * i) % (vocab - 1) + 1 for i, n in enumerate(DOC_LENGTHS)]  # no id 0 (pad)
    positions = [torch.arange(n) for n in DOC_LENGTHS]
    # fork_rng: building the random model draws from the CPU generator, which the run's seed owns
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(0)
        try:
            # a copy: building a model writes its attention choice into the config it gets
            model = model_class.from_config(copy.deepcopy(config), dtype=torch.float32, attn_implementation=attn, trust_remote_code=False)
            model.eval()  # no dropout: packed and alone must be the same function
            packed = model(input_ids=torch.cat(docs)[None], position_ids=torch.cat(positions)[None], use_cache=False).logits[0]
            alone = torch.cat([model(input_ids=d[None], position_ids=p[None], use_cache=False).logits[0]
                               for d, p in zip(docs, positions)])
        except Exception as e:  # noqa: BLE001 - a model the probe cannot build or run: nothing measured
            return f"a packing probe on a tiny copy of the model failed ({type(e).__name__}: {(str(e).splitlines() or [''])[0][:120]})"
    gap = ((packed.float() - alone.float()).abs().max() / alone.float().abs().max().clamp_min(1e-6)).item()
    if not gap <= TOLERANCE:  # also NaN
        return (f"transformers' {attn} attention of {type(model).__name__} lets packed documents attend to each other "
                f"(a document's logits packed differ from alone by {gap:.2g} relative: its mask does not follow the restarting "
                "position_ids)")
    return None
