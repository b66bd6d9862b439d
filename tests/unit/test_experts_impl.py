"""model.experts_implementation: each of transformers' experts implementations trains the same function as eager
(loss and gradients) on a tiny MoE on CPU; auto's choice per device and dtype; the choice is said and recorded."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from trainforge.config.run import RunConfig
from trainforge.model.experts_impl import choose, current
from trainforge.model.load import build_model
from trainforge.tools.plan import VocabOnly

INIT = {"architecture": "qwen2_moe", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
        "moe_intermediate_size": 16, "shared_expert_intermediate_size": 24, "num_experts": 8, "num_experts_per_tok": 2,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128}
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}  # (loss, gradients) relative


def checkpoint(tmp_path):
    """INIT saved as a checkpoint directory (LoRA adapts a pretrained model), with a stand-in tokenizer file."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    path = tmp_path / "moe"
    if not path.exists():
        torch.manual_seed(0)
        fields = {k: v for k, v in INIT.items() if k != "architecture"}
        AutoModelForCausalLM.from_config(CONFIG_MAPPING[INIT["architecture"]](**fields)).save_pretrained(path)
        (path / "tokenizer_config.json").write_text("{}")
    return path


def loss_and_grads(experts: str, method: str, dtype: torch.dtype, tmp_path) -> tuple[float, dict[str, torch.Tensor]]:
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "a"}\n')
    source = {"init": INIT} if method == "full" else {"path": str(checkpoint(tmp_path))}
    cfg = RunConfig.model_validate({"model": {**source, "method": method, "experts_implementation": experts},
                                    "data": {"train": str(data)}})
    model = build_model(cfg.model, VocabOnly(64), seed=0)
    assert current(model) == experts
    if method == "full":
        model.to(dtype)
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(1))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.item(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("method, dtype", [("full", torch.float32), ("full", torch.bfloat16), ("lora", torch.float32)])
@pytest.mark.parametrize("experts", ["batched_mm", "grouped_mm"])
def test_each_implementation_matches_eager(tmp_path, experts, method, dtype):
    ref_loss, ref = loss_and_grads("eager", method, dtype, tmp_path)
    loss, grads = loss_and_grads(experts, method, dtype, tmp_path)
    tol_loss, tol_grad = TOLERANCE[dtype]
    assert loss == pytest.approx(ref_loss, rel=tol_loss)
    assert grads.keys() == ref.keys()
    assert any("experts" in n for n in grads)  # the routed experts' weights (full) or their adapters (lora) train
    for name, g in grads.items():
        scale = ref[name].abs().max().clamp_min(1e-12)
        assert (g - ref[name]).abs().max() / scale < tol_grad, name


def test_auto_takes_grouped_mm_where_the_kernel_serves_and_eager_where_it_does_not():
    assert choose("auto", "cpu", torch.float32)[0] == "grouped_mm"
    assert choose("auto", "cpu", torch.bfloat16)[0] == "grouped_mm"
    assert choose("auto", "cuda", torch.bfloat16, (9, 0))[0] == "grouped_mm"
    assert choose("auto", "cuda", torch.float32, (9, 0))[0] == "eager"  # fp32 masters: autocast's bf16 in eager
    assert choose("auto", "cuda", torch.bfloat16, (7, 5))[0] == "eager"  # before Ampere: no grouped kernel
    assert choose("auto", "mps", torch.bfloat16)[0] == "eager"
    assert choose("batched_mm", "cuda", torch.float32, (9, 0)) == ("batched_mm", "model.experts_implementation")


def test_the_choice_is_on_the_console_and_in_the_summary(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"alpha beta gamma delta {i} epsilon zeta"}) + "\n" for i in range(16)))
    config = tmp_path / "c.yaml"
    config.write_text(json.dumps({"model": {"init": {k: v for k, v in INIT.items() if k != "vocab_size"},
                                            "experts_implementation": "eager", "tokenizer": "char"},
                                  "data": {"train": str(data), "max_length": 32},
                                  "train": {"max_steps": 1, "compile": False, "micro_batch_size": 2}}))
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "trainforge", "train", str(config), "--output", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "experts eager (model.experts_implementation)" in done.stdout + done.stderr
    assert json.loads((out / "summary.json").read_text())["experts_implementation"] == "eager"


def test_auto_on_a_gpu_runs_fp32_masters_under_bf16_autocast_on_the_grouped_kernel():
    """A full fine-tune's fp32 expert weights: torch's grouped GEMM takes bf16 only and is no autocast op, so auto
    ran them one linear per expert; under bf16 autocast trainforge's grouped path casts as autocast does."""
    from trainforge.model.experts_forward import GROUPED_NAME

    assert choose("auto", "cuda", torch.float32, (9, 0), torch.bfloat16)[0] == GROUPED_NAME
    assert "autocast's bf16 copies" in choose("auto", "cuda", torch.float32, None, torch.bfloat16)[1]
    assert choose("auto", "cuda", torch.float32, (9, 0), None)[0] == "eager"  # fp32 run: nothing to cast to
    assert choose("auto", "cuda", torch.float32, (9, 0), torch.float16)[0] == "eager"
    assert choose("auto", "cuda", torch.float32, (7, 5), torch.bfloat16)[0] == "eager"
    assert choose("auto", "cpu", torch.float32, None, torch.bfloat16)[0] == "grouped_mm"  # CPU: as before


def test_the_grouped_path_under_autocast_equals_eager_under_autocast(monkeypatch):
    """The GPU branch checked on the CPU (``CAST_DEVICES`` given the CPU): fp32 expert weights under bf16 autocast,
    trainforge's grouped path against transformers' eager loop under the same autocast: the same loss and gradients
    to bf16 tolerance, and every grouped GEMM was handed bf16 operands."""
    import trainforge.model.experts_forward as ef
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    from trainforge.model.experts_impl import use_experts_implementation

    monkeypatch.setattr(ef, "CAST_DEVICES", ("cuda", "cpu"))
    seen: list[tuple[torch.dtype, torch.dtype]] = []
    grouped = ef._grouped_mm
    monkeypatch.setattr(ef, "_grouped_mm", lambda rows, w, off: seen.append((rows.dtype, w.dtype)) or grouped(rows, w, off))
    fields = {k: v for k, v in INIT.items() if k != "architecture"}
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(1))
    results = {}
    for name in ("eager", ef.GROUPED_NAME):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(CONFIG_MAPPING[INIT["architecture"]](**fields))
        assert use_experts_implementation(model, name, torch.device("cpu"))[0] == name
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results[name] = loss.item(), {n: p.grad.float() for n, p in model.named_parameters() if "experts" in n}
    assert seen and all(dtypes == (torch.bfloat16, torch.bfloat16) for dtypes in seen)
    (ref_loss, ref), (loss, grads) = results["eager"], results[ef.GROUPED_NAME]
    assert loss == pytest.approx(ref_loss, rel=TOLERANCE[torch.bfloat16][0])
    assert grads.keys() == ref.keys() and grads
    for name, g in grads.items():
        assert g.dtype == torch.float32  # the fp32 masters get their gradient through the cast
        assert (g - ref[name]).abs().max() / ref[name].abs().max().clamp_min(1e-12) < TOLERANCE[torch.bfloat16][1], name
