"""FLOPs per token from the model's shape, LoRA-aware; the CPU peak probe is cached."""

from __future__ import annotations

import json

import pytest
import torch

from trainforge.config.run import LoraSettings, ModelSettings
from trainforge.hardware.device import cpu_matmul_flops
from trainforge.metrics.flops import flops_per_token, linear_params
from trainforge.model.load import apply_lora, build_model
from trainforge.model.tokenizer import load_tokenizer


def test_full_model_counts_six_n_plus_attention(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    model = build_model(ModelSettings(path=tiny_model_dir), tok, seed=0)
    c = model.config
    per_layer = 4 * c.hidden_size * c.hidden_size + 3 * c.hidden_size * c.intermediate_size  # q,k,v,o (MHA) + mlp
    matmul = c.num_hidden_layers * per_layer + c.vocab_size * c.hidden_size  # + LM head; embeddings excluded
    assert linear_params(model) == (matmul, 0)
    attention = 2 * 2 * c.num_hidden_layers * c.hidden_size * 64 * 3
    assert flops_per_token(model, 64) == 6 * matmul + attention


def test_lora_frozen_weights_skip_weight_gradients(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    full = build_model(ModelSettings(path=tiny_model_dir), tok, seed=0)
    n_full, _ = linear_params(full)
    lora = apply_lora(build_model(ModelSettings(path=tiny_model_dir), tok, seed=0), LoraSettings(r=4))
    trained, frozen = linear_params(lora)
    adapters = sum(p.numel() for n, p in lora.named_parameters() if "lora_" in n)
    assert trained == adapters and frozen == n_full
    assert flops_per_token(lora, 64) < flops_per_token(full, 64)


def quick_check_only(rate: float):
    """A fake matmul probe where the full probe must not run again: the half-size quick check reads ``rate``."""
    def measure(dtype, n=1024, reps=5):
        assert n < 1024, "re-measured"
        return rate
    return measure


def test_cpu_peak_probe_is_cached(tmp_path, monkeypatch):
    import trainforge.hardware.device as hardware

    monkeypatch.setattr(hardware, "load_per_core", lambda: 0.0)  # a quiet machine (see the busy case below)
    first = cpu_matmul_flops("fp32", tmp_path)
    assert first > 0 and (tmp_path / "cpu_peak.json").is_file()

    monkeypatch.setattr(hardware, "measure_matmul", quick_check_only(first / 2))
    assert cpu_matmul_flops("fp32", tmp_path) == first


def test_a_cached_peak_that_a_quick_probe_beats_is_measured_again(tmp_path, monkeypatch):
    """A peak cached while other work held the cores (the load average said quiet) reads low: every run divided
    by it and printed MFU over 100%. A half-size matmul checks it at each use."""
    import trainforge.hardware.device as hardware

    monkeypatch.setattr(hardware, "load_per_core", lambda: 0.0)
    monkeypatch.setattr(hardware, "measure_matmul", lambda dtype, n=1024, reps=5: 1.0e9)
    assert cpu_matmul_flops("fp32", tmp_path) == 1.0e9  # taken while a core was busy
    monkeypatch.setattr(hardware, "measure_matmul", lambda dtype, n=1024, reps=5: 5.0e10 if n == 1024 else 4.0e10)
    assert cpu_matmul_flops("fp32", tmp_path) == 5.0e10  # the quick check saw 40x: measured again, and kept
    monkeypatch.setattr(hardware, "measure_matmul", quick_check_only(4.5e10))
    assert cpu_matmul_flops("fp32", tmp_path) == 5.0e10
    # the real probes: a cached figure far below this machine is replaced
    monkeypatch.undo()
    monkeypatch.setattr(hardware, "load_per_core", lambda: 0.0)
    (tmp_path / "cpu_peak.json").unlink()
    real = cpu_matmul_flops("fp32", tmp_path)
    table = json.loads((tmp_path / "cpu_peak.json").read_text())
    table = {key: {"value": 1.0, "load_per_core": 0.0} for key in table}  # 1 FLOP/s: no machine is that slow
    (tmp_path / "cpu_peak.json").write_text(json.dumps(table))
    assert cpu_matmul_flops("fp32", tmp_path) > 1e6 and real > 1e6


def test_probe_leaves_the_global_random_stream_alone(tmp_path):
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    cpu_matmul_flops("fp32", tmp_path / "fresh")
    torch.testing.assert_close(torch.rand(4), expected, rtol=0, atol=0)


def test_cpu_peak_probe_is_measured_again_on_another_cpu(tmp_path, monkeypatch):
    """Same host name, other hardware (a VM moved, a container image reused): the cached figure is not reused."""
    import trainforge.hardware.device as hardware

    monkeypatch.setattr(hardware, "measure_matmul", lambda *a, **k: 1.0e9)
    monkeypatch.setattr(hardware, "cpu_identity", lambda: "Old-CPU")
    assert cpu_matmul_flops("fp32", tmp_path) == 1.0e9
    monkeypatch.setattr(hardware, "measure_matmul", lambda *a, **k: 5.0e10)
    monkeypatch.setattr(hardware, "cpu_identity", lambda: "New-CPU+bf16")
    assert cpu_matmul_flops("fp32", tmp_path) == 5.0e10


def test_a_probe_taken_on_a_busy_machine_is_taken_again_when_quieter(tmp_path, monkeypatch):
    import trainforge.hardware.device as hardware

    monkeypatch.setattr(hardware, "load_per_core", lambda: 2.0)  # a test suite shares the cores
    monkeypatch.setattr(hardware, "measure_matmul", lambda *a, **k: 1.0e10)
    assert cpu_matmul_flops("fp32", tmp_path) == 1.0e10
    # the full probe could do better now, but the quick check, as busy, does not beat the cached figure
    monkeypatch.setattr(hardware, "measure_matmul", lambda dtype, n=1024, reps=5: 4.0e10 if n == 1024 else 1.0e10)
    assert cpu_matmul_flops("fp32", tmp_path) == 1.0e10  # still as busy: the cached figure stands
    monkeypatch.setattr(hardware, "load_per_core", lambda: 0.1)
    assert cpu_matmul_flops("fp32", tmp_path) == 4.0e10  # quiet now: measured again, the better kept
    monkeypatch.setattr(hardware, "measure_matmul", quick_check_only(4.0e10))
    assert cpu_matmul_flops("fp32", tmp_path) == 4.0e10  # taken quietly: kept for good
    # a cost probe keeps the lower figure
    monkeypatch.setattr(hardware, "load_per_core", lambda: 2.0)
    assert hardware.cached_probe("op-overhead", lambda: 9e-6, tmp_path, better=min) == 9e-6
    monkeypatch.setattr(hardware, "load_per_core", lambda: 0.2)
    assert hardware.cached_probe("op-overhead", lambda: 4e-6, tmp_path, better=min) == 4e-6


@pytest.mark.parametrize("native_bf16", [True, False])
def test_an_emulated_precision_divides_by_the_fp32_peak(tmp_path, monkeypatch, native_bf16):
    """fp16 on a CPU (and bf16 without native support) computes in fp32 underneath: its own probe timed the emulation
    (0.00 TFLOP/s) and the run reported MFU 245%. Its peak is the fp32 probe's, and the source says why."""
    import trainforge.hardware.device as hardware

    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: native_bf16)
    monkeypatch.setattr(hardware, "measure_matmul", lambda dtype, *a, **k: {torch.float32: 1e11}.get(dtype, 3e9))
    cpu = torch.device("cpu")
    assert hardware.peak_flops(cpu, "fp16", tmp_path) == (1e11, "fp32 matmul probe: fp16 is emulated on this CPU")
    assert hardware.peak_flops(cpu, "fp32", tmp_path) == (1e11, "matmul probe")
    bf16 = hardware.peak_flops(cpu, "bf16", tmp_path)
    assert bf16 == ((3e9, "matmul probe") if native_bf16 else (1e11, "fp32 matmul probe: bf16 is emulated on this CPU"))
