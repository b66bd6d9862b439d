"""plan on mixture-of-experts models: the traced step (static balanced routing, engine/predict/moe.py) against a
real CPU step's live-tensor peak, in every precision and experts implementation, and its FLOPs the routed ones only."""

from __future__ import annotations

import pytest
import torch

from test_plan import real_step_peak
from trainforge.config.run import RunConfig
from trainforge.engine.predict.timing import predict_step_time
from trainforge.engine.predict.trace import _trace, trace_training_step
from trainforge.hardware.profiles import find_profile
from trainforge.hardware.device import PRECISIONS
from trainforge.metrics.flops import linear_params
from trainforge.model.load import build_model
from trainforge.tools.plan import VocabOnly

VOCAB, ROWS, LENGTH = 64, 4, 64
SHAPE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=128, num_experts_per_tok=2)
FAMILIES = {
    "qwen3_moe": dict(num_experts=8, moe_intermediate_size=16, intermediate_size=48),
    "qwen2_moe": dict(num_experts=8, moe_intermediate_size=16, shared_expert_intermediate_size=24, intermediate_size=48),
    "olmoe": dict(num_experts=8, intermediate_size=16),
    "mixtral": dict(num_local_experts=8, intermediate_size=16),
}


def moe_dir(tmp_path, arch: str, **fields) -> str:
    """A tiny random checkpoint of ``arch`` saved in bf16 (as published ones are)."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    torch.manual_seed(0)
    config = CONFIG_MAPPING[arch](vocab_size=VOCAB, **SHAPE, **FAMILIES[arch], **fields)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    path = tmp_path / arch
    model.save_pretrained(path)
    (path / "tokenizer_config.json").write_text("{}")  # a model directory has tokenizer files; none is read here
    return str(path)


def run_config(tmp_path, arch: str, method: str, from_dir: bool, experts: str = "auto", **model) -> RunConfig:
    """``from_dir``: a bf16 checkpoint directory (its tokenizer: a stand-in file; plan and the step read only its size)."""
    source = {"path": moe_dir(tmp_path, arch)} if from_dir else {
        "init": {"architecture": arch, "vocab_size": VOCAB, **SHAPE, **FAMILIES[arch]}}
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "alpha beta"}\n')
    return RunConfig.model_validate({
        "model": {**source, "method": method, "experts_implementation": experts, **model},
        "data": {"train": str(data), "max_length": LENGTH},
    })


@pytest.mark.parametrize("arch, method, precision, checkpointing, from_dir, experts", [
    ("qwen3_moe", "full", "fp32", False, False, "auto"),
    ("qwen2_moe", "lora", "bf16", False, True, "auto"),  # shared expert; LoRA on the 3-D experts too
    ("olmoe", "full", "bf16", True, False, "auto"),
    ("mixtral", "lora", "fp32", True, True, "auto"),
    ("qwen3_moe", "full", "bf16", False, False, "eager"),  # eager under autocast: bf16 copies of expert weights
    ("qwen3_moe", "lora", "fp32", False, True, "batched_mm"),  # traced as transformers runs it
])
def test_traced_moe_peak_matches_a_real_step(tmp_path, arch, method, precision, checkpointing, from_dir, experts):
    cfg = run_config(tmp_path, arch, method, from_dir, experts)
    cfg.train.activation_checkpointing = checkpointing
    tok, prec = VocabOnly(VOCAB), PRECISIONS[precision]
    predicted = trace_training_step(cfg, tok, prec, ROWS, checkpointing)
    measured, parts = real_step_peak(cfg, tok, prec, ROWS)
    assert predicted.parts["weights"] == parts["weights"]  # every expert held, in its real dtype
    assert predicted.parts["optimizer"] == parts["optimizer"]
    assert abs(predicted.peak / measured - 1) < 0.15, (predicted.parts, parts)


@pytest.mark.parametrize("experts, precision", [
    ("auto", "fp32"), ("grouped_mm", "bf16"), ("grouped_mm", "fp16"), ("eager", "fp16"), ("batched_mm", "bf16")])
def test_every_precision_and_implementation_traces(tmp_path, precision, experts):
    cfg = run_config(tmp_path, "qwen3_moe", "full", False, experts)
    trace = trace_training_step(cfg, VocabOnly(VOCAB), PRECISIONS[precision], 2, False)
    assert trace.peak > 0 and trace.flops > 0


def matmul_flops(trace) -> float:
    return sum(o.flops for o in trace.ops if o.name in ("mm", "addmm", "bmm"))


def test_traced_flops_are_the_routed_ones(tmp_path):
    """The step's matmul FLOPs are 6 x the active matrix parameters x tokens (top-k of the experts, the router,
    attention and the head): the same with 8 or 16 experts, while the weights held double in the experts."""
    traces, active = {}, {}
    for experts in (8, 16):
        cfg = run_config(tmp_path, "qwen3_moe", "full", False)
        cfg.model.init["num_experts"] = experts
        traces[experts] = _trace(cfg, VocabOnly(VOCAB), PRECISIONS["fp32"], ROWS, False, 1, "cpu", None)
        model = build_model(cfg.model, VocabOnly(VOCAB), 0)
        active[experts] = linear_params(model)[0]
    tokens = ROWS * LENGTH
    for experts in (8, 16):
        assert matmul_flops(traces[experts]) == pytest.approx(6 * active[experts] * tokens, rel=1e-9)
    router = 2 * 8 * 32  # the router grows with the experts (8 more rows of 32, two layers); the experts' share does not
    assert active[16] - active[8] == router
    # the plan's step time (its tokens/s and MFU) prices these FLOPs: twice the experts cost only the router's
    h100 = find_profile("h100")
    more = predict_step_time(traces[16], h100).flops - predict_step_time(traces[8], h100).flops
    assert more == pytest.approx(6 * router * tokens, rel=1e-6)
    assert traces[16].parts["weights"] > 1.8 * traces[8].parts["weights"] - 2 * VOCAB * 32 * 4


def test_experts_outside_transformers_interface_are_refused_naming_the_module():
    from trainforge.engine.predict.moe import UntraceableExperts, use_static_routing
    from trainforge.errors import EXIT_BAD_INPUT

    class OwnExperts(torch.nn.Module):  # routed experts with a forward of their own (DBRX, JetMoE, Llama 4 keep theirs)
        def __init__(self) -> None:
            super().__init__()
            self.num_experts = 4
            self.w = torch.nn.Parameter(torch.zeros(4, 8, 8))

    with pytest.raises(UntraceableExperts, match="OwnExperts") as caught:
        use_static_routing(torch.nn.Sequential(OwnExperts()), "grouped_mm")
    assert caught.value.exit_code == EXIT_BAD_INPUT


def test_a_gpu_plan_traces_fp32_masters_on_the_grouped_path_as_eager_under_autocast(tmp_path):
    """On a GPU, auto runs a bf16 full fine-tune's fp32 expert weights on trainforge's grouped path, which casts as
    autocast casts eager's linear: the plan traces it so (its bf16 copies kept for backward), about eager's peak."""
    from trainforge.engine.predict.moe import trace_experts
    from trainforge.model.experts_forward import GROUPED_NAME

    cfg = run_config(tmp_path, "qwen3_moe", "full", False)
    model = build_model(cfg.model, VocabOnly(VOCAB), 0)
    assert trace_experts(model, "auto", "cuda", torch.bfloat16) == GROUPED_NAME
    assert all(m._trainforge_autocast for m in model.modules() if hasattr(m, "_trainforge_autocast"))
    bf16 = PRECISIONS["bf16"]
    grouped = trace_training_step(cfg, VocabOnly(VOCAB), bf16, ROWS, False, device_type="cuda")
    eager = trace_training_step(run_config(tmp_path, "qwen3_moe", "full", False, "eager"), VocabOnly(VOCAB), bf16, ROWS,
                                False, device_type="cuda")
    assert grouped.parts["weights"] == eager.parts["weights"]
    assert abs(grouped.peak / eager.peak - 1) < 0.10, (grouped.parts, eager.parts)
