"""The prompts of an online RL run: rows read from ``data.train``, rendered, tokenized once, with the row fields
the rewards read (``answer``, ...). A prompt is ``{prompt: text}`` (tokenized with the tokenizer's special tokens,
as training tokenizes text), ``{prompt: [messages]}`` or ``{messages: [...]}`` (the chat template with the
assistant's turn opened). Held-out prompts (``data.eval`` a fraction) measure the reward of greedy completions."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..config.errors import ConfigError
from ..data.formats import DEFAULT_CHAT_TEMPLATE
from ..data.sources import BadRows, DataError, Row, iter_source


@dataclass
class Prompt:
    """One prompt: its token ids, its text (what reward functions get), its row's fields, and where it came from."""

    ids: list[int]
    text: str
    fields: dict[str, Any]
    where: str
    index: int = -1  # its position among the train prompts (the example index the engine's messages name)


@dataclass
class PromptStore:
    """The train prompts (what ``row_describer`` and checkpoints see of a store)."""

    prompts: list[Prompt]
    desirable: None = None

    def __len__(self) -> int:
        return len(self.prompts)

    def describe(self, indices) -> str:
        """The sentence the engine's messages append about a step's examples: the prompts, where they came from."""
        shown = [f"{self.prompts[i].where} {self.prompts[i].text[:40]!r}" for i in dict.fromkeys(indices)][:5]
        return f" Their prompts (source, first words): {'; '.join(shown)}." if shown else ""


@dataclass
class PromptCollate:
    """What ``describe_data`` reads of a collator: rollout rows are packed documents."""

    packed: bool = True
    concat: bool = False
    generations: int = 1  # completions per prompt (rl.num_generations)


@dataclass
class PreparedPrompts:
    train: PromptStore
    eval: PromptStore | None
    stats: dict[str, Any]
    cache_path: Path
    format: str = "prompt"


@dataclass
class PromptPlan:
    """The ``DataPlan`` of a grpo run: prompts instead of packed token rows."""

    prepared: PreparedPrompts
    train_rows: list[Prompt]
    eval_rows: list[Prompt] = field(default_factory=list)
    collate: PromptCollate = field(default_factory=PromptCollate)
    eval_collate: None = None


def prompt_text(row: Row, tokenizer, chat_template: str | None) -> tuple[str, bool]:
    """(the text the model continues, whether a chat template rendered it)."""
    value = row.data.get("prompt", row.data.get("messages"))
    if isinstance(value, str):
        return value, False
    if isinstance(value, list) and value and all(isinstance(m, dict) and "role" in m for m in value):
        template = chat_template or getattr(tokenizer, "chat_template", None) or DEFAULT_CHAT_TEMPLATE
        text = tokenizer.apply_chat_template(value, chat_template=template, add_generation_prompt=True, tokenize=False)
        return text, True
    raise DataError(f"{row.where}: a grpo prompt row holds 'prompt' (text, or a list of {{role, content}} messages) "
                    f"or 'messages'; this row has {sorted(row.data)}")


def plan_prompts(cfg: Any, tokenizer, reporter, pin: bool = False, between_chunks=None) -> PromptPlan:
    """Read, check and tokenize the prompts of ``data.train``; hold out ``data.eval`` (a fraction) of them."""
    from .rewards import RewardSet

    d = cfg.data
    rewards = RewardSet.from_settings(cfg.rl.rewards, cfg.rl.reward_timeout_s)
    bad = BadRows(d.on_bad_row)
    prompts: list[Prompt] = []
    for k, spec in enumerate(d.sources()):
        template = d.read_as(k).chat_template  # a source's own template, else data.chat_template
        for row in iter_source(str(spec.path), bad):
            rewards.check_row(row.data, row.where)  # a field a reward reads is missing: exit 2, naming the row
            text, templated = prompt_text(row, tokenizer, template)
            ids = tokenizer(text, add_special_tokens=not templated)["input_ids"]
            if len(ids) > d.max_length:
                raise DataError(f"{row.where}: the prompt is {len(ids)} tokens, over data.max_length ({d.max_length}); "
                                "raise data.max_length or shorten the prompt")
            fields = {k: v for k, v in row.data.items() if k not in ("prompt", "messages")}
            prompts.append(Prompt(list(ids), text, fields, row.where))
            if d.max_documents is not None and len(prompts) >= d.max_documents:
                break
    if not prompts:
        raise DataError(f"{d.source_label()}: no prompts")
    train, held = split_prompts(prompts, d.eval if isinstance(d.eval, float) else 0.0, cfg.train.seed)
    for i, p in enumerate(train):
        p.index = i
    digest = hashlib.blake2b("\n".join(p.text for p in prompts).encode(), digest_size=8).hexdigest()
    tokens = sum(len(p.ids) for p in train)
    stats = {"format": "prompt", "train_rows": len(train), "train_sequences": len(train), "train_tokens": tokens,
             "eval_rows": len(held), "bad_rows": bad.count}
    prepared = PreparedPrompts(PromptStore(train), PromptStore(held) if held else None, stats, Path(f"prompts-{digest}"))
    return PromptPlan(prepared, train, held, PromptCollate(generations=cfg.rl.num_generations))


def split_prompts(prompts: list[Prompt], fraction: float, seed: int) -> tuple[list[Prompt], list[Prompt]]:
    """(train, held-out): ``fraction`` of the prompts held out by a seeded draw (at least one train prompt)."""
    n_held = min(int(round(fraction * len(prompts))), len(prompts) - 1)
    if n_held <= 0:
        return prompts, []
    held = set(np.random.default_rng([seed, 11]).choice(len(prompts), size=n_held, replace=False).tolist())
    return [p for i, p in enumerate(prompts) if i not in held], [p for i, p in enumerate(prompts) if i in held]


def check_room(cfg: Any) -> None:
    """``rl.max_completion_length`` behind the longest prompt (``data.max_length``) must fit the model's positions."""
    from ..model.load import position_limit

    positions, learned = position_limit(cfg.model)
    need = cfg.data.max_length + cfg.rl.max_completion_length
    if positions is not None and need > positions:
        raise ConfigError(f"rl.max_completion_length: {cfg.rl.max_completion_length} new tokens behind prompts of up to "
                          f"data.max_length ({cfg.data.max_length}) make {need} positions, beyond the model's {positions}; "
                          f"lower rl.max_completion_length to {max(positions - cfg.data.max_length, 1)} or data.max_length")
