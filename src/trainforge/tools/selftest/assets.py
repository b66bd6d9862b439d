"""The tiny tokenizer, "pretrained" model and data selftest trains on, built locally once per cache.

Everything is made from fixed seeds (nothing is downloaded) into a directory named by a hash of
its contents, and written through ``trainforge.rundir.atomic``: each writer fills a temporary of its own
(``.NAME.tmp-HOST-PID-RANDOM``) that then appears whole, so several selftests sharing one cache
directory never touch each other's half-written files.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import random
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...rundir.atomic import atomic_write_text, publish_dir, remove_stale_temps, staging_dir
from .reporters import quiet


WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau".split()
# The "pretrained" model learns the word cycle forwards; the training data of the cases runs it
# backwards: something new for LoRA to learn, and as learnable as any order from scratch.
FORWARD, BACKWARD = 1, -1


def _cycle(start: int, n: int, stride: int = BACKWARD) -> list[str]:
    return [WORDS[(start + stride * i) % len(WORDS)] for i in range(n)]


def _texts(n: int, seed: int, stride: int = BACKWARD) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [{"text": " ".join(_cycle(rng.randrange(len(WORDS)), rng.randrange(5, 40), stride)) + "."} for _ in range(n)]


def _prompt_completions(n: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        start, k, m = rng.randrange(len(WORDS)), rng.randrange(2, 8), rng.randrange(2, 7)
        words = _cycle(start, k + m)
        rows.append({"prompt": "continue: " + " ".join(words[:k]), "completion": " " + " ".join(words[k:])})
    return rows


def _chats(n: int, seed: int) -> list[dict[str, Any]]:
    """OpenAI-style rows: a system turn on some, one or two user/assistant exchanges."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        messages = [{"role": "system", "content": "You continue word cycles."}] if i % 3 == 0 else []
        for _ in range(1 + (i % 2)):
            start, k = rng.randrange(len(WORDS)), rng.randrange(2, 6)
            words = _cycle(start, 2 * k)
            messages.append({"role": "user", "content": " ".join(words[:k])})
            messages.append({"role": "assistant", "content": " ".join(words[k:])})
        rows.append({"messages": messages})
    return rows


MODEL_INIT = {
    "architecture": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,  # grouped-query attention, as current Llama-family models have
    "max_position_embeddings": 128,
}
PRETRAIN_STEPS = 60
ASSETS_VERSION = 1  # bump when what build_assets makes changes in a way the content hash cannot see
# A temporary whose writer is gone (its process on this host has ended; another host's, or a name
# without an owner, unchanged this long) is removed by the next build in the same directory.
STALE_TEMP_S = 2 * 3600


@dataclass(frozen=True)
class Assets:
    root: Path
    tokenizer: Path
    pretrained: Path  # a "downloaded" model directory (tied embeddings), what LoRA adapts
    data: dict[str, tuple[Path, Path]]  # data shape -> (train, eval) JSONL


def build_assets(parent: Path, cache_dir: Path | None = None) -> Assets:
    """Tokenizer, a tiny pretrained-style Llama directory and the JSONL files of every data shape,
    from fixed seeds, in a directory of ``parent`` named by a hash of their contents: built once,
    reused by later runs (the token cache then hits too)."""
    files = {
        "text": (_texts(240, 1), _texts(24, 2)),
        "completion": (_prompt_completions(240, 3), _prompt_completions(24, 4)),
        "chat": (_chats(200, 5), _chats(24, 6)),
        "pretrain": (_texts(400, 7, FORWARD), []),
    }
    blob = json.dumps([ASSETS_VERSION, files, MODEL_INIT, PRETRAIN_STEPS], sort_keys=True)
    root = parent / hashlib.blake2b(blob.encode(), digest_size=8).hexdigest()
    root.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(root, STALE_TEMP_S)
    data = {}
    for kind, (train, held_out) in files.items():
        data[kind] = (root / f"{kind}_train.jsonl", root / f"{kind}_eval.jsonl")
        for path, rows in zip(data[kind], (train, held_out)):
            if not path.is_file():
                atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in rows))
    tok_dir, model_dir = root / "tokenizer", root / "pretrained"
    if not (tok_dir / "tokenizer.json").is_file():
        from ...model.tokenizer import train_bpe_tokenizer

        texts = [r["text"] for r in files["text"][0] + files["pretrain"][0]]
        texts += [r["prompt"] + r["completion"] for r in files["completion"][0]]
        texts += [m["content"] for r in files["chat"][0] for m in r["messages"]] + ["<|im_start|>user\n<|im_end|>\n"] * 20
        # the same for every writer: of two building it at once, the first complete one stays
        publish_dir(tok_dir, train_bpe_tokenizer(texts, vocab_size=320).save_pretrained, lambda d: (d / "tokenizer.json").is_file())
    if not (model_dir / "config.json").is_file():
        _pretrain(root, tok_dir, data["pretrain"][0], model_dir, cache_dir)
    shapes = {"concat": data["text"], "packed": data["text"], "completion": data["completion"], "chat": data["chat"]}
    return Assets(root, tok_dir, model_dir, shapes)


def _pretrain(root: Path, tokenizer: Path, text: Path, model_dir: Path, cache_dir: Path | None) -> None:
    """The "pretrained" model LoRA adapts: the tiny Llama (tied embeddings) trained briefly on
    forward word cycles. LoRA on random weights barely learns in a few steps. The run goes to a
    directory of this writer alone; its ``final/`` then appears at ``model_dir`` whole."""
    from ...config.run import RunConfig
    from ...engine.trainer import train

    out = staging_dir(root / "pretrain-run")
    cfg = {
        "model": {"init": {**MODEL_INIT, "tie_word_embeddings": True}, "tokenizer": str(tokenizer)},
        "data": {"train": str(text), "eval": None, "max_length": 64, "num_workers": 1, "cache_dir": str_or_none(cache_dir)},
        "train": {"max_steps": PRETRAIN_STEPS, "micro_batch_size": 8, "precision": "fp32", "device": "cpu", "compile": False, "seed": 1234},
        "optim": {"lr": 3e-3, "warmup_steps": 0, "schedule": "constant"},
        "checkpoint": {"every_minutes": None},
        "log": {"every_steps": PRETRAIN_STEPS, "tensorboard": False, "report": False},
    }
    try:
        with rng_kept():
            train(RunConfig.model_validate(cfg), out, quiet(), resume="never")
        # two writers at once: the first complete model stays (a rename onto it fails, which is not an error)
        publish_dir(model_dir, lambda tmp: _move_contents(out / "final", tmp),
                    lambda d: (d / "config.json").is_file() and (d / "model.safetensors").is_file())
    finally:
        shutil.rmtree(out, ignore_errors=True)


def _move_contents(src: Path, dst: Path) -> None:
    for p in src.iterdir():
        p.rename(dst / p.name)


def str_or_none(path: Path | None) -> str | None:
    return str(path) if path is not None else None


@contextlib.contextmanager
def rng_kept() -> Iterator[None]:
    """Leave torch's global RNG as it was (the assets and checks seed models of their own)."""
    state = torch.random.get_rng_state()
    try:
        yield
    finally:
        torch.random.set_rng_state(state)
