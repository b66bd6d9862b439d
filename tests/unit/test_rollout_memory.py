"""A grpo step's memory: the rollout phase (weights, the sampler's KV cache, its temporaries) beside the learning step,
the peak the larger of the two; the KV cache by its formula, the rest against a traced run of the sampler; the auto
micro-batch fitted to both phases; the plan's table listing the KV cache."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from conftest import TINY_LLAMA_INIT
from trainforge.config.run import RunConfig
from trainforge.engine.predict.fit import FIT_MARGIN, fit_run, predict_memory
from trainforge.engine.predict.rollout_memory import DecoderShape, predict_rollout, rollout_parts
from trainforge.hardware.device import PRECISIONS
from trainforge.hardware.profiles import GIB, HardwareProfile
from trainforge.tools.plan import VocabOnly

# 2 layers, 4 heads of 8 (num_key_value_heads 2: grouped), hidden 32
MODEL = {"init": {**TINY_LLAMA_INIT, "num_key_value_heads": 2, "max_position_embeddings": 512}, "tokenizer": "char"}


def grpo(completion: int = 16, micro: int | str = 4, accum: int = 2, **train) -> RunConfig:
    return RunConfig.model_validate({
        "model": MODEL, "data": {"train": "builtin:arithmetic", "max_length": 24},
        "train": {"objective": "grpo", "micro_batch_size": micro, "grad_accum": accum, "activation_checkpointing": False, **train},
        "rl": {"num_generations": 4, "max_completion_length": completion, "rewards": [{"name": "final_number"}]},
    })


def device(gib: float) -> HardwareProfile:
    return HardwareProfile("tiny", "a tiny device", gib, {"fp32": 1.0, "bf16": 2.0, "fp16": 2.0}, 100.0, True,
                           fixed_gib=0.0, allocator_overhead=0.0)


BF16 = PRECISIONS["bf16"]


def test_the_kv_cache_is_rows_x_tokens_x_layers_x_2_x_kv_heads_x_head_dim_x_bytes():
    learning = {"weights": 1000, "grads": 10, "optimizer": 20, "activations": 30, "temporaries": 40}
    parts, rows = predict_rollout(grpo(completion=256), VocabOnly(256), BF16, 4, 2, 1, learning)
    # at the decode end: the step's 8 completions (micro-batch 4 x accumulation 2), each a prompt of at most 24
    # tokens and 256 new ones, 2 layers, keys and values, 2 kv heads of 32 / 4 = 8, in bf16
    assert rows == 8 and parts["kv_cache"] == 8 * (24 + 256) * 2 * 2 * 2 * 8 * 2
    assert parts["weights"] == 1000 and parts["optimizer"] == 20 and "grads" not in parts  # the last step's were freed
    # short completions, groups of 2: the prefill over the 4 prompts (each once for its 2 completions) holds more
    # (its layers' temporaries), with the prompts' cache
    pairs = grpo(completion=8)
    pairs.rl.num_generations = 2
    parts, _ = predict_rollout(pairs, VocabOnly(256), BF16, 4, 2, 1, learning)
    assert parts["kv_cache"] == 4 * 24 * 2 * 2 * 2 * 8 * 2
    # groups of 4: a prefill of 2 prompts is too small to matter; the decode end's cache is the peak's
    parts, _ = predict_rollout(grpo(completion=8), VocabOnly(256), BF16, 4, 2, 1, learning)
    assert parts["kv_cache"] == 8 * (24 + 8) * 2 * 2 * 2 * 8 * 2
    # under train.global_batch_size the rollout samples the step's share of it, whatever the micro-batch
    assert predict_rollout(grpo(micro=4, accum=1, global_batch_size=32), VocabOnly(256), BF16, 4, 8, 2, learning)[1] == 16
    sft = RunConfig.model_validate({"model": MODEL, "data": {"train": "builtin:arithmetic", "max_length": 24}})
    assert predict_rollout(sft, VocabOnly(256), BF16, 4, 2, 1, learning) is None


def test_a_longer_completion_raises_the_peak_which_the_rollout_sets_when_it_samples_many():
    short, long = (predict_memory(grpo(completion=c, accum=64), VocabOnly(256), BF16, device(1.0), 4, False, 64)
                   for c in (200, 400))
    assert long.rollout["kv_cache"] == short.rollout["kv_cache"] * (24 + 400) // (24 + 200)
    assert long.tensors > short.tensors
    assert long.tensors == long.phases["rollout"] > long.phases["learning"]  # 256 rows sampled, 4 learned from at once


@pytest.mark.parametrize("rows,prompt,new,group", [(8, 16, 48, 1), (16, 160, 1, 1), (16, 160, 1, 4)])
def test_the_rollout_prediction_matches_a_traced_run_of_the_sampler(rows, prompt, new, group):
    # the decode end's peak; the prefill's; a prefill shared by each prompt's 4 completions, its cache repeated
    """``rollout.sample`` on a real model, every tensor it makes counted (the plan's tracer): the prediction of its
    KV cache, temporaries and autocast's weight copies is within 25% of the traced peak."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainforge.engine.predict.trace import StepTracer
    from trainforge.rl.rollout import Sampling, sample, stream_keys

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)).eval()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 2048, (prompt - i % 3,), generator=gen).tolist() for i in range(rows // group)]
    class Counter(StepTracer):  # live bytes only: the ops' records (for the time model) are not needed here
        def _record(self, *args):
            return None

    tracer = Counter()
    with tracer:
        sample(model, prompts, Sampling(new, top_p=0.9), stream_keys(0, range(rows)), 0,
               torch.autocast("cpu", dtype=torch.bfloat16), group=group)
    tracer.close()
    cfg = SimpleNamespace(model=SimpleNamespace(method="full"), data=SimpleNamespace(max_length=prompt),
                          rl=SimpleNamespace(max_completion_length=new, top_k=0, min_p=0.0, top_p=0.9,
                                             num_generations=group))
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    parts = rollout_parts(cfg, DecoderShape(4, 128, 4, 2, 32, 256, 2048), 2, rows, {"weights": weights})
    predicted = sum(parts.values()) - weights  # the tracer counts what sampling makes, not the weights
    assert 0.8 < predicted / tracer.peak < 1.25, (parts, tracer.peak)


def test_auto_micro_batch_fits_both_phases_in_whole_groups():
    cfg = grpo(completion=128, micro="auto", accum=2)
    one = predict_memory(cfg, VocabOnly(256), BF16, device(1.0), 1, False, 2)
    two = predict_memory(cfg, VocabOnly(256), BF16, device(1.0), 2, False, 2)
    room = device((one.tensors + 11 * (two.tensors - one.tensors)) / GIB / FIT_MARGIN)  # about 12 rows' worth
    fit = fit_run(cfg, VocabOnly(256), BF16, room)
    assert fit.memory.fits(FIT_MARGIN) and fit.micro_batch_size % 2 == 0  # 4 generations, 2 micro-batches: even
    assert 8 <= fit.micro_batch_size <= 12  # the line through 1 and 2 rows, stepped down to whole groups
    assert "the rollout samples" in fit.why_micro_batch and "KV cache" in fit.why_micro_batch
    longer = fit_run(grpo(completion=384, micro="auto", accum=2), VocabOnly(256), BF16, room)
    assert longer.micro_batch_size < fit.micro_batch_size


def test_the_plan_shows_the_rollout_beside_the_learning_step(tmp_path):
    from rich.console import Console

    from trainforge.tools.plan import make_plan, render

    plan = make_plan(grpo(completion=64, accum=16), hardware="t4")
    rollout = plan["memory"]["rollout"]
    assert rollout["completions"] == 64 and rollout["tokens_per_completion"] == 88 and rollout["parts"]["kv_cache"] > 0
    assert rollout["peak_phase"] in ("rollout", "learning")
    console = Console(record=True, width=200)
    render(plan, console)
    text = console.export_text()
    assert "kv_cache" in text and "rollout GiB (64 x 88 tokens)" in text and "learning GiB" in text
    assert "sampling time is not predicted" in text


def test_a_rollout_that_does_not_fit_is_fixed_by_shorter_completions():
    from trainforge.tools.plan_remedy import one_change_to_fit

    cfg = grpo(completion=400, accum=64)  # 256 completions sampled at once: the KV cache sets the peak
    m = predict_memory(cfg, VocabOnly(256), BF16, device(1.0), 1, True, 64)
    half = predict_memory(grpo(completion=200, accum=64), VocabOnly(256), BF16, device(1.0), 1, True, 64)
    small = device((m.tensors + half.tensors) / 2 / GIB)  # between the two
    remedy = one_change_to_fit(cfg, VocabOnly(256), BF16, small, predict_memory(cfg, VocabOnly(256), BF16, small, 1, True, 64),
                               64, 1, "none")
    assert remedy["setting"] == "rl.max_completion_length" and remedy["value"] == 200, remedy
