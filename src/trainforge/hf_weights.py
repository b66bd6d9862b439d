"""A model directory's weight files, checked before anything loads them: every safetensors header parses, and no
pickled ``.bin`` needs more than torch's weights-only loader (nothing of such a file ever runs).

``check_weights`` is the one check; the config schema calls it on ``model.path`` (so ``train`` and ``plan`` refuse
before a run directory exists) and ``model/resolve.py`` on what ``generate``, ``eval`` and ``export`` load. Each
file is checked once per version (resolved path, mtime, size, inode). A leaf like ``hf_dir``: the schema may import it.
"""

from __future__ import annotations

import json
import stat
from functools import lru_cache
from pathlib import Path

from .errors import TrainforgeError

SAFETENSORS = ("model.safetensors", "adapter_model.safetensors")
PICKLED = ("pytorch_model.bin", "adapter_model.bin")
INDEXES = {"model.safetensors.index.json": "model.safetensors", "pytorch_model.bin.index.json": "pytorch_model.bin"}
REDOWNLOAD = "download or save the model there again"


class DamagedWeights(TrainforgeError, ValueError):
    """A weight file that cannot be loaded as it is: a damaged safetensors header, a missing shard, a pickle
    that needs more than tensors to unpickle. The message names the file and what to do."""


def index_shards(index: Path) -> list[Path]:
    """The shard files a ``*.index.json`` names, in order (``DamagedWeights`` where it does not parse)."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        names = sorted(set(weight_map.values()))
    except (OSError, ValueError, RecursionError, KeyError, TypeError, AttributeError) as e:
        detail = e.strerror if isinstance(e, OSError) else "not a JSON object with a weight_map of file names"
        raise DamagedWeights(f"{index}: cannot be read ({detail}); {REDOWNLOAD}") from None
    if not all(isinstance(n, str) and n and "/" not in n for n in names):
        raise DamagedWeights(f"{index}: its weight_map names something that is not a file of the directory; {REDOWNLOAD}")
    return [index.parent / n for n in names]


def weight_files(path: str | Path) -> list[Path]:
    """The weight files ``from_pretrained`` (or PEFT) reads in the directory ``path``: its safetensors (one file or
    an index's shards) where it has any, else its pickled ``.bin`` files, of the model and of an adapter alike.
    A shard the index names but the directory lacks is ``DamagedWeights``."""
    path = Path(path)
    found = {".safetensors": [], ".bin": []}
    for single in (*SAFETENSORS, *PICKLED):
        if (path / single).is_file():
            found[Path(single).suffix].append(path / single)
    for index_name, single in INDEXES.items():
        index = path / index_name
        if index.is_file() and not (path / single).is_file():
            for shard in index_shards(index):
                if not shard.is_file():
                    raise DamagedWeights(f"{index} names the shard {shard.name}, which {path} lacks; {REDOWNLOAD}")
                found[Path(single).suffix].append(shard)
    return found[".safetensors"] or found[".bin"]


def check_weights(path: str | Path, role: str = "") -> None:
    """Raise ``DamagedWeights`` unless every weight file of the directory ``path`` can be loaded as it is.
    ``role``: what the directory is to the user (``model.path``), put before the message."""
    where = f"{role}: " if role else ""
    try:
        for file in weight_files(path):
            problem = _problem(*_version(file))
            if problem:
                raise DamagedWeights(f"{file}: {problem}")
    except DamagedWeights as e:
        raise DamagedWeights(f"{where}{e}") from None


def _version(file: Path) -> tuple[str, tuple[int, int, int] | None]:
    try:
        resolved = file.resolve()
        st = resolved.stat()
    except (OSError, RuntimeError) as e:
        raise DamagedWeights(f"{file}: cannot be read ({getattr(e, 'strerror', None) or e})") from None
    if not stat.S_ISREG(st.st_mode):
        raise DamagedWeights(f"{file}: not a regular file (a device, pipe or socket); {REDOWNLOAD}")
    return str(resolved), (st.st_mtime_ns, st.st_size, st.st_ino)


@lru_cache(maxsize=256)
def _problem(file: str, version: tuple[int, int, int]) -> str | None:
    """What keeps this version of a weight file from loading (None: nothing)."""
    if version[1] == 0:
        return f"is empty (0 bytes); {REDOWNLOAD}"
    if file.endswith(".safetensors"):
        return _safetensors_problem(file)
    return _pickle_problem(file)


def _safetensors_problem(file: str) -> str | None:
    """safetensors' own reader on the header (the 8-byte length, the JSON, every tensor's offsets against the
    file's size); nothing of the weights is read."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(file, framework="numpy"):
            return None
    except SafetensorError as e:
        detail = str(e).removeprefix("Error while deserializing header: ")
        return f"corrupt header ({detail}): the file is damaged or cut short, or not safetensors; {REDOWNLOAD}"
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"


def _pickle_problem(file: str) -> str | None:
    """torch's weights-only loader on a pickled checkpoint (as ``from_pretrained`` loads it): refused where the
    pickle names anything but tensors and plain containers; nothing of the file runs. Zip checkpoints are mapped,
    not read."""
    import pickle

    import torch

    try:
        with open(file, "rb") as f:
            mmap = torch.serialization._is_zipfile(f)
        torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        lines = [line.strip().rstrip(".") for line in str(e).splitlines()]
        why = next((line for line in lines if "GLOBAL" in line.upper()), None)
        if why is None:  # no object named: bytes that are no pickle at all (an unknown opcode)
            what = next((line[:200] for line in lines if "Unsupported" in line), "not a torch checkpoint")
            return f"cannot be read as torch weights ({what}); {REDOWNLOAD}"
        return (
            f"holds pickled objects; refused (torch's weights-only loader would have to run code from it"
            f": {why}; nothing of it ran). Get the model's safetensors weights (model.safetensors), or "
            "convert this file to safetensors where you trust it"
        )
    except Exception as e:  # a cut-short zip, a file that is no torch checkpoint: it cannot load either way
        first = (str(e).strip().splitlines() or [""])[0][:200]
        return f"cannot be read as torch weights ({type(e).__name__}{': ' + first if first else ''}); {REDOWNLOAD}"
    return None
