"""``trainforge eval``: loss, perplexity and token count of a model on a dataset, through the same
data pipeline, masks and loss as training.

The data settings are the run's (``config.yaml``: format, max_length, packing, chat template,
train_on_prompt, too_long, ...) when the model is a run directory, else the defaults; ``--data``
replaces the source and ``--set`` overrides any key. The file is tokenized as one source (cached
like training data), packed in stored order and batched as the run's eval set is, so on the run's
own eval file the loss equals the run's final ``eval_loss``.

Encoder-decoder models (T5, BART, ...): rows map to source -> target as in training (the same
renderer, per-side limits ``data.max_length`` / ``data.max_target_length``, one example per row,
the decoder starting from the model's start token), and the loss averages over target tokens.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import ValidationError

from ..config.run import ConfigError, RunConfig, apply_override, parse_override
from ..config.errors import format_errors
from ..data.loader import eval_batches
from ..data.plan import collator_for, lost_tokens_warning, rows_for
from ..data.prepare import prepare_data
from ..data.sources import DataError
from ..engine.evaluate import evaluate
from ..hardware.device import PRECISIONS, Precision, configure_backends, pick_device, resolve_precision
from ..metrics.console import ConsoleReporter
from ..model.resolve import ModelSource, load_model, load_source_tokenizer, resolve_source, run_precision
from .evaluate_preference import eval_objective, preference_figures, with_objective

DEFAULT_MAX_LENGTH = 1024


def eval_config(src: ModelSource, data: str, overrides: list[str], max_positions: int | None = None) -> RunConfig:
    """The run's config (or the defaults) reading ``data`` as its only source, then ``overrides``.

    Every row of ``data`` is evaluated: the run's ``data.max_documents`` and
    ``train.eval_max_batches`` are cleared (set them with ``--set`` to cap). The model section
    names the resolved model, so a base model or training data moved since the run does not matter.
    """
    if src.run_config is not None:
        raw = copy.deepcopy(src.run_config)
        source = f"{src.run_dir / 'config.yaml'}"
    else:
        raw = {"data": {"max_length": min(DEFAULT_MAX_LENGTH, max_positions or DEFAULT_MAX_LENGTH)}}
        source = "eval defaults"
    attention = raw.get("model", {}).get("attention", "auto")
    raw["model"] = {"path": str(src.weights), "tokenizer": str(src.tokenizer_dir), "attention": attention}
    raw.setdefault("data", {}).update(train=data, eval=None, max_documents=None)
    raw.setdefault("train", {})["eval_max_batches"] = None
    overridden: set[tuple[str, ...]] = set()
    for item in overrides:
        parts, value = parse_override(item)
        apply_override(raw, parts, value)
        overridden.add(tuple(parts))
    if raw["data"].get("max_length") == "auto":  # sized for a training step on this machine: eval reads as it is told
        raise ConfigError("data.max_length: auto is for training; give eval a number of tokens (--set data.max_length=N)")
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as e:
        for err in e.errors():
            if tuple(err["loc"][:2]) == ("data", "train") and ("data", "train") not in overridden:  # --data's own value
                raise ConfigError(f"--data {data}: {err['msg'].removeprefix('Value error, ')}") from None
        raise ConfigError(format_errors(e, raw, source, {}, overridden, RunConfig)) from None


def eval_precision(src: ModelSource, cfg: RunConfig, overrides: list[str], device: torch.device) -> tuple[Precision, str]:
    """``--set train.precision`` when given; else the run's own precision (summary.json), so the
    figures are the run's; else ``train.precision`` (auto: the same rule as training)."""
    if not any(o.split("=", 1)[0].strip() == "train.precision" for o in overrides) and run_precision(src) in PRECISIONS:
        return PRECISIONS[run_precision(src)], "the run's precision (summary.json)"
    return resolve_precision(cfg.train.precision, device, cfg.data.cache_dir)


def evaluate_model(source: str | Path, data: str, overrides: list[str], reporter: ConsoleReporter) -> dict[str, Any]:
    """Evaluate the model that ``source`` names on ``data``; returns the figures as a dict."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    src = resolve_source(source)
    max_positions = None
    if src.adapter is None and src.run_config is None:
        import json

        max_positions = json.loads((src.weights / "config.json").read_text()).get("max_position_embeddings")
    cfg = eval_config(src, data, overrides, max_positions)
    try:
        device = pick_device(cfg.train.device)
    except RuntimeError as e:  # a run trained on a GPU, evaluated where there is none
        raise ConfigError(f"{e} (--set train.device=cpu)") from None
    precision, why = eval_precision(src, cfg, overrides, device)
    configure_backends(device)
    reporter.info(f"model: {src.describe()} | {device} | precision {precision.name} ({why})")

    tokenizer = load_source_tokenizer(src)
    # the data layer's messages name the file as given here, not as data.train (a key the user never wrote)
    cfg = cfg.model_copy(update={"data": cfg.data.named_as(f"--data {data}", "score them with --set train.objective={}", "--set {}={}")})
    d = cfg.data
    prepared = prepare_data(d, tokenizer, cfg.train.seed, log=reporter.info, seq2seq=src.encoder_decoder)
    if (warning := lost_tokens_warning(prepared.stats, d.max_length)) is not None:
        reporter.warn(warning)
    store = prepared.train  # the file is read as the one training source: every row, in order
    pairs = prepared.format in ("preference", "unpaired")
    cfg = with_objective(cfg, prepared.format)  # preference data: the run's objective, else dpo or kto; other data: sft
    rows = rows_for(cfg, prepared)(store, np.arange(len(store)))  # a kto run's eval on pairs: names --set train.objective
    # an adapter's decoder starts where its base's does (the adapter directory has no config.json)
    collate = collator_for(cfg, tokenizer, cfg.model.model_copy(update={"path": src.base or src.weights}))(store)
    batches = eval_batches(rows, collate, cfg.train.micro_batch_size, cfg.train.eval_max_batches)

    model = load_model(src, device, precision, vocab_size=len(tokenizer))
    where = {"sequences": len(store), "rows": len(rows), "format": prepared.format, "data": data, "model": str(src.path),
             "precision": precision.name, "device": str(device)}
    if pairs:  # the objective's loss and rewards, against its reference (tools/evaluate_preference.py)
        objective = eval_objective(cfg, src, device, precision)
        result = evaluate(model, batches, precision, device, fused=cfg.train.fused_loss, objective=objective)
        return {**preference_figures(result), "objective": objective.name, "reference": objective.reference, **where}
    result = evaluate(model, batches, precision, device, fused=cfg.train.fused_loss)
    return {
        "loss": result["eval_loss"],
        "perplexity": result["eval_ppl"],
        "tokens": result["eval_tokens"],  # target tokens the loss averages over
        "sequences": len(store),
        "rows": len(rows),
        "format": prepared.format,
        "data": data,
        "model": str(src.path),
        "precision": precision.name,
        "device": str(device),
    }


def render(result: dict[str, Any]) -> str:
    """The figures as lines for the console."""
    if "objective" in result:
        rewards = {k: v for k, v in result.items() if k.startswith(("reward", "logps", "kl"))}
        return (f"{result['objective']} loss  {result['loss']:.6f} over {result['pairs']:,} "
                + ("examples" if result["objective"] == "kto" else "pairs") + f" (reference: {result['reference']})\n"
                + "\n".join(f"{k:<18} {v:.4f}" for k, v in rewards.items())
                + f"\nprecision   {result['precision']} on {result['device']}")
    return (
        f"loss        {result['loss']:.6f}\n"
        f"perplexity  {result['perplexity']:.4f}\n"
        f"tokens      {result['tokens']:,} (targets, in {result['sequences']:,} {result['format']} sequences)\n"
        f"precision   {result['precision']} on {result['device']}"
    )
