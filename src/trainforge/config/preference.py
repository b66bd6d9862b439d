"""The ``preference`` section of a run config: the hyperparameters of ``train.objective`` dpo, ipo, orpo, simpo and kto,
and which model gives the reference log-probabilities; ``check_objective`` holds the objective against the rest."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from .base import Section

OBJECTIVES = ("sft", "dpo", "ipo", "orpo", "simpo", "kto", "grpo")
"""``train.objective`` values: next-token cross-entropy, the preference objectives (engine/preference.py), then online
RL (grpo: the ``rl`` section, config/rl.py)."""
OBJECTIVES_FOR_DATA = {"preference": tuple(o for o in OBJECTIVES if o not in ("sft", "kto", "grpo")), "unpaired": ("kto",)}
"""The objectives that train on each kind of preference data (pairs; KTO's labelled rows)."""
REFERENCE_FREE = ("orpo", "simpo")
"""Objectives that compare the policy with itself: no reference model runs."""
READ_BY = {"label_smoothing": ("dpo",), "simpo_gamma": ("simpo",), "desirable_weight": ("kto",), "undesirable_weight": ("kto",)}
"""The ``preference`` keys only some objectives read (``reference``: all but ``REFERENCE_FREE``; ``beta``: all)."""


class PreferenceSettings(Section):
    beta: float = Field(
        0.1, gt=0, le=1000,
        description="dpo: the KL weight beta (rewards are beta x log-ratio); ipo: the regularization tau; simpo: the "
        "reward scale (the paper uses 2-10); orpo: the weight lambda of the odds-ratio term next to the chosen NLL",
    )
    label_smoothing: float = Field(
        0.0, ge=0, lt=0.5, description="dpo: the probability that a pair's preference is flipped (conservative DPO)",
    )
    simpo_gamma: float = Field(0.5, ge=0, le=1000, description="simpo: the target reward margin gamma")
    desirable_weight: float = Field(1.0, gt=0, le=1000, description="kto: the weight of a desirable example's loss")
    undesirable_weight: float = Field(
        1.0, gt=0, le=1000, description="kto: the weight of an undesirable example's loss (the paper balances the two "
        "so that weight x count is about equal on both sides)",
    )
    reference: Literal["auto", "model", "precompute", "none"] = Field(
        "auto",
        description="the reference of dpo, ipo and kto: auto: with LoRA/QLoRA the same model with its adapters switched off "
        "(no second copy of the weights), with a full fine-tune a frozen copy of the starting weights; model: always "
        "a frozen copy; precompute: the starting weights' log-probabilities of every pair computed once before "
        "training and cached beside the token store (no reference forward in the steps, no second copy); none: "
        "reference-free (log-ratios against 0). orpo and simpo use no reference",
    )


def check_objective(cfg: Any) -> None:
    """Raise ValueError naming the key when ``train.objective`` of ``cfg`` (a RunConfig being validated) does not
    fit the model or the data settings (``data.format``, and each source's own format)."""
    objective = cfg.train.objective
    formats = cfg.data.set_formats()
    if objective == "grpo":  # prompts and rewards: config/rl.py checks them
        for key, fmt in formats:
            if fmt in ("preference", "unpaired"):
                raise ValueError(f"{key}: {fmt} rows train a preference objective; grpo reads prompt rows "
                                 f"({{prompt, ...}} or {{messages, ...}}): set {key}: auto")
        return
    if objective == "sft":
        for key, fmt in formats:
            if fmt in ("preference", "unpaired"):
                raise ValueError(f"{key}: {fmt} rows train a preference objective; set train.objective to "
                                 + ("kto" if fmt == "unpaired" else "one of dpo, ipo, orpo, simpo"))
        return
    if cfg.model.kind.encoder_decoder:
        raise ValueError(f"train.objective: {objective} is for decoder-only models here; this model is an encoder-decoder")
    rows = "unpaired" if objective == "kto" else "preference"
    for key, fmt in formats:
        if fmt not in ("auto", rows):
            fix = (f"for KTO on pairs set {key}: unpaired (each chosen reply a desirable example, each rejected one an "
                   "undesirable one; auto refuses pairs under kto)" if objective == "kto" and fmt == "preference"
                   else f"set {key}: {rows} or auto")
            raise ValueError(f"{key}: train.objective {objective} reads {rows} rows; {fix}")
    _check_unread(objective, cfg.preference)
    if objective == "kto" and cfg.preference.reference == "none":
        raise ValueError("preference.reference: kto compares each completion with the reference; use auto or model")
    if cfg.data.packing is not True:
        raise ValueError(f"data.packing: train.objective {objective} puts a pair's chosen and rejected sides into one row "
                         "as two documents (one forward for both); set data.packing: true")


def _check_unread(objective: str, settings: PreferenceSettings) -> None:
    """Raise ValueError for a ``preference`` key set away from its default that ``objective`` never reads: it would
    change nothing (TRL applies a label smoothing to SimPO, for one; here only DPO's conservative loss has one)."""
    for key, readers in READ_BY.items():
        value, default = getattr(settings, key), PreferenceSettings.model_fields[key].default
        if objective not in readers and value != default:
            raise ValueError(f"preference.{key}: {value} has no effect on train.objective {objective} (only "
                             f"{' and '.join(readers)} reads it); remove it or set it to {default}")
    if objective in REFERENCE_FREE and settings.reference in ("model", "precompute"):
        raise ValueError(f"preference.reference: {settings.reference} has no effect on train.objective {objective}, which "
                         "runs no reference model; remove it or set it to auto")


def resolve_reference(objective: str, reference: str, method: str) -> str:
    """What gives the reference log-probabilities: ``adapters``, ``model``, ``precompute`` or ``none`` (preference.reference)."""
    if objective in REFERENCE_FREE or reference == "none":
        return "none"
    if reference == "auto":
        return "adapters" if method in ("lora", "qlora") else "model"
    return reference


def run_reference(cfg: Any) -> str:
    """The reference a run (a RunConfig) computes: ``none`` for sft; for grpo DPO's (adapters off, or a frozen copy)
    when ``rl.beta`` > 0, else none; for a preference objective ``resolve_reference``."""
    objective = cfg.train.objective
    if objective == "sft":
        return "none"
    if objective == "grpo":
        return "none" if cfg.rl.beta == 0 else resolve_reference("dpo", "auto", cfg.model.method)
    return resolve_reference(objective, cfg.preference.reference, cfg.model.method)
