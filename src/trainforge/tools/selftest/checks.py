"""The checks beside the training cases (``CHECKS``): head gradients, attention, resume, guard, pinned memory."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from ...hardware.device import Precision
from .assets import MODEL_INIT, Assets, rng_kept
from .cases import CHECKPOINT_EVERY, Case, case_config
from .lifecycle import train_stopped_after_checkpoint
from .probes import PAIR_DOCS, attention_implementations, masked_batch, packed_attention_gap, pair_batch, pair_documents
from .reporters import quiet
from .results import CheckFailed, Result, Skip
from .tolerances import (ATTENTION_TOL, CUDA_RESUME_TOL, FP8_TOL, GRPO_TOL, HEAD_GRAD_TOL, LOSS_TOL, PREFERENCE_TOL, fmt_values,
                         relative_gap)


def worst_gap(reference: tuple[float, dict], other: tuple[float, dict]) -> tuple[str, float, float]:
    """(the tensor whose gradient differs most, that relative norm gap, the loss's relative gap) of
    ``other`` against ``reference``, each a (loss, {name: gradient})."""
    (loss_r, g_r), (loss_o, g_o) = reference, other
    gaps = {n: float((g_o[n] - g_r[n]).norm() / g_r[n].norm().clamp_min(1e-30)) for n in g_r}
    worst, gap = max(gaps.items(), key=lambda kv: kv[1])
    return worst, gap, abs(loss_o - loss_r) / abs(loss_r)


def fused_matches_direct(name: str, runs: dict, direct: str, precision: str, tol: float) -> str:
    """The note of a fused-vs-direct comparison (``runs``: ``loss_and_grads`` of each); CheckFailed beyond ``tol``."""
    worst, gap, loss_gap = worst_gap(runs["direct"], runs["fused"])
    if gap > tol or loss_gap > tol:
        raise CheckFailed(
            f"{name}: the training step and {direct} differ under {precision}: loss {runs['fused'][0]:.5f} vs "
            f"{runs['direct'][0]:.5f}; gradient of {worst} by {gap:.2e} (tolerance {tol:.0e})"
        )
    return f"{name} {max(gap, loss_gap):.1e}"


def loss_and_grads(model: torch.nn.Module, loss_of: Callable[[], torch.Tensor]) -> tuple[float, dict[str, torch.Tensor]]:
    """(loss, {name: gradient}) of one backward of ``loss_of()`` from cleared gradients, for ``worst_gap``."""
    model.zero_grad(set_to_none=True)
    loss = loss_of()
    loss.backward()
    return loss.item(), {n: p.grad.detach().float() for n, p in model.named_parameters() if p.grad is not None}


class Checks:
    """The ``_check_<name>`` methods ``SelfTest.check`` (runner.py) dispatches to, one per kind of
    check; each returns its detail line or raises ``CheckFailed``/``Skip``. The runner provides the
    state below."""

    device: torch.device
    workdir: Path
    cache_dir: Path | None
    assets: Assets
    weights: dict[str, dict[str, torch.Tensor]]
    case: Callable[[Case], Result]
    tolerance: Callable[[dict[str, float], str], float]

    def _check_head_grads(self, precision: str) -> str:
        """Fused vs standard LM-head loss: the loss and every gradient, on two packed rows with
        masked positions (prompts, a fully masked document, document ends, padding), for the
        untied full model and LoRA on the tied "pretrained" one."""
        from ...config.run import LoraSettings, ModelSettings
        from ...engine.loss import fused_head
        from ...engine.step import loss_sum
        from ...hardware.device import PRECISIONS as MODES
        from ...model.load import apply_lora, build_model
        from ...model.tokenizer import load_tokenizer

        mode, tol = MODES[precision], self.tolerance(HEAD_GRAD_TOL, precision)
        half = mode.autocast_dtype is not None  # flash-attention (CUDA) serves bf16/fp16 only
        tok = load_tokenizer(self.assets.tokenizer)
        notes = []
        for label in ("full", "lora"):
            with rng_kept():
                if label == "full":
                    model = build_model(ModelSettings(init=dict(MODEL_INIT), tokenizer=self.assets.tokenizer), tok, 0, self.device, half)
                else:
                    base = build_model(ModelSettings(path=self.assets.pretrained), tok, 0, self.device, half)
                    model = apply_lora(base, LoraSettings(r=4, alpha=8))
                    torch.manual_seed(1)
                    for n, p in model.named_parameters():
                        if "lora_B" in n:  # B starts at zero, which would make A's gradient zero on both paths
                            torch.nn.init.normal_(p, std=0.02)
            model = model.to(self.device)
            if fused_head(model) is None:
                raise CheckFailed(f"{label}: the model has no fused head path: the comparison would be standard vs standard")
            batch = masked_batch(len(tok), self.device)
            runs = {fused: loss_and_grads(model, lambda: loss_sum(model, batch, mode, fused=fused)) for fused in (True, False)}
            (loss_f, g_f), (loss_s, g_s) = runs[True], runs[False]
            if g_f.keys() != g_s.keys() or not g_s:
                raise CheckFailed(f"{label}: gradients of different tensors: fused {sorted(g_f)}, standard {sorted(g_s)}")
            worst, gap, loss_gap = worst_gap((loss_s, g_s), (loss_f, g_f))
            if gap > tol or loss_gap > tol:
                raise CheckFailed(
                    f"{label}: fused and standard head differ under {precision}: loss {loss_f:.5f} vs {loss_s:.5f}; "
                    f"gradient of {worst} by {gap:.2e} (relative norm; tolerance {tol:.0e})"
                )
            notes.append(f"{label} {max(gap, loss_gap):.1e}")
        return f"fused vs standard: {', '.join(notes)} (tol {tol:.0e})"

    def _moved_lora_policy(self, mode: Precision) -> tuple:
        """(tokenizer, LoRA model on the pretrained asset whose adapters moved: the policy differs from its reference)."""
        from ...config.run import LoraSettings, ModelSettings
        from ...model.load import apply_lora, build_model
        from ...model.tokenizer import load_tokenizer

        tok = load_tokenizer(self.assets.tokenizer)
        with rng_kept():
            base = build_model(ModelSettings(path=self.assets.pretrained), tok, 0, self.device, mode.autocast_dtype is not None)
            model = apply_lora(base, LoraSettings(r=4, alpha=8)).to(self.device)
            torch.manual_seed(1)
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    torch.nn.init.normal_(p, std=0.05)
        return tok, model

    def _check_preference(self, precision: str) -> str:
        """One path per preference family, the training step's against a direct unfused implementation: DPO
        with its reference as LoRA adapters off, SimPO without one, KTO on unpaired examples; packed pairs through the fused head
        vs each document run alone through the model's own logits, both in this precision: the loss and
        every gradient."""
        from ...config.preference import PreferenceSettings
        from ...engine import preference as pref
        from ...engine.objective import PairObjective
        from ...hardware.device import PRECISIONS as MODES

        mode, tol = MODES[precision], self.tolerance(PREFERENCE_TOL, precision)
        tok, model = self._moved_lora_policy(mode)
        batch, documents = pair_batch(len(tok), self.device), pair_documents(len(tok))
        prompts = [prompt for docs in PAIR_DOCS for _, prompt in docs]
        settings = PreferenceSettings(beta=0.5, simpo_gamma=0.3)

        def direct(policy: bool) -> pref.PairLogps:
            """Each document alone, the model's own logits (in this precision), fp32 log-softmax of its reply
            tokens, summed."""
            sums, counts = [], []
            for toks, prompt in zip((d for row in documents for d in row), prompts):
                ids = toks[None].to(self.device)
                with mode.autocast(self.device):
                    if policy:
                        logits = model(input_ids=ids).logits[0, :-1].float()
                    else:
                        with torch.no_grad(), model.disable_adapter():
                            logits = model(input_ids=ids).logits[0, :-1].float()
                logp = torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None]).squeeze(1)[prompt - 1 :]
                sums.append(logp.sum())
                counts.append(torch.tensor(len(logp), device=self.device))
            s, c = torch.stack(sums), torch.stack(counts)
            return pref.PairLogps(s[0::2], s[1::2], c[0::2], c[1::2])

        notes = []
        for name, reference in (("dpo", "adapters"), ("simpo", "none"), ("kto", "adapters")):
            objective = PairObjective(name, settings, reference)

            def direct_loss() -> torch.Tensor:
                p = direct(True)
                if reference != "none":
                    ref = direct(False)
                    p.ref_chosen, p.ref_rejected = ref.chosen, ref.rejected
                if name == "kto":  # the rejected documents as the KL samples: this batch's reference point
                    kl = (p.rejected.detach() - p.ref_rejected).mean().clamp(min=0)
                    return pref.kto_loss(p.chosen, p.ref_chosen, batch.desirable, kl, settings.beta).sum()
                return objective.pair_losses(p).sum()

            runs = {"fused": loss_and_grads(model, lambda: objective.loss_sum(model, batch, mode)),
                    "direct": loss_and_grads(model, direct_loss)}
            notes.append(fused_matches_direct(name, runs, "the direct implementation", precision, tol))
        return f"packed + fused vs each pair alone, unfused: {', '.join(notes)} (tol {tol:.0e})"

    def _check_grpo(self, precision: str) -> str:
        """Each GRPO loss (grpo, dr_grpo, dapo, gspo) as the training step computes it (completions packed behind
        their prompts, the fused head, the reference recorded by the stage's packed pass) against the same loss
        written out one completion at a time through the model's own logits: the loss and every gradient, with
        clipping biting on some tokens (grpo.py says how the rollout is made)."""
        from ...engine.grpo import COUNT, GRPOObjective
        from ...engine.loss import fused_head
        from ...hardware.device import PRECISIONS as MODES
        from . import grpo

        mode, tol = MODES[precision], self.tolerance(GRPO_TOL, precision)
        tok, model = self._moved_lora_policy(mode)
        if fused_head(model) is None:
            raise CheckFailed("the model has no fused head path: the comparison would be standard vs standard")
        docs = grpo.rollout(len(tok))
        grpo.record(model, docs, GRPOObjective(grpo.settings("grpo"), "adapters"), mode, self.device)
        notes = []
        for name in grpo.LOSSES:
            s, metrics = grpo.settings(name), {}
            runs = {"fused": loss_and_grads(model, lambda: grpo.fused_loss(model, docs, s, mode, self.device, metrics)),
                    "direct": loss_and_grads(model, lambda: grpo.naive_loss(model, docs, s, mode, self.device))}
            clipped, of = float(metrics["clip_ratio"]), float(metrics[COUNT + "clip_ratio"])
            if not 0 < clipped < of:  # the clipped branch (no gradient) and the other must both be in the comparison
                raise CheckFailed(f"{name}: the clipped term was taken on {clipped:.0f} of {of:.0f}: the check cannot see clipping")
            notes.append(fused_matches_direct(name, runs, "the per-completion loss", precision, tol))
        return f"packed + fused vs each completion alone, unfused: {', '.join(notes)} (tol {tol:.0e})"

    def _check_resume(self, precision: str) -> str:
        """Stop a run after a checkpoint as SIGTERM does, resume it, and compare the final weights
        and every step's loss with the uninterrupted run of the same case."""
        from ...config.run import RunConfig
        from ...engine import trainer
        from ...metrics.tracker import read_metrics

        case = Case(precision, "packed", "full", "fused")
        whole = self.case(case)
        if whole.status == "skipped":
            raise Skip(whole.detail)
        if not whole.ok:
            raise CheckFailed(f"the uninterrupted run {case.name} failed: nothing to compare with")
        cfg = RunConfig.model_validate(case_config(case, self.assets, str(self.device), self.cache_dir))
        out = self.workdir / f"resume-{precision}"
        shutil.rmtree(out, ignore_errors=True)
        train_stopped_after_checkpoint(cfg, out)
        resumed = trainer.train(cfg, out, quiet(), resume="auto")
        if resumed.summary["resumed_from_step"] != CHECKPOINT_EVERY:
            raise CheckFailed(f"resumed from step {resumed.summary['resumed_from_step']}, expected {CHECKPOINT_EVERY}")
        losses = [r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
        expected = self.weights[case.name]
        got = {k: v.detach().cpu() for k, v in resumed.model.state_dict().items()}
        diff = max(float((got[k].float() - v.float()).abs().max()) for k, v in expected.items())
        if self.device.type == "cpu":
            exact = losses == whole.losses and diff == 0.0
            if not exact:
                raise CheckFailed(
                    f"the resumed run differs from the uninterrupted one: largest weight difference {diff:.2e}; "
                    f"losses {fmt_values(losses)} vs {fmt_values(whole.losses)}"
                )
            return f"stopped at step {CHECKPOINT_EVERY}, resumed: bitwise equal to the uninterrupted run"
        scale = max(float(v.float().abs().max()) for v in expected.values())
        loss_gap = relative_gap(losses, whole.losses)
        if diff / scale > CUDA_RESUME_TOL or loss_gap > LOSS_TOL[precision] or len(losses) != len(whole.losses):
            raise CheckFailed(
                f"the resumed run differs from the uninterrupted one: weights by {diff / scale:.2e} (tolerance "
                f"{CUDA_RESUME_TOL:.0e}), losses {fmt_values(losses)} vs {fmt_values(whole.losses)}"
            )
        return f"stopped at step {CHECKPOINT_EVERY}, resumed: weights within {diff / scale:.1e} of the uninterrupted run"

    def _check_attention(self, precision: str) -> str:
        """Packed rows (several documents, position_ids restarting at 0) against each document run
        on its own, through every attention implementation that handles packed rows here."""
        from ...hardware.device import PRECISIONS as MODES

        mode, tol = MODES[precision], self.tolerance(ATTENTION_TOL, precision)
        notes = []
        for impl in attention_implementations(self.device):
            if impl in ("flash_attention_2", "trainforge_varlen") and mode.autocast_dtype is None:
                continue  # flash kernels compute in fp16/bf16 only
            gap, leak = packed_attention_gap(impl, mode, self.device)
            if not leak > 10 * tol:  # the measure must tell a leak from rounding, or it proves nothing
                raise CheckFailed(f"{impl}: rows without document boundaries differ by only {leak:.1e}: the check cannot see a leak")
            if not gap <= tol:
                raise CheckFailed(
                    f"{impl}: packed documents differ from one-at-a-time by {gap:.2e} (tolerance {tol:.0e}; "
                    f"attention across documents gives {leak:.1e})"
                )
            notes.append(f"{impl.removeprefix('trainforge_')} {gap:.1e}")
        return f"{', '.join(notes)} vs per document (tol {tol:.0e}; a leak: {leak:.0e})"

    def _check_nonfinite_guard(self, precision: str) -> str:
        """The non-finite guard as CUDA runs it (its streak read one step late, from pinned memory
        there) and the optimizer's update skip, on this device."""
        from ...config.run import OptimSettings
        from ...engine.nonfinite import NonFiniteError, NonFiniteGuard, skip_update_if
        from ...engine.optim import build_optimizer

        guard = NonFiniteGuard(2, self.device, lagged=True)
        raised_at = None
        for step, bad in enumerate([False, True, True, False, False], 1):
            try:
                guard.record(torch.tensor(bad, device=self.device), step, [step])
            except NonFiniteError as e:
                raised_at = step
                if "training stopped at step 3" not in str(e):
                    raise CheckFailed(f"the guard named the wrong step: {e}") from None
                break
        if raised_at != 4:  # the streak of steps 2-3 is read at step 4: one step late
            raise CheckFailed(f"the lagged guard raised at step {raised_at}, expected 4 (one step after the streak)")
        if int(guard.total) != 2:
            raise CheckFailed(f"the guard counted {int(guard.total)} skipped steps, expected 2")
        layer = torch.nn.Linear(4, 4).to(self.device)
        opt = build_optimizer(layer, OptimSettings(lr=0.1), self.device)
        before = layer.weight.detach().clone()
        layer(torch.ones(2, 4, device=self.device)).sum().backward()
        skip_update_if(opt, torch.tensor(True, device=self.device))
        if not torch.equal(layer.weight, before):
            raise CheckFailed("a step flagged non-finite changed the weights")
        skip_update_if(opt, torch.tensor(False, device=self.device))
        if torch.equal(layer.weight, before):
            raise CheckFailed("a good step did not change the weights")
        kind = "fused AdamW skips on the device" if opt.defaults.get("fused") else "AdamW skips after a host check"
        return f"streak read one step late; {kind}"

    def _check_pinned_memory(self, precision: str) -> str:
        """CUDA: training batches come from pinned host memory and arrive intact, asynchronously."""
        if self.device.type != "cuda":
            raise Skip("CUDA only: pinned host memory needs a GPU")
        from ...config.run import RunConfig
        from ...data.plan import get_tokenizer, plan_data

        case = Case("fp32", "chat", "full", "fused")
        cfg = RunConfig.model_validate(case_config(case, self.assets, str(self.device), self.cache_dir))
        plan = plan_data(cfg, get_tokenizer(cfg, quiet()), quiet(), pin=True)
        batch = plan.collate(plan.train_rows[:4], [0, 1, 2, 3])
        host = [t for t in (batch.input_ids, batch.labels, batch.position_ids) if t is not None]
        if not all(t.is_pinned() for t in host):
            raise CheckFailed("the collator did not pin the batch's host memory")
        moved = batch.to(self.device)
        torch.cuda.synchronize(self.device)
        if not (torch.equal(moved.input_ids.cpu(), batch.input_ids) and torch.equal(moved.labels.cpu(), batch.labels)):
            raise CheckFailed("a non-blocking copy from pinned memory arrived changed")
        return "batches pinned; non-blocking copies arrive intact"

    def _check_fp8(self, precision: str) -> str:
        """FP8 linear layers (train.fp8, torchao) against the same model in bf16: the loss and every
        gradient of one step on packed rows. On CUDA with FP8 tensor cores (8.9+); on a CPU torch
        emulates the FP8 matmuls, so the wiring is checked everywhere."""
        import importlib.util

        from ...config.run import ModelSettings
        from ...engine.step import loss_sum
        from ...hardware.device import PRECISIONS as MODES
        from ...model.load import build_model
        from ...model.tokenizer import load_tokenizer

        if importlib.util.find_spec("torchao") is None:
            raise Skip("torchao is not installed: pip install 'trainforge[gpu]'")
        if self.device.type == "cuda" and torch.cuda.get_device_capability(self.device) < (8, 9):
            raise Skip("this GPU has no FP8 tensor cores (compute capability 8.9+)")
        mode, tok = MODES[precision], load_tokenizer(self.assets.tokenizer)
        batch = masked_batch(len(tok), self.device)
        runs, layers = {}, ""
        for fp8 in (None, "tensorwise"):
            with rng_kept():
                settings = ModelSettings(init=dict(MODEL_INIT), tokenizer=self.assets.tokenizer)
                model = build_model(settings, tok, 0, self.device, True, compute_dtype=mode.autocast_dtype, fp8=fp8).to(self.device)
            runs[fp8] = loss_and_grads(model, lambda: loss_sum(model, batch, mode))
            layers = model.trainforge_fp8 or layers
        worst, gap, loss_gap = worst_gap(runs[None], runs["tensorwise"])
        if not layers.startswith("tensorwise") or " 0 linear" in layers:
            raise CheckFailed(f"no linear layer was converted to FP8 ({layers or 'none'})")
        if gap > FP8_TOL or loss_gap > FP8_TOL:
            raise CheckFailed(
                f"fp8 vs bf16: loss {runs['tensorwise'][0]:.5f} vs {runs[None][0]:.5f}; gradient of {worst} by {gap:.2e} "
                f"(relative norm; tolerance {FP8_TOL:.0e})"
            )
        return f"fp8 {layers} vs bf16: loss {loss_gap:.1e}, gradients {gap:.1e} (tol {FP8_TOL:.0e})"

    def _check_kernels(self, precision: str) -> str:
        """Liger's kernels (train.kernels: liger) against PyTorch's on the same weights and packed rows:
        the loss and every gradient, under ``precision``. CUDA with liger-kernel installed only."""
        from transformers.models.llama import modeling_llama

        from ...config.run import ModelSettings
        from ...engine.step import loss_sum
        from ...hardware.device import PRECISIONS as MODES
        from ...model.kernels import liger_installed
        from ...model.load import build_model
        from ...model.tokenizer import load_tokenizer

        if self.device.type != "cuda":
            raise Skip("CUDA only: Liger's Triton kernels need a GPU")
        if not liger_installed():
            raise Skip("liger-kernel is not installed: pip install 'trainforge[gpu]'")
        mode, tol = MODES[precision], self.tolerance(HEAD_GRAD_TOL, precision)
        tok = load_tokenizer(self.assets.tokenizer)
        batch = masked_batch(len(tok), self.device)
        patched = {n: getattr(modeling_llama, n) for n in ("apply_rotary_pos_emb", "LlamaRMSNorm", "LlamaMLP")}
        runs = {}
        try:
            for kernels in ("torch", "liger"):  # torch first: Liger replaces names in transformers' Llama module
                with rng_kept():
                    settings = ModelSettings(init=dict(MODEL_INIT), tokenizer=self.assets.tokenizer)
                    model = build_model(settings, tok, 0, self.device, mode.autocast_dtype is not None, kernels=kernels).to(self.device)
                loss = loss_sum(model, batch, mode)
                loss.backward()
                runs[kernels] = loss.item(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
        finally:
            for name, value in patched.items():
                setattr(modeling_llama, name, value)
        (loss_t, g_t), (loss_l, g_l) = runs["torch"], runs["liger"]
        worst, gap, loss_gap = worst_gap((loss_t, g_t), (loss_l, g_l))
        if gap > tol or loss_gap > tol:
            raise CheckFailed(
                f"liger vs torch under {precision}: loss {loss_l:.5f} vs {loss_t:.5f}; gradient of {worst} by {gap:.2e} "
                f"(relative norm; tolerance {tol:.0e})"
            )
        return f"liger vs torch: loss {loss_gap:.1e}, gradients {gap:.1e} (tol {tol:.0e})"
