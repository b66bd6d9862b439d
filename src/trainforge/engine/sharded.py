"""Model and optimizer state of a data-parallel run, per mode.

DDP: every rank holds the same full weights, so rank 0 writes the ordinary ``state.pt``.
FSDP2: each rank holds a shard; checkpoints hold them as a ``torch.distributed.checkpoint``
directory (``sharded/``, written by all ranks together) beside rank 0's ``state.pt`` with
everything else, and ``final/`` gathers the full weights on rank 0.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..rundir.checkpoint import save_checkpoint
from ..dist import DistContext

SHARDED_DIR = "sharded"
SHARDED_KEYS = ("model", "optimizer")


def sharded_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's shards of the model and optimizer state (DTensors), keyed by parameter name."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}


def load_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, checkpoint: Path) -> None:
    """Read ``checkpoint/sharded`` into the FSDP model and optimizer (all ranks together)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    state = sharded_state(model, optimizer)
    dcp.load(state, checkpoint_id=str(checkpoint / SHARDED_DIR))
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optimizer"])


def full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's weights on rank 0's CPU (other ranks get an empty dict); all ranks call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def checkpoint_writer(ctx: DistContext) -> Callable[..., Any]:
    """``Checkpointer``'s writer for this rank: the plain one alone; rank 0 only under DDP;
    under FSDP all ranks write their shards into rank 0's staging directory, then rank 0 publishes it."""
    if not ctx.enabled:
        return save_checkpoint
    if ctx.mode == "ddp":
        return save_checkpoint if ctx.is_main else _skip
    return lambda root, step, state, meta, keep_last: _save_fsdp(ctx, root, step, state, meta, keep_last)


def _skip(*args: Any) -> None:
    """Other DDP ranks: their state equals rank 0's (which holds their random states too)."""


def _save_fsdp(ctx: DistContext, root: Path, step: int, state: dict[str, Any], meta: dict[str, Any], keep_last: int) -> None:
    import torch.distributed.checkpoint as dcp

    from ..rundir.checkpoint import staging_dir, step_dir_name

    shards = {k: state[k] for k in SHARDED_KEYS}
    rest = {k: v for k, v in state.items() if k not in SHARDED_KEYS}

    def write_shards(tmp: Path) -> None:
        ctx.barrier()  # the others wait for rank 0 to create the staging directory
        dcp.save(shards, checkpoint_id=str(tmp / SHARDED_DIR))
        ctx.barrier()  # every shard is on disk before rank 0 writes meta.json and renames

    # one staging directory for all ranks: rank 0 names it (after itself), the others write into it
    staging = Path(ctx.broadcast_object(str(staging_dir(root / step_dir_name(step))) if ctx.is_main else None))
    if ctx.is_main:
        save_checkpoint(root, step, rest, meta, keep_last, write_shards=write_shards, staging=staging)
    else:
        write_shards(staging)
    ctx.barrier()  # nobody starts the next step (or a resume scan) before the rename
