"""Long context on the memory model: each lever priced in the traced step, the longest length by search,
and what auto turns on (engine/predict/levers.py, engine/predict/longest.py)."""

from __future__ import annotations

import pytest
import torch

from trainforge.config.run import RunConfig
from trainforge.engine.predict.fit import predict_memory
from trainforge.engine.predict.levers import Levers, lever_ladder, resolve_levers, resolved_config, with_levers
from trainforge.engine.predict.longest import GRANULE, lever_table, longest_length
from trainforge.engine.predict.trace import _trace
from trainforge.hardware.device import PRECISIONS
from trainforge.hardware.profiles import GIB, HardwareProfile
from trainforge.tools.plan import VocabOnly

VOCAB = VocabOnly(256)
TABLE_GIB = 0.125  # the lever table's device: small, so that each row's longest length (and each trace) stays short
# four layers: with offload two boundaries stay on the device (the one in backward and the one below it, brought back
# early: engine/offload.py), so offload buys something from three layers on
SHAPE = {"architecture": "llama", "hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1 << 20}


def config(tmp_path, shape: dict | None = None, **train) -> RunConfig:
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "alpha beta gamma"}\n')
    return RunConfig.model_validate({"model": {"init": shape or SHAPE}, "data": {"train": str(data), "max_length": 2048},
                                     "train": train})


def device(gib: float, kind: str = "gpu") -> HardwareProfile:
    return HardwareProfile("tiny", "a tiny device", gib, {"fp32": 1.0, "bf16": 2.0, "fp16": 2.0}, 100.0, True,
                           fixed_gib=0.0, allocator_overhead=0.0, kind=kind)


def tensors(cfg: RunConfig, levers: Levers, length: int, profile: HardwareProfile | None = None) -> int:
    return predict_memory(with_levers(cfg, levers, length), VOCAB, PRECISIONS["bf16"], profile or device(8.0), 1,
                          levers.checkpointing).tensors


def test_each_lever_lowers_the_peak_and_the_peak_grows_linearly(tmp_path):
    # an MLP four times wider than the vocabulary: its intermediates, not the head's logits, set the checkpointed peak
    shape = {**SHAPE, "intermediate_size": 1024}
    cfg = config(tmp_path, shape)
    ladder = [Levers(), Levers(True), Levers(True, True), Levers(True, True, True)]
    at = {n: [tensors(cfg, lv, n) for lv in ladder] for n in (4096, 8192)}
    for n, peaks in at.items():
        assert all(later < earlier for earlier, later in zip(peaks, peaks[1:])), (n, peaks)
    short = [tensors(cfg, lv, 2048) for lv in ladder[1:]]
    for i, lv in enumerate(ladder[1:], 1):  # at most linear in length: the second doubling adds at most twice the first's
        first, second = at[4096][i] - short[i - 1], at[8192][i] - at[4096][i]  # (quadratic would be four times)
        assert 0 < second <= 2.2 * first, lv  # a term in the square of the length would make it 4
    # tiling takes the MLP's intermediates out of the recomputed layer: at least 3 of its 4 bf16 intermediates
    assert at[8192][1] - at[8192][2] >= 3 * 8192 * shape["intermediate_size"] * 2
    # offload takes each layer's input (a bf16 hidden-size row per token) off the device: all but the one whose
    # backward reaches the peak (its input back on the device; the head's last chunk is freed before backward) and
    # the one below it, already on its way back (engine/offload.py's prefetch)
    assert at[8192][2] - at[8192][3] >= (shape["num_hidden_layers"] - 2) * 8192 * SHAPE["hidden_size"] * 2 * 0.9


def test_offload_is_priced_only_for_a_gpu(tmp_path):
    cfg = config(tmp_path)
    cpu = device(8.0, "cpu")
    assert tensors(cfg, Levers(True, True, True), 8192, cpu) == tensors(cfg, Levers(True, True), 8192, cpu)


def test_the_sampled_tile_trace_equals_tracing_every_tile(tmp_path, monkeypatch):
    cfg = with_levers(config(tmp_path), Levers(True, True), 2048)
    sampled = _trace(cfg, VOCAB, PRECISIONS["bf16"], 1, True, 1, "cuda", None)
    import torch.utils._python_dispatch as dispatch

    monkeypatch.setattr(dispatch, "_get_current_dispatch_mode_stack", lambda: [])  # no tracer found: every tile runs
    every = _trace(cfg, VOCAB, PRECISIONS["bf16"], 1, True, 1, "cuda", None)
    assert sampled.parts == every.parts and sampled.peak == every.peak
    assert len(sampled.ops) == len(every.ops) and sampled.flops == pytest.approx(every.flops, rel=1e-12)


def test_the_chunked_head_is_traced_in_three_chunks_with_the_whole_loops_peak_and_flops(tmp_path, monkeypatch):
    """A long row's head runs in many chunks (CPU: 512 tokens each, here 16); a plan traces chunks 0, 1 and the
    last and counts the middle one's ops for the rest: the same peak, parts, op list and FLOPs as tracing every
    chunk, at a cost that does not grow with the length (`plan --longest` on the built-in default traced rows of
    millions of tokens: over 10 minutes, 85 s since)."""
    import torch.utils._python_dispatch as dispatch

    from trainforge.engine import loss

    cfg = with_levers(config(tmp_path), Levers(True), 16 * 512)
    chunks: list[int] = []
    real = loss.add_weight_grad  # once per chunk: the head's weight trains in a full fine-tune
    monkeypatch.setattr(loss, "add_weight_grad", lambda *a: chunks.append(1) or real(*a))
    sampled = _trace(cfg, VOCAB, PRECISIONS["fp32"], 1, True, 1, "cpu", None)
    assert len(chunks) == 3
    monkeypatch.setattr(dispatch, "_get_current_dispatch_mode_stack", lambda: [])  # no tracer found: every chunk runs
    every = _trace(cfg, VOCAB, PRECISIONS["fp32"], 1, True, 1, "cpu", None)
    assert len(chunks) == 3 + 16
    assert sampled.parts == every.parts and sampled.peak == every.peak
    assert len(sampled.ops) == len(every.ops) and sampled.flops == pytest.approx(every.flops, rel=1e-12)


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    """The lever table of the tiny model on a TABLE_GIB GPU (one search per row), shared by the tests below."""
    cfg = config(tmp_path_factory.mktemp("long"), activation_checkpointing="auto", micro_batch_size=1)
    return cfg, lever_table(cfg, VOCAB, PRECISIONS["bf16"], device(TABLE_GIB))


def test_the_lever_table_grows_down_the_ladder_and_each_row_is_the_last_that_fits(table):
    cfg, rows = table
    assert [r.levers for r in rows] == [Levers(), Levers(True), Levers(True, True), Levers(True, True, True)]
    lengths = [r.length for r in rows]
    assert all(b > a for a, b in zip(lengths, lengths[1:])), lengths
    budget = 0.9 * device(TABLE_GIB).memory_bytes
    for found in rows:
        assert found.length > 0 and found.length % GRANULE == 0
        assert found.memory.process <= budget < found.beyond.process  # one GRANULE more does not fit
        assert len(found.traced) <= 10  # a handful of traces, not a scan
    last = rows[-1]  # plan's own prediction agrees at that length and one step beyond
    at = lambda n: predict_memory(with_levers(cfg, last.levers, n), VOCAB, PRECISIONS["bf16"], device(TABLE_GIB), 1, True)  # noqa: E731
    assert at(last.length).fits(0.9) and not at(last.length + GRANULE).fits(0.9)


def test_auto_turns_levers_on_only_when_needed(table):
    cfg, rows = table
    longest = {r.levers: r.length for r in rows}
    at = lambda n: cfg.model_copy(update={"data": cfg.data.model_copy(update={"max_length": n})})  # noqa: E731
    choice = resolve_levers(at(longest[Levers(True)]), VOCAB, PRECISIONS["bf16"], device(TABLE_GIB))
    assert choice.levers == Levers(True) and choice.why_tiled.startswith("off: the run fits")
    choice = resolve_levers(at(longest[Levers(True, True)]), VOCAB, PRECISIONS["bf16"], device(TABLE_GIB))
    assert choice.levers == Levers(True, True) and choice.why_tiled.startswith("on: without it")
    assert choice.why_offload.startswith("off: the run fits")
    choice = resolve_levers(at(longest[Levers(True, True, True)]), VOCAB, PRECISIONS["bf16"], device(TABLE_GIB))
    assert choice.levers == Levers(True, True, True) and choice.why_offload.startswith("on: without it")
    assert resolved_config(cfg, choice).train.tiled_mlp is True
    cpu = resolve_levers(at(longest[Levers(True, True)]), VOCAB, PRECISIONS["bf16"], device(TABLE_GIB, "cpu"))
    assert cpu.levers.offload is False and "CPU" in cpu.why_offload


def test_the_ladder_keeps_what_the_config_fixes(tmp_path):
    gpu = device(1.0)
    assert lever_ladder(config(tmp_path, tiled_mlp=False), gpu) == [Levers(True), Levers(True, False, True)]
    assert lever_ladder(config(tmp_path, activation_checkpointing=False), gpu) == [Levers(), Levers(False, True)]
    gpt2 = config(tmp_path).model_copy(update={"model": config(tmp_path).model.model_copy(
        update={"init": {"architecture": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4}})})
    assert lever_ladder(gpt2, gpu) == [Levers(True), Levers(True, False, True)]


def test_one_decision_traces_each_setting_once_and_nothing_is_kept_after_it(tmp_path, monkeypatch):
    from trainforge.engine.predict import trace as trace_module
    from trainforge.engine.predict.trace_cache import reusing_traces

    calls = []
    real = trace_module._trace
    monkeypatch.setattr(trace_module, "_trace", lambda *a, **k: calls.append(a[3:6]) or real(*a, **k))
    cfg = config(tmp_path)
    with reusing_traces():
        first = tensors(cfg, Levers(True), 256)
        per = len(calls)  # one setting's traces: two shallow depths, extrapolated to the model's four layers
        assert per == 2 and tensors(cfg, Levers(True), 256) == first and len(calls) == per  # the same settings: once
        tensors(cfg, Levers(True), 512)
        assert len(calls) == 2 * per  # other settings: traced
    tensors(cfg, Levers(True), 256)
    assert len(calls) == 3 * per  # outside a decision nothing is kept


def test_plan_lists_each_long_context_lever_with_why(tmp_path):
    from trainforge.tools.plan import make_plan

    rows = {d["setting"]: d for d in make_plan(config(tmp_path, micro_batch_size=1), hardware="h100", time_ops=False)["decisions"]}
    assert rows["tiled_mlp"]["choice"] == "false" and rows["tiled_mlp"]["why"].startswith("off: ")
    assert rows["activation_offload"]["choice"] == "false" and rows["activation_offload"]["why"].startswith("off: ")
    fixed = {d["setting"]: d for d in make_plan(config(tmp_path, micro_batch_size=1, tiled_mlp=True),
                                                hardware="h100", time_ops=False)["decisions"]}
    assert fixed["tiled_mlp"] == {"setting": "tiled_mlp", "choice": "true", "why": "train.tiled_mlp: True"}
