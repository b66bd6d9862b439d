"""GRPO learns on a CPU. A tiny model is trained by SFT to copy a three-digit number, and for every prompt it sees
two endings: the number alone, or the number followed by a stray "+1" (then ``final_number`` reads 1, a wrong
answer). The stray ending is a habit that does not depend on the number, so the SFT model copies held-out numbers
too and ends them wrongly about half the time: groups whose rewards differ. GRPO with the ``final_number`` reward
must then raise the mean reward on held-out numbers (never seen by either run), sampled at temperature 1 with a
fixed seed, clearly above the SFT model's."""

from __future__ import annotations

import json
import os
import random

import pytest
import torch
import yaml
from integration_helpers import run_cli, show

MODEL = {"architecture": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "max_position_embeddings": 32}
SEED = int(os.environ.get("TF_GRPO_LEARNS_SEED", "0"))  # another seed: the same rise (docs/rl.md has seeds 0-2)


def numbers() -> tuple[list[int], list[int]]:
    pool = list(range(100, 1000))
    random.Random(SEED).shuffle(pool)
    return pool[:300], pool[300:400]


def heldout_reward(model_dir, held) -> float:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainforge.config.rewards import RewardSettings
    from trainforge.rl.heldout import heldout_reward as measure
    from trainforge.rl.prompts import Prompt
    from trainforge.rl.rewards import RewardSet

    tokenizer, model = AutoTokenizer.from_pretrained(model_dir), AutoModelForCausalLM.from_pretrained(model_dir)
    prompts = [Prompt(tokenizer(f"{n}=")["input_ids"], f"{n}=", {"answer": str(n)}, f"held:{k}")
               for k, n in enumerate(held)]
    rewards = RewardSet.from_settings([RewardSettings(name="final_number")], 30)
    with torch.no_grad():
        return measure(model, tokenizer, prompts, rewards, 6, temperature=1.0, samples=4, seed=0)


@pytest.mark.slow
def test_grpo_raises_the_heldout_reward_of_an_sft_model(tmp_path):
    train, held = numbers()
    rows = [{"prompt": f"{n}=", "completion": ending, "answer": str(n)} for n in train for ending in (str(n), f"{n}+1")]
    (tmp_path / "copy.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    log = {"every_steps": 5, "report": False, "tensorboard": False}
    sft = {"model": {"init": MODEL, "tokenizer": "char"},
           "data": {"train": "copy.jsonl", "eval": None, "max_length": 16, "format": "prompt_completion"},
           "train": {"max_steps": 120, "micro_batch_size": 32, "eval_every": None, "seed": SEED},
           "optim": {"lr": 3e-3, "warmup_steps": 10}, "log": log, "checkpoint": {"every_minutes": None}}
    grpo = {"model": {"path": str(tmp_path / "sft" / "final")},
            "data": {"train": "copy.jsonl", "eval": None, "max_length": 8},
            "train": {"objective": "grpo", "max_steps": 30, "micro_batch_size": 64, "eval_every": None, "seed": SEED},
            "optim": {"lr": 5e-4, "warmup_steps": 0, "schedule": "constant"},
            "rl": {"num_generations": 8, "max_completion_length": 6, "beta": 0.0, "rewards": [{"name": "final_number"}]},
            "log": log, "checkpoint": {"every_minutes": None}}
    for name, cfg in (("sft", sft), ("grpo", grpo)):
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
        proc = run_cli(["train", f"{name}.yaml", "--output", tmp_path / name], tmp_path)
        assert proc.returncode == 0, show(proc)
    before, after = heldout_reward(tmp_path / "sft" / "final", held), heldout_reward(tmp_path / "grpo" / "final", held)
    rewards = [json.loads(line).get("reward") for line in (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()]
    rewards = [r for r in rewards if r is not None]
    assert rewards[-1] > rewards[0] + 0.15, rewards  # the training reward rose too (measured: 0.62-0.64 -> 0.92-0.93)
    assert after >= before + 0.25, (before, after)  # measured: +0.37 to +0.43 over seeds 0-2; seed-to-seed spread ~0.06
