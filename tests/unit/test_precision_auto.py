"""``train.precision: auto`` on a CPU, whatever CPU runs the test (the native-bf16 probe and the
matmul probe are made to answer each way), and bf16 refused on GPUs without bf16 tensor cores."""

from __future__ import annotations

import pytest
import torch

import trainforge.hardware.device as hardware
from trainforge.hardware.device import BF16_MIN_SPEEDUP, resolve_precision

CPU = torch.device("cpu")


def fake_probe(monkeypatch, native: bool, bf16_speedup: float) -> None:
    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: native)
    rates = {"fp32": 100e9, "bf16": 100e9 * bf16_speedup}
    monkeypatch.setattr(hardware, "cpu_matmul_flops", lambda precision, cache_dir=None: rates[precision])


def test_auto_takes_bf16_where_native_and_faster(monkeypatch):
    fake_probe(monkeypatch, native=True, bf16_speedup=4.0)
    precision, why = resolve_precision("auto", CPU)
    assert precision.name == "bf16" and precision.autocast_dtype is torch.bfloat16
    assert "4.0x" in why


def test_auto_keeps_fp32_without_native_bf16(monkeypatch):
    fake_probe(monkeypatch, native=False, bf16_speedup=4.0)
    precision, why = resolve_precision("auto", CPU)
    assert precision.name == "fp32" and precision.autocast_dtype is None
    assert "no native bf16" in why


def test_auto_keeps_fp32_when_native_bf16_is_not_faster(monkeypatch):
    fake_probe(monkeypatch, native=True, bf16_speedup=BF16_MIN_SPEEDUP * 0.9)
    precision, why = resolve_precision("auto", CPU)
    assert precision.name == "fp32"
    assert "train.precision=bf16" in why  # the user is told how to force it


@pytest.mark.parametrize("name", ["fp32", "bf16", "fp16"])
def test_explicit_precision_is_honoured_on_cpu(monkeypatch, name):
    fake_probe(monkeypatch, native=False, bf16_speedup=1.0)
    precision, why = resolve_precision(name, CPU)
    assert precision.name == name and why == "as configured"
    assert precision.needs_grad_scaler is (name == "fp16")


def test_auto_attention_on_cpu_is_packed_sdpa():
    """CPU: packed documents batched by length; the CUDA choices are tested in test_doc_attention.py."""
    from trainforge.model.load import attention_implementation

    assert attention_implementation("auto", CPU, half_precision=True).endswith("packed_sdpa")
    assert attention_implementation("auto", CPU, half_precision=False).endswith("packed_sdpa")


@pytest.mark.parametrize("native", [False, True])
def test_forced_bf16_warns_where_the_cpu_emulates_it(native, finetune_config, tmp_path, monkeypatch):
    """`train.precision: bf16` on a CPU without AVX512-BF16/AMX trains many times slower than fp32: say so."""
    import io

    from rich.console import Console

    from trainforge.config.run import RunConfig
    from trainforge.engine import setup, trainer
    from trainforge.metrics.console import ConsoleReporter

    monkeypatch.setattr(setup, "cpu_has_native_bf16", lambda: native)
    cfg = finetune_config  # a fresh dict per test
    cfg["train"].update(precision="bf16", max_steps=1, grad_accum=1)
    buf = io.StringIO()
    trainer.train(RunConfig.model_validate(cfg), tmp_path / "run", ConsoleReporter(Console(file=buf, width=400)))
    assert ("bf16 on this CPU is emulated" in buf.getvalue()) is not native


@pytest.mark.parametrize(("capability", "refused"), [((7, 5), True), ((7, 0), True), ((8, 0), False), ((9, 0), False)])
def test_bf16_on_a_gpu_needs_bf16_tensor_cores(monkeypatch, capability, refused):
    """torch's is_bf16_supported() says yes on a T4 or V100 (emulation), where Triton's kernels then
    refuse bf16 mid-run: precision bf16 is refused up front, naming the card and what to use."""
    from trainforge.config.run import ConfigError

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    if refused:
        with pytest.raises(ConfigError, match=r"Tesla T4 has no bf16 tensor cores.*use fp16"):
            resolve_precision("bf16", torch.device("cuda"))
    else:
        assert resolve_precision("bf16", torch.device("cuda"))[0].name == "bf16"


def test_the_run_gpu_becomes_the_current_one(monkeypatch):
    """One process on cuda:1: Triton's kernels (Liger, compiled code) and CUDA events launch on the
    current GPU, so configuring the run's backends makes cuda:1 current (cuda:0 stays otherwise)."""
    from torch.cuda._utils import _get_device_index

    current = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: current.append(_get_device_index(d)))  # as torch's: an index
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        hardware.configure_backends(torch.device("cuda", 1))
        hardware.configure_backends(torch.device("cuda"))  # auto's device: no index, nothing to change
        hardware.configure_backends(CPU)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before
    assert current == [1]
