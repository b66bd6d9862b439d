"""QLoRA of the routed experts (model/nf4_experts.py): their 3-D weights in NF4, computed one weight per GEMM, with
the experts' LoRA as factors; the same function as LoRA on the dequantized weights."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("bitsandbytes")

from test_lora_experts import FAMILIES, adapted, assert_same_function  # noqa: E402

from trainforge.config.run import ConfigError, RunConfig  # noqa: E402
from trainforge.model.experts_forward import GROUPED_NAME, NF4_STASH  # noqa: E402
from trainforge.model.load import build_model, weight_storage  # noqa: E402
from trainforge.model.moe import expert_modules  # noqa: E402
from trainforge.model.nf4_experts import quantize_experts, round_experts_through_nf4  # noqa: E402
from trainforge.tools.plan import VocabOnly  # noqa: E402


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_nf4_experts_equal_lora_on_their_dequantized_weights(arch):
    """The reference is what ``export --merge`` builds for a QLoRA run: the experts rounded through NF4."""
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(2))
    quantized, reference = adapted(arch, fused=True), adapted(arch, fused=True)
    assert quantize_experts(quantized) == 4
    assert round_experts_through_nf4(reference) == 4  # what export --merge merges the adapters into
    for module in expert_modules(quantized):
        for name in getattr(module, NF4_STASH):
            weight = getattr(module, name)
            assert weight.untyped_storage().nbytes() <= 4 and weight.quant_state is not None  # nothing held but bytes
        assert module.config._experts_implementation == GROUPED_NAME
    assert_same_function(quantized, reference, ids)


def test_no_dequantized_weight_is_kept_for_backward():
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(2))
    model = adapted("qwen3_moe", fused=True)
    shapes = {tuple(p.shape) for p in model.parameters() if p.ndim == 3}
    quantize_experts(model)
    kept = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.ndim == 3 and tuple(t.shape) in shapes | {tuple(s[:1]) + tuple(s[:0:-1]) for s in shapes}:
            kept.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, use_cache=False).logits.sum().backward()
    assert not kept


def test_another_experts_implementation_is_refused_and_peft_forward_is_not_taken_on_4bit_experts():
    model = adapted("qwen3_moe", fused=True)
    model.base_model.model.set_experts_implementation("eager")
    with pytest.raises(ConfigError, match="model.experts_implementation: eager cannot run 4-bit experts"):
        quantize_experts(model)
    model = adapted("qwen3_moe", fused=True)
    quantize_experts(model)
    with pytest.raises(Exception, match="4-bit .QLoRA."):
        with model.disable_adapter():  # PEFT's own forward would read the placeholders' zeros
            model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=False)


def test_a_qlora_moe_directory_loads_with_every_expert_in_nf4(tmp_path):
    """``model.method: qlora`` on a saved MoE: bitsandbytes quantizes the linear layers, trainforge the experts; the
    weight facts count both as nf4, and a step trains the adapters."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    config = CONFIG_MAPPING["qwen3_moe"](vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2,
                                         **FAMILIES["qwen3_moe"])
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "moe")
    (tmp_path / "moe" / "tokenizer_config.json").write_text("{}")
    (tmp_path / "d.jsonl").write_text('{"text": "a"}\n')
    cfg = RunConfig.model_validate({"model": {"path": str(tmp_path / "moe"), "method": "qlora"},
                                    "data": {"train": str(tmp_path / "d.jsonl")}})
    model = build_model(cfg.model, VocabOnly(64), seed=0, compute_dtype=torch.bfloat16)
    assert model.trainforge_nf4_experts == 4
    frozen = weight_storage(model)["frozen"]
    experts = sum(p.quant_state.shape.numel() for m in expert_modules(model) for p in m.parameters(recurse=False) if p.ndim == 3)
    assert frozen.get("nf4", 0) >= experts > 0
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    grads = [n for n, p in model.named_parameters() if p.grad is not None]
    assert grads and all("lora_" in n for n in grads) and any(".experts." in n for n in grads)
