"""The live console: a progress bar (step, loss, tokens/s, ETA) on terminals, plain lines elsewhere."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from .by_source import describe_losses


class ConsoleReporter:
    def __init__(self, console: Console | None = None):
        # soft_wrap: a log line stays one line in files and pipes (no hard wrap at 80 columns)
        self.console = console or Console(highlight=False, soft_wrap=True)
        self.progress = Progress(
            TextColumn("step"),
            MofNCompleteColumn(),
            BarColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[tps]} tok/s"),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=self.console,
            disable=not self.console.is_terminal,  # a bar in a log file is noise; log lines suffice
        )
        self._task = None

    def info(self, message: str) -> None:
        self._print(message)

    def warn(self, message: str) -> None:
        self._print(f"warning: {message}")

    def _print(self, message: str) -> None:
        self.console.print(message, markup=False)  # samples and paths contain "[...]"; never markup
        self.console.file.flush()  # piped stdout is block-buffered: flush so `tail -f` and job logs stay live

    def start(self, total_steps: int, first_step: int = 0) -> None:
        self.progress.start()
        self._task = self.progress.add_task("train", total=total_steps, completed=first_step, loss="-", tps="-")

    def log_step(self, rec: dict[str, Any], total_steps: int, eta_s: float | None) -> None:
        loss, tps = f"{rec['loss']:.4f}", f"{rec['tokens_per_s']:,.0f}"
        if self._task is not None:
            self.progress.update(self._task, completed=rec["step"], loss=loss, tps=tps)
        eta = f" | ETA {_fmt_time(eta_s)}" if eta_s is not None else ""
        mfu = f" | MFU {rec['mfu']:.1%}" if rec.get("mfu") is not None else ""
        wait = f" | data {rec['data_wait_pct']:.1f}%" if "data_wait_pct" in rec else ""
        if "completion_length" in rec:  # grpo: reward, completion length, KL, clipping, the share of time sampling
            loss += f" | reward {rec['reward']:.3f} len {rec['completion_length']:.1f}" + (
                f" kl {rec['kl']:.4f}" if "kl" in rec else "") + f" clip {rec.get('clip_ratio', 0.0):.1%}" + (
                f" gen {min(rec['gen_s'] * rec['steps_per_s'], 1.0):.0%}" if "gen_s" in rec else "")
        elif "reward_accuracy" in rec:  # a preference objective: how often chosen wins, and by how much (KTO: its KL estimate)
            loss += f" | reward acc {rec['reward_accuracy']:.1%}" + (
                f" margin {rec['reward_margin']:.3f}" if "reward_margin" in rec else f" kl {rec.get('kl', float('nan')):.3f}")
        if "aux_loss" in rec:  # a mixture-of-experts model's router load-balancing loss (before its coefficient)
            loss += f" | aux {rec['aux_loss']:.4f}"
        if "z_loss" in rec:  # its router z-loss (Switch Transformers), before its coefficient
            loss += f" | z {rec['z_loss']:.4g}"
        if "expert_load_max" in rec:  # the worst layer's most-loaded expert's share of tokens, against an even load
            loss += f" | load max {rec['expert_load_max']:.1%} (even {rec['expert_load_even']:.1%})"
        loss += describe_losses(rec)  # a mixture of sources: each source's loss
        self._print(
            f"step {rec['step']:>{len(str(total_steps))}}/{total_steps} | loss {loss} | lr {rec['lr']:.2e} "
            f"| grad_norm {rec['grad_norm']:.3f} | {tps} tok/s{mfu}{wait}{eta}"
        )

    def advance(self, step: int) -> None:
        if self._task is not None:
            self.progress.update(self._task, completed=step)

    def stop(self) -> None:
        if self._task is not None:
            self.progress.stop()
            self._task = None


def _fmt_time(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"
