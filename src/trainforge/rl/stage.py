"""The rollout stage: a loader whose micro-batches are generated. Each step's prompts (a seeded order over the train
prompts, this process's share) are sampled ``rl.num_generations`` times with the policy (rl/rollout.py), scored
(rl/rewards.py), given group-normalized advantages, and packed as prompt + completion documents whose targets are
the completion's tokens (engine/grpo.py's ``RolloutBatch``). The generated completions are kept for
``rl.num_iterations`` steps, with the log-probabilities recorded when they were generated.

Each completion's draws are keyed by (run seed, epoch, the prompt's index, its number in the group)
(rl/rollout.py's ``stream_keys``), not by a generator of the process: a prompt's completions are the same whichever
process samples it, so ``--nproc N`` trains as one process with the same global batch. The loader's state (prompt
position, iteration, and the kept completions while they are still to be trained on) goes into checkpoints: a
resumed run samples the same completions."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..data.formats import IGNORE
from ..data.loader import padded_width
from ..data.packing import best_fit_decreasing
from ..engine.grpo import COUNT, SEQUENCES, RolloutBatch, token_logps
from ..model.generate import stop_token_ids
from .prompts import Prompt
from .rollout import Sampling, sample, stream_keys

ROLLOUTS = 0x524C  # the first part of a rollout's key: other samplers (held-out rewards) use others


@dataclass
class Doc:
    """One completion behind its prompt, with what learning reads."""

    prompt: list[int]
    completion: list[int]
    finished: bool
    advantage: float
    reward: float
    each: dict[str, float]
    masked: bool  # truncated and rl.mask_truncated_completions: no targets
    index: int = -1  # its prompt's index among the train prompts
    old: torch.Tensor | None = None  # per completion token, recorded at generation (num_iterations > 1)
    ref: torch.Tensor | None = None  # the reference's (beta > 0)

    @property
    def targets(self) -> int:
        return 0 if self.masked else len(self.completion)


def advantages(rewards: np.ndarray, group: int, scale: str, step_rewards: np.ndarray | None = None) -> np.ndarray:
    """Reward minus its group's mean, over the group's std (``scale`` group), the batch's (batch: ``step_rewards``,
    the step's rewards on every process, else ``rewards``) or 1 (none); the std unbiased with 1e-4 added, as TRL's
    GRPOTrainer."""
    grouped = rewards.reshape(-1, group)
    centered = (grouped - grouped.mean(axis=1, keepdims=True)).reshape(-1)
    if scale == "none":
        return centered
    if scale == "group":
        std = np.repeat(grouped.std(axis=1, ddof=1), group)
    else:
        std = np.full(len(rewards), (rewards if step_rewards is None else step_rewards).std(ddof=1))
    return centered / (std + 1e-4)


def collate(docs: Sequence[Doc], capacity: int, indices: list[int]) -> RolloutBatch:
    """Pack ``docs`` into rows of at most ``capacity`` inputs, each its own document (positions restart at 0)."""
    lengths = np.array([len(d.prompt) + len(d.completion) - 1 for d in docs])
    rows = best_fit_decreasing(lengths, capacity)
    width = padded_width(max(int(lengths[r].sum()) for r in rows))
    ids = np.zeros((len(rows), width), dtype=np.int64)
    labels = np.full((len(rows), width), IGNORE, dtype=np.int64)
    positions = np.zeros((len(rows), width), dtype=np.int64)
    seq, old, ref = [], [], []
    for k, r in enumerate(rows):
        at = 0
        for i in r:
            d = docs[i]
            toks = np.asarray(d.prompt + d.completion, dtype=np.int64)
            n = len(toks) - 1
            ids[k, at : at + n], positions[k, at : at + n] = toks[:-1], np.arange(n)
            if not d.masked:  # the completion's tokens are the targets
                labels[k, at + len(d.prompt) - 1 : at + n] = toks[len(d.prompt):]
                seq += [i] * len(d.completion)
                old.append(d.old)
                ref.append(d.ref)
            at += n
        positions[k, at:] = np.arange(width - at)  # the padding tail is a document of its own
    cat = lambda parts: torch.cat(parts) if parts and all(p is not None for p in parts) else None  # noqa: E731
    return RolloutBatch(
        torch.from_numpy(ids), torch.from_numpy(labels), torch.from_numpy(positions), n_tokens=int(lengths.sum()),
        n_targets=len(seq), indices=indices, n_documents=len(docs), token_seq=torch.tensor(seq, dtype=torch.long),
        advantages=torch.tensor([d.advantage for d in docs], dtype=torch.float32),
        seq_tokens=torch.tensor([d.targets for d in docs], dtype=torch.long),
        old_logps=cat(old), ref_logps=cat(ref), n_sequences=len(docs),
    )


def host_sums(docs: Sequence[Doc]) -> dict[str, float]:
    """The metric sums of ``docs`` (engine/objective.py's ``mean_metrics`` divides by the completions)."""
    sums = {SEQUENCES: float(len(docs)), "reward": sum(d.reward for d in docs),
            "completion_length": float(sum(len(d.completion) for d in docs)),
            "truncated": float(sum(not d.finished for d in docs))}
    for name in docs[0].each if docs else ():  # a reward that returned None (NaN) for a completion: not counted
        values = [d.each[name] for d in docs if not math.isnan(d.each[name])]
        sums[f"reward_{name}"], sums[COUNT + f"reward_{name}"] = float(sum(values)), float(len(values))
    return sums


class RolloutLoader:
    """Endless GRPO micro-batches (``TrainLoader``'s interface: ``batch_size``, ``state_dict``, iteration). ``rows``:
    the train prompts; ``batch_size``: completions per micro-batch. ``bind`` gives it the policy before the loop."""

    def __init__(self, rows: Sequence[Prompt], collate: Any, batch_size: int, seed: int, group_by_length: bool = False,
                 rank: int = 0, world_size: int = 1):
        self.rows, self.batch_size, self.seed, self.rank, self.world_size = list(rows), batch_size, seed, rank, world_size
        self.generations = collate.generations  # completions per prompt
        self.epoch = self.offset = self.iteration = self.cursor = 0  # cursor: completions of the kept batch handed out
        self.docs: list[Doc] = []
        self.generation_s = 0.0  # seconds this step's first micro-batch spent generating (0 when it reused a batch)
        self.longest_first = False

    def bind(self, cfg: Any, model: torch.nn.Module, objective: Any, tokenizer, precision: Any, device: torch.device,
             grad_accum: int) -> None:
        """The run's policy, settings and step size."""
        self.cfg, self.s, self.model, self.objective = cfg, cfg.rl, model, objective
        self.tokenizer, self.precision, self.device = tokenizer, precision, device
        from .rewards import RewardSet

        self.rewards = RewardSet.from_settings(self.s.rewards, self.s.reward_timeout_s,
                                               lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"]))
        self.step_completions = self.batch_size * grad_accum
        g = self.s.num_generations
        if self.step_completions % g:
            raise ValueError(f"train.micro_batch_size x train.grad_accum ({self.step_completions} completions a step) must "
                             f"be a multiple of rl.num_generations ({g})")
        self.sampling = Sampling(self.s.max_completion_length, self.s.temperature, self.s.top_p, self.s.top_k, self.s.min_p,
                                 tuple(stop_token_ids(model, tokenizer)))
        self.capacity = cfg.data.max_length + self.s.max_completion_length

    @property
    def batches_per_epoch(self) -> int:
        """Global micro-batches per pass over the prompts (each prompt ``num_generations`` completions)."""
        return max(1, -(-len(self.rows) * self.generations // (self.batch_size * self.world_size)))

    def padding_efficiency(self) -> float:
        return 1.0  # rows are packed from the step's completions: known once they are generated

    def state_dict(self) -> dict[str, Any]:
        state = {"epoch": self.epoch, "offset": self.offset, "iteration": self.iteration, "cursor": self.cursor}
        if self.docs and (self.cursor < len(self.docs) or self.iteration + 1 < self.s.num_iterations):
            state["docs"] = [vars(d).copy() for d in self.docs]  # completions still to be trained on
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
        self.iteration, self.cursor = int(state.get("iteration", 0)), int(state.get("cursor", 0))
        self.docs = [Doc(**d) for d in state.get("docs", [])]
        if not self.docs:
            self.cursor = 0

    def __iter__(self) -> Iterator[RolloutBatch]:
        while True:
            if self.cursor >= len(self.docs):  # the step's completions are all handed out: reuse them, or sample anew
                if self.docs and self.iteration + 1 < self.s.num_iterations:
                    self.iteration, self.cursor, self.generation_s = self.iteration + 1, 0, 0.0
                else:
                    t = time.perf_counter()
                    self.docs, self.iteration, self.cursor = self.generate(), 0, 0
                    self.generation_s = time.perf_counter() - t
            start = self.cursor
            part = self.docs[start : start + self.batch_size]
            self.cursor += len(part)
            batch = collate(part, self.capacity, [d.index for d in part])
            batch.host_sums = host_sums(part)
            if start == 0:  # the step's first micro-batch carries its generation seconds
                batch.host_sums.update({"gen_s": self.generation_s, COUNT + "gen_s": 1.0})
            yield batch

    def next_prompts(self) -> list[tuple[int, int]]:
        """This process's prompts of the next step, as (index among the train prompts, epoch it was drawn in): a seeded
        order per epoch, the global step's contiguous share."""
        per_rank = self.step_completions // self.s.num_generations
        glob, taken = [], 0
        while taken < per_rank * self.world_size:
            if self.offset >= len(self.rows):
                self.epoch, self.offset = self.epoch + 1, 0
            order = np.random.default_rng([self.seed, self.epoch, 5]).permutation(len(self.rows))
            chunk = order[self.offset : self.offset + per_rank * self.world_size - taken].tolist()
            glob += [(i, self.epoch) for i in chunk]
            taken += len(chunk)
            self.offset += len(chunk)
        return glob[self.rank * per_rank : (self.rank + 1) * per_rank]

    def generate(self) -> list[Doc]:
        """Sample, score and record one step's completions."""
        drawn, g = self.next_prompts(), self.s.num_generations
        flat = [self.rows[i] for i, _ in drawn for _ in range(g)]
        index, epoch = (np.repeat(np.array(part, dtype=np.int64), g) for part in zip(*drawn))
        keys = stream_keys(ROLLOUTS, self.seed, epoch, index, np.tile(np.arange(g), len(drawn)))
        out = sample(self.model, [self.rows[i].ids for i, _ in drawn], self.sampling, keys, self.tokenizer.pad_token_id,
                     self.precision.autocast(self.device), group=g)  # one prefill per prompt
        texts = [self.tokenizer.decode(c, skip_special_tokens=True) for c in out.tokens]
        scores = self.rewards.score([p.text for p in flat], texts, [p.fields for p in flat], [p.where for p in flat])
        total = np.asarray(scores.total, dtype=np.float64)
        everyone = self.step_rewards(total) if self.s.scale_rewards == "batch" else None
        adv = advantages(total, g, self.s.scale_rewards, everyone)
        docs = [
            Doc(p.ids, c, fin, float(a), float(r), {k: float(v[i]) for k, v in scores.each.items()},
                self.s.mask_truncated_completions and not fin, p.index)
            for i, (p, c, fin, a, r) in enumerate(zip(flat, out.tokens, out.finished, adv, total))
        ]
        docs = [d if d.completion else _nonempty(d) for d in docs]
        self.record_logps(docs)
        return docs

    def step_rewards(self, total: np.ndarray) -> np.ndarray:
        """The step's rewards on every process in rank order (the one-process run's order): ``scale_rewards: batch``
        divides by their std, so that the processes' advantages are the one-process run's."""
        if self.world_size == 1 or not torch.distributed.is_initialized():
            return total
        parts: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(parts, total.tolist())  # a few floats per completion, exact as Python floats
        return np.concatenate([np.asarray(p, dtype=np.float64) for p in parts])

    @torch.no_grad()
    def record_logps(self, docs: list[Doc]) -> None:
        """The rollout's own log-probabilities (num_iterations > 1) and the reference's (beta > 0), per completion,
        computed as training computes them (packed, through the same head), a micro-batch at a time."""
        old, ref = self.s.num_iterations > 1, self.s.beta > 0
        if not (old or ref):
            return
        fused = self.cfg.train.fused_loss
        was = self.model.training
        self.model.eval()  # dropout off, as when sampling: the ratio of the first iteration is 1
        try:
            for start in range(0, len(docs), self.batch_size):
                part = [d for d in docs[start : start + self.batch_size] if not d.masked]
                if not part:
                    continue
                batch = collate(part, self.capacity, []).to(self.device)
                order = _target_order(part, self.capacity)
                if old:
                    _spread(token_logps(self.model, batch, self.precision, fused, self.s.temperature), part, order, "old")
                if ref:
                    _spread(self.objective.reference_logps(self.model, batch, self.precision, fused), part, order, "ref")
        finally:
            self.model.train(was)


def _nonempty(d: Doc) -> Doc:
    """A completion of no tokens cannot happen (a stop token is kept); kept for safety: it learns nothing."""
    d.masked = True
    return d


def _target_order(docs: Sequence[Doc], capacity: int) -> list[int]:
    """The order in which ``collate`` lays out the documents' targets (row by row)."""
    lengths = np.array([len(d.prompt) + len(d.completion) - 1 for d in docs])
    return [i for r in best_fit_decreasing(lengths, capacity) for i in r]


def _spread(values: torch.Tensor, docs: Sequence[Doc], order: list[int], name: str) -> None:
    """Cut a batch's per-target values into each document's share, on the host."""
    values = values.float().cpu()
    at = 0
    for i in order:
        n = docs[i].targets
        setattr(docs[i], name, values[at : at + n].clone())
        at += n
