"""Running and reporting: ``SelfTest`` runs cases and checks; ``run_selftest``, its table and its JSON."""

from __future__ import annotations

import contextlib
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from ...stop import Interrupted, StopRequest
from ...hardware.device import cuda_has_native_bf16
from .assets import Assets, build_assets
from .cases import CHECKS, PRECISIONS, STEPS, Case, plan
from .checks import Checks
from .moe import MoEChecks
from .results import CheckFailed, Result, Skip
from .training import TrainingCases


def _error_text(e: BaseException) -> str:
    frames = traceback.extract_tb(e.__traceback__)
    where = next((f"{Path(f.filename).name}:{f.lineno}" for f in reversed(frames) if "/trainforge/" in f.filename), "")
    return f"{type(e).__name__}: {e}" + (f" (at {where})" if where else "")


class SelfTest(TrainingCases, Checks, MoEChecks):
    """Runs cases and checks on one device and remembers the results (each fp32 reference runs once)."""

    def __init__(
        self,
        device: str = "cpu",
        workdir: Path | None = None,
        cache_dir: Path | None = None,
        threads: int | None = 1,
        assets: Assets | None = None,
    ):
        """``workdir``: where the runs go (default: a temporary directory, removed by ``close``).
        ``cache_dir``: token, probe and asset cache (default: trainforge's, ``$TRAINFORGE_CACHE``).
        ``threads``: CPU threads while running. 1 by default: these tiny shapes run fastest on one
        core, and two threads sharing a busy machine wait on each other (measured 10-100x slower
        per op on 2 cores under load); None leaves torch's setting."""
        self.device = torch.device(device)
        self._tmp = None if workdir else tempfile.TemporaryDirectory(prefix="trainforge-selftest-")
        self.workdir = Path(workdir or self._tmp.name)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.cache_dir = cache_dir
        self.threads = threads if self.device.type == "cpu" else None
        self._assets = assets
        if self.device.type == "cuda":
            from ...hardware.device import configure_backends

            configure_backends(self.device)  # as every run does (TF32 matmuls on Ampere+): checks see the same numerics
        self.results: dict[str, Result] = {}
        self.weights: dict[str, dict[str, torch.Tensor]] = {}  # final weights of each finished case

    @property
    def assets(self) -> Assets:
        if self._assets is None:
            from ...config.data import default_cache_dir

            with self._threads():
                self._assets = build_assets((self.cache_dir or default_cache_dir()) / "selftest", self.cache_dir)
        return self._assets

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()

    def tolerance(self, table: dict[str, float], precision: str) -> float:
        """``table[precision]``; "fp32" on a GPU with TF32 matmuls on has fp16's unit roundoff (10 bits)."""
        if precision == "fp32" and self.device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
            return table["fp16"]
        return table[precision]

    @contextlib.contextmanager
    def _threads(self) -> Iterator[None]:
        before = torch.get_num_threads()
        if self.threads:
            torch.set_num_threads(self.threads)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    def _attempt(self, result: Result, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` into ``result``: a failure is recorded, never raised (the matrix goes on); a stop by
        SIGTERM/SIGINT is raised (it stops the whole selftest, not just the path it arrived in)."""
        t = time.perf_counter()
        try:
            with self._threads():
                return fn()
        except Interrupted:
            raise
        except Skip as e:
            result.status, result.detail = "skipped", str(e)
        except CheckFailed as e:
            result.fail(str(e))
        except Exception as e:  # noqa: BLE001 - every failure is reported with where it happened
            result.fail(_error_text(e))
        finally:
            result.seconds += time.perf_counter() - t
        return None

    # ---------------------------------------------------------------- training cases

    def case(self, case: Case) -> Result:
        """Train ``case`` (its fp32 reference first), check it, remember the result."""
        if case.name in self.results:
            return self.results[case.name]
        reference = self.case(case.reference) if case != case.reference else None
        result = Result(case.name, "train")
        self._attempt(result, lambda: self._train_case(case, result))
        if result.status == "ok" and reference is not None:
            self._compare(case, result, reference)
        self.results[case.name] = result
        return result


    # ---------------------------------------------------------------- checks

    def check(self, name: str) -> Result:
        """Run one check of ``CHECKS`` and remember its result."""
        if name in self.results:
            return self.results[name]
        if name not in CHECKS:
            raise ValueError(f"unknown check {name!r}; known: {', '.join(CHECKS)}")
        kind, _, precision = name.rpartition("-")
        if precision not in PRECISIONS:
            kind, precision = name, "fp32"
        result = Result(name, "check")
        if precision == "bf16" and self.device.type == "cuda" and not cuda_has_native_bf16(self.device):
            result.status, result.detail = "skipped", "this GPU has no bf16"
        else:
            detail = self._attempt(result, lambda: getattr(self, "_check_" + kind.replace("-", "_"))(precision))
            if result.status == "ok":
                result.detail = detail
        self.results[name] = result
        return result


    # ---------------------------------------------------------------- everything

    def run(self, cases: list[Case], checks: list[str], on_result: Callable[[Result], None] | None = None,
            stop: StopRequest | None = None) -> list[Result]:
        """Every case, then every check, in order; ``on_result`` sees each result as it comes. ``stop``: a signal
        outside a training run (a check, the assets) stops it before the next item (one inside a run stops the run)."""
        for item in [*cases, *checks]:
            if stop is not None and stop.requested:
                raise Interrupted(f"{stop.name} between paths", stop.name)
            seen = set(self.results)
            self.case(item) if isinstance(item, Case) else self.check(item)
            for name in self.results:
                if name not in seen and on_result:
                    on_result(self.results[name])
        wanted = [c.name for c in cases] + list(checks)
        return [self.results[n] for n in wanted]


def run_selftest(device: str = "auto", quick: bool = False, console=None, cache_dir: Path | None = None) -> list[Result]:
    """``trainforge selftest``: run the matrix and the checks on ``device``, print the table and
    any failure; returns the results (the caller turns failures into the exit code)."""
    from rich.console import Console
    from rich.markup import escape
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from transformers.utils import logging as hf_logging

    from ...hardware.device import describe, pick_device

    if console is None:
        console = Console(highlight=False)
        if not console.is_terminal:  # a log file or a pipe: wide enough for the table's details
            console.width = max(console.width, 160)
    dev = pick_device(device)
    cases, checks = plan(dev, quick)
    where = "cpu (1 thread: fastest for these tiny shapes)" if dev.type == "cpu" else describe(dev)
    console.print(
        f"trainforge selftest on {where}, torch {torch.__version__}: {len(cases)} training paths "
        f"({'the quick subset' if quick else 'the full matrix'}, {STEPS} steps each on a tiny Llama) and {len(checks)} checks"
    )
    if any(c.compiled for c in cases):
        console.print("  the compiled case takes tens of seconds the first time (torch caches the compiled graphs)")
    hf_logging.disable_progress_bar()
    st = SelfTest(str(dev), cache_dir=cache_dir)
    progress = Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console, transient=True, disable=not console.is_terminal,
    )
    task = progress.add_task("preparing", total=len(cases) + len(checks))
    t = time.perf_counter()

    def advance(r: Result) -> None:
        progress.update(task, advance=1, description=r.name)
        if not console.is_terminal:  # a log: one line per path as it ends, so a run cut off by a time limit still says how far it got
            console.print(f"  {r.status} {r.name} ({r.seconds:.1f}s)" + ("" if r.ok else f": {escape(r.error)}"), soft_wrap=True)

    try:
        # a signal while no run holds its own handler (a check, the assets) stops selftest before the next path
        with progress, StopRequest("stopping selftest after the path it is on (send it again to stop at once)") as stop:
            results = st.run(cases, checks, advance, stop)
    except Interrupted as e:  # the path it arrived in saved a checkpoint in the temporary workdir: nothing to resume
        finished = list(st.results.values())
        if finished:
            console.print(render_table(finished))
        raise Interrupted(f"selftest stopped by {e.signal_name or 'a signal'} after {len(finished)} of "
                          f"{len(cases) + len(checks)} paths and checks; nothing was saved: run it again to check every path",
                          e.signal_name) from None
    finally:
        st.close()
    console.print(render_table(results))
    failed = [r for r in results if not r.ok]
    for r in failed:
        console.print(f"[bold red]FAILED[/bold red] {r.name}: {escape(r.error)}", soft_wrap=True)
    skipped = sum(r.status == "skipped" for r in results)
    verdict = f"{len(failed)} of {len(results)} FAILED" if failed else f"all {len(results) - skipped} passed"
    console.print(
        f"selftest: {verdict}" + (f", {skipped} skipped" if skipped else "") + f" in {time.perf_counter() - t:.0f}s",
        style="bold red" if failed else "bold green",
    )
    return results


def render_table(results: list[Result]):
    """path | result | loss vs fp32 | tokens/s | time | detail (the error of a failure)."""
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="trainforge selftest")
    table.add_column("path", no_wrap=True)
    table.add_column("result", no_wrap=True)
    table.add_column("loss vs fp32", justify="right", no_wrap=True)
    table.add_column("tokens/s", justify="right", no_wrap=True)
    table.add_column("time", justify="right", no_wrap=True)
    table.add_column("detail", overflow="fold")
    for r in results:
        status = {"ok": "[green]ok[/green]", "FAILED": "[bold red]FAILED[/bold red]", "skipped": "[dim]skipped[/dim]"}[r.status]
        if r.loss_gap is not None:
            gap = f"{100 * r.loss_gap:.2g}%"
        else:
            gap = "reference" if r.kind == "train" and r.name.startswith("fp32-") and r.status == "ok" else ""
        tps = f"{r.tokens_per_s:,.0f}" if r.tokens_per_s else ""
        table.add_row(r.name, status, gap, tps, f"{r.seconds:.1f}s", escape(r.detail if r.ok else r.error))
    return table


def results_json(results: list[Result], device: str) -> dict[str, Any]:
    """The ``--out`` file: the device and every result with its per-step losses."""
    from ... import __version__

    return {
        "trainforge_version": __version__,
        "torch_version": torch.__version__,
        "device": device,
        "passed": all(r.ok for r in results),
        "results": [asdict(r) for r in results],
    }
