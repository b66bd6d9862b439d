"""Rollout sampling: trainforge's decode loop (rl/rollout.py) against transformers' ``generate`` on the same
batches, in the same process: prompts x num_generations completions, sampled at the same temperature, the same
model, the same maximum length. Prints tokens/s of each and their ratio (a benchmark, not a timed test).
trainforge prefills each prompt once for its ``--generations`` completions (``rollout.sample``'s ``group``);
``--unshared`` adds a row that prefills every copy, as ``generate`` does. The samplers take turns, round by round,
and each one's best round counts. On a machine shared with other jobs, run one thread (``OMP_NUM_THREADS=1``):
threads spinning against the other jobs make every figure noise.

    PYTHONPATH=src python benchmarks/bench_rollout.py [--hidden 256] [--layers 4] [--prompts 16] [--generations 8]
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from trainforge.rl.rollout import Sampling, sample, stream_keys


def model_of(hidden: int, layers: int, vocab: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
                      num_attention_heads=max(hidden // 64, 1), max_position_embeddings=1024)
    return LlamaForCausalLM(cfg).eval()


def prompts_of(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (int(torch.randint(16, 48, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]


def ours(model, batch: list[list[int]], new: int, stop: int, group: int = 1) -> int:
    """``batch``: each prompt repeated ``group`` times in a row; sampled with one prefill per prompt."""
    out = sample(model, batch[::group], Sampling(new, 1.0, stop_ids=(stop,)), stream_keys(0, range(len(batch))), 0,
                 group=group)
    return sum(len(t) for t in out.tokens)


def theirs(model, batch: list[list[int]], new: int, stop: int) -> int:
    width = max(len(p) for p in batch)
    ids = torch.zeros((len(batch), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(batch):
        ids[i, width - len(p):], mask[i, width - len(p):] = torch.tensor(p), 1
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=True, temperature=1.0,
                             top_k=0, eos_token_id=stop, pad_token_id=0)
    new_tokens = out[:, width:]
    # tokens up to and including each row's stop token (generate pads finished rows to the longest)
    ends = [(row == stop).nonzero()[0].item() + 1 if (row == stop).any() else len(row) for row in new_tokens]
    return sum(ends)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--new", type=int, default=64, help="max_completion_length")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--unshared", action="store_true", help="also trainforge prefilling every copy of a prompt")
    a = ap.parse_args()
    model = model_of(a.hidden, a.layers, a.vocab)
    # a stop token some rows draw early and others late: finished rows leaving the batch is part of what is measured
    stop = 1
    with torch.no_grad():  # the stop token's head row leans toward a common direction: drawn now and then
        model.lm_head.weight[stop] = 40 * model.lm_head.weight.mean(0)
    batch = [p for p in prompts_of(a.prompts, a.vocab) for _ in range(a.generations)]
    runs = {"trainforge": lambda m, b, n, s: ours(m, b, n, s, a.generations), "transformers generate": theirs}
    if a.unshared:
        runs = {"trainforge": runs["trainforge"], "trainforge, unshared": ours, "transformers generate": theirs}
    for fn in runs.values():
        fn(model, batch[: 2 * a.generations], 4, stop)  # warm-up
    best = dict.fromkeys(runs, float("inf"))
    cpu = dict.fromkeys(runs, float("inf"))
    tokens = {}
    for _ in range(a.repeats):  # rounds of each in turn: a slow spell of a shared machine falls on all of them
        for name, fn in runs.items():
            t, c = time.perf_counter(), time.process_time()
            tokens[name] = fn(model, batch, a.new, stop)
            best[name], cpu[name] = min(best[name], time.perf_counter() - t), min(cpu[name], time.process_time() - c)
    rate = {name: tokens[name] / best[name] for name in runs}
    for name in runs:
        print(f"{name:>22}: {tokens[name]} completion tokens in {best[name]:.3f}s = {rate[name]:,.0f} tokens/s "
              f"({tokens[name] / cpu[name]:,.0f} per CPU second)")
    if a.unshared:
        print(f"shared prefill / unshared: {rate['trainforge'] / rate['trainforge, unshared']:.2f}x")
    print(f"ratio trainforge / generate: {rate['trainforge'] / rate['transformers generate']:.2f}x "
          f"({len(batch)} completions, up to {a.new} tokens, {torch.get_num_threads()} threads, best of {a.repeats} rounds)")


if __name__ == "__main__":
    main()
