"""Command line: parse, load the config, call one function.

Exit codes of ``trainforge train``: 0 done; 1 an unexpected error (a traceback); 2 bad input
(config, data, output directory, a checkpoint that does not fit); 3 stopped on non-finite
loss/gradients (train.max_skipped_steps in a row); 4 out of memory even at micro-batch 1;
75 stopped by SIGTERM/SIGINT after saving a checkpoint (EX_TEMPFAIL: run it again to resume).
A second signal ends the process at once, by the signal (128 + its number in a shell).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False)
err = Console(stderr=True, highlight=False)

EXIT_BAD_INPUT = 2
EXIT_NONFINITE = 3
EXIT_OUT_OF_MEMORY = 4
EXIT_INTERRUPTED = 75  # sysexits.h EX_TEMPFAIL: a temporary failure, retrying (resuming) is expected to work

TRAIN_EPILOG = (
    "Exit codes: 0 done; 1 unexpected error; 2 bad input (config, data, output dir, a checkpoint that does not "
    "fit); 3 stopped after train.max_skipped_steps non-finite steps in a row; 4 out of memory even at "
    "micro-batch 1; 75 stopped by SIGTERM/SIGINT after saving a checkpoint: run the same command to resume "
    "(a second signal stops at once, without saving)."
)


@app.callback()
def _root() -> None:
    """trainforge: train and fine-tune language models fast, and measure it."""


@app.command(epilog=TRAIN_EPILOG)
def train(
    config: Annotated[Optional[Path], typer.Argument(help="YAML config; omit for the built-in default demo")] = None,
    set_: Annotated[
        Optional[list[str]], typer.Option("--set", help="override a key: --set train.max_steps=100 (repeatable)")
    ] = None,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="run directory (default: runs/NAME-TIME)")] = None,
    resume: Annotated[
        str,
        typer.Option(
            "--resume",
            help="auto: continue from the newest complete checkpoint in --output; never: refuse a directory "
            "that holds a run; or a checkpoint / run directory to continue from",
        ),
    ] = "auto",
    nproc: Annotated[
        Optional[int],
        typer.Option(
            "--nproc",
            min=1,
            help="run data-parallel on this many processes of this machine (launches torchrun; "
            "for several machines run torchrun yourself: torchrun ... -m trainforge train CONFIG)",
        ),
    ] = None,
) -> None:
    """Train a model and write config.yaml, metrics.jsonl, checkpoints/, final/ and summary.json."""
    from .config import ConfigError, load_config

    try:
        cfg = load_config(config, set_ or [])
    except ConfigError as e:
        _fail(str(e))
    output = output or Path("runs") / f"{config.stem if config else 'default'}-{time.strftime('%Y%m%d-%H%M%S')}"
    if nproc is not None and nproc > 1:
        from .launch import launch

        args = [*([str(config)] if config else []), *(a for s in set_ or [] for a in ("--set", s))]
        raise typer.Exit(launch(nproc, [*args, "--output", str(output), "--resume", resume]))

    from .data.sources import DataError
    from .dist import DistError, launched_by_torchrun
    from .engine.nonfinite import NonFiniteError
    from .engine.oom import OutOfMemory
    from .engine.preempt import Interrupted
    from .engine.resume import ResumeError
    from .engine.trainer import OutputDirError
    from .engine.trainer import train as run_training

    worker = launched_by_torchrun()
    # errors every rank meets alike (the same data, config, run directory, loss) are printed by rank 0 only
    alike = worker and os.environ.get("RANK", "0") != "0"
    code = 1
    try:
        try:
            run_training(cfg, output, resume=resume)
            code = 0
        except (DataError, OutputDirError, ResumeError, DistError, ConfigError) as e:
            _fail(str(e), quiet=alike)
        except NonFiniteError as e:
            _fail(str(e), EXIT_NONFINITE, quiet=alike)
        except OutOfMemory as e:
            _fail(str(e), EXIT_OUT_OF_MEMORY)
        except Interrupted as e:
            _fail(str(e), EXIT_INTERRUPTED, label="stopped", quiet=alike)
        except Exception as e:
            if not (worker and _peer_failure(e)):
                raise
            # not this rank's fault: one line here, the failing rank shows its own error (and torchrun names it)
            _fail(f"rank {os.environ.get('RANK')}: stopping because another process of the job failed ({type(e).__name__})", 1)
    except typer.Exit as e:
        code = e.exit_code
        raise
    except BaseException:
        if worker:
            import traceback

            traceback.print_exc()
        raise
    finally:
        if worker:
            _end_worker(code)


def _end_worker(code: int) -> None:
    """A torchrun worker ends here: its exit code for ``--nproc``'s launcher, then ``os._exit``:
    the interpreter's own shutdown would free what is left of the process group's threads, which
    can hang (see dist.shutdown); everything the run writes is closed by now."""
    from .launch import record_exit_code

    record_exit_code(code)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _peer_failure(e: BaseException) -> bool:
    """A collective that failed because another rank died, hung or closed its connections."""
    import torch.distributed as dist

    text = str(e).lower()
    return isinstance(e, dist.DistError) or any(w in text for w in ("connection closed by peer", "connection reset by peer"))


@app.command()
def prepare(
    config: Annotated[Optional[Path], typer.Argument(help="YAML config; omit for the built-in default")] = None,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="override a key (repeatable)")] = None,
) -> None:
    """Tokenize, pack and cache the data only; a later `train` with the same data reuses the cache."""
    from .config import ConfigError, load_config

    try:
        cfg = load_config(config, set_ or [])
    except ConfigError as e:
        _fail(str(e))
    from .data.sources import DataError
    from .data.plan import prepare_only

    try:
        prepare_only(cfg)
    except DataError as e:
        _fail(str(e))


@app.command()
def bench(
    config: Annotated[Optional[Path], typer.Argument(help="YAML config; omit for the built-in default")] = None,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="override a key (repeatable)")] = None,
    sweep: Annotated[
        Optional[list[str]],
        typer.Option("--sweep", help="KEY=V1,V2,... (repeatable; combinations are crossed). Sweeping "
                     "train.micro_batch_size alone holds the global batch constant via grad_accum"),
    ] = None,
    steps: Annotated[int, typer.Option("--steps", min=1, help="measured optimizer steps per variant")] = 20,
    warmup: Annotated[int, typer.Option("--warmup", min=1, help="steps run before measuring")] = 5,
    synthetic: Annotated[bool, typer.Option("--synthetic", help="random-word documents instead of the config's data")] = False,
    out: Annotated[Optional[Path], typer.Option("--out", help="write the results as JSON here")] = None,
) -> None:
    """Measure tokens/s, MFU, peak memory and data wait of the training loop, per variant."""
    import json

    from rich.console import Console

    from .config import ConfigError
    from .tools.bench import bench as run_bench
    from .tools.bench import render

    try:
        results = run_bench(str(config) if config else None, set_ or [], sweep or [], steps, warmup, synthetic)
    except ConfigError as e:
        _fail(str(e))
    render(results, Console())
    if out:
        out.write_text(json.dumps(results, indent=2))
    if any("error" in r for r in results):
        raise typer.Exit(1)


@app.command()
def selftest(
    device: Annotated[
        str, typer.Option("--device", help="auto: CUDA when present, else CPU; or cpu, cuda, cuda:N")
    ] = "auto",
    quick: Annotated[
        bool, typer.Option("--quick", help="a subset: every precision and data shape, LoRA and the standard head; no compile")
    ] = False,
    out: Annotated[Optional[Path], typer.Option("--out", help="write every result (with per-step losses) as JSON here")] = None,
) -> None:
    """Train every path (precision x data x method x head, compiled) a few steps on a tiny model on this
    machine and check it against fp32; run it first on a new machine. Exit code 1 if any path fails."""
    import json
    import re

    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", device):
        _fail(f"--device {device!r}: use auto, cpu, cuda or cuda:N")
    from .hardware import describe, pick_device
    from .tools.selftest import results_json, run_selftest

    try:
        resolved = pick_device(device)
    except RuntimeError as e:  # --device cuda without CUDA
        _fail(str(e))
    results = run_selftest(str(resolved), quick)
    if out:
        out.write_text(json.dumps(results_json(results, describe(resolved)), indent=2))
    if not all(r.ok for r in results):
        raise typer.Exit(1)


@app.command()
def config(
    config: Annotated[Optional[Path], typer.Argument(help="YAML config; omit for the built-in default")] = None,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="override a key (repeatable)")] = None,
    reference: Annotated[bool, typer.Option("--reference", help="print every key with its default, as Markdown")] = False,
) -> None:
    """Print the resolved config (every default spelled out), or the reference of all keys."""
    from .config import ConfigError, load_config

    if reference:
        from .tools.config_reference import config_reference

        typer.echo(config_reference(), nl=False)
        return
    try:
        typer.echo(load_config(config, set_ or []).to_yaml(), nl=False)
    except ConfigError as e:
        _fail(str(e))


def _fail(message: str, code: int = EXIT_BAD_INPUT, label: str = "error", quiet: bool = False) -> None:
    """Print the message (unless ``quiet``: another process prints it) and exit with ``code``."""
    from rich.markup import escape

    if not quiet:
        # the message quotes user input, which may contain "[...]": escape it so rich shows it verbatim
        err.print(f"[bold red]{label}:[/bold red] {escape(message)}", soft_wrap=True)
    raise typer.Exit(code)


def main() -> None:
    app()


if __name__ == "__main__":
    sys.exit(main())
