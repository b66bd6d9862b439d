"""optim.name / optim.offload: what runs where, state bytes against plan's figures, exact resume."""

from __future__ import annotations

import copy
import importlib.util
import io
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from rich.console import Console

from trainforge.config.run import OptimSettings, RunConfig
from trainforge.engine import optim as optim_module
from trainforge.engine import trainer
from trainforge.engine.optim import (
    OptimizerUnavailable, build_optimizer, check_optimizer, measured_state_bytes, optimizer_state_bytes,
)
from trainforge.metrics.console import ConsoleReporter

CPU_RUNNABLE = ["adamw", "adamw_8bit", "paged_adamw_8bit", "paged_adamw", "adamw_4bit"]  # all run on a CPU here
needs_libraries = pytest.mark.skipif(
    importlib.util.find_spec("bitsandbytes") is None or importlib.util.find_spec("torchao") is None,
    reason="needs bitsandbytes and torchao (the test extra installs both)",
)


def test_offload_takes_adamw_only():
    with pytest.raises(ValidationError, match="optim.offload: cpu runs torch's AdamW on the host; optim.name is adamw_8bit"):
        OptimSettings(name="adamw_8bit", offload="cpu")
    with pytest.raises(ValidationError):
        OptimSettings(name="sgd")


@pytest.mark.parametrize(
    "settings, device, mode, match",
    [
        (dict(offload="cpu"), "cpu", None, "this run is on cpu, where it already lives in host memory"),
        (dict(offload="cpu"), "cuda", "ddp", "optim.offload: cpu is for one GPU"),
        (dict(name="adamw_8bit"), "cuda", "fsdp", "does not take FSDP2's sharded parameters"),
        (dict(name="paged_adamw"), "cpu", "fsdp", "does not take FSDP2's sharded parameters"),
    ],
)
def test_what_cannot_run_is_refused_naming_the_setting(settings, device, mode, match):
    with pytest.raises(OptimizerUnavailable, match=match) as e:
        check_optimizer(OptimSettings(**settings), device, mode)
    assert e.value.exit_code == 2


def test_what_can_run_passes():
    check_optimizer(OptimSettings(name="adamw_4bit"), "cuda", "fsdp")  # torchao's states take DTensors
    check_optimizer(OptimSettings(name="adamw_8bit"), "cpu", "ddp")
    check_optimizer(OptimSettings(offload="cpu"), "cuda", None)


def test_a_missing_library_names_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    with pytest.raises(OptimizerUnavailable, match=r"needs bitsandbytes: pip install 'trainforge\[lowmem\]'"):
        check_optimizer(OptimSettings(name="adamw_8bit"), "cpu", None)


@needs_libraries
@pytest.mark.parametrize("name", CPU_RUNNABLE)
def test_state_bytes_match_plan_within_15_percent(name):
    """One step of each optimizer on a tiny Llama (tensors above and below the 4,096-value threshold):
    the state it allocates equals what plan predicts (``optimizer_state_bytes``) within 15%."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256,
                                                         num_hidden_layers=2, num_attention_heads=4))
    settings = OptimSettings(name=name)
    opt = build_optimizer(model, settings, torch.device("cpu"))
    ids = torch.randint(0, 512, (2, 32))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    predicted, host = optimizer_state_bytes([p for p in model.parameters() if p.requires_grad], settings)
    measured = measured_state_bytes(opt)
    assert host == 0 and abs(predicted / measured - 1) < 0.15, (predicted, measured)
    if name != "adamw":  # the low-bit states are what they claim: well under AdamW's 8 bytes a value
        values = sum(p.numel() for p in model.parameters())
        assert measured < (4.5 if "8bit" in name else 2.5 if "4bit" in name else 9) * values


@needs_libraries
@pytest.mark.parametrize("name", ["adamw_8bit", "paged_adamw_8bit", "paged_adamw", "adamw_4bit"])
def test_a_checkpoint_resumes_exactly_with_each_optimizer(name, finetune_config, tmp_path, monkeypatch):
    """Stopped after step 4 and resumed: the same weights and optimizer state as the uninterrupted run
    (all three are deterministic on a CPU)."""
    cfg = copy.deepcopy(finetune_config)
    cfg["train"]["max_steps"] = 6
    cfg["optim"]["name"] = name
    cfg["checkpoint"] = {"every_steps": 2, "keep_last": 5}
    run = lambda out: trainer.train(RunConfig.model_validate(cfg), out, ConsoleReporter(Console(file=io.StringIO())))  # noqa: E731
    whole = tmp_path / "whole"
    run(whole)
    cut = tmp_path / "cut"
    original = trainer.forward_backward_adaptive

    class Crash(BaseException):
        """The process dying in step 5: nothing in trainforge catches it."""

    def crashing(r, *args, **kwargs):
        if r.step + 1 == 5:
            raise Crash
        return original(r, *args, **kwargs)

    monkeypatch.setattr(trainer, "forward_backward_adaptive", crashing)
    with pytest.raises(Crash):
        run(cut)
    monkeypatch.setattr(trainer, "forward_backward_adaptive", original)
    resumed = run(cut)
    assert resumed.summary["resumed_from_step"] == 4
    a = torch.load(whole / "checkpoints" / "step-00000006" / "state.pt", weights_only=True)
    b = torch.load(cut / "checkpoints" / "step-00000006" / "state.pt", weights_only=True)
    for k, v in a["model"].items():
        assert torch.equal(v, b["model"][k]), k
    from trainforge.engine.nonfinite import checkpoint_tensors

    got = dict(checkpoint_tensors(b))
    for key, v in checkpoint_tensors(a):  # every tensor, through bitsandbytes' nested dicts and torchao's subclasses
        w = got[key]
        if not torch.is_tensor(v):  # step counts kept as numbers
            assert v == w, (name, key)
            continue
        if type(v) is not torch.Tensor and hasattr(v, "dequantize"):
            v, w = v.dequantize(), w.dequantize()
        assert torch.equal(v, w), (name, key)
    assert any("optimizer state" in key for key, _ in checkpoint_tensors(a))


class OffloadedLikeTorchao:
    """The parts of torchao's CPUOffloadOptimizer (CUDA-only) the engine touches: no ``defaults`` and no
    ``state`` of its own (it never calls Optimizer.__init__), one host AdamW per large tensor in
    ``optim_dict``, and ``d_opt`` None when no tensor is small enough to stay on the device."""

    def __init__(self, params):
        self.optim_dict = {p: torch.optim.AdamW([p], lr=0.1) for p in params}
        self.d_opt = None

    def step(self):
        for opt in self.optim_dict.values():
            opt.step()


def test_an_offloaded_optimizer_steps_skips_and_counts_its_state():
    """optim.offload: cpu crashed at the first step (``optimizer.defaults``) and at the summary (``state``
    of a d_opt that is None when every tensor is offloaded)."""
    from trainforge.engine.nonfinite import skip_update_if

    w = torch.nn.Parameter(torch.ones(64, 64))
    opt = OffloadedLikeTorchao([w])
    w.grad = torch.ones_like(w)
    skip_update_if(opt, torch.tensor(True))
    assert torch.equal(w.detach(), torch.ones(64, 64))  # skipped: untouched
    skip_update_if(opt, torch.tensor(False))
    assert not torch.equal(w.detach(), torch.ones(64, 64))
    assert measured_state_bytes(opt) == 2 * 64 * 64 * 4  # exp_avg and exp_avg_sq, fp32 (step counts left out)


class CopiedEvent:
    def synchronize(self) -> None:
        pass


def test_clipping_reaches_the_host_copies_an_offloaded_optimizer_steps_with():
    """CPUOffloadOptimizer's backward hook copied the gradient to the host before the clip scaled the device
    one: its host AdamW stepped with unclipped gradients. The host copies now get the same coefficient."""
    from trainforge.engine.optim import clip_gradients

    w = torch.nn.Parameter(torch.zeros(4, 4))
    w.grad = torch.full((4, 4), 3.0)  # norm 12
    opt = OffloadedLikeTorchao([])
    host = torch.zeros(4, 4)
    host.grad = w.grad.clone()  # what the hook copied during backward
    opt.device, opt.stream, opt.param_d2h_map, opt.queue = "cpu", torch.cpu.Stream(), {w: host}, {w: CopiedEvent()}
    norm = clip_gradients([w], opt, 1.0)
    assert float(norm) == pytest.approx(12.0)
    assert float(w.grad.norm()) == pytest.approx(1.0, rel=1e-4) and torch.allclose(host.grad, w.grad)
    host.grad = w.grad.clone()
    clip_gradients([w], opt, None)  # no clipping asked: nothing scaled
    assert torch.equal(host.grad, w.grad)
