"""``preference.reference: precompute``: the reference's log-probability of every stored sequence, computed once
with the starting weights before the first step and cached beside the token store.

The table is keyed by what decides its values (the starting weights, the method, the precision and head path,
the row length), so a rerun, a resume or a second run of the same data loads it instead of computing it, and
training then runs no reference forward at all and holds no second copy of the weights.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..rundir.atomic import atomic_write_bytes
from ..data.packing import pair_rows
from ..hardware.device import Precision
from .loss import fused_head
from .preference import batch_pair_logps

REFERENCE_VERSION = 1  # bump when the table's values would come out differently


def reference_key(cfg: Any, precision: Precision) -> str:
    """Hash of what the reference log-probabilities depend on besides the tokens (the store holding the table
    is keyed by those): the starting weights' identity, method, precision, head path and row length."""
    m = cfg.model
    if m.path is not None:  # a pretrained directory: its config and weight files, by name, size and time
        files = sorted(p for p in Path(m.path).iterdir() if p.suffix in (".json", ".safetensors", ".bin"))
        weights: Any = [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]
    else:  # from scratch: the architecture and the seed make the weights
        weights = {"init": m.init, "seed": cfg.train.seed, "vocab": m.tokenizer_vocab_size}
    key = {"v": REFERENCE_VERSION, "weights": weights, "method": m.method, "lora": m.lora.model_dump(mode="json"),
           "precision": precision.name, "fused": cfg.train.fused_loss, "max_length": cfg.data.max_length}
    return hashlib.blake2b(json.dumps(key, sort_keys=True, default=str).encode(), digest_size=12).hexdigest()


@torch.no_grad()
def sequence_logps(model: torch.nn.Module, store, collate, precision: Precision, device: torch.device,
                   rows_per_batch: int, max_length: int, fused: bool = True) -> np.ndarray:
    """The reference's summed log-probability of every sequence of a pair store (float32, one per sequence):
    its pairs packed as training packs them, ``model`` with its LoRA adapters off where it has them."""
    table = np.full(len(store), np.nan, dtype=np.float32)
    rows = pair_rows(store, np.arange(len(store) // 2), max_length)
    fused = fused and fused_head(model) is not None
    was_training = model.training
    model.eval()
    adapters_off = model.disable_adapter() if hasattr(model, "disable_adapter") else contextlib.nullcontext()
    with adapters_off:
        for i in range(0, len(rows), rows_per_batch):
            chunk = rows[i : i + rows_per_batch]
            p = batch_pair_logps(model, collate(chunk, list(range(len(chunk)))).to(device), precision, fused)
            first = collate.pair_sequences(chunk)
            table[first] = p.chosen.float().cpu().numpy()
            table[first + 1] = p.rejected.float().cpu().numpy()
    model.train(was_training)
    return table


def attach_reference(cfg: Any, data: Any, model: torch.nn.Module, precision: Precision, device: torch.device,
                     ctx: Any, say) -> None:
    """Load (or compute and cache) the reference table of the train and eval stores and give each collator its
    own: every pair batch then carries its reference log-probabilities. Rank 0 computes; the others load."""
    key = reference_key(cfg, precision)
    root = Path(data.prepared.cache_path) / "reference"
    stores = [("train", data.prepared.train, data.collate)]
    if data.eval_collate is not None:
        stores.append(("eval", data.prepared.eval, data.eval_collate))
    with ctx.main_first():
        for name, store, collate in stores:
            path = root / key / f"{name}.npy"
            if path.is_file():
                table, how = np.load(path), "loaded from the cache"
            else:
                table = sequence_logps(model, store, collate, precision, device, cfg.train.micro_batch_size,  # resolved by now
                                       cfg.data.max_length, cfg.train.fused_loss)
                with contextlib.suppress(OSError):  # a read-only cache only costs computing it again next time
                    path.parent.mkdir(parents=True, exist_ok=True)
                    buffer = io.BytesIO()
                    np.save(buffer, table)
                    atomic_write_bytes(path, buffer.getvalue())  # a reader never sees half a table
                how = "computed with the starting weights"
            collate.reference = table
            say(f"reference log-probabilities of {len(table) // 2:,} {name} pairs: {how} ({path.parent})")

