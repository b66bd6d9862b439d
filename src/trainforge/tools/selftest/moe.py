"""The mixture-of-experts checks (``moe-full-{p}``, ``moe-lora-{p}``): trainforge's experts path against eager.

A tiny Qwen2-MoE (routed experts as transformers 5's 3-D weights, a shared expert behind its own gate) is built from
a fixed seed and saved once per runner; ``full`` trains it whole, ``lora`` puts adapters on it through the target
selection a run uses (``all-linear``: attention, the shared expert and, through PEFT's ``target_parameters``, the
routed experts' ``gate_up_proj`` / ``down_proj``; the routers left out). One training step as a run takes it
(``build_model`` picks ``model.experts_implementation: auto``; ``forward_backward`` with the router's load-balancing
term, the fused head) is compared on the same weights with the model's own eager experts through transformers'
``loss`` with ``output_router_logits=True`` (mean cross-entropy + ``router_aux_loss_coef x aux``): the
cross-entropy, the aux loss and every gradient. On CUDA the device is all that changes: the rows check whatever
``auto`` picks there (eager for fp32 expert weights: the comparison is then of the aux term and the step alone).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from .assets import Assets, rng_kept
from .results import CheckFailed
from .tolerances import MOE_MASTERS_TOL, MOE_TOL

MOE_INIT = {
    "architecture": "qwen2_moe",
    "hidden_size": 32,
    "intermediate_size": 48,
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 24,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    # large enough that the aux term moves the routers' gradient by ~100%: a lost or misweighted term stands out
    "router_aux_loss_coef": 0.5,
}
MOE_ROWS = (128, 128, 100, 128)
"""Real tokens of each row of the check's batch (right-padded to the longest). ~500 tokens: a routing choice that
rounding flips (a near tie of two experts' scores) moves the gradients by ~1/tokens, not by percents."""


def moe_batch(vocab: int, device: torch.device):
    """Rows of random tokens, one document each, right-padded after ``MOE_ROWS`` real tokens (``real`` marks them);
    the trainforge batch and transformers' labels (the tokens themselves, padding ignored: it shifts them)."""
    from ...data.formats import IGNORE
    from ...data.loader import Batch

    width = max(MOE_ROWS)
    ids = torch.randint(2, vocab, (len(MOE_ROWS), width), generator=torch.Generator().manual_seed(2))
    real = torch.arange(width)[None, :] < torch.tensor(MOE_ROWS)[:, None]
    labels = torch.full_like(ids, IGNORE)
    for i, n in enumerate(MOE_ROWS):
        labels[i, : n - 1] = ids[i, 1:n]  # trainforge's labels are the next token already
    hf_labels = ids.masked_fill(~real, IGNORE)
    batch = Batch(ids, labels, None, sum(MOE_ROWS), int((labels != IGNORE).sum()), list(range(len(MOE_ROWS))), real=real)
    return batch.to(device), hf_labels.to(device)


class MoEChecks:
    """``_check_moe_full`` / ``_check_moe_lora``, dispatched by ``SelfTest.check``; the runner provides the state."""

    device: torch.device
    workdir: Path
    assets: Assets
    tolerance: Callable[[dict[str, float], str], float]

    def _moe_base(self) -> Path:
        """The tiny MoE as a model directory (LoRA adapts a pretrained model), saved once per runner: seeded weights,
        routers drawn wide so the experts' load is uneven and few tokens sit on a near tie between two experts."""
        from ...config.run import ModelSettings
        from ...model.load import build_model
        from ...model.tokenizer import load_tokenizer

        path = self.workdir / "moe-base"
        if not (path / "config.json").is_file():
            with rng_kept():
                model = build_model(ModelSettings(init=dict(MOE_INIT), tokenizer=self.assets.tokenizer),
                                    load_tokenizer(self.assets.tokenizer), 0, torch.device("cpu"), False)
                torch.manual_seed(3)
                with torch.no_grad():
                    for name, p in model.named_parameters():
                        if name.endswith("mlp.gate.weight"):
                            p.normal_(0, 0.5)
            model.save_pretrained(path)
        return path

    def _check_moe_full(self, precision: str) -> str:
        return self._moe_row("full", precision)

    def _check_moe_lora(self, precision: str) -> str:
        return self._moe_row("lora", precision)

    def _moe_row(self, method: str, precision: str) -> str:
        """One step of trainforge's path vs transformers' eager experts with the aux loss, on the same weights."""
        from ...config.run import LoraSettings, ModelSettings
        from ...engine.router_loss import AUX, router_loss_for, router_means
        from ...engine.step import TokenObjective, forward_backward
        from ...hardware.device import PRECISIONS as MODES
        from ...model.experts_forward import GROUPED_NAME
        from ...model.experts_impl import current, expert_weight_dtype, use_experts_implementation
        from ...model.load import build_model
        from ...model.tokenizer import load_tokenizer
        from .checks import loss_and_grads, worst_gap

        mode = MODES[precision]
        tok = load_tokenizer(self.assets.tokenizer)
        settings = ModelSettings(path=self._moe_base(), tokenizer=self.assets.tokenizer, method=method,
                                 lora=LoraSettings(r=4, alpha=8))
        with rng_kept():
            model = build_model(settings, tok, 0, self.device, mode.autocast_dtype is not None,
                                compute_dtype=mode.autocast_dtype).to(self.device)
            torch.manual_seed(1)
            with torch.no_grad():
                for n, p in model.named_parameters():
                    if "lora_B" in n:  # B starts at zero, which would make A's gradient zero on both paths
                        p.normal_(0, 0.05)
        chosen, why = model.trainforge_experts or (None, "")
        if chosen is None or current(model) != ("grouped_mm" if chosen == GROUPED_NAME else chosen):
            raise CheckFailed(f"the experts run {current(model)}, not the implementation chosen for them ({chosen})")
        # fp32 masters under autocast: the chosen path may multiply them unrounded where eager rounds to the half dtype
        masters = mode.autocast_dtype is not None and chosen != "eager" and expert_weight_dtype(model) == torch.float32
        tol = MOE_MASTERS_TOL if masters else self.tolerance(MOE_TOL, precision)
        router = router_loss_for(model)
        if router is None or not router.coef:
            raise CheckFailed("no router load-balancing loss was found for the model: the step would train without it")
        model.train()
        batch, hf_labels = moe_batch(len(tok), self.device)
        metrics: dict = {}
        model.zero_grad(set_to_none=True)
        ce = float(forward_backward(model, [batch], mode, self.device, objective=TokenObjective(router), metrics=metrics))
        step = {n: p.grad.detach().float() for n, p in model.named_parameters() if p.grad is not None}
        aux = router_means(metrics).get(AUX)
        use_experts_implementation(model, "eager", self.device)
        if current(model) != "eager":
            raise CheckFailed(f"the reference's experts run {current(model)}, not eager")
        out: dict = {}

        def transformers_loss(aux_on: bool) -> torch.Tensor:
            with mode.autocast(self.device):  # transformers' own loss: mean cross-entropy (+ coef x aux)
                o = model(input_ids=batch.input_ids, attention_mask=batch.real.long(), labels=hf_labels,
                          output_router_logits=aux_on, use_cache=False)
            out[aux_on] = o
            return o.loss

        reference = loss_and_grads(model, lambda: transformers_loss(True))
        without_aux = loss_and_grads(model, lambda: transformers_loss(False))
        if step.keys() != reference[1].keys() or not reference[1]:
            raise CheckFailed(f"gradients of different tensors: trainforge {sorted(step)}, eager {sorted(reference[1])}")
        missing = [part for part in ("experts", "self_attn") if not any(part in n for n in step)]
        if missing:  # LoRA: the experts' 3-D weights and attention must carry adapters, or the row checks less than it says
            raise CheckFailed(f"no trained weight in {' or '.join(missing)}: {sorted(step)}")
        ref_aux = float(out[True].aux_loss.detach())
        ref_ce = reference[0] - router.coef * ref_aux
        # the step's gradient is of ce + coef x aux (its value is the ce alone); its losses are compared one by one below
        worst, gap, _ = worst_gap(reference, (reference[0], step))
        ce_gap = abs(ce - ref_ce) / abs(ref_ce)
        aux_gap = abs((aux if aux is not None else float("nan")) - ref_aux) / max(abs(ref_aux), 1e-12)
        _, visible, _ = worst_gap(reference, without_aux)
        if not visible > 3 * tol:  # the aux term must move some gradient by far more than rounding, or it is unchecked
            raise CheckFailed(f"the aux loss moves no gradient by more than {visible:.1e}: the check cannot see it")
        if not (gap <= tol and ce_gap <= tol and aux_gap <= tol):
            got_aux = f"{aux:.5f}" if aux is not None else "not computed"
            raise CheckFailed(
                f"{method}: trainforge's step with experts {chosen} and transformers' eager experts with "
                f"output_router_logits differ under {precision}: loss {ce:.5f} vs {ref_ce:.5f}, aux {got_aux} vs "
                f"{ref_aux:.5f}; gradient of {worst} by {gap:.2e} (relative norm; tolerance {tol:.0e})"
            )
        why_tol = ", the experts' fp32 masters unrounded vs eager's bf16" if masters else ""
        path = f"{chosen} ({why}) vs eager" if chosen != "eager" else f"eager ({why}), as the reference"
        return (f"{path}: loss {ce_gap:.1e}, aux {aux_gap:.1e}, gradients {gap:.1e} (tol {tol:.0e}{why_tol}; "
                f"without the aux term {visible:.1e})")
