"""Bad grpo input is refused before any work, naming the key or the row: a group of one, rl settings without grpo,
FSDP, completions past the model's positions, a prompt longer than data.max_length. (``micro_batch_size: auto`` is
fitted to the rollout too: tests/unit/test_rollout_memory.py.)"""

from __future__ import annotations

import json

import pytest

from trainforge.config.errors import ConfigError
from trainforge.config.run import load_config
from trainforge.data.sources import DataError
from trainforge.rl.prompts import check_room, plan_prompts

MODEL = {"init": {"architecture": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                  "num_attention_heads": 2, "max_position_embeddings": 32}, "tokenizer": "char"}


def config(tmp_path, **sections):
    raw = {"model": MODEL, "data": {"train": "builtin:arithmetic", "max_length": 8},
           "train": {"objective": "grpo", "micro_batch_size": 8},
           "rl": {"num_generations": 4, "max_completion_length": 4, "rewards": [{"name": "final_number"}]}}
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value}
    (tmp_path / "c.yaml").write_text(json.dumps(raw))
    return load_config(tmp_path / "c.yaml")


@pytest.mark.parametrize("sections,key", [
    ({"rl": {"num_generations": 1}}, "rl.num_generations"),
    ({"train": {"objective": "sft"}}, "rl:"),
    ({"train": {"distributed": "fsdp"}}, "train.distributed"),
    ({"rl": {"rewards": []}}, "rl.rewards"),
    ({"rl": {"epsilon": 0.3, "epsilon_high": 0.2}}, "epsilon_high"),
])
def test_bad_settings_name_their_key(tmp_path, sections, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as e:
        config(tmp_path, **sections)
    assert e.value.exit_code == 2


def test_completions_past_the_model_positions_name_max_completion_length(tmp_path):
    cfg = config(tmp_path, rl={"max_completion_length": 30})  # 8 + 30 > 32 positions
    with pytest.raises(ConfigError, match=r"rl\.max_completion_length: 30 .* 38 positions, beyond the model's 32"):
        check_room(cfg)
    check_room(config(tmp_path, rl={"max_completion_length": 24}))


class CharTokenizer:
    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) for c in text]}


def test_a_prompt_longer_than_max_length_names_the_row_and_rows_keep_their_fields(tmp_path):
    rows = [{"prompt": "1+1=", "answer": "2", "level": 1}, {"prompt": "12345+67890=", "answer": "80235"}]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = config(tmp_path, data={"train": str(tmp_path / "p.jsonl"), "eval": None})
    with pytest.raises(DataError, match=r"p\.jsonl:2: the prompt is 12 tokens, over data\.max_length \(8\)") as e:
        plan_prompts(cfg, CharTokenizer(), None)
    assert e.value.exit_code == 2
    cfg = config(tmp_path, data={"train": str(tmp_path / "p.jsonl"), "eval": None, "max_length": 16})
    plan = plan_prompts(cfg, CharTokenizer(), None)
    assert [p.fields for p in plan.train_rows] == [{"answer": "2", "level": 1}, {"answer": "80235"}]
    assert plan.train_rows[0].ids == [ord(c) for c in "1+1="]
