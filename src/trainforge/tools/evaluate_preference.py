"""``trainforge eval`` on preference data: the objective's loss and reward metrics of a model on pairs (or KTO
rows), through the same rows, reference and code as a run's evaluation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..config.run import ConfigError, RunConfig
from ..config.preference import resolve_reference
from ..engine.objective import PairObjective
from ..hardware.device import Precision
from ..model.resolve import ModelSource, load_model, resolve_source


def with_objective(cfg: RunConfig, fmt: str) -> RunConfig:
    """``cfg`` scoring data of format ``fmt``: preference data with the run's objective (else dpo for pairs and
    kto for unpaired rows), any other data with next-token loss (sft), whatever the run trained."""
    if fmt not in ("preference", "unpaired"):
        objective = "sft"
    elif cfg.train.objective != "sft":
        return cfg
    else:
        objective = "kto" if fmt == "unpaired" else "dpo"
    return cfg.model_copy(update={"train": cfg.train.model_copy(update={"objective": objective})})


def eval_objective(cfg: RunConfig, src: ModelSource, device: torch.device, precision: Precision) -> PairObjective:
    """The objective scoring ``src``'s model. The reference of an adapter is its base with the adapters off; of
    full weights, the starting weights: the run's ``model.path`` (or ``--set model.path=...``), loaded apart;
    ``--set preference.reference=none`` scores reference-free."""
    objective = cfg.train.objective
    reference = resolve_reference(objective, cfg.preference.reference, "lora" if src.adapter is not None else "full")
    if reference in ("adapters", "none"):
        return PairObjective(objective, cfg.preference, reference)
    start = cfg.model.path if cfg.model.path != src.weights else None  # --set model.path=DIR names it
    run_start = ((src.run_config or {}).get("model") or {}).get("path")
    start = start or (Path(run_start) if run_start else None)  # else the directory the run started from
    if start is None or not start.is_dir():
        if start:
            why = f" ({start}, which is not a directory now)"
        elif src.run_config is None:  # a plain model directory: nothing says what it was tuned from
            why = ", the model it was tuned from, which a model directory does not name (it is not a trainforge run)"
        else:
            why = ", which this run did not load from a directory"
        raise ConfigError(
            f"{src.path}: the reference of full weights is their starting model{why}; give it with --set model.path=DIR "
            "(the model before preference tuning), or score reference-free with --set preference.reference=none"
        )
    base = load_model(resolve_source(start), device, precision).eval().requires_grad_(False)
    return PairObjective(objective, cfg.preference, "model", base)


def preference_figures(result: dict[str, Any]) -> dict[str, Any]:
    """The figures of a preference evaluation, named as ``trainforge eval`` reports them."""
    return {"loss": result["eval_loss"], "pairs": result["eval_pairs"],
            **{k.removeprefix("eval_"): v for k, v in result.items() if k not in ("eval_loss", "eval_pairs")}}
