"""What a model directory's weight files hold, from their safetensors headers alone (no weights read):
the dtype and size of every tensor. ``trainforge plan`` prices loading them with it."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import hf_weights

SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip


@dataclass(frozen=True)
class StoredTensor:
    name: str
    dtype: torch.dtype
    numel: int
    nbytes: int  # in the file


def weight_files(path: Path) -> list[Path]:
    """The safetensors files ``from_pretrained`` reads in ``path`` (one file or the shards of an index), as
    ``hf_weights`` finds (and the config's validation checks) them."""
    return [f for f in hf_weights.weight_files(path) if f.suffix == ".safetensors"]


def stored_tensors(path: Path) -> list[StoredTensor] | None:
    """Every tensor of the model's safetensors files, from their headers; None when there are none
    (a config-only directory, or pickled ``.bin`` weights whose dtypes cannot be read without loading)."""
    files = weight_files(path)
    if not files:
        return None
    out = []
    for file in files:
        with open(file, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            dtype = SAFETENSORS_DTYPES.get(entry["dtype"], torch.uint8)
            start, end = entry["data_offsets"]
            numel = 1
            for n in entry["shape"]:
                numel *= n
            out.append(StoredTensor(name, dtype, numel, end - start))
    return out


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
_SAMPLES, _BLOCK = 16, 4096  # blocks read per file by weights_fingerprint


def weights_fingerprint(path: Path) -> str | None:
    """A cheap identity of the weights in the model directory ``path``: ``config.json``, and of every weight file its
    name, its size and 16 blocks of 4 KiB spread over it (a safetensors header among them). Another checkpoint of the
    same architecture differs in them; nothing like the gigabytes of the weights is read. None where ``path`` is no
    directory or holds no weight files."""
    import hashlib

    if not path.is_dir():
        return None
    files = sorted(p for p in path.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file())
    if not files:
        return None
    h = hashlib.blake2b(digest_size=16)
    config = path / "config.json"
    if config.is_file():
        h.update(config.read_bytes())
    for file in files:
        size = file.stat().st_size
        h.update(f"{file.name}:{size}".encode())
        with open(file, "rb") as f:
            for k in range(_SAMPLES):
                f.seek(max(0, size - _BLOCK) * k // (_SAMPLES - 1))
                h.update(f.read(_BLOCK))
    return h.hexdigest()
