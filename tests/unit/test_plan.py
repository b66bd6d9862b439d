"""The plan's parts: the traced step's memory against a real step, the layer extrapolation, fitting,
the time model and the hardware profiles. Tiny fixed-seed models; nothing is downloaded."""

from __future__ import annotations


import pytest
import torch

from conftest import TINY_LLAMA_INIT, WORDS
from trainforge.config.run import RunConfig
from trainforge.data.loader import Batch
from trainforge.engine.optim import build_optimizer
from trainforge.engine.predict.fit import FIT_MARGIN, fit_run, predict_memory
from trainforge.engine.predict.timing import predict_step_time
from trainforge.engine.predict.trace import StepTracer, _trace, trace_training_step
from trainforge.engine.step import forward_backward, optimizer_step
from trainforge.hardware.device import PRECISIONS
from trainforge.model.load import build_model
from trainforge.model.tokenizer import load_tokenizer
from trainforge.hardware.profiles import GIB, PROFILES, HardwareProfile, find_profile, profile_for_gpu_name
from trainforge.tools.plan import VocabOnly, eval_batches_per_pass


def config(overrides: dict, tmp_path) -> RunConfig:
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "alpha beta gamma"}\n')
    base = {"model": {"init": dict(TINY_LLAMA_INIT)}, "data": {"train": str(data), "max_length": 64}}
    for section, values in overrides.items():
        base.setdefault(section, {}).update(values)
    return RunConfig.model_validate(base)


def real_step_peak(cfg: RunConfig, tokenizer, precision, rows: int) -> tuple[int, dict[str, int]]:
    """Live tensor peak of a real steady-state step on full rows, every position a target."""
    model = build_model(cfg.model, tokenizer, 0, torch.device("cpu"), precision.autocast_dtype is not None,
                        precision.autocast_dtype, bool(cfg.train.activation_checkpointing))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = build_optimizer(model, cfg.optim, torch.device("cpu"))
    ids = torch.randint(0, len(tokenizer), (rows, cfg.data.max_length), generator=torch.Generator().manual_seed(0))
    batch = Batch(ids, ids.clone(), None, ids.numel(), ids.numel(), list(range(rows)))

    def step() -> None:
        loss = forward_backward(model, [batch], precision, torch.device("cpu"))
        optimizer_step(params, opt, 1.0, None, loss)

    step()
    tracer = StepTracer()
    tracer.track([*model.parameters(), *model.buffers()], "weights")
    tracer.track([v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)], "optimizer")
    tracer.watch_grads(params)
    with tracer:
        step()
    tracer.close()
    return tracer.peak, tracer.peak_parts


@pytest.mark.parametrize(
    "method,precision,checkpointing",
    [("full", "fp32", False), ("full", "bf16", True), ("lora", "bf16", False), ("lora", "fp32", True)],
)
def test_traced_peak_matches_a_real_step(method, precision, checkpointing, tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    cfg = RunConfig.model_validate({
        "model": {"path": str(tiny_model_dir), "method": method},
        "data": {"train": str(tiny_model_dir / "config.json"), "max_length": 96},
        "train": {"activation_checkpointing": checkpointing},
    })
    prec = PRECISIONS[precision]
    predicted = trace_training_step(cfg, tok, prec, 4, checkpointing)
    measured, parts = real_step_peak(cfg, tok, prec, 4)
    assert predicted.parts["weights"] == parts["weights"]  # exact: the same parameters in the same dtypes
    assert predicted.parts["optimizer"] == parts["optimizer"]
    assert abs(predicted.peak / measured - 1) < 0.15, (predicted.parts, parts)


def test_optimizer_state_is_two_fp32_moments_per_trained_weight(tmp_path):
    cfg = config({}, tmp_path)
    trace = trace_training_step(cfg, VocabOnly(300), PRECISIONS["fp32"], 2, False)
    trained = trace.trainable_grads  # fp32 gradients: as many bytes as the trained weights
    assert trace.parts["optimizer"] >= 2 * trained
    assert trace.parts["optimizer"] - 2 * trained < 1024  # plus a step counter per tensor


def test_deep_models_are_extrapolated_exactly_from_two_shallow_traces(tmp_path):
    cfg = config({"model": {"init": {**TINY_LLAMA_INIT, "num_hidden_layers": 7}}}, tmp_path)
    for prec, ckpt in (("fp32", False), ("bf16", True)):
        full = _trace(cfg, VocabOnly(300), PRECISIONS[prec], 2, ckpt, 1, "cpu", None)
        extrapolated = trace_training_step(cfg, VocabOnly(300), PRECISIONS[prec], 2, ckpt)
        assert extrapolated.fewer_ops is not None
        assert extrapolated.parts == full.parts
        assert extrapolated.flops == pytest.approx(full.flops, rel=1e-9)


def test_with_activation_offload_deep_models_are_extrapolated_exactly_too(tmp_path):
    """Offload keeps two boundaries on the device from two layers on (the one below is brought back early): the
    shallow traces are at 2 and 3 layers, where both hold two, so the per-layer slope is the deep model's."""
    cfg = config({"model": {"init": {**TINY_LLAMA_INIT, "num_hidden_layers": 7}}, "data": {"max_length": 256},
                  "train": {"activation_offload": True, "tiled_mlp": False}}, tmp_path)
    full = _trace(cfg, VocabOnly(300), PRECISIONS["bf16"], 2, True, 1, "cuda", None)
    extrapolated = trace_training_step(cfg, VocabOnly(300), PRECISIONS["bf16"], 2, True, device_type="cuda")
    assert extrapolated.fewer_ops is not None and extrapolated.extrapolate == pytest.approx((7 - 3) / (3 - 2))
    assert extrapolated.parts == full.parts


def test_each_memory_lever_lowers_the_prediction(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)

    def peak(method: str, precision: str, ckpt: bool) -> dict[str, int]:
        cfg = RunConfig.model_validate({
            "model": {"path": str(tiny_model_dir), "method": method},
            "data": {"train": str(tiny_model_dir / "config.json"), "max_length": 128},
        })
        return trace_training_step(cfg, tok, PRECISIONS[precision], 8, ckpt).parts

    full, ckpt = peak("full", "fp32", False), peak("full", "fp32", True)
    assert ckpt["activations"] < full["activations"] and ckpt["weights"] == full["weights"]
    lora32, lora16 = peak("lora", "fp32", False), peak("lora", "bf16", False)
    assert lora16["weights"] < lora32["weights"]  # the frozen base in bf16
    assert lora32["optimizer"] < full["optimizer"] and lora32["grads"] <= full["grads"]
    qlora = peak("qlora", "bf16", False)
    assert qlora["weights"] < lora16["weights"]


def test_plan_shows_each_lever_as_the_prediction_with_that_lever_flipped(tiny_model_dir):
    """LoRA in fp32 without checkpointing: plan's levers are the peaks of the same run with checkpointing,
    with a bf16 run (the frozen base stored in bf16) and with QLoRA, each traced on its own; and back."""
    from trainforge.tools.plan import lever_savings

    tok = load_tokenizer(tiny_model_dir)
    device = tiny_device(64.0)

    def cfg(method: str) -> RunConfig:
        return RunConfig.model_validate({
            "model": {"path": str(tiny_model_dir), "method": method},
            "data": {"train": str(tiny_model_dir / "config.json"), "max_length": 64},
        })

    def tensors(method: str, precision: str, ckpt: bool) -> int:
        return predict_memory(cfg(method), tok, PRECISIONS[precision], device, 4, ckpt).tensors

    planned = predict_memory(cfg("lora"), tok, PRECISIONS["fp32"], device, 4, False)
    levers = lever_savings(cfg("lora"), tok, PRECISIONS["fp32"], device, planned, 1, 1, "none")
    optimizer_levers = {k: levers.pop(k) for k in list(levers) if k.startswith("with_optim_")}
    assert set(optimizer_levers) == {"with_optim_adamw_8bit", "with_optim_adamw_4bit", "with_optim_offload_cpu"}
    for name in ("adamw_8bit", "adamw_4bit"):  # the state's difference, at large tensors' rate: near a traced step
        other = cfg("lora").model_copy(deep=True)
        other.optim.name = name
        traced = predict_memory(other, tok, PRECISIONS["fp32"], device, 4, False).tensors
        assert optimizer_levers[f"with_optim_{name}"] == pytest.approx(traced, rel=0.1)  # small LoRA tensors stay fp32
    assert optimizer_levers["with_optim_offload_cpu"] == planned.tensors - planned.parts["optimizer"]
    assert levers == {
        "with_activation_checkpointing": tensors("lora", "fp32", True),
        "with_precision_bf16": tensors("lora", "bf16", False),
        "with_method_qlora": tensors("qlora", "fp32", False),
    }
    assert all(v < planned.tensors for v in levers.values())  # each one saves memory here
    planned = predict_memory(cfg("qlora"), tok, PRECISIONS["bf16"], device, 4, True)
    levers = lever_savings(cfg("qlora"), tok, PRECISIONS["bf16"], device, planned, 1, 1, "none")
    levers = {k: v for k, v in levers.items() if not k.startswith("with_optim_")}
    assert levers == {"without_activation_checkpointing": tensors("qlora", "bf16", False), "with_method_lora": tensors("lora", "bf16", True)}
    assert levers["without_activation_checkpointing"] > planned.tensors


def tiny_device(gib: float) -> HardwareProfile:
    return HardwareProfile("tiny", "a tiny device", gib, {"fp32": 1.0, "bf16": 2.0, "fp16": 2.0}, 100.0, True,
                           fixed_gib=0.0, allocator_overhead=0.0)


def test_auto_micro_batch_is_the_largest_that_fits(tmp_path):
    cfg = config({"train": {"micro_batch_size": "auto", "activation_checkpointing": False}}, tmp_path)
    prec = PRECISIONS["fp32"]
    one = predict_memory(cfg, VocabOnly(300), prec, tiny_device(1.0), 1, False)
    device = tiny_device((one.tensors + 5.5 * (predict_memory(cfg, VocabOnly(300), prec, tiny_device(1.0), 2, False).tensors - one.tensors)) / GIB / FIT_MARGIN)
    fit = fit_run(cfg, VocabOnly(300), prec, device)
    assert fit.memory.fits(FIT_MARGIN)
    bigger = predict_memory(cfg, VocabOnly(300), prec, device, fit.micro_batch_size + 1, False)
    assert not bigger.fits(FIT_MARGIN)
    assert "largest that fits" in fit.why_micro_batch


def test_auto_micro_batch_divides_the_global_batch(tmp_path):
    cfg = config({"train": {"micro_batch_size": "auto", "global_batch_size": 12}}, tmp_path)
    fit = fit_run(cfg, VocabOnly(300), PRECISIONS["fp32"], tiny_device(64.0))
    assert fit.micro_batch_size == 12 and not fit.activation_checkpointing


def test_checkpointing_auto_turns_on_only_when_the_run_does_not_fit(tmp_path):
    cfg = config({"train": {"micro_batch_size": 8}}, tmp_path)
    prec = PRECISIONS["fp32"]
    without = predict_memory(cfg, VocabOnly(300), prec, tiny_device(1.0), 8, False)
    with_ckpt = predict_memory(cfg, VocabOnly(300), prec, tiny_device(1.0), 8, True)
    roomy = fit_run(cfg, VocabOnly(300), prec, tiny_device(without.tensors / GIB / FIT_MARGIN * 1.01))
    tight = fit_run(cfg, VocabOnly(300), prec, tiny_device((with_ckpt.tensors + without.tensors) / 2 / GIB / FIT_MARGIN))
    assert roomy.activation_checkpointing is False and tight.activation_checkpointing is True
    assert "does not fit" in tight.why_checkpointing


def test_time_model_roofline():
    from trainforge.engine.predict.trace import OpRecord, StepTrace

    ops = [OpRecord("mm", 2e12, 1_000, "bfloat16", "forward"), OpRecord("add", 0.0, int(2e9), "float32", "backward"),
           OpRecord("_fused_adamw", 0.0, int(1e9), "float32", "optimizer")]
    device = HardwareProfile("x", "x", 80, {"bf16": 1000.0, "fp16": 1000.0, "fp32": 50.0}, 1000.0, True,
                             op_overhead_s=0.0, matmul_efficiency=1.0, bandwidth_efficiency=1.0)
    one = predict_step_time(StepTrace(0, {}, ops, tokens=100), device, grad_accum=1)
    assert one.compute_s == pytest.approx(2.0e-3) and one.memory_s == pytest.approx(3.0e-3)
    four = predict_step_time(StepTrace(0, {}, ops, tokens=100), device, grad_accum=4)
    assert four.seconds == pytest.approx(4 * 4.0e-3 + 1.0e-3)  # the optimizer runs once per step
    assert four.tokens == 400


def test_profiles_by_short_name_and_by_device_name():
    assert find_profile("H100").name == "h100"
    assert find_profile("h100-pcie").name == "h100-pcie"
    assert find_profile("A100-80GB").name == "a100-80gb"
    assert find_profile("RTX 4070").name == "rtx4070" and find_profile("4070").name == "rtx4070"
    assert find_profile("t4").bf16 is False
    with pytest.raises(ValueError, match="did you mean"):
        find_profile("h10")
    assert profile_for_gpu_name("NVIDIA H100 80GB HBM3").name == "h100"
    assert profile_for_gpu_name("NVIDIA H100 PCIe").name == "h100-pcie"
    assert profile_for_gpu_name("NVIDIA A100-SXM4-40GB").name == "a100-40gb"
    assert profile_for_gpu_name("NVIDIA GeForce RTX 4090").name == "rtx4090"
    for p in PROFILES.values():  # Pascal GeForce (GTX 1080) is the one card whose fp16 is slower than its fp32
        assert p.source and p.memory_gib > 0 and (p.peak_flops("fp16") >= p.peak_flops("fp32", tf32=False)) != (p.name == "gtx1080")


def test_memory_cap_from_the_environment(monkeypatch):
    from trainforge.hardware.device import this_profile

    monkeypatch.setenv("TRAINFORGE_MEMORY_GIB", "1.5")
    assert this_profile(torch.device("cpu"), timing=False).memory_gib == 1.5
    monkeypatch.setenv("TRAINFORGE_MEMORY_GIB", " ")  # blank: as unset
    assert this_profile(torch.device("cpu"), timing=False).memory_gib > 0


@pytest.mark.parametrize("value", ["lots", "0", "-2", "nan", "inf"])
def test_a_bad_memory_cap_is_a_config_error_naming_the_variable(monkeypatch, value):
    """A ValueError (a traceback, exit 1, from train); nan, 0 and negatives passed, nan as no cap at all."""
    from trainforge.errors import EXIT_BAD_INPUT, TrainforgeError
    from trainforge.hardware.device import this_profile

    monkeypatch.setenv("TRAINFORGE_MEMORY_GIB", value)
    with pytest.raises(TrainforgeError) as e:
        this_profile(torch.device("cpu"), timing=False)
    assert e.value.exit_code == EXIT_BAD_INPUT
    assert str(e.value).startswith(f"$TRAINFORGE_MEMORY_GIB={value!r}: expected a positive number of GiB, e.g. 12")


def test_load_peak_counts_the_weight_file_bytes_read_and_what_they_become(tiny_model_dir):
    """A bf16 LoRA base from fp32 files reads every byte of them, and holds the bf16 base and the adapters
    beside the mapped pages (exact against the model build_model loads); an fp32 full fine-tune of the
    same files casts nothing, so loading maps them lazily and holds nothing; a GPU is not priced."""
    from dataclasses import replace

    from trainforge.engine.predict.fit import predict_load_memory

    tok = load_tokenizer(tiny_model_dir)
    cpu = replace(tiny_device(64.0), kind="cpu", fixed_gib=0.25)

    def plan(method: str, precision: str, profile: HardwareProfile = cpu):
        cfg = RunConfig.model_validate({
            "model": {"path": str(tiny_model_dir), "method": method},
            "data": {"train": str(tiny_model_dir / "config.json"), "max_length": 64},
        })
        memory = predict_memory(cfg, tok, PRECISIONS[precision], profile, 2, False)
        return cfg, predict_load_memory(cfg, PRECISIONS[precision], profile, memory)

    cfg, load = plan("lora", "bf16")
    weights = tiny_model_dir / "model.safetensors"
    header = 8 + int.from_bytes(weights.read_bytes()[:8], "little")
    assert load.mapped == weights.stat().st_size - header  # the fp32 file, every tensor read to be cast
    model = build_model(cfg.model, tok, 0, torch.device("cpu"), True, torch.bfloat16)
    assert load.converted == sum(p.numel() * p.element_size() for p in model.parameters())  # bf16 base + fp32 adapters
    assert load.process == load.fixed + load.mapped + load.converted
    _, full = plan("full", "fp32")
    assert full.mapped == full.converted == 0 and full.process == full.fixed == int(0.25 * GIB)
    _, full = plan("full", "fp32", replace(cpu, load_fixed_gib=0.125))  # before its first step a process holds less
    assert full.process == full.fixed == int(0.125 * GIB)
    assert plan("lora", "bf16", tiny_device(64.0))[1] is None  # a GPU profile


def test_eval_time_counts_the_eval_rows_in_micro_batches():
    """Prepared data: the eval pass is its rows over the micro-batch (not the rows themselves as batches)."""
    cfg = RunConfig.model_validate(
        {"model": {"init": TINY_LLAMA_INIT}, "data": {"train": "builtin:python-stdlib"}, "train": {"micro_batch_size": 4}}
    )
    assert eval_batches_per_pass(cfg, {"eval_rows": 100}) == 25
    assert eval_batches_per_pass(cfg, {"eval_sequences": 10, "eval_rows": 100}) == 3
    assert eval_batches_per_pass(cfg, {}) == 13  # not prepared: 50 rows assumed
    capped = cfg.model_copy(update={"train": cfg.train.model_copy(update={"eval_max_batches": 7})})
    assert eval_batches_per_pass(capped, {"eval_rows": 100}) == 7
    # auto (the default) with the run's length: 5% of 26 x 4 rows x 3 forwards over two evals, in 4-row batches
    assert eval_batches_per_pass(cfg, {"eval_rows": 100}, steps=26) == 1
    assert eval_batches_per_pass(cfg, {"eval_rows": 100}, steps=2000) == 25  # all of them


@pytest.mark.parametrize("method,objective,reference", [("full", "dpo", "model"), ("lora", "dpo", "adapters"), ("full", "simpo", "none"),
                                                        ("lora", "kto", "adapters")])
def test_a_preference_plan_adds_the_references_forward_and_copy(tiny_model_dir, method, objective, reference):
    """A reference forward costs a third of a full fine-tune's step and half of an adapter step; a frozen
    copy of the starting weights is held beside them (so micro_batch_size: auto counts it too); a
    reference-free objective adds nothing."""
    from trainforge.engine.predict.timing import StepTime
    from trainforge.tools.plan_preference import describe_reference, with_reference

    tok = load_tokenizer(tiny_model_dir)
    device = tiny_device(64.0)

    def cfg_of(objective: str) -> RunConfig:
        return RunConfig.model_validate({
            "model": {"path": str(tiny_model_dir), "method": method},
            "data": {"train": str(tiny_model_dir / "config.json"), "max_length": 64},
            "train": {"objective": objective},
        })

    cfg = cfg_of(objective)
    sft = predict_memory(cfg_of("sft"), tok, PRECISIONS["fp32"], device, 4, False)
    memory = predict_memory(cfg, tok, PRECISIONS["fp32"], device, 4, False)
    step = StepTime(1.0, 0.6, 0.3, 0.1, 1e9, 256)
    planned, facts = with_reference(cfg, step, memory)
    assert facts["objective"] == objective and facts["reference"] == reference
    if reference == "model":
        assert memory.parts["reference"] == sft.parts["weights"] > 0
        assert memory.tensors == sft.tensors + sft.parts["weights"] and memory.process > sft.process
    else:
        assert memory.parts == sft.parts and memory.tensors == sft.tensors
    share = {"model": 1 / 3, "adapters": 1 / 2, "none": 0.0}[reference] * (2 if objective == "kto" else 1)
    assert planned.seconds == pytest.approx(1.0 + 0.9 * share) and planned.flops == pytest.approx(1e9 * (1 + share))
    assert ("forward adds" in describe_reference(facts)) == (share > 0)


def test_attention_flops_are_counted_causal_and_by_the_backward_factor(tmp_path):
    """torch's FLOP counter has no formula for the CPU flash kernel a plan traces: the trace counts
    Q K^T and P V per layer, halved for a causal kernel, 2.5 times that for its backward."""
    cfg = config({"data": {"max_length": 64}}, tmp_path)
    trace = trace_training_step(cfg, VocabOnly(300), PRECISIONS["fp32"], 2, False)
    init = TINY_LLAMA_INIT
    heads, layers = init["num_attention_heads"], init["num_hidden_layers"]
    head_dim = init["hidden_size"] // heads
    forward = 2.0 * 2 * heads * 64 * 64 * (2 * head_dim) / 2
    fwd = [op.flops for op in trace.ops if op.name == "_scaled_dot_product_flash_attention_for_cpu"]
    bwd = [op.flops for op in trace.ops if op.name == "_scaled_dot_product_flash_attention_for_cpu_backward"]
    assert fwd == [forward] * layers and bwd == [2.5 * forward] * layers


def test_document_masked_attention_is_priced_by_the_documents_length():
    """Packed rows under varlen/flex attend within each document: the step prices that share of the
    traced whole-row attention, and nothing else changes."""
    from trainforge.engine.predict.timing import document_attention_share
    from trainforge.engine.predict.trace import OpRecord, StepTrace

    assert document_attention_share(512, 2048) == 0.25 and document_attention_share(None, 2048) == 1.0
    assert document_attention_share(4096, 2048) == 1.0  # a document longer than a row is cut at the row
    ops = [OpRecord("mm", 1e12, 0, "bfloat16", "forward"), OpRecord("_scaled_dot_product_flash_attention_for_cpu", 1e12, 0, "bfloat16", "forward")]
    device = HardwareProfile("x", "x", 80, {"bf16": 1000.0, "fp16": 1000.0, "fp32": 50.0}, 1000.0, True,
                             op_overhead_s=0.0, matmul_efficiency=1.0, bandwidth_efficiency=1.0)
    whole = predict_step_time(StepTrace(0, {}, ops, tokens=100), device)
    quarter = predict_step_time(StepTrace(0, {}, ops, tokens=100), device, attention_share=0.25)
    assert whole.compute_s == pytest.approx(2e-3) and quarter.compute_s == pytest.approx(1.25e-3)
    assert quarter.flops == pytest.approx(1.25e12)
    measured = {op.key: 1.0 for op in ops}  # a CPU plan replays the whole-row attention: its time takes the share too
    assert predict_step_time(StepTrace(0, {}, ops, tokens=100), device, measured=measured, attention_share=0.25).compute_s == pytest.approx(1.25)


def test_plan_for_a_gpu_prices_packed_documents_under_varlen(tmp_path):
    """A plan for an H100 (varlen attention) or this CPU (packed_sdpa) of packed short documents: the
    attention share is the prepared data's token-weighted mean document length over the row; unpacked rows and concat
    blocks keep all of it."""
    from trainforge.tools.plan_kernels import attention_share

    cfg = config({"data": {"max_length": 64}}, tmp_path)
    h100 = find_profile("h100")
    facts = {"prepared": True, "train_tokens": 1600, "train_sequences": 100}
    assert attention_share(cfg, PRECISIONS["bf16"], None, h100, facts) == pytest.approx(16 / 64)  # an older cache: the mean
    # half the documents 8 tokens long, half 24: a row holds as many tokens of each, and the 24-token
    # ones cost 9x as much attention each, so the token-weighted length (20) prices it, not the mean (16)
    spread = facts | {"train_token_squares": 50 * 8**2 + 50 * 24**2}
    assert attention_share(cfg, PRECISIONS["bf16"], None, h100, spread) == pytest.approx(20 / 64)
    unpacked = config({"data": {"max_length": 64, "packing": False}}, tmp_path)
    assert attention_share(unpacked, PRECISIONS["bf16"], None, h100, facts) == 1.0
    assert attention_share(cfg, PRECISIONS["bf16"], None, h100, {"prepared": False}) == 1.0
    from trainforge.tools.plan import resolve_profile

    here, cpu = resolve_profile("this", cfg)
    assert attention_share(cfg, PRECISIONS["fp32"], cpu, here, facts) == pytest.approx(16 / 64)  # packed_sdpa: by document
    concat = config({"data": {"max_length": 64, "packing": "concat"}}, tmp_path)  # one stream: no document boundaries
    assert attention_share(concat, PRECISIONS["bf16"], None, h100, facts) == 1.0


def test_a_prepared_cache_gives_the_plan_its_document_lengths(tmp_path, tiny_tokenizer_dir):
    """``trainforge prepare`` counts each document's squared length; the plan reads it back from the
    cache and prices packed attention at the token-weighted length, above the plain mean on a spread."""
    import json

    from trainforge.data.prepare import prepare_data
    from trainforge.tools.plan import data_facts
    from trainforge.tools.plan_kernels import attention_share

    rows = [{"prompt": "say:", "completion": " " + " ".join(WORDS[: 2 + (i % 5) * 9])} for i in range(40)]
    path = tmp_path / "pc.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = config({"model": {"tokenizer": str(tiny_tokenizer_dir)}, "data": {"train": str(path), "eval": None, "cache_dir": str(tmp_path / "cache")}}, tmp_path)
    tok = load_tokenizer(tiny_tokenizer_dir)
    store = prepare_data(cfg.data, tok, seed=cfg.train.seed, log=lambda *_: None).train
    inputs = [len(store.sequence(i)[0]) - 1 for i in range(len(store))]
    facts = data_facts(cfg, tok)
    assert facts["prepared"] and facts["train_token_squares"] == sum(n * n for n in inputs)
    weighted = sum(n * n for n in inputs) / sum(inputs)
    assert weighted > sum(inputs) / len(inputs)
    assert attention_share(cfg, PRECISIONS["bf16"], None, find_profile("h100"), facts) == pytest.approx(weighted / 64)


def test_rows_past_a_learned_position_table_are_refused_and_past_rotary_ones_warned():
    """GPT-2's n_positions is a table: a longer row indexes past it (an IndexError mid-step before); a rotary
    model runs on past max_position_embeddings, beyond its training, which is said."""
    from trainforge.config.run import ConfigError, ModelSettings
    from trainforge.model.load import check_positions, position_problem

    gpt2 = ModelSettings(init={"architecture": "gpt2", "n_embd": 32, "n_layer": 1, "n_head": 4, "n_positions": 64})
    llama = ModelSettings(init=dict(TINY_LLAMA_INIT))  # max_position_embeddings 128
    assert position_problem(gpt2, 64) is None and position_problem(llama, 128) is None
    with pytest.raises(ConfigError, match="data.max_length 65 exceeds the model's 64 learned positions.*set data.max_length: 64"):
        check_positions(gpt2, 65, pytest.fail)
    said = []
    check_positions(llama, 256, said.append)
    assert "runs past the 128 positions" in said[0] and "rope_scaling" in said[0]


def test_a_tokenizer_built_from_the_data_is_found_by_the_plan_once_cached(tmp_path):
    """A from-scratch model trains its BPE on the data: plan said "data not prepared yet" for every such run, the
    built-in default included, so a run defined by epochs never got a duration. Once a run (or prepare) cached the
    tokenizer and the tokens, plan reads both."""
    import io
    import json

    from rich.console import Console

    from trainforge.data.plan import get_tokenizer
    from trainforge.data.prepare import prepare_data
    from trainforge.metrics.console import ConsoleReporter
    from trainforge.tools.plan import data_facts, plan_tokenizer, run_steps

    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"text": " ".join(WORDS[i % 7 :] * 3)}) + "\n" for i in range(30)))
    cfg = config({"model": {"init": {"architecture": "llama"}, "tokenizer_vocab_size": 300},
                  "data": {"train": str(path), "eval": None, "cache_dir": str(tmp_path / "cache")},
                  "train": {"max_steps": None, "epochs": 2}}, tmp_path)
    assert isinstance(plan_tokenizer(cfg), VocabOnly) and not data_facts(cfg, plan_tokenizer(cfg))["prepared"]
    tok = get_tokenizer(cfg, ConsoleReporter(Console(file=io.StringIO())))
    prepare_data(cfg.data, tok, seed=cfg.train.seed, log=lambda *_: None)
    found = plan_tokenizer(cfg)
    assert not isinstance(found, VocabOnly) and found.get_vocab() == tok.get_vocab()
    facts = data_facts(cfg, found)
    assert facts["prepared"] and run_steps(cfg, 1, 1, facts) is not None


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_dora_is_traced_on_a_4bit_base(tiny_model_dir, method):
    """PEFT's DoRA reads the base layer's weight (dequantized): the trace's 4-bit stand-in had none, so plan crashed on
    every DoRA config (QLoRA's trace, and LoRA's 'with QLoRA' lever) and so did train with micro_batch_size: auto."""
    from trainforge.tools.plan import lever_savings

    tok = load_tokenizer(tiny_model_dir)
    cfg = RunConfig.model_validate({
        "model": {"path": str(tiny_model_dir), "method": method, "lora": {"use_dora": True}},
        "data": {"train": str(tiny_model_dir / "config.json"), "max_length": 64},
    })
    planned = predict_memory(cfg, tok, PRECISIONS["bf16"], tiny_device(64.0), 4, False)
    levers = lever_savings(cfg, tok, PRECISIONS["bf16"], tiny_device(64.0), planned, 1, 1, "none")
    assert planned.tensors > 0 and ("with_method_qlora" in levers) == (method == "lora")


def test_an_auto_micro_batch_is_predicted_accumulating_as_the_run_will(tmp_path):
    """With micro_batch_size: auto the prediction traced one pass (no gradients held across micro-batches), so the
    pick of a run with grad_accum 8 was predicted below the same settings given by hand (an 8B plan by 18 GiB)."""
    prec = PRECISIONS["fp32"]
    auto = config({"train": {"micro_batch_size": "auto", "grad_accum": 8, "activation_checkpointing": False}}, tmp_path)
    fit = fit_run(auto, VocabOnly(300), prec, tiny_device(64.0))
    fixed = predict_memory(auto, VocabOnly(300), prec, tiny_device(64.0), fit.micro_batch_size, False, 8)
    assert fit.memory.tensors == fixed.tensors
    held = config({"train": {"micro_batch_size": "auto", "global_batch_size": 64, "activation_checkpointing": False}}, tmp_path)
    fit = fit_run(held, VocabOnly(300), prec, tiny_device(64.0))
    assert fit.memory.tensors == predict_memory(held, VocabOnly(300), prec, tiny_device(64.0), fit.micro_batch_size, False, 2).tensors
