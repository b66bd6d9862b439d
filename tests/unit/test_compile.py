"""torch.compile: the auto rule, and a failing compile falls back to eager with a warning."""

from __future__ import annotations

import json

import pytest
import torch
from rich.console import Console

from trainforge.config.run import RunConfig
from trainforge.engine.trainer import train
from trainforge.metrics.console import ConsoleReporter
import trainforge.engine.compile_auto as compile_auto
from trainforge.engine.compile_auto import CompileAuto, compile_key

CPU = torch.device("cpu")


def probe(auto: CompileAuto, step_s: float, remaining: int) -> str | None:
    """Feed PROBE_STEPS eager steps of ``step_s`` (the first a slow warm-up), return the decision."""
    reason = None
    for i in range(compile_auto.PROBE_STEPS):
        auto.record_step(step_s * (5 if i == 0 else 1), compiled=False)
        reason = auto.after_eager_steps(remaining)
    return reason


def test_unknown_config_weighs_assumed_speedup_against_a_cold_compile(tmp_path):
    key = compile_key({"model": "a"})
    # the demo: 0.2 s x 600 steps x (1 - 1/1.3) = 28 s saved < ~90 s of compiling
    assert probe(CompileAuto("auto", key, tmp_path / "h.json", CPU), 0.2, 600) is None
    assert probe(CompileAuto("auto", key, tmp_path / "h.json", CPU), 0.2, 10_000) is not None
    assert probe(CompileAuto(False, key, tmp_path / "h.json", CPU), 0.2, 10_000) is None


def test_one_eager_step_slowed_by_other_work_does_not_buy_a_compile(tmp_path):
    """The demo's steps at 0.2 s, one of them 2.3 s (another process took the core): the median decides."""
    auto = CompileAuto("auto", compile_key({"model": "a"}), tmp_path / "h.json", CPU)
    reason = None
    for seconds in (1.0, 0.2, 2.3, 0.2):  # warm-up, then one noisy step among steady ones
        auto.record_step(seconds, compiled=False)
        reason = auto.after_eager_steps(600)
    assert reason is None  # 0.2 s x 600 steps does not pay for a cold compile; a mean of 0.9 s would have


def measured_compile(history, key, eager_s=0.2, compiled_s=0.1, first_s=40.0):
    """A run that probes, compiles and measures: leaves its record in ``history``."""
    auto = CompileAuto(True, key, history, CPU)
    assert auto.at_start(1000) == "compile: as configured"
    for _ in range(compile_auto.PROBE_STEPS):  # as if the run had timed eager steps (a resume with compile: true has none)
        auto.record_step(eager_s, compiled=False)
    auto.record_step(first_s, compiled=True)
    auto.record_step(compiled_s + 5.0, compiled=True)  # a recompile
    for _ in range(compile_auto.MEASURE_STEPS - 2):
        auto.record_step(compiled_s, compiled=True)
    return auto


def test_a_compiled_run_records_compile_time_and_speedup(tmp_path):
    history, key = tmp_path / "h.json", compile_key({"model": "a"})
    measured_compile(history, key)
    entry = json.loads(history.read_text())[key]
    assert entry["speedup"] == pytest.approx(2.0)
    assert entry["compile_s"] == pytest.approx(39.9 + 5.0)
    assert entry["eager_step_s"] == pytest.approx(0.2) and entry["compiled_step_s"] == pytest.approx(0.1)


def test_known_config_with_warm_cache_compiles_from_the_first_step(tmp_path, monkeypatch):
    history, key = tmp_path / "h.json", compile_key({"model": "a"})
    measured_compile(history, key)
    monkeypatch.setattr(compile_auto, "torch_cache_present", lambda: True)
    auto = CompileAuto("auto", key, history, CPU)
    # no warm compile measured yet: assumed WARM_FRACTION of the 44.9 s cold one (~7 s) < 200 s saved
    reason = auto.at_start(2000)
    assert "compiling from the first step" in reason and "~7s to load" in reason
    assert auto.after_eager_steps(2000) is None  # decided once
    # a short rerun does not pay for it: 0.2 s x 50 x 0.5 = 5 s < ~7 s
    assert CompileAuto("auto", key, history, CPU).at_start(50) is None
    # the warm compile is measured too, and from then on decides
    warm = CompileAuto("auto", key, history, CPU)
    warm.at_start(2000)
    for s in [3.1] + [0.1] * (compile_auto.MEASURE_STEPS - 1):
        warm.record_step(s, compiled=True)
    entry = json.loads(history.read_text())[key]
    assert entry["warm_compile_s"] == pytest.approx(3.0) and entry["compile_s"] == pytest.approx(44.9)
    assert "~3s to load" in CompileAuto("auto", key, history, CPU).at_start(200)  # 20 s saved > 3 s


def test_cleared_torch_cache_means_probing_again(tmp_path, monkeypatch):
    history, key = tmp_path / "h.json", compile_key({"model": "a"})
    measured_compile(history, key)
    monkeypatch.setattr(compile_auto, "torch_cache_present", lambda: False)
    auto = CompileAuto("auto", key, history, CPU)
    assert auto.at_start(100_000) is None
    assert probe(auto, 0.2, 100_000) is not None  # with the measured speed-up and cold compile time


def test_compiled_step_time_from_a_forced_compile_gives_the_speedup(tmp_path, monkeypatch):
    """A run with compile: true has no eager steps to compare; a later auto run probes eager steps
    and takes the speed-up against the compiled step time recorded then."""
    history, key = tmp_path / "h.json", compile_key({"model": "a"})
    forced = CompileAuto(True, key, history, CPU)
    forced.at_start(100)
    for s in [40.0] + [0.1] * (compile_auto.MEASURE_STEPS - 1):
        forced.record_step(s, compiled=True)
    entry = json.loads(history.read_text())[key]
    assert "speedup" not in entry and entry["compiled_step_s"] == pytest.approx(0.1)
    monkeypatch.setattr(compile_auto, "torch_cache_present", lambda: True)
    auto = CompileAuto("auto", key, history, CPU)
    assert auto.at_start(10**6) is None  # no measured speed-up yet: probe first
    assert "2.00x" in probe(auto, 0.2, 1000)  # 0.2 / 0.1; 100 s saved > ~6 s (a warm share of the recorded 40 s)


def test_config_measured_no_faster_is_not_compiled_again(tmp_path, monkeypatch):
    history, key = tmp_path / "h.json", compile_key({"model": "a"})
    measured_compile(history, key, eager_s=0.2, compiled_s=0.21)
    monkeypatch.setattr(compile_auto, "torch_cache_present", lambda: True)
    auto = CompileAuto("auto", key, history, CPU)
    assert auto.at_start(10**6) is None and probe(auto, 0.2, 10**6) is None
    assert "0.95x" in auto.skipped_reason() and "0.95x" in auto.skip_note


def test_forced_compile_measured_slower_than_eager_is_remembered(tmp_path, monkeypatch):
    """compile: true recorded 0.143 s compiled steps; eager steps of a later auto run take 0.123 s:
    not compiled, said once, and the measured speed-up is kept so the next run skips the probe."""
    history, key = tmp_path / "h.json", compile_key({"model": "a"})
    forced = CompileAuto(True, key, history, CPU)
    forced.at_start(100)
    for s in [4.2] + [0.143] * (compile_auto.MEASURE_STEPS - 1):
        forced.record_step(s, compiled=True)
    monkeypatch.setattr(compile_auto, "torch_cache_present", lambda: True)
    auto = CompileAuto("auto", key, history, CPU)
    assert auto.at_start(600) is None
    assert probe(auto, 0.123, 600) is None and "0.86x" in auto.skip_note
    assert json.loads(history.read_text())[key]["speedup"] == pytest.approx(0.123 / 0.143)
    again = CompileAuto("auto", key, history, CPU)
    assert again.at_start(10**6) is None and "0.86x" in again.skip_note
    assert compile_key({"model": "b"}) != key


def test_failed_compile_trains_eager_with_a_warning(finetune_config, tmp_path, monkeypatch):
    def broken(self, *args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(torch.nn.Module, "compile", broken)
    finetune_config["train"]["compile"] = True
    console = Console(record=True, width=200)
    result = train(RunConfig.model_validate(finetune_config), tmp_path / "run", ConsoleReporter(console))
    assert "compile failed (RuntimeError: no C++ compiler); training eager" in console.export_text()
    assert result.summary["compiled"] is False and result.summary["steps"] == 8


def test_auto_does_not_compile_a_short_run(finetune_config, tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINFORGE_CACHE", str(tmp_path / "cache"))  # no compile history of other tests
    calls = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, *a, **k: calls.append(self))
    result = train(RunConfig.model_validate(finetune_config), tmp_path / "run", ConsoleReporter(Console(quiet=True)))
    assert calls == [] and result.summary["compiled"] is False


def _graph_nodes(layers: int, regional: bool) -> tuple[int, int, float, float]:
    """(graphs compiled, their FX nodes in all, compiled loss, eager loss) for a tiny Llama of ``layers``
    layers through ``compile_decoder``, with a backend that counts what it is given and runs it eagerly."""
    import torch._dynamo
    from transformers import AutoModelForCausalLM, LlamaConfig

    from trainforge.model.compile import compile_decoder

    seen = []

    def counting(gm, example_inputs):
        seen.append(len(gm.graph.nodes))
        return gm.forward

    torch._dynamo.reset()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    eager = float(model(input_ids=ids, labels=ids, use_cache=False).loss)
    assert compile_decoder(model, print, regional=regional, backend=counting)
    compiled = float(model(input_ids=ids, labels=ids, use_cache=False).loss)
    torch._dynamo.reset()
    return len(seen), sum(seen), compiled, eager


def test_regional_compile_does_not_grow_with_depth():
    """Per-layer compile: the layers of one class share one graph, the same at 2 and 4 layers (compile
    time does not grow with depth); the whole-stack graph grows with depth. Same loss as eager."""
    graphs2, nodes2, compiled, eager = _graph_nodes(2, regional=True)
    graphs4, nodes4, _, _ = _graph_nodes(4, regional=True)
    assert (graphs2, nodes2) == (graphs4, nodes4) and graphs2 >= 1
    assert compiled == pytest.approx(eager, rel=1e-5)
    _, whole2, _, _ = _graph_nodes(2, regional=False)
    _, whole4, compiled, eager = _graph_nodes(4, regional=False)
    assert whole4 > whole2 > nodes2
    assert compiled == pytest.approx(eager, rel=1e-5)


def test_repeated_layers_of_encoder_decoder_and_lora():
    """T5's blocks, and a PEFT-wrapped Llama's decoder layers, are found for regional compile."""
    from transformers import AutoModelForCausalLM, LlamaConfig, T5Config, T5ForConditionalGeneration

    from trainforge.config.run import LoraSettings
    from trainforge.model.compile import repeated_layers
    from trainforge.model.load import apply_lora

    t5 = T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4))
    assert len(repeated_layers(t5.get_encoder())) == 2 and len(repeated_layers(t5.get_decoder())) == 2
    llama = AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                         num_hidden_layers=3, num_attention_heads=4))
    lora = apply_lora(llama, LoraSettings(r=2, alpha=4))
    layers = repeated_layers(lora.get_base_model().get_decoder())
    assert len(layers) == 3 and type(layers[0]).__name__ == "LlamaDecoderLayer"


def test_regional_compile_of_lora_compiles_the_layer_once():
    """Under LoRA the embedding is frozen: without help the first layer's input needs no gradient and
    dynamo compiles that layer a second time. One graph, and the adapters' gradients match eager."""
    import torch._dynamo
    from transformers import AutoModelForCausalLM, LlamaConfig

    from trainforge.config.run import LoraSettings
    from trainforge.model.compile import compile_decoder
    from trainforge.model.load import apply_lora

    def lora_model():
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2)
        return apply_lora(AutoModelForCausalLM.from_config(config, attn_implementation="sdpa"), LoraSettings(r=2, alpha=4))

    def grads(model):
        ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
        for _ in range(2):
            model.zero_grad()
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    seen = []

    def counting(gm, example_inputs):
        seen.append(len(gm.graph.nodes))
        return gm.forward

    eager = grads(lora_model())
    torch._dynamo.reset()
    model = lora_model()
    assert compile_decoder(model, print, backend=counting)
    compiled = grads(model)
    torch._dynamo.reset()
    assert len(seen) == 1
    assert compiled.keys() == eager.keys()
    for name, grad in eager.items():
        torch.testing.assert_close(compiled[name], grad, rtol=1e-5, atol=1e-7)


FAMILY_GRAPHS = {  # config class, its extra settings, graphs for 6 layers (one per kind of layer)
    "Qwen3Config": ({}, 1),
    "Gemma3TextConfig": ({"sliding_window_pattern": 3}, 1),  # sliding and full layers share a graph
    "MixtralConfig": ({"num_local_experts": 4}, 1),
    "Cohere2Config": ({}, 2),  # sliding layers with RoPE, full layers without
    "SmolLM3Config": ({"pad_token_id": None}, 2),  # every fourth layer without RoPE
}


@pytest.mark.parametrize("config_class", sorted(FAMILY_GRAPHS))
def test_regional_compile_shares_graphs_across_a_family_layers(config_class):
    """A layer attribute dynamo guards on (a layer index, say) would compile every layer anew and,
    past dynamo's recompile limit, run the rest eagerly: real families compile once per kind of layer."""
    import torch._dynamo
    import transformers

    from trainforge.model.compile import compile_decoder

    extra, expected = FAMILY_GRAPHS[config_class]
    config = getattr(transformers, config_class)(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                                                 num_attention_heads=4, num_key_value_heads=2, head_dim=8, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    seen = []

    def counting(gm, example_inputs):
        seen.append(gm)
        return gm.forward

    torch._dynamo.reset()
    assert compile_decoder(model, print, backend=counting)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    torch._dynamo.reset()
    assert len(seen) == expected


def test_an_hour_long_gpu_run_pays_for_a_compile(tmp_path):
    """On CUDA the assumed (regional) compile is ~40 s: an hour of 0.5 s steps compiles after its
    probe steps; a 100-step run (~12 s saved at the assumed 1.3x) stays eager."""
    cuda = torch.device("cuda")
    key = compile_key({"model": "gpu"})
    assert probe(CompileAuto("auto", key, tmp_path / "h.json", cuda), 0.5, 7200) is not None
    assert probe(CompileAuto("auto", key, tmp_path / "h.json", cuda), 0.5, 100) is None


def test_a_compiled_run_reports_its_compile(tmp_path):
    auto = measured_compile(tmp_path / "h.json", compile_key({"model": "a"}))
    measured = auto.measured()
    assert measured["compile_s"] == pytest.approx(39.9 + 5.0) and measured["speedup"] == pytest.approx(2.0)
    assert CompileAuto("auto", compile_key({"model": "b"}), tmp_path / "h.json", CPU).measured() is None


def test_the_end_of_run_sample_decodes_eagerly(finetune_config, tmp_path, monkeypatch):
    """Decoding one token at a time at growing lengths would recompile every compiled layer up to dynamo's
    limit (seconds each, and warnings): the end-of-run sample runs with compiled code set aside."""
    from torch._dynamo import eval_frame

    import trainforge.engine.trainer as trainer

    stances = []
    monkeypatch.setattr(trainer, "sample_prompt", lambda *a, **k: stances.append(eval_frame._stance.stance) or "sampled")
    cfg = dict(finetune_config)
    cfg["train"] = {**cfg["train"], "max_steps": 2, "compile": False}
    cfg["log"] = {**cfg["log"], "sample_prompt": "alpha beta"}
    result = trainer.train(RunConfig.model_validate(cfg), tmp_path / "run", ConsoleReporter(Console(quiet=True)))
    assert stances == ["force_eager"] and result.summary["sample"] == "sampled"
