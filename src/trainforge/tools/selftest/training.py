"""A training case: train it through ``engine.trainer.train``, check the run, compare it with fp32."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import torch

from .assets import Assets
from .cases import CHECKPOINT_EVERY, STEPS, Case, case_config
from .reporters import quiet
from .results import CheckFailed, Result, Skip
from .tolerances import GRAD_NORM_TOL, LOSS_TOL, MIN_DECREASE, fmt_values, relative_gap


class TrainingCases:
    """What ``SelfTest`` (runner.py) does for one training case; the runner provides the state below."""

    device: torch.device
    workdir: Path
    cache_dir: Path | None
    assets: Assets
    weights: dict[str, dict[str, torch.Tensor]]

    def _train_case(self, case: Case, result: Result) -> None:
        from ...config.run import RunConfig
        from ...engine.trainer import train
        from ...hardware.device import PRECISIONS as MODES
        from ...hardware.device import cuda_has_native_bf16
        from ...metrics.tracker import read_metrics
        from ...data.prompt import sample_prompt

        if case.precision == "bf16" and self.device.type == "cuda" and not cuda_has_native_bf16(self.device):
            raise Skip("this GPU has no bf16")
        out = self.workdir / case.name
        shutil.rmtree(out, ignore_errors=True)
        cfg = RunConfig.model_validate(case_config(case, self.assets, str(self.device), self.cache_dir))
        graphs_before = _compiled_graphs()
        run = train(cfg, out, quiet(), resume="never")
        steps = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
        result.losses = [r["loss"] for r in steps]
        result.grad_norms = [r["grad_norm"] for r in steps]
        s = run.summary
        result.tokens_per_s, result.eval_loss = s["tokens_per_s"], s["eval_loss"]
        self.weights[case.name] = {k: v.detach().to("cpu", copy=True) for k, v in run.model.state_dict().items()}

        if [r["step"] for r in steps] != list(range(1, STEPS + 1)):
            raise CheckFailed(f"metrics.jsonl has steps {[r['step'] for r in steps]}, expected 1..{STEPS}")
        bad = [i + 1 for i, loss in enumerate(result.losses) if not math.isfinite(loss)]
        if bad:
            raise CheckFailed(f"non-finite loss at steps {bad}: {fmt_values(result.losses)}")
        result.overflows = [i + 1 for i, g in enumerate(result.grad_norms) if not math.isfinite(g)]
        if result.overflows and case.precision != "fp16":
            raise CheckFailed(f"non-finite grad norm at steps {result.overflows}: {fmt_values(result.grad_norms)}")
        if s["skipped_steps"]:
            raise CheckFailed(f"{s['skipped_steps']} steps skipped as non-finite")
        if s.get("advice"):  # the live advisor must be silent on every healthy path: a warning here is a false alarm
            raise CheckFailed(f"the advisor warned on a healthy run: {', '.join(s['advice'])} (see {out / 'events.jsonl'})")
        self._check_scaler(case, result, out)
        # learning, robust to batch-to-batch noise: the training loss falls from the first half of
        # the run to the second, and the eval loss (the same batches before and after) falls clearly
        half = STEPS // 2
        first, second = sum(result.losses[:half]) / half, sum(result.losses[half:]) / (STEPS - half)
        if not second < first:
            raise CheckFailed(f"training loss did not decrease: mean {first:.4f} over steps 1-{half}, {second:.4f} after")
        before, after = s["eval_loss_before"], s["eval_loss"]
        if not (after is not None and math.isfinite(after) and after < (1 - MIN_DECREASE) * before):
            raise CheckFailed(f"eval loss {before} before training, {after} after: not finite or not {MIN_DECREASE:.0%} lower")
        saved = sorted(p.name for p in (out / "checkpoints").glob("step-*"))
        if saved != [f"step-{CHECKPOINT_EVERY:08d}", f"step-{STEPS:08d}"]:
            raise CheckFailed(f"checkpoints {saved}, expected steps {CHECKPOINT_EVERY} and {STEPS}")
        weights = "adapter_model.safetensors" if case.method == "lora" else "model.safetensors"
        if not ((out / "final" / weights).is_file() and (out / "final" / "tokenizer.json").is_file()):
            raise CheckFailed(f"final/ lacks {weights} or the tokenizer: {sorted(p.name for p in (out / 'final').iterdir())}")
        if case.compiled:
            if not s["compiled"] or _compiled_graphs() == graphs_before:
                raise CheckFailed("train.compile: true, but no graph was compiled: the decoder ran eagerly")
            return
        if not s.get("sample"):
            raise CheckFailed("no sample was generated at the end of the run")
        with MODES[case.precision].autocast(self.device):  # generation under mixed precision, as users may run it
            text = sample_prompt(run.model, run.tokenizer, "alpha beta", 6)
        if not text.startswith("alpha beta"):
            raise CheckFailed(f"a sample under {case.precision} autocast does not continue its prompt: {text!r}")

    def _check_scaler(self, case: Case, result: Result, out: Path) -> None:
        """fp16: the GradScaler ran, and each overflow (a step whose unscaled grad norm is not
        finite) was skipped and backed the scale off, exactly: the saved scale must be the initial
        one times the back-off factor once per overflow (no growth within ``STEPS`` steps).
        Other precisions: no loss scaling at all."""
        from ...rundir.checkpoint import load_checkpoint_state

        scaler = load_checkpoint_state(out / "checkpoints" / f"step-{STEPS:08d}").get("scaler")
        if case.precision != "fp16":
            if scaler is not None:
                raise CheckFailed(f"{case.precision} saved a GradScaler state: loss scaling is on where it must not be")
            return
        if scaler is None:
            raise CheckFailed("fp16 ran without a GradScaler: small gradients underflow, overflows reach the weights")
        initial = torch.amp.GradScaler(self.device.type).state_dict()["scale"]
        expected = initial * scaler["backoff_factor"] ** len(result.overflows)
        if scaler["scale"] != expected:
            raise CheckFailed(
                f"loss scale {scaler['scale']:g} after {len(result.overflows)} overflows (steps {result.overflows}), "
                f"expected {expected:g}: overflows were not handled by the scaler"
            )

    def _compare(self, case: Case, result: Result, reference: Result) -> None:
        if not reference.ok:
            result.fail(f"its fp32 reference {reference.name} failed: nothing to compare with")
            return
        if reference.status == "skipped":
            return
        # an fp16 overflow skips that step's update (correctly): from there on the run differs from
        # fp32 by design, so both are compared up to and including the first overflow's loss
        n = result.overflows[0] if result.overflows else STEPS
        result.loss_gap = relative_gap(result.losses[:n], reference.losses[:n])
        result.grad_norm_gap = relative_gap(result.grad_norms[: n - 1 if result.overflows else n], reference.grad_norms)
        tol, gtol = LOSS_TOL[case.precision], GRAD_NORM_TOL[case.precision]
        result.detail = f"grad norm vs fp32 {result.grad_norm_gap:.1e} (tol {gtol:.0e}), loss tol {tol:.0e}"
        if result.overflows:
            result.detail += f"; step {', '.join(map(str, result.overflows))} overflowed: skipped, scale lowered"
        if result.loss_gap > tol:
            result.fail(
                f"loss departs from fp32 by {result.loss_gap:.2%} (tolerance {tol:.2%}): "
                f"{fmt_values(result.losses)} vs fp32 {fmt_values(reference.losses)}"
            )
        if result.grad_norm_gap > gtol:
            result.fail(
                f"grad norm departs from fp32 by {result.grad_norm_gap:.2%} (tolerance {gtol:.2%}): "
                f"{fmt_values(result.grad_norms)} vs fp32 {fmt_values(reference.grad_norms)}"
            )


def _compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
