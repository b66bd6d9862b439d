"""Command line: parse, load the config, call one function.

Every error a user can act on is a ``TrainforgeError`` (errors.py), which names its exit code; the
codes are listed once, in ``errors.EXIT_CODES``. A second signal ends the process at once, by the
signal (128 + its number in a shell).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from .hardware.allocator import prefer_expandable_segments
from .errors import EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_PLAN_ERROR, EXIT_UNEXPECTED, TrainforgeError, exit_codes_text

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False)
err = Console(stderr=True, highlight=False)

QUIET_RANK_GRACE_S = 5.0  # a torchrun worker that leaves a shared error to rank 0 waits this long before exiting
TRAIN_EPILOG = "Exit codes: " + exit_codes_text()
PLAN_EPILOG = (
    f"Exit codes: 0 no finding is an error; {EXIT_PLAN_ERROR} a finding is an error (the run as planned would fail: "
    f"it does not fit, the device cannot do it, ...; each finding names its fix); {EXIT_BAD_INPUT} bad input "
    f"(config, unknown --hardware); {EXIT_UNEXPECTED} --measure's real steps failed, or an unexpected error."
)


@app.callback()
def _root() -> None:
    """trainforge: train and fine-tune language models fast, and measure it."""
    prefer_expandable_segments()  # before anything starts CUDA: its allocator reads the setting once


@app.command(epilog=TRAIN_EPILOG)
def train(
    config: Annotated[Optional[Path], typer.Argument(help="YAML config; omit for the built-in default demo")] = None,
    set_: Annotated[
        Optional[list[str]], typer.Option("--set", help="override a key: --set train.max_steps=100 (repeatable)")
    ] = None,
    preset: Annotated[
        Optional[str], typer.Option("--preset", help="smoke (prove the config in about a minute) or production: laid over the config, beneath --set")
    ] = None,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="run directory (default: runs/NAME-TIME)")] = None,
    resume: Annotated[str, typer.Option("--resume", help="auto: continue from the newest complete checkpoint in --output; never: "
                                         "refuse a directory that holds a run; or a checkpoint / run directory to continue from")] = "auto",
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
    from .config.run import load_config

    with user_errors():
        cfg = load_config(config, set_ or [], preset=preset)
    output = output or Path("runs") / f"{config.stem if config else 'default'}-{time.strftime('%Y%m%d-%H%M%S')}"
    if nproc is not None and nproc > 1:
        from .launch import launch

        args = [*([str(config)] if config else []), *(["--preset", preset] if preset else []), *(a for s in set_ or [] for a in ("--set", s))]
        raise typer.Exit(launch(nproc, [*args, "--output", str(output), "--resume", resume]))

    from .dist import launched_by_torchrun, peer_failure
    from .engine.oom import OutOfMemory
    from .engine.trainer import train as run_training
    from .launch import wait_for_rank_zero

    worker = launched_by_torchrun()
    # errors every rank meets alike (the same data, config, run directory, loss) are printed by rank 0 only
    alike = worker and os.environ.get("RANK", "0") != "0"
    code = 1
    try:
        try:
            run_training(cfg, output, resume=resume)
            code = 0
        except TrainforgeError as e:
            # out of memory is one rank's own (unless rank 0 decided it for all): every rank says so; others: rank 0 speaks
            quiet = alike and (not isinstance(e, OutOfMemory) or getattr(e, "decided_by_rank_zero", False))
            if quiet:  # torchrun stops every process as soon as one exits: let rank 0 print the shared error first
                wait_for_rank_zero(QUIET_RANK_GRACE_S)
            _fail_with(e, quiet=quiet)
        except Exception as e:
            if not (worker and peer_failure(e)):
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


@app.command()
def prepare(
    config: Annotated[Optional[Path], typer.Argument(help="YAML config; omit for the built-in default")] = None,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="override a key (repeatable)")] = None,
) -> None:
    """Tokenize, pack and cache the data only; a later `train` with the same data reuses the cache.
    SIGTERM/SIGINT stops it at the next chunk of rows, nothing cached (exit 75)."""
    from .config.run import load_config
    from .data.plan import PREPARE_STOPPING, prepare_only
    from .engine.row_length import resolve_here
    from .stop import StopRequest

    with user_errors():
        cfg = resolve_here(load_config(config, set_ or []))  # data.max_length: auto, as train takes it
        with StopRequest(PREPARE_STOPPING) as stop:
            prepare_only(cfg, stop=stop)


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
    from rich.console import Console

    from .tools.bench import bench as run_bench
    from .tools.bench import render

    _check_json_out(out)
    with user_errors():
        results = run_bench(str(config) if config else None, set_ or [], sweep or [], steps, warmup, synthetic)
    render(results, Console())
    _write_json_out(out, results)
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
    import re

    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", device):
        _fail(f"--device {device!r}: use auto, cpu, cuda or cuda:N")
    from .hardware.device import describe, pick_device
    from .tools.selftest import results_json, run_selftest

    _check_json_out(out)
    with user_errors():  # --device cuda without CUDA; a SIGTERM/SIGINT stops it (exit 75)
        resolved = pick_device(device)
        results = run_selftest(str(resolved), quick)
    _write_json_out(out, results_json(results, describe(resolved)))
    if not all(r.ok for r in results):
        raise typer.Exit(1)


@app.command(epilog=PLAN_EPILOG)
def plan(
    config: Annotated[Optional[Path], typer.Argument(help="YAML config; omit for the built-in default")] = None,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="override a key (repeatable)")] = None,
    preset: Annotated[
        Optional[str], typer.Option("--preset", help="smoke (prove the config in about a minute) or production: laid over the config, beneath --set")
    ] = None,
    hardware: Annotated[
        str, typer.Option("--hardware", help="a profile name (h100, a100-80gb, rtx4070, t4, ...), 'this' (the local machine), or 'list'")
    ] = "this",
    nproc: Annotated[int, typer.Option("--nproc", min=1, help="plan for this many data-parallel processes (one device each)")] = 1,
    json_out: Annotated[bool, typer.Option("--json", help="print the plan as one JSON object")] = False,
    measure: Annotated[
        bool, typer.Option("--measure", help="then run a few real steps at the planned settings here, longest rows first, and compare")
    ] = False,
    measure_steps: Annotated[int, typer.Option("--measure-steps", min=1, help="timed steps of --measure")] = 5,
    longest: Annotated[bool, typer.Option("--longest", help="only the longest data.max_length that fits at micro-batch 1, and what each lever buys")] = False,
) -> None:
    """Predict peak memory, speed and run time before training, on this machine or any hardware profile;
    print the decisions the run would take and what in the config will fail or waste time."""
    import json

    from rich.console import Console

    from .config.run import load_config

    console = Console(highlight=False, soft_wrap=True)
    if hardware.lower() == "list":
        from .tools.plan import render_profiles

        if json_out:
            from .hardware.profiles import describe_profiles

            typer.echo(json.dumps(describe_profiles(), indent=2))
        else:
            render_profiles(console)
        return
    if measure and (hardware.lower() != "this" or nproc > 1):
        _fail("--measure runs real steps on this machine in one process: use it with --hardware this and no --nproc")
    with user_errors():
        cfg = load_config(config, set_ or [], plan_only=not measure, preset=preset)
    if longest:  # a search over the memory model alone (tools/plan_longest.py)
        from .tools.plan_longest import print_longest

        with user_errors(ValueError):  # an unknown --hardware profile is a ValueError
            return print_longest(cfg, hardware, nproc, json_out, console)
    from .tools.plan import make_plan, render
    from .tools.plan_measure import measure as run_measure
    from .tools.plan_measure import render_measured

    with user_errors(ValueError):  # an unknown --hardware profile is a ValueError
        result = make_plan(cfg, hardware, nproc)
    if measure:
        with user_errors():  # SIGTERM/SIGINT stops the measurement (exit 75)
            result["measured"] = run_measure(str(config) if config else None, set_ or [], result, measure_steps)
    if json_out:
        typer.echo(json.dumps(result, indent=2, default=str))
    else:
        render(result, console)
        if measure:
            render_measured(result, result["measured"], console)
    if any(f["level"] == "error" for f in result["findings"]):
        raise typer.Exit(EXIT_PLAN_ERROR)
    if "error" in result.get("measured", {}):
        raise typer.Exit(EXIT_UNEXPECTED)


@app.command()
def config(
    config: Annotated[Optional[Path], typer.Argument(help="YAML config; omit for the built-in default")] = None,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="override a key (repeatable)")] = None,
    preset: Annotated[
        Optional[str], typer.Option("--preset", help="smoke (prove the config in about a minute) or production: laid over the config, beneath --set")
    ] = None,
    reference: Annotated[bool, typer.Option("--reference", help="print every key with its default, as Markdown")] = False,
) -> None:
    """Print the resolved config (every default spelled out), or the reference of all keys."""
    from .config.run import load_config

    if reference:
        from .tools.config_reference import config_reference

        typer.echo(config_reference(), nl=False)
        return
    with user_errors():
        typer.echo(load_config(config, set_ or [], preset=preset).to_yaml(), nl=False)


MODEL_ARG_HELP = "a run directory (its final/), a Hugging Face model directory, or a LoRA adapter directory"
GENERATE_EPILOG = (
    "--chat reads the conversation from stdin: JSON (a list of {\"role\", \"content\"} messages, or "
    "{\"messages\": [...]}) or lines 'user: ...', 'assistant: ...', 'system: ...' (a line without a role continues "
    "the turn above; text without any role is one user turn). The model's reply is rendered with the chat template "
    "it was trained with. Encoder-decoder models (T5, BART, ...) read the prompt, or the rendered conversation, with "
    "their encoder, as training read sources; the text is their decoder's. Exit code 2: the directory is not a model, "
    "or the input is malformed."
)


@app.command(epilog=GENERATE_EPILOG)
def generate(
    model: Annotated[Path, typer.Argument(help=MODEL_ARG_HELP)],
    prompt: Annotated[Optional[str], typer.Option("--prompt", "-p", help="text to continue (an encoder-decoder: its input)")] = None,
    chat: Annotated[bool, typer.Option("--chat", help="answer the conversation read from stdin (see below)")] = False,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", min=1, help="tokens to generate at most")] = 128,
    temperature: Annotated[float, typer.Option("--temperature", min=0.0, help="0: greedy; higher: more varied (top-k 50)")] = 0.7,
    seed: Annotated[int, typer.Option("--seed", help="seeds sampling: the same seed gives the same text")] = 0,
    device: Annotated[str, typer.Option("--device", help="auto (CUDA when present), cpu, cuda, cuda:N")] = "auto",
    precision: Annotated[
        Optional[str], typer.Option("--precision", help="bf16, fp16 or fp32 (default: the run's, else auto)")
    ] = None,
) -> None:
    """Generate text: continue --prompt, or reply to the chat turns on stdin (--chat); the text streams
    to stdout as it is generated, everything else goes to stderr."""
    if (prompt is None) == (not chat):
        _fail("give exactly one of --prompt TEXT or --chat (turns on stdin)")
    if precision is not None and precision not in ("bf16", "fp16", "fp32", "auto"):
        _fail(f"--precision {precision!r}: use bf16, fp16, fp32 or auto")
    from .tools.generate import run_generate

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()  # stream: each piece reaches the terminal (or pipe) as it is generated

    with user_errors():
        run_generate(
            model, prompt, sys.stdin.read() if chat else None, max_new_tokens, temperature, seed, device, precision,
            write, _stderr_reporter(),
        )
    sys.stdout.write("\n")


@app.command(name="eval")
def eval_(
    model: Annotated[Path, typer.Argument(help=MODEL_ARG_HELP)],
    data: Annotated[str, typer.Option("--data", help="JSONL/Parquet/text file, directory or glob to evaluate on")],
    set_: Annotated[
        Optional[list[str]],
        typer.Option("--set", help="override a key of the run's config (data.max_length=512, data.format=chat, "
                     "train.micro_batch_size=4, train.precision=fp32, ...; repeatable)"),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the figures as one JSON object")] = False,
) -> None:
    """Loss, perplexity and token count of a model on a dataset, through the training data pipeline and masks
    (completion-only / assistant-only as the run trained). On a run directory its data settings and precision
    apply; on the run's eval file the loss equals the run's final eval_loss where the run evaluated every batch
    (train.eval_max_batches: null; auto evaluates a share). Progress goes to stderr."""
    import json

    from .tools.evaluate import evaluate_model, render

    with user_errors():
        result = evaluate_model(model, data, set_ or [], _stderr_reporter())
    typer.echo(json.dumps(result) if as_json else render(result))


@app.command()
def export(
    model: Annotated[Path, typer.Argument(help="a run directory, a LoRA adapter directory or a model directory")],
    out: Annotated[Path, typer.Option("--out", "-o", help="directory to write (new, or empty); --format gguf: a new NAME.gguf")],
    merge: Annotated[bool, typer.Option("--merge", help="fold the LoRA/DoRA/QLoRA adapter into its base: a plain HF model (a full model is written as one)")] = False,
    dtype: Annotated[Optional[str], typer.Option("--dtype", help="bf16, fp16 or fp32 for the merged (or full) model; default: the base's")] = None,
    format_: Annotated[str, typer.Option("--format", help="hf (a Hugging Face directory) or gguf (one file for llama.cpp / Ollama; adapters are merged)")] = "hf",
    quant: Annotated[Optional[str], typer.Option("--quant", help="with --format gguf: f16 (default), bf16 or q8_0")] = None,
    ollama: Annotated[Optional[Path], typer.Option("--ollama", help="with --format gguf: also write an Ollama Modelfile in this directory")] = None,
) -> None:
    """Export a model: with --merge a plain HF directory that loads without PEFT; without, the adapter or model copied
    with its tokenizer; with --format gguf, one GGUF file (merged, tokenizer, chat template), optionally a Modelfile."""
    from .tools.export import export_any

    with user_errors():
        export_any(model, out, merge, dtype, format_, quant, ollama, _stderr_reporter())


def _stderr_reporter():
    """Progress lines on stderr: stdout carries only the command's result (text, figures, JSON)."""
    from .metrics.console import ConsoleReporter

    return ConsoleReporter(Console(stderr=True, highlight=False, soft_wrap=True))


@app.command()
def report(
    run_dirs: Annotated[list[Path], typer.Argument(help="one run directory, or several to compare", show_default=False)],
    out: Annotated[
        Optional[Path],
        typer.Option("--out", "-o", help="HTML file to write (default: RUN_DIR/report.html for one run, ./report.html for several)"),
    ] = None,
) -> None:
    """Write one self-contained HTML page of a run's curves (loss, learning rate, grad norm, tokens/s,
    MFU, memory, data wait; resumes, checkpoints, out-of-memory back-offs and skipped steps marked);
    with several runs, the curves overlaid and their summaries side by side, config differences first."""
    from .metrics.report import write_report

    with user_errors():
        path = write_report(run_dirs, out, warn=lambda note: err.print(f"warning: {note}", markup=False, soft_wrap=True))
    typer.echo(f"wrote {path}")


@app.command()
def doctor(
    run_dir: Annotated[Path, typer.Argument(help="a run directory (the --output of trainforge train)", show_default=False)],
    as_json: Annotated[bool, typer.Option("--json", help="print the diagnosis as JSON")] = False,
    verify: Annotated[
        Optional[bool], typer.Option("--verify/--no-verify", help="read the checkpoints and check them as a resume does "
                                     "(default: where the newest is at most 2 GiB)", show_default=False)
    ] = None,
) -> None:
    """Diagnose a run from its files, finished, stopped, running or killed: its state and step, the checkpoint a
    rerun resumes from, the environment, config problems, the time estimate against what happened, what
    limited it and the advice given while it ran."""
    from .tools.doctor import diagnose, render, render_json

    with user_errors():
        found = diagnose(run_dir, verify)
    typer.echo(render_json(found) if as_json else render(found))


@contextlib.contextmanager
def user_errors(*also: type[Exception]) -> Iterator[None]:
    """Turn a ``TrainforgeError`` (or one of ``also``, as bad input) into its message on stderr and its exit code."""
    try:
        yield
    except TrainforgeError as e:
        _fail_with(e)
    except also as e:
        _fail(str(e))


def _check_json_out(out: Path | None) -> None:
    """Before minutes of work: ``--out`` can be written (its directory made, the path not a directory), else exit 2."""
    if out is None:
        return
    if out.is_dir():
        _fail(f"--out {out} is a directory; give a file path for the JSON (e.g. {out / 'results.json'})")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        _fail(f"--out {out}: cannot make its directory: {e.strerror or e}")
    if not os.access(out.parent, os.W_OK) or (out.exists() and not os.access(out, os.W_OK)):
        _fail(f"--out {out}: not writable here; give a path you can write")


def _write_json_out(out: Path | None, results: object) -> None:
    """``results`` as JSON at ``out`` (whole or not at all); a failure (disk full) names the path, exit 2."""
    import json

    from .rundir.atomic import atomic_write_text

    if out is None:
        return
    try:
        atomic_write_text(out, json.dumps(results, indent=2))
    except OSError as e:
        _fail(f"cannot write --out {out}: {e.strerror or e} (the results are in the table above)")


def _fail_with(e: TrainforgeError, quiet: bool = False) -> None:
    _fail(str(e), e.exit_code, e.label, quiet)


def _fail(message: str, code: int = EXIT_BAD_INPUT, label: str = "error", quiet: bool = False) -> None:
    """Print the message (unless ``quiet``: another process prints it) and exit with ``code``."""
    from rich.markup import escape

    if not quiet:
        # the message quotes user input, which may contain "[...]": escape it so rich shows it verbatim
        err.print(f"[bold red]{label}:[/bold red] {escape(message)}", soft_wrap=True)
    raise typer.Exit(code)


def _stop_early(signum: int, frame: object) -> None:
    """SIGTERM/SIGINT where no command's own stop handling runs (before a run installs it, or in a command without
    one): exit 75 with a line. SystemExit passes every ``except Exception`` on the way (and click), and unwinds
    through the ``finally`` blocks that remove temporaries; os.write, not the console: a handler can interrupt a
    print that holds the console's lock."""
    import signal

    # it also stands where a command's own handling has ended (after a run saved, while its process group shuts down):
    # "nothing more was saved" holds either way
    os.write(2, f"stopped: {signal.Signals(signum).name}; nothing more was saved (what was saved before stays); "
                "run the same command again\n".encode())
    raise SystemExit(EXIT_INTERRUPTED)


def main() -> None:
    """The command line. A signal before a command's own handling is installed (imports, config, probes take a few
    seconds) stops it with exit 75 and a line saying nothing was saved, not a bare 143 or a KeyboardInterrupt."""
    import signal

    from .library_logs import quiet_library_logs

    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, _stop_early)
    quiet_library_logs()
    app()


if __name__ == "__main__":
    sys.exit(main())
