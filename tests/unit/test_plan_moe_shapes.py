"""plan for published mixture-of-experts shapes on GPU profiles, from their config.json values written offline
(nothing downloaded): parameter counts against the published totals, and the fit answer with its advice."""

from __future__ import annotations

import json

import pytest

from trainforge.config.run import RunConfig
from trainforge.engine.predict.fit import predict_memory
from trainforge.hardware.device import PRECISIONS
from trainforge.hardware.profiles import GIB, find_profile
from trainforge.tools.plan import VocabOnly
from trainforge.tools.plan_moe import moe_facts, no_fit_fix

QWEN3_30B_A3B = {  # Qwen/Qwen3-30B-A3B config.json
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048, "head_dim": 128,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
    "norm_topk_prob": True, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "max_position_embeddings": 40960, "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-06, "router_aux_loss_coef": 0.001, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "vocab_size": 151936, "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu",
}
MIXTRAL_8X7B = {  # mistralai/Mixtral-8x7B-v0.1 config.json
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
    "num_local_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-05,
    "router_aux_loss_coef": 0.02, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 32000,
    "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "sliding_window": None,
}
PUBLISHED = {"qwen3": (QWEN3_30B_A3B, 30.5e9, 3.3e9), "mixtral": (MIXTRAL_8X7B, 46.7e9, 12.9e9)}


def run_config(tmp_path, name: str, method: str) -> RunConfig:
    fields = PUBLISHED[name][0]
    model = tmp_path / name
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(fields))
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "alpha beta"}\n')
    return RunConfig.model_validate({"model": {"path": str(model), "method": method},  # plan: config.json only
                                     "data": {"train": str(data), "max_length": 2048}}, context={"plan": True})


@pytest.mark.parametrize("name", ["qwen3", "mixtral"])
def test_parameter_counts_are_the_published_ones(tmp_path, name):
    cfg = run_config(tmp_path, name, "lora")
    fields, total, active = PUBLISHED[name]
    facts = moe_facts(cfg, VocabOnly(fields["vocab_size"]), PRECISIONS["bf16"], find_profile("h100"))
    assert facts["total_parameters"] == pytest.approx(total, rel=0.03)
    assert facts["active_parameters"] == pytest.approx(active, rel=0.03)
    assert facts["expert_dtype"] == "bfloat16" and facts["experts_implementation"] == "grouped_mm"


def one_row(cfg: RunConfig, name: str, hardware: str):
    """The smallest step the plan can offer: one row of 2048 tokens with activation checkpointing."""
    tok, profile = VocabOnly(PUBLISHED[name][0]["vocab_size"]), find_profile(hardware)
    return predict_memory(cfg, tok, PRECISIONS["bf16"], profile, 1, True), tok, profile


def test_qwen3_30b_a3b_lora_fits_an_h100(tmp_path):
    cfg = run_config(tmp_path, "qwen3", "lora")
    memory, _, _ = one_row(cfg, "qwen3", "h100")
    assert memory.fits()
    assert memory.parts["weights"] / GIB == pytest.approx(30.5e9 * 2 / GIB, rel=0.05)  # every expert, in bf16


@pytest.mark.parametrize("name, hardware", [("qwen3", "rtx4090"), ("mixtral", "a100-80gb")])
def test_qlora_of_an_moe_holds_its_experts_in_nf4(tmp_path, name, hardware):
    """QLoRA quantizes the routed experts too (model/nf4_experts.py): the plan prices them at NF4's ~4.1 bits, plus
    one expert weight dequantized at a time. Mixtral-8x7B then fits an A100 80GB (its experts were 84 GiB in bf16);
    Qwen3-30B-A3B at one row of 2048 tokens is just past a 24 GB card."""
    cfg = run_config(tmp_path, name, "qlora")
    memory, tok, profile = one_row(cfg, name, hardware)
    facts = moe_facts(cfg, tok, PRECISIONS["bf16"], profile)
    assert facts["expert_dtype"] == "nf4"
    assert facts["expert_bytes"] == pytest.approx(facts["expert_parameters"] * 0.5156, rel=0.01)
    assert facts["expert_bytes"] < memory.parts["weights"] < facts["expert_bytes"] + 0.3 * facts["expert_parameters"]
    if name == "mixtral":
        assert memory.fits()
    else:
        assert not memory.fits() and memory.process < 1.15 * memory.capacity  # 69.4 GiB with its experts in bf16
    assert no_fit_fix(facts, profile.memory_bytes) is None  # the experts alone no longer exceed the card

def test_a_qlora_run_that_does_not_fit_is_not_told_to_use_qlora(tmp_path):
    from trainforge.tools.plan import make_plan

    cfg = run_config(tmp_path, "qwen3", "qlora").model_copy(deep=True)
    cfg.train.micro_batch_size, cfg.train.activation_checkpointing = 1, True
    plan = make_plan(cfg, hardware="rtx4090", time_ops=False)
    errors = [f for f in plan["findings"] if f["level"] == "error" and "exceeds" in f["message"]]
    assert errors and "lower data.max_length" in errors[0]["fix"] and "qlora" not in errors[0]["fix"], errors
