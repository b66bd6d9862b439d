"""The long-context levers on the memory model: which of ``train.tiled_mlp`` and ``train.activation_offload``
an ``auto`` turns on (only when the run does not fit without it), and why.

The traced step (trace.py) runs the levers a config has set to ``true``; this module tries them in
order of cost (none, tiled MLP, tiled MLP + offload), each at the micro-batch the run asks for (one row
when that is auto) with activation checkpointing on unless it is off, and keeps the first that fits.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...config.run import RunConfig
from ...hardware.device import Precision
from ...hardware.profiles import GIB, HardwareProfile
from .fit import FIT_MARGIN, MemoryPrediction, predict_memory


@dataclass(frozen=True)
class Levers:
    """The long-context levers of one step (``True``: on)."""

    checkpointing: bool = False
    tiled_mlp: bool = False
    offload: bool = False

    def describe(self) -> str:
        names = [n for n, on in (("checkpointing", self.checkpointing), ("tiled MLP", self.tiled_mlp),
                                 ("offload", self.offload)) if on]
        return " + ".join(names) or "none"


def with_levers(cfg: RunConfig, levers: Levers, max_length: int | None = None) -> RunConfig:
    """``cfg`` with these levers (and this row length) set, as the traced step reads them."""
    train = cfg.train.model_copy(update={
        "activation_checkpointing": levers.checkpointing, "tiled_mlp": levers.tiled_mlp, "activation_offload": levers.offload,
    })
    data = cfg.data if max_length is None else cfg.data.model_copy(update={"max_length": max_length})
    return cfg.model_copy(update={"train": train, "data": data})


def tiling_covers(cfg: RunConfig) -> bool:
    """Whether the model's family is one the tiled MLP covers (from its config, nothing loaded)."""
    from ...model.load import architecture_field
    from ...model.tiled_mlp import TILED_FAMILIES

    field = "architecture" if cfg.model.init is not None else "model_type"  # model.init names its family "architecture"
    try:
        kind = architecture_field(cfg.model, field)
    except Exception:  # a model directory without a readable config: the lever stays off
        return False
    return kind in TILED_FAMILIES


def lever_ladder(cfg: RunConfig, profile: HardwareProfile) -> list[Levers]:
    """The lever settings ``auto`` may choose from, cheapest first: each adds one lever the config leaves to auto
    (and that can act here: offload only on a GPU and with checkpointing, tiling only where it covers the model)."""
    t = cfg.train
    ckpt = t.activation_checkpointing is not False
    tiled = [t.tiled_mlp] if t.tiled_mlp != "auto" else ([False, True] if tiling_covers(cfg) else [False])
    offload_ok = ckpt and profile.kind == "gpu"
    offload = [t.activation_offload and ckpt] if t.activation_offload != "auto" else ([False, True] if offload_ok else [False])
    ladder = [Levers(ckpt, tiled[0], offload[0])]
    if len(tiled) > 1:
        ladder.append(Levers(ckpt, True, offload[0]))
    if len(offload) > 1:
        ladder.append(Levers(ckpt, ladder[-1].tiled_mlp, True))
    return ladder


@dataclass
class LeverChoice:
    levers: Levers
    why_tiled: str
    why_offload: str
    memory: MemoryPrediction | None


def resolve_levers(
    cfg: RunConfig, tokenizer, precision: Precision, profile: HardwareProfile, world_size: int = 1, mode: str = "ddp",
    margin: float = FIT_MARGIN,
) -> LeverChoice:
    """What ``tiled_mlp: auto`` and ``activation_offload: auto`` become for ``cfg`` on ``profile``, and why."""
    t = cfg.train
    ladder = lever_ladder(cfg, profile)
    rows = t.micro_batch_size if isinstance(t.micro_batch_size, int) else 1
    memory = None
    for levers in ladder:
        memory = predict_memory(with_levers(cfg, levers), tokenizer, precision, profile, rows, levers.checkpointing,
                                t.grad_accum, world_size, mode)
        if memory.fits(margin):
            break
    chosen = levers  # the first that fits, else the last (every lever)
    capacity = f"{margin:.0%} of {profile.memory_bytes / GIB:.1f} GiB"
    fits = memory is not None and memory.fits(margin)
    at = f"{memory.process / GIB:.2f} GiB at {rows} row{'s' if rows != 1 else ''} of {cfg.row_tokens()} tokens"

    def why(name: str, on: bool, auto: bool) -> str:
        if not auto:
            return "as configured"
        if name == "tiled" and not tiling_covers(cfg):
            return "off: the tiling covers the decoder MLPs of Llama, Mistral, Qwen2/3, Gemma and Phi-3, not this model"
        if name == "offload" and profile.kind != "gpu":
            return "off: on a CPU the boundaries already sit in host memory (nothing to move)"
        if name == "offload" and t.activation_checkpointing is False:
            return "off: it moves the checkpointed layers' inputs, and activation checkpointing is off"
        if not on:
            return f"off: the run fits without it ({at}, under {capacity})" if fits else "off"
        return (f"on: without it the run does not fit in {capacity} ({at} with it)" if fits
                else f"on: even with every lever the run is predicted at {at}, over {capacity}")

    return LeverChoice(
        chosen,
        why("tiled", chosen.tiled_mlp, t.tiled_mlp == "auto"),
        why("offload", chosen.offload, t.activation_offload == "auto"),
        memory,
    )


def resolved_config(cfg: RunConfig, choice: LeverChoice) -> RunConfig:
    """``cfg`` with the levers it leaves to auto replaced by ``choice`` (checkpointing stays as configured: fit_run decides it;
    offload on turns it on, since offload moves its boundaries)."""
    t = cfg.train
    # only what was left to auto: a lever the config fixes stays as it is (the quick path's choice is all-off)
    update = {k: v for k, v in (("tiled_mlp", choice.levers.tiled_mlp), ("activation_offload", choice.levers.offload))
              if getattr(t, k) == "auto"}
    if choice.levers.offload and t.activation_checkpointing == "auto":
        update["activation_checkpointing"] = True
    return cfg.model_copy(update={"train": t.model_copy(update=update)})


def decide_levers(cfg: RunConfig, tokenizer, precision: Precision, profile: HardwareProfile, world_size: int = 1,
                  mode: str = "ddp") -> LeverChoice:
    """``resolve_levers`` as a run's set-up and ``plan`` take it: with a fixed micro-batch whose rough estimate is far
    below the device, both levers off without tracing a step."""
    from .fit import QUICK_SHARE, rough_skeleton_bytes

    rows = cfg.train.micro_batch_size
    rough = rough_skeleton_bytes(cfg, tokenizer, precision, rows) if isinstance(rows, int) else None
    if rough is not None and rough < QUICK_SHARE * profile.memory_bytes:
        why = f"off: a rough estimate ({rough / GIB:.2f} GiB) is far below the {profile.memory_bytes / GIB:.1f} GiB of the device"
        return LeverChoice(Levers(), why, why, None)
    return resolve_levers(cfg, tokenizer, precision, profile, world_size, mode)


def with_decided_levers(cfg: RunConfig, tokenizer, precision: Precision, profile: HardwareProfile, world_size: int = 1,
                        mode: str = "ddp") -> tuple[RunConfig, dict[str, str]]:
    """``cfg`` with its auto long-context levers decided (``plan``: the levers the run's set-up will take), and why
    each lever left to auto took its setting (by its config key; empty when none was auto)."""
    t = cfg.train
    if "auto" not in (t.tiled_mlp, t.activation_offload):
        return cfg, {}
    choice = decide_levers(cfg, tokenizer, precision, profile, world_size, mode)
    why = {k: v for k, v, auto in (("tiled_mlp", choice.why_tiled, t.tiled_mlp == "auto"),
                                   ("activation_offload", choice.why_offload, t.activation_offload == "auto")) if auto}
    return resolved_config(cfg, choice), why
