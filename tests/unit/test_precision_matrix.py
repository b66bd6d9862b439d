"""The selftest matrix as tests: every precision x data shape x method x head (and one compiled
case) trains through the real entry point and tracks fp32; the checks beside it; and broken
paths, to show that the checks catch what they are there for (the mixture-of-experts rows too).

The matrix, its tolerances and their justification live in ``trainforge/tools/selftest/``
(``cases.py``, ``tolerances.py``): ``trainforge selftest`` runs the same cases on the user's
machine. Every precision is forced, so this runs alike on CPUs with and without native bf16
(fp16 is emulated on any CPU).
"""

from __future__ import annotations

import math

import pytest
import torch

import trainforge.engine.loss as loss_module
import trainforge.engine.step as step_module
import trainforge.model.packed_attention as packed_attention
from trainforge.data.loader import TrainLoader
from trainforge.tools.selftest import CASES, CHECKS, QUICK, STEPS, Case, SelfTest, matrix, plan


@pytest.fixture(scope="session")
def selftest(tmp_path_factory) -> SelfTest:
    """One runner for the session: tokenizer, model and data built once, each fp32 reference run once."""
    return SelfTest("cpu", workdir=tmp_path_factory.mktemp("selftest"))


def runner_with(selftest: SelfTest, tmp_path, *done: Case) -> SelfTest:
    """A fresh runner that shares the session's assets and already has ``done`` (run cleanly)."""
    fresh = SelfTest("cpu", workdir=tmp_path, assets=selftest.assets)
    for case in done:
        result = selftest.case(case)
        assert result.status == "ok", result.error
        fresh.results[case.name], fresh.weights[case.name] = result, selftest.weights[case.name]
    return fresh


# ---------------------------------------------------------------- the matrix


def test_matrix_covers_every_combination_once():
    names = [c.name for c in CASES]
    assert len(names) == len(set(names)) == 3 * 4 * 2 * 2 + 1 + 2 + 2
    assert names.index("fp32-chat-lora-standard") < names.index("bf16-concat-full-fused")  # references first
    assert [c.name for c in CASES if c.compiled] == ["bf16-packed-full-fused-compiled"]
    checkpointed = ["fp32-packed-full-fused-checkpointing", "bf16-chat-lora-fused-checkpointing",
                    "fp32-packed-full-fused-checkpointing-tiled-offload", "bf16-chat-lora-fused-checkpointing-tiled-offload"]
    assert [c.name for c in CASES if c.checkpointing] == checkpointed
    assert all(c.reference in CASES and not c.reference.checkpointing for c in CASES if c.checkpointing)
    quick = matrix(quick=True)
    assert len(quick) == 3 * len(QUICK) + 4 and not any(c.compiled for c in quick)
    assert [c.name for c in quick if c.checkpointing] == checkpointed
    for p in ("fp32", "bf16", "fp16"):  # the quick subset still has every data shape, LoRA and the standard head
        mine = [c for c in quick if c.precision == p]
        assert {c.data for c in mine} == {"concat", "packed", "completion", "chat"}
        assert {c.method for c in mine} == {"full", "lora"} and {c.head for c in mine} == {"fused", "standard"}


def test_the_compiled_lora_case_of_a_gpu_trains_here_too(selftest):
    """``selftest`` on CUDA adds a compiled LoRA case (fused LoRA layers inside regionally compiled decoder layers: the
    8B LoRA row's path); on a CPU it is left out of the user's matrix for time. It runs here, once, through the same
    runner: a graph is compiled and the run tracks its fp32 reference."""
    cuda_cases = matrix(compiled_precision="bf16", compiled_lora=True)
    added = [c for c in cuda_cases if c not in CASES]
    assert [c.name for c in added] == ["bf16-chat-lora-fused-compiled"]
    result = selftest.case(added[0])
    assert result.status == "ok", result.error
    assert result.loss_gap is not None and all(math.isfinite(x) for x in result.losses)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_training_path(selftest, case):
    result = selftest.case(case)
    assert result.status == "ok", result.error
    assert len(result.losses) == STEPS and all(math.isfinite(x) for x in result.losses)
    assert result.tokens_per_s > 0 and math.isfinite(result.eval_loss)
    if case.precision != "fp32":
        assert result.loss_gap is not None and result.grad_norm_gap is not None


@pytest.mark.parametrize("name", CHECKS)
def test_check(selftest, name):
    result = selftest.check(name)
    if result.status == "skipped":
        # the fixture runs on the CPU; pinned memory and Liger's kernels are checked on CUDA (fp8: without torchao)
        assert name == "pinned-memory" or name.startswith("kernels-") or (name == "fp8-bf16" and "torchao" in result.detail)
        pytest.skip(result.detail)
    assert result.status == "ok", result.error


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_matrix_on_cuda(tmp_path):
    """The same matrix on the GPU: flash-attention varlen (when installed), pinned memory, the lagged guard."""
    cases, checks = plan(torch.device("cuda"))
    results = SelfTest("cuda", workdir=tmp_path).run(cases, checks)
    failed = [f"{r.name}: {r.error}" for r in results if not r.ok]
    assert not failed, "\n".join(failed)


# ---------------------------------------------------------------- the checks can fail


def test_gradients_left_scaled_by_the_grad_scaler_fail(selftest, tmp_path, monkeypatch):
    """fp16 gradients that stay multiplied by the loss scale: AdamW's update hardly changes
    (scale-invariant, and clipping hides the size), so only the grad-norm comparison sees it."""
    case = Case("fp16", "packed", "full", "fused")
    runner = runner_with(selftest, tmp_path, case.reference)
    unscale = torch.amp.GradScaler.unscale_

    def unscale_forgotten(self, optimizer):
        unscale(self, optimizer)  # the scaler's bookkeeping (inf checks) as usual...
        for group in optimizer.param_groups:  # ...but the gradients keep their scale
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(self.get_scale())

    monkeypatch.setattr(torch.amp.GradScaler, "unscale_", unscale_forgotten)
    result = runner.case(case)
    assert result.status == "FAILED"
    assert "grad norm departs from fp32" in result.error, result.error


def test_a_wrongly_scaled_bf16_loss_fails(selftest, tmp_path, monkeypatch):
    case = Case("bf16", "chat", "full", "fused")
    runner = runner_with(selftest, tmp_path, case.reference)
    loss_sum = step_module.loss_sum

    def doubled_in_bf16(model, batch, precision, fused=True):
        loss = loss_sum(model, batch, precision, fused)
        return loss * 2 if precision.name == "bf16" else loss  # e.g. a token count off by a factor

    monkeypatch.setattr(step_module, "loss_sum", doubled_in_bf16)
    result = runner.case(case)
    assert result.status == "FAILED"
    assert "loss departs from fp32" in result.error, result.error


def _overflow_in_step(monkeypatch, step: int) -> None:
    """An fp16 gradient overflow in ``step``: an inf in a gradient before the scaler checks them."""
    unscale, calls = torch.amp.GradScaler.unscale_, {"n": 0}

    def unscale_with_overflow(self, optimizer):
        calls["n"] += 1
        if calls["n"] == step:
            p = next(p for g in optimizer.param_groups for p in g["params"] if p.grad is not None)
            p.grad.view(-1)[0] = float("inf")
        unscale(self, optimizer)

    monkeypatch.setattr(torch.amp.GradScaler, "unscale_", unscale_with_overflow)


def test_an_fp16_overflow_is_skipped_and_backs_the_scale_off(selftest, tmp_path, monkeypatch):
    """The overflow path on any CPU: the step is skipped, the scale halves, training goes on."""
    case = Case("fp16", "completion", "full", "fused")
    runner = runner_with(selftest, tmp_path, case.reference)
    _overflow_in_step(monkeypatch, 3)
    result = runner.case(case)
    assert result.status == "ok", result.error
    assert result.overflows == [3] and "step 3 overflowed" in result.detail


def test_an_fp16_overflow_the_scaler_does_not_back_off_from_fails(selftest, tmp_path, monkeypatch):
    case = Case("fp16", "completion", "full", "fused")
    runner = runner_with(selftest, tmp_path, case.reference)
    _overflow_in_step(monkeypatch, 3)
    update = torch.amp.GradScaler.update

    def update_keeping_the_scale(self, new_scale=None):
        scale = self._scale.clone()
        update(self, new_scale)
        self._scale.copy_(scale)

    monkeypatch.setattr(torch.amp.GradScaler, "update", update_keeping_the_scale)
    result = runner.case(case)
    assert result.status == "FAILED"
    assert "overflows were not handled by the scaler" in result.error, result.error


def test_a_wrong_fused_head_gradient_fails(selftest, tmp_path, monkeypatch):
    runner = runner_with(selftest, tmp_path)
    backward = loss_module._LinearCrossEntropy.backward

    def halved(ctx, grad_out):
        grad_h, *rest = backward(ctx, grad_out)
        return (grad_h * 0.5, *rest)

    monkeypatch.setattr(loss_module._LinearCrossEntropy, "backward", staticmethod(halved))
    result = runner.check("head-grads-bf16")
    assert result.status == "FAILED"
    assert "fused and standard head differ under bf16" in result.error, result.error


def test_documents_that_see_each_other_fail(selftest, tmp_path, monkeypatch):
    runner = runner_with(selftest, tmp_path)
    plan = packed_attention._plan
    # every row one document: position_ids' restarts ignored
    monkeypatch.setattr(packed_attention, "_plan", lambda pos: plan(torch.arange(pos.shape[1]).expand(pos.shape[0], -1).contiguous()))
    monkeypatch.setattr(packed_attention, "_cache", None)
    result = runner.check("attention-fp32")
    packed_attention._cache = None
    assert result.status == "FAILED"
    assert "trainforge_packed_sdpa: packed documents differ from one-at-a-time" in result.error, result.error


def test_a_resume_that_loses_the_data_position_fails(selftest, tmp_path, monkeypatch):
    runner = runner_with(selftest, tmp_path, Case("bf16", "packed", "full", "fused"))
    monkeypatch.setattr(TrainLoader, "load_state_dict", lambda self, state: None)
    result = runner.check("resume-bf16")
    assert result.status == "FAILED"
    assert "the resumed run differs from the uninterrupted one" in result.error, result.error


def test_a_preference_step_whose_pairs_are_swapped_fails(selftest, tmp_path, monkeypatch):
    from trainforge.engine import preference as pref

    runner = runner_with(selftest, tmp_path)
    pairs = pref.batch_pair_logps

    def swapped(*args, **kwargs):  # chosen and rejected read from the wrong documents
        p = pairs(*args, **kwargs)
        p.chosen, p.rejected = p.rejected, p.chosen
        return p

    monkeypatch.setattr(pref, "batch_pair_logps", swapped)
    result = runner.check("preference-fp32")
    assert result.status == "FAILED"
    assert "the training step and the direct implementation differ under fp32" in result.error, result.error


def test_a_grpo_step_reading_the_neighbouring_completions_advantage_fails(selftest, tmp_path, monkeypatch):
    from trainforge.engine import grpo

    runner = runner_with(selftest, tmp_path)
    terms = grpo.grpo_terms

    def shifted(logps, batch, s):  # each completion learns from the advantage of the one before it
        batch.advantages = batch.advantages.roll(1)
        return terms(logps, batch, s)

    monkeypatch.setattr(grpo, "grpo_terms", shifted)
    result = runner.check("grpo-fp32")
    assert result.status == "FAILED"
    assert "grpo: the training step and the per-completion loss differ under fp32" in result.error, result.error


def test_a_signal_between_paths_stops_the_run_before_the_next(selftest, tmp_path):
    """A SIGTERM/SIGINT that lands outside a training run (a check, the assets: no run's handler holds it) is taken
    by selftest's own and stops it before the next path; before, it killed the process (SIGTERM, exit 143, no table)
    or raised KeyboardInterrupt past the results."""
    import signal

    from trainforge.stop import Interrupted, StopRequest

    stop = StopRequest()
    fresh = SelfTest("cpu", workdir=tmp_path, assets=selftest.assets)
    ran = []

    def arrives_during_the_first(result) -> None:
        ran.append(result.name)
        stop.signum = signal.SIGTERM  # as its handler sets it

    with pytest.raises(Interrupted, match="SIGTERM between paths") as stopped:
        fresh.run([], ["nonfinite-guard", "head-grads-fp32"], arrives_during_the_first, stop)
    assert ran == ["nonfinite-guard"] and stopped.value.signal_name == "SIGTERM"


def test_the_moe_rows_compare_the_grouped_path_on_a_cpu(selftest):
    """On a CPU ``auto`` picks grouped_mm for the experts: the rows compare it with eager, not eager with itself."""
    for name in ("moe-full-fp32", "moe-lora-bf16"):
        result = selftest.check(name)
        assert result.status == "ok", result.error
        assert result.detail.startswith("grouped_mm (auto") and " vs eager: " in result.detail, result.detail


@pytest.mark.parametrize("name", ["moe-full-fp32", "moe-lora-bf16"])
def test_a_grouped_experts_path_that_drops_a_routed_term_fails(selftest, tmp_path, monkeypatch, name):
    """Each token's second expert left out of the grouped path's weighted sum (its routing weight zeroed); under LoRA
    the experts run trainforge's grouped implementation (the adapters as factors): the same fault there."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    from trainforge.model.experts_forward import register_grouped

    runner = runner_with(selftest, tmp_path)

    def without_second_expert(grouped):
        def forward(self, hidden_states, top_k_index, top_k_weights):
            kept = top_k_weights.clone()
            kept[:, 1:] = 0
            return grouped(self, hidden_states, top_k_index, kept)
        return forward

    for key in ("grouped_mm", register_grouped()):
        monkeypatch.setitem(ALL_EXPERTS_FUNCTIONS._global_mapping, key, without_second_expert(ALL_EXPERTS_FUNCTIONS[key]))
    result = runner.check(name)
    assert result.status == "FAILED"
    assert "trainforge's step with experts grouped_mm and transformers' eager experts" in result.error, result.error


def test_a_router_aux_loss_missing_from_the_gradient_fails(selftest, tmp_path, monkeypatch):
    """The aux loss computed and logged, but its term left out of what the step differentiates."""
    from trainforge.engine.router_loss import RouterLoss

    runner = runner_with(selftest, tmp_path)
    add = RouterLoss.add

    def logged_only(self, ce_sum, routed, batch, metrics):
        add(self, ce_sum, routed, batch, metrics)  # the metrics as usual...
        return ce_sum  # ...but the gradient without coef x aux

    monkeypatch.setattr(RouterLoss, "add", logged_only)
    result = runner.check("moe-full-fp32")
    assert result.status == "FAILED"
    # every gradient upstream of a router moves (by ~1.0 relative): the row names the worst, router or attention
    gap = float(result.error.split(" by ")[-1].split(" ")[0])
    assert "gradient of model.layers." in result.error and gap > 0.5, result.error


def test_tiled_mlp_weight_gradients_that_count_a_tile_twice_fail(selftest, tmp_path, monkeypatch):
    """The long-context case tracks its plain reference only if each tile's gradients reach the weights once: a
    backward that recomputes the last tile twice (its weight gradients summed in twice) is caught."""
    import trainforge.model.tiled_mlp as tiled_mlp

    case = next(c for c in CASES if c.long_context and c.precision == "fp32")
    runner = runner_with(selftest, tmp_path, case.reference)
    every_tile = tiled_mlp.run_tiles

    def last_tile_twice_in_backward(n, one_tile):
        every_tile(n, one_tile)
        if torch.is_grad_enabled():  # backward recomputes under enable_grad; forward runs under no_grad
            one_tile(n - 1)

    monkeypatch.setattr(tiled_mlp, "run_tiles", last_tile_twice_in_backward)
    result = runner.case(case)
    assert result.status == "FAILED" and "grad norm departs from fp32" in result.error, result.error
