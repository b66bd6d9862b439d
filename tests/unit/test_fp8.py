"""train.fp8: torchao's FP8 linear layers, which layers convert, the refusals, and a run on CPU
(torch emulates the FP8 matmuls there) that trains, checkpoints and exports like a bf16 run."""

from __future__ import annotations

import json

import pytest
import torch
from pydantic import ValidationError
from rich.console import Console
from transformers import AutoModelForCausalLM, LlamaConfig

from trainforge.config.run import RunConfig
from trainforge.config.train import TrainSettings
from trainforge.engine.trainer import train
from trainforge.metrics.console import ConsoleReporter
from trainforge.metrics.tracker import read_metrics
from trainforge.model import fp8 as fp8_module
from trainforge.model.fp8 import FP8Unavailable, apply_fp8, cpu_takes_rowwise_scales, fp8_recipe, resolve_fp8

pytest.importorskip("torchao")
CPU = torch.device("cpu")


def tiny_llama(hidden: int = 32, layers: int = 2) -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, max_position_embeddings=64)
    return AutoModelForCausalLM.from_config(config)


def float8_names(model: torch.nn.Module) -> set[str]:
    from torchao.float8.float8_linear import Float8Linear

    return {name for name, m in model.named_modules() if isinstance(m, Float8Linear)}


@pytest.mark.parametrize("setting, recipe", [(False, None), (True, "tensorwise"), ("tensorwise", "tensorwise"), ("rowwise", "rowwise")])
def test_the_setting_names_a_recipe(setting, recipe):
    assert fp8_recipe(setting) == recipe
    assert fp8_recipe(TrainSettings.model_validate({"fp8": setting}).fp8) == recipe


def test_an_unknown_recipe_is_refused_with_the_choices():
    with pytest.raises(ValidationError, match="rowwise"):
        TrainSettings.model_validate({"fp8": "blockwise"})


def test_every_decoder_linear_layer_converts_but_the_head():
    model = tiny_llama()
    keys = list(model.state_dict())
    assert apply_fp8(model, "tensorwise") == 2 * 7  # q, k, v, o, gate, up, down in each of 2 layers
    names = float8_names(model)
    assert len(names) == 14 and "lm_head" not in names and all(".layers." in n for n in names)
    assert list(model.state_dict()) == keys  # checkpoints and final/ keep their keys


def test_layers_whose_sides_are_not_multiples_of_16_stay_bf16():
    model = tiny_llama(hidden=40)  # 40 is not a multiple of 16; the MLP's 80 is not either
    assert apply_fp8(model, "tensorwise") == 0 and not float8_names(model)


def test_fp8_forward_and_gradients_stay_close_to_bf16():
    """The same weights, bf16 autocast: the FP8 model's loss within 2% and its gradients pointing the same way."""
    ids = torch.randint(0, 96, (4, 32), generator=torch.Generator().manual_seed(1))
    grads, losses = [], []
    recipes = ("tensorwise", "rowwise") if cpu_takes_rowwise_scales() else ("tensorwise",)  # torch 2.11's CPU: per-tensor only
    for recipe in (None, *recipes):
        model = tiny_llama()
        if recipe:
            apply_fp8(model, recipe)
        with torch.autocast("cpu", torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
        grads.append(torch.cat([p.grad.flatten().float() for p in model.parameters()]))
    for loss, grad in zip(losses[1:], grads[1:]):
        assert loss == pytest.approx(losses[0], rel=0.02)
        assert torch.nn.functional.cosine_similarity(grad, grads[0], dim=0) > 0.98


def test_lora_wraps_the_fp8_base_layers():
    from peft import LoraConfig, get_peft_model

    model = tiny_llama()
    apply_fp8(model, "tensorwise")
    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    q = peft_model.base_model.model.model.layers[0].self_attn.q_proj
    assert type(q.base_layer).__name__ == "Float8Linear" and type(q.lora_A["default"]) is torch.nn.Linear
    ids = torch.randint(0, 96, (2, 16))
    with torch.autocast("cpu", torch.bfloat16):
        peft_model(input_ids=ids, labels=ids).loss.backward()
    assert q.lora_B["default"].weight.grad is not None and q.base_layer.weight.grad is None


def test_rowwise_on_a_cpu_whose_torch_lacks_per_row_scales_is_refused(monkeypatch):
    """torch 2.11's CPU scaled matmul asserts per-tensor scales: a rowwise run there would crash at its
    first forward; it is refused with the way out instead."""
    assert isinstance(cpu_takes_rowwise_scales(), bool)
    monkeypatch.setattr(fp8_module, "cpu_takes_rowwise_scales", lambda: False)
    with pytest.raises(FP8Unavailable, match="per-tensor scales only there: set train.fp8: tensorwise"):
        resolve_fp8("rowwise", CPU, torch.bfloat16, "full")
    assert resolve_fp8("tensorwise", CPU, torch.bfloat16, "full") == "tensorwise"


def test_refusals_name_the_setting_and_the_fix(monkeypatch):
    with pytest.raises(FP8Unavailable, match="train.precision: bf16"):
        resolve_fp8(True, CPU, None, "full")
    with pytest.raises(FP8Unavailable, match="train.precision: bf16"):
        resolve_fp8(True, CPU, torch.float16, "full")
    with pytest.raises(FP8Unavailable, match="qlora"):
        resolve_fp8(True, CPU, torch.bfloat16, "qlora")
    with pytest.raises(FP8Unavailable, match="runs on CUDA"):
        resolve_fp8(True, torch.device("mps"), torch.bfloat16, "full")
    assert resolve_fp8(False, CPU, None, "qlora") is None  # off: nothing is checked
    if cpu_takes_rowwise_scales():  # else refused: test_rowwise_on_a_cpu_whose_torch_lacks_per_row_scales_is_refused
        assert resolve_fp8("rowwise", CPU, torch.bfloat16, "lora") == "rowwise"
    monkeypatch.setattr(fp8_module.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FP8Unavailable, match=r"pip install 'trainforge\[gpu\]'"):
        resolve_fp8(True, CPU, torch.bfloat16, "full")


@pytest.mark.parametrize("capability, setting, refused", [
    ((8, 0), True, "compute capability 8.9"), ((8, 9), True, None), ((8, 9), "rowwise", "or tensorwise"), ((9, 0), "rowwise", None),
])
def test_gpus_without_fp8_tensor_cores_are_refused(monkeypatch, capability, setting, refused):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some GPU")
    if refused:
        with pytest.raises(FP8Unavailable, match=refused):
            resolve_fp8(setting, torch.device("cuda"), torch.bfloat16, "full")
    else:
        assert resolve_fp8(setting, torch.device("cuda"), torch.bfloat16, "full") == fp8_recipe(setting)


def test_an_fp8_run_trains_reports_and_exports_plain_weights(finetune_config, tmp_path):
    cfg = dict(finetune_config)
    cfg["train"] = {**cfg["train"], "precision": "bf16", "fp8": True, "max_steps": 6, "compile": False}
    out = tmp_path / "run"
    result = train(RunConfig.model_validate(cfg), out, ConsoleReporter(Console(quiet=True)))
    assert result.summary["fp8"] == "tensorwise (14 linear layers)"
    losses = [r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert losses[-1] < losses[0]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_loss"] < summary["eval_loss_before"]
    reloaded, info = AutoModelForCausalLM.from_pretrained(out / "final", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not float8_names(reloaded)  # final/ is an ordinary model: it loads anywhere


@pytest.mark.parametrize("hardware, problem", [("h100", None), ("l4", None), ("a100", "has no FP8 tensor cores"), ("v100", "precision is fp16")])
def test_plan_shows_fp8_and_refuses_gpus_that_cannot_run_it(finetune_config, hardware, problem):
    from trainforge.tools.plan import make_plan

    cfg = dict(finetune_config)
    cfg["train"] = {**cfg["train"], "precision": "auto", "device": "auto", "fp8": True}
    plan = make_plan(RunConfig.model_validate(cfg), hardware=hardware, time_ops=False)
    (row,) = [d for d in plan["decisions"] if d["setting"] == "fp8"]
    assert row["choice"] == "tensorwise"
    errors = [f["message"] for f in plan["findings"] if f["level"] == "error"]
    assert any(problem in e for e in errors) if problem else not any("fp8" in e for e in errors)
    warned = any("train.fp8 with train.compile: false" in f["message"] for f in plan["findings"] if f["level"] == "warn")
    assert warned == (problem is None and cfg["train"].get("compile") is False)


def backward_matmuls(frozen: bool) -> int:
    """Matmuls in the compiled backward of one FP8 linear layer whose weight is frozen or trained."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    counted = {}

    def count(gm, inputs):
        counted["bw"] = sum(1 for n in gm.graph.nodes if n.op == "call_function" and ("_scaled_mm" in str(n.target) or str(n.target).startswith("aten.mm")))
        return make_boxed_func(gm.forward)

    layer = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False)).to(torch.bfloat16)
    apply_fp8(layer, "tensorwise")
    layer[0].weight.requires_grad_(not frozen)
    compiled = torch.compile(layer, backend=aot_autograd(fw_compiler=lambda gm, _: make_boxed_func(gm.forward), bw_compiler=count))
    compiled(torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)).float().sum().backward()
    return counted["bw"]


def test_compiled_lora_base_layers_drop_the_unused_weight_gradient():
    """Why LoRA under train.fp8 wants compile: eager torchao computes a frozen weight's gradient too; in a
    compiled graph it is dead code (the warning the run gives uncompiled says so)."""
    torch._dynamo.reset()
    assert backward_matmuls(frozen=False) == 2 and backward_matmuls(frozen=True) == 1


def test_uncompiled_lora_under_fp8_is_warned(finetune_config, tmp_path):
    cfg = dict(finetune_config)
    cfg["model"] = {**cfg["model"], "method": "lora"}
    cfg["train"] = {**cfg["train"], "precision": "bf16", "fp8": True, "max_steps": 2, "compile": False}
    console = Console(record=True, width=400)
    train(RunConfig.model_validate(cfg), tmp_path / "run", ConsoleReporter(console))
    assert "it also computes the frozen base layers' weight gradients" in console.export_text()


def test_plan_traces_the_fp8_layers_and_prices_their_matmuls_at_the_fp8_rate(finetune_config):
    from trainforge.engine.predict.timing import _roofline
    from trainforge.engine.predict.trace import trace_training_step
    from trainforge.hardware.device import PRECISIONS
    from trainforge.model.tokenizer import load_tokenizer
    from trainforge.hardware.profiles import find_profile

    cfg = dict(finetune_config)
    cfg["train"] = {**cfg["train"], "precision": "bf16", "fp8": True}
    run_cfg = RunConfig.model_validate(cfg)
    tok = load_tokenizer(run_cfg.model.path)
    trace = trace_training_step(run_cfg, tok, PRECISIONS["bf16"], 2, False, 1, "cuda")
    fp8_matmuls = [op for op in trace.ops if op.dtype == "float8" and op.flops > 0]
    assert len(fp8_matmuls) == 14 * 3  # each converted layer: output, input gradient, weight gradient
    h100, a100 = find_profile("h100"), find_profile("a100")
    assert h100.peak_flops("fp8") == 2 * h100.peak_flops("bf16") and a100.peak_flops("fp8") == a100.peak_flops("bf16")
    op = fp8_matmuls[0]
    assert _roofline(op, h100)[0] == pytest.approx(op.flops / (h100.peak_flops("fp8") * h100.matmul_efficiency))


def test_fp8_layers_follow_cpu_autocast_as_linear_layers_do():
    """torchao casts a layer's input to CUDA's autocast dtype only: on CPU (runs, tests, a plan's fake-tensor
    trace) the input is cast to CPU's, so the activation kept for backward is bf16 as on a GPU, not fp32."""
    fp8 = torch.nn.Sequential(torch.nn.Linear(32, 32))
    assert apply_fp8(fp8, "tensorwise") == 1 and type(fp8[0]).__name__ == "Float8Linear"
    x = torch.randn(4, 32, requires_grad=True)
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        with torch.autocast("cpu", torch.bfloat16):
            assert fp8(x).dtype == torch.bfloat16
        fp8(x)  # no autocast: the input's dtype
    saved_inputs = [t.dtype for t in kept if t.shape == (4, 32)]
    assert saved_inputs == [torch.bfloat16, torch.float32]


def test_plan_warns_that_uncompiled_fp8_runs_its_casts_unfused(finetune_config):
    from trainforge.tools.plan import make_plan

    cfg = dict(finetune_config)
    cfg["train"] = {**cfg["train"], "precision": "auto", "device": "auto", "fp8": True, "compile": False}
    plan = make_plan(RunConfig.model_validate(cfg), hardware="h100", time_ops=False)
    (finding,) = [f for f in plan["findings"] if "train.fp8 with train.compile: false" in f["message"]]
    assert finding["level"] == "warn" and finding["fix"] == "set train.compile: true (or auto)"


def test_token_counts_cuda_refuses_are_padded_to_16_and_cut_back(monkeypatch):
    """CUDA's FP8 matmul needs the weight gradient's inner dimension (the batch's tokens) in multiples of
    16: 3 rows x 5 tokens go in as 16 zero-padded rows; output and every gradient equal the unpadded
    layer's (the CPU emulation, which takes any count, is the reference)."""
    inner = []
    scaled_mm = torch._scaled_mm

    def recording(a, b, *args, **kwargs):
        inner.append(a.shape[1])
        return scaled_mm(a, b, *args, **kwargs)

    x = torch.randn(3, 5, 32, generator=torch.Generator().manual_seed(0))
    results = []
    for pad in (False, True):
        torch.manual_seed(0)
        layer = torch.nn.Sequential(torch.nn.Linear(32, 48))
        apply_fp8(layer, "tensorwise")
        monkeypatch.setattr(fp8_module, "pads_tokens", lambda t, pad=pad: pad)
        monkeypatch.setattr(torch, "_scaled_mm", recording)
        inner.clear()
        xi = x.clone().requires_grad_(True)
        with torch.autocast("cpu", torch.bfloat16):
            out = layer(xi)
        out.float().square().sum().backward()
        monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
        assert out.shape == (3, 5, 48)
        results.append((out.detach().float(), xi.grad, layer[0].weight.grad))
        if pad:
            assert inner and all(n % 16 == 0 for n in inner), inner
        else:
            assert 15 in inner  # the weight gradient contracted over the 15 tokens
    for a, b in zip(*results):
        torch.testing.assert_close(a, b)


def test_a_deep_copy_of_an_fp8_model_computes_with_its_own_weights():
    """A preference run's frozen reference is a deep copy: its FP8 layers must run the copy's weights."""
    import copy

    model = torch.nn.Sequential(torch.nn.Linear(32, 32, bias=False))
    apply_fp8(model, "tensorwise")
    frozen = copy.deepcopy(model)
    with torch.no_grad():
        model[0].weight.zero_()
    x = torch.randn(16, 32)
    assert frozen(x).abs().sum() > 0 and model(x).abs().sum() == 0
