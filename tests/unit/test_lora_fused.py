"""Fused LoRA layers (model/lora_fused.py): PEFT's function and files, without PEFT's input copies."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from trainforge.config.run import LoraSettings
from trainforge.model.load import apply_lora
from trainforge.model.lora_fused import fused_class, lora_layer_classes

TOKENS = 64


def llama(seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=TOKENS)
    return AutoModelForCausalLM.from_config(config).to(dtype)


def pair(settings: LoraSettings, dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The same adapted model twice: with fused layers, and on PEFT's own forward. lora_B is random (PEFT
    starts it at zero, which would hide the update)."""
    fused = apply_lora(llama(dtype=dtype), settings)
    torch.manual_seed(1)
    for name, param in fused.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.2)
        if param.requires_grad:
            param.data = param.data.float()  # as the trainer keeps adapters: fp32 (adapt())
    plain = copy.deepcopy(fused)
    for module in plain.modules():
        if type(module).__name__.startswith("Fused"):
            module.__class__ = type(module).__mro__[1]  # PEFT's class back
    return fused, plain


def step(model: torch.nn.Module, ids: torch.Tensor, autocast: torch.dtype | None = None, seed: int = 7):
    """Loss and adapter gradients of one forward/backward (the dropout RNG seeded alike)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach().float(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


IDS = torch.randint(0, 96, (2, TOKENS), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_fp32_equals_peft_forward_value_and_gradients(dropout):
    fused, plain = pair(LoraSettings(r=4, alpha=8, dropout=dropout))
    assert sum(type(m).__name__.startswith("Fused") for m in fused.modules()) == 14  # 7 linears x 2 layers
    assert fused.trainforge_lora_fused == 14
    (loss_f, grads_f), (loss_p, grads_p) = step(fused, IDS), step(plain, IDS)
    torch.testing.assert_close(loss_f, loss_p, rtol=1e-6, atol=1e-6)
    for name, grad in grads_p.items():
        torch.testing.assert_close(grads_f[name], grad, rtol=1e-5, atol=1e-6)


def test_under_bf16_autocast_as_close_to_fp32_as_peft_and_keeps_less_for_backward():
    """Under autocast PEFT copies each layer's input to fp32 and its lora_A keeps a bf16 copy of that: the
    fused layer keeps the base's input itself. Its result is no further from the fp32 computation."""
    fused, plain = pair(LoraSettings(r=4, alpha=8), dtype=torch.bfloat16)
    reference = copy.deepcopy(plain).float()
    loss_ref, grads_ref = step(reference, IDS)
    loss_f, grads_f = step(fused, IDS, torch.bfloat16)
    loss_p, grads_p = step(plain, IDS, torch.bfloat16)

    def error(grads):
        return sum(((grads[n] - g).norm() / g.norm()).item() for n, g in grads_ref.items()) / len(grads_ref)

    assert abs(loss_f - loss_ref) <= abs(loss_p - loss_ref) + 2e-3
    assert error(grads_f) <= error(grads_p) * 1.1 + 1e-3
    assert saved_bytes(fused, IDS) < saved_bytes(plain, IDS)


def saved_bytes(model: torch.nn.Module, ids: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd keeps for backward in one bf16-autocast forward."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=ids, labels=ids).loss
    return sum(seen.values())


def test_what_the_fused_path_does_not_cover_runs_peft_forward():
    """DoRA layers, adapters switched off (a preference run's reference) and merged weights give PEFT's results."""
    fused, plain = pair(LoraSettings(r=4, alpha=8, use_dora=True))
    torch.testing.assert_close(step(fused, IDS)[0], step(plain, IDS)[0], rtol=1e-6, atol=1e-6)
    fused, plain = pair(LoraSettings(r=4, alpha=8))
    with torch.no_grad():
        with fused.disable_adapter(), plain.disable_adapter():
            torch.testing.assert_close(fused(input_ids=IDS).logits, plain(input_ids=IDS).logits)
        fused.merge_adapter()
        plain.merge_adapter()
        torch.testing.assert_close(fused(input_ids=IDS).logits, plain(input_ids=IDS).logits, rtol=1e-5, atol=1e-5)


def test_a_peft_release_that_flags_dora_in_use_dora_runs_peft_forward(monkeypatch):
    """PEFT before 0.15 marked DoRA in ``use_dora`` (no ``lora_variant``): such a layer is not fused."""
    fused, _ = pair(LoraSettings(r=4, alpha=8))
    layer = next(m for m in fused.modules() if type(m).__name__.startswith("Fused"))
    peft_calls = []
    monkeypatch.setattr(type(layer), "_peft_forward", lambda self, x, *a, **k: peft_calls.append(self) or self.base_layer(x))
    with torch.no_grad():
        layer(torch.randn(2, 32))
        layer.use_dora = {"default": True}
        layer(torch.randn(2, 32))
    assert peft_calls == [layer]


def base_calls(model: torch.nn.Module) -> list[int]:
    """A counter of the base layers' forwards under the LoRA layers of ``model``."""
    calls = [0]
    for module in model.modules():
        if type(module).__name__.startswith("Fused"):
            module.base_layer.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def test_mixed_dtypes_without_autocast_take_peft_casts():
    """A bf16 base under fp32 adapters with no autocast (how generate may call a model): PEFT's casts apply,
    and each base layer runs once."""
    fused, plain = pair(LoraSettings(r=4, alpha=8), dtype=torch.bfloat16)
    calls = base_calls(fused)
    with torch.no_grad():
        torch.testing.assert_close(fused(input_ids=IDS).logits, plain(input_ids=IDS).logits)
    assert calls[0] == 14


def test_fused_false_keeps_peft_layers_and_the_adapter_files_are_peft_s(tmp_path):
    from peft import PeftModel

    off = apply_lora(llama(), LoraSettings(r=4, alpha=8, fused=False))
    assert not any(type(m).__name__.startswith("Fused") for m in off.modules())
    fused, _ = pair(LoraSettings(r=4, alpha=8))
    fused.save_pretrained(tmp_path / "adapter")
    loaded = PeftModel.from_pretrained(llama(), tmp_path / "adapter")
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=IDS).logits, fused(input_ids=IDS).logits, rtol=1e-5, atol=1e-5)
    assert all(isinstance(m, cls) for m in fused.modules() for cls in lora_layer_classes() if type(m) is fused_class(cls))


def test_a_deep_copy_uses_its_own_adapters():
    """A frozen reference copy (DPO with a full copy) must not read the trained model's weights."""
    fused, _ = pair(LoraSettings(r=4, alpha=8))
    frozen = copy.deepcopy(fused)
    with torch.no_grad():
        before = frozen(input_ids=IDS).logits.clone()
        for name, param in fused.named_parameters():
            if "lora_B" in name:
                param.add_(1.0)
        torch.testing.assert_close(frozen(input_ids=IDS).logits, before)
        assert not torch.allclose(fused(input_ids=IDS).logits, before)


def test_qlora_4bit_layers_are_fused_and_match_peft(tiny_model_dir):
    """QLoRA's 4-bit base (bitsandbytes' CPU backend here): the adapted layers are fused and give PEFT's
    loss and adapter gradients under bf16 autocast, as the trainer runs them, running each base layer once."""
    pytest.importorskip("bitsandbytes")
    from trainforge.config.run import ModelSettings
    from trainforge.model.load import build_model
    from trainforge.model.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    fused = build_model(ModelSettings(path=tiny_model_dir, method="qlora", lora=LoraSettings(r=4, alpha=8)), tok, seed=0,
                        compute_dtype=torch.bfloat16)
    kinds = {type(m).__name__ for m in fused.modules() if type(m).__name__.startswith("Fused")}
    assert kinds == {"FusedLinear4bit"}
    torch.manual_seed(1)
    for name, param in fused.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.2)
    plain = copy.deepcopy(fused)
    for module in plain.modules():
        if type(module).__name__.startswith("Fused"):
            module.__class__ = type(module).__mro__[1]
    ids = IDS % len(tok)
    calls = base_calls(fused)
    (loss_f, grads_f), (loss_p, grads_p) = step(fused, ids, torch.bfloat16), step(plain, ids, torch.bfloat16)
    assert calls[0] == 14  # once each, also where the 4-bit base answers in fp32 (its input's dtype after fp32 norms)
    torch.testing.assert_close(loss_f, loss_p, rtol=2e-2, atol=2e-2)
    for name, grad in grads_p.items():
        assert ((grads_f[name] - grad).norm() / grad.norm()).item() < 0.05, name
