"""The lifecycle of a run, one for every tool: ``open_run`` (setup) -> ``train_loop(run, n)`` (steps) -> ``finish``.

``train`` is the three in a row. ``bench``, ``plan --measure`` and ``selftest`` use the same
calls and never reach into a run's internals; ``setup`` (engine/setup.py) builds the run.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from .. import __version__
from ..hardware.allocator import allocator_settings, expandable_segments_in_effect
from ..rundir.checkpoint import atomic_write_dir
from ..config.run import RunConfig
from ..data.formats import trained_chat_template
from ..data.loader import Batch
from ..data.prompt import sample_prompt
from ..dist import init_distributed, shutdown
from ..model.adapter_keys import save_model
from ..hardware.device import describe, peak_memory_bytes, pick_device
from ..metrics.console import ConsoleReporter
from ..metrics.profile import StepProfile, describe_split
from ..model.compile import compile_decoder
from ..model.load import count_parameters, weight_storage
from ..rundir.writing import writing
from ..rundir.lock import OutputDirError, hold_run_dir
from ..metrics.limits import describe_limits, rank_limits
from .advisor import RunTimes
from .evaluate import evaluate, planned_evals
from .mfu import follow_threads, run_mfu, window_mfu
from .nonfinite import final_weights_check
from .objective import mean_metrics
from .router_loss import router_means
from ..data.mixture import source_names
from ..metrics.by_source import describe_losses, source_losses
from .oom import fetch_step, forward_backward_adaptive
from .optim import measured_state_bytes
from .ending import eval_stop, record_failure, stop_before_first_step, stop_on_signal, write_report
from ..stop import Interrupted, StopRequest
from .resume import length_key, refuse_changed_settings, wrote_its_end
from .run import Run, RunResult
from .setup import setup
from .sharded import full_model_state
from .step import forward_backward, optimizer_step

__all__ = ["OutputDirError", "Run", "RunResult", "finish", "open_run", "probe_step", "rewind_data", "train", "train_loop"]


def train(
    cfg: RunConfig, output_dir: Path, reporter: ConsoleReporter | None = None, resume: str = "auto"
) -> RunResult:
    """Train a model as ``cfg`` says, writing the run directory; returns the trained model too.

    ``resume``: ``auto`` continues from the newest complete checkpoint in ``output_dir``,
    ``never`` refuses a directory that holds a run, a path names the checkpoint to continue.
    """
    with open_run(cfg, output_dir, reporter, resume) as run:
        if finished_before(run):  # the same command again after the run ended: nothing to train or rewrite
            return RunResult(run.out, json.loads((run.out / "summary.json").read_text()), run.model, run.tokenizer)
        train_loop(run)
        run.saver.close()  # the end-of-run checkpoint is reported before final/ and the summary
        return finish(run)


def finished_before(run: Run) -> bool:
    """The run directory holds this run finished (its last checkpoint at train.max_steps, final/ and
    summary.json written): said, with what to do to train more."""
    if run.resumed_from is None or run.step < run.max_steps:
        return False
    if not wrote_its_end(run.out):
        return False  # stopped after its last step, before final/: finish now
    key = length_key(run.cfg)  # an epochs run trains on with more epochs, or with train.max_steps in their place
    run.reporter.info(
        f"{run.out} holds this run finished: {run.step} steps ({key}), its model in {run.out / 'final'}; "
        f"nothing to train. To train on, raise {key}; to train again, give another --output"
    )
    return True


@contextlib.contextmanager
def open_run(
    cfg: RunConfig,
    output_dir: Path,
    reporter: ConsoleReporter | None = None,
    resume: str = "auto",
    stop: StopRequest | None = None,
) -> Iterator[Run]:
    """Set up a run holding its run directory (one writer: rundir/lock.py), under torchrun in its process
    group; on leaving, close what it opened: pending checkpoint, console, report.html, metrics, the group.

    ``stop``: who asks the run to stop; by default SIGTERM/SIGINT do, for the block.
    """
    completed = False
    ctx = init_distributed(pick_device(cfg.train.device).type, cfg.train.dist_timeout_s)
    try:
        if not ctx.is_main:  # only rank 0 prints
            from rich.console import Console

            reporter = ConsoleReporter(Console(quiet=True))
        output_dir = ctx.broadcast_object(Path(output_dir))  # a default name holds the time: rank 0's wins
        reporter = reporter or ConsoleReporter()
        with (contextlib.nullcontext(stop) if stop is not None else StopRequest()) as stop, hold_run_dir(
            output_dir, ctx, reporter, lambda: stop.requested, cfg.train.dist_timeout_s * 0.9 if ctx.enabled else None
        ):
            refuse_changed_settings(output_dir, cfg, resume, ctx.world_size)  # before the data is tokenized and the model loaded
            run = setup(cfg, output_dir, reporter, resume, stop, ctx)
            try:
                yield run
                completed = True
            except Exception as e:
                if not isinstance(e, Interrupted):  # a stop by signal records its own event
                    record_failure(run, e)
                raise
            finally:
                run.saver.close()
                run.cpu_threads.restore()
                run.reporter.stop()
                write_report(run)  # report.html at the end, also after a signal or an error
                run.metrics.close(ok=completed)
                # drop the DDP wrapper (and its gradient reducer) now, while the process group still
                # lives: freed after it, the reducer would free the group from this thread (see dist.shutdown)
                run.train_model = run.sync = None
    finally:
        if ctx.enabled:
            shutdown(wait_for_peers=completed)  # a failed rank must not wait for peers stuck in its collective


def probe_step(run: Run) -> None:
    """One optimizer step on the next batches outside the run's record (no counters, schedule, logs or
    checkpoints): for tools that trace or time a bare step. ``rewind_data`` puts the batches back."""
    if run.batches is None:
        run.batches = iter(run.loader)
    loss = forward_backward(run.train_model, fetch_step(run), run.precision, run.device, run.scaler, None, run.sync,
                            fused=run.cfg.train.fused_loss, objective=run.objective)
    optimizer_step(run.params, run.optimizer, run.cfg.optim.max_grad_norm, run.scaler, loss)


def rewind_data(run: Run, longest_first: bool | None = None) -> None:
    """Start the data again at its first batch; ``longest_first``: from now on in that order (the
    largest batches first, as ``plan --measure`` wants), or back to the seeded shuffle."""
    if longest_first is not None:
        run.loader.longest_first = longest_first
    run.loader.load_state_dict({"epoch": 0, "offset": 0})
    run.batches = None


def run_eval(run: Run, label: str) -> dict[str, float]:
    """Evaluate, log to metrics.jsonl and the console; its seconds to the counters and events.jsonl."""
    t = time.perf_counter()
    result = evaluate(run.model, run.eval_set, run.precision, run.device, run.dist, run.cfg.train.fused_loss, run.objective,
                      eval_stop(run, label), source_names(run.cfg.data.sources()))
    if result:
        took = time.perf_counter() - t
        run.counters.eval_s += took
        run.counters.evals += 1
        run.advisor.eval_ran()
        run.metrics.event("eval", run.step, seconds=round(took, 3), batches=len(run.eval_set))
        run.metrics.write({"step": run.step, **result})
        extra = f"(ppl {result['eval_ppl']:.1f})" if "eval_ppl" in result else (
            f"(reward accuracy {result['eval_reward_accuracy']:.1%}, "
            + (f"margin {result['eval_reward_margin']:.3f})" if "eval_reward_margin" in result else f"kl {result['eval_kl']:.3f})"))
        run.reporter.info(f"eval {label}: loss {result['eval_loss']:.4f} {extra}{describe_losses(result, 'eval_loss/')}")
        run.counters.last_eval = result
    return result


def train_loop(run: Run, steps: int | None = None) -> None:
    """The hot loop: fetch micro-batches, forward/backward, step; log, eval, checkpoint. ``steps``: stop
    after this many more (the last of them is logged), else at ``train.max_steps``."""
    cfg, c = run.cfg, run.counters
    if run.startup_s is None:
        note_start(run)
    if c.step == (run.resumed_from or 0):  # no step of this process yet: a stop has nothing new to save
        if c.step == 0 and run.resumed_from is None and not c.eval_before:
            c.eval_before = run_eval(run, "before training")
        elif run.eval_again:  # the evaluation a signal stopped at this step (ending.eval_stopped_at_checkpoint)
            run.eval_again = not run_eval(run, f"at step {c.step}")
        stop_before_first_step(run)
    run.stop.stepping = True
    end = run.max_steps if steps is None else min(run.max_steps, c.step + steps)
    run.batches = iter(run.loader)
    first_step, loop_start = c.step, time.perf_counter()
    tick = run.window.started = loop_start
    run.reporter.start(run.max_steps, first_step)
    if not run.compiled:
        compile_if(run, run.compile_auto.at_start(run.max_steps - c.step))
    while c.step < end:
        step_start = time.perf_counter()
        position = run.loader.state_dict()  # where this step's examples start: an out-of-memory retry re-reads them
        profile = StepProfile(run.timer, run.step + 1, run.out / "profile") if run.step + 1 in cfg.log.profile_steps else None
        t = time.perf_counter()
        with run.timer.phase("data"):
            micro_batches = fetch_step(run)
        wait = time.perf_counter() - t - getattr(run.loader, "generation_s", 0.0)  # grpo: sampling is no data wait
        c.data_wait_s += wait
        # all ranks' counts of the loss divisor (target tokens, or pairs) and input tokens, and agreement on
        # stopping / a time-based save
        n_targets, step_tokens, stop, time_due = run.dist.step_totals(
            sum(run.objective.units(mb) for mb in micro_batches),
            sum(mb.n_tokens for mb in micro_batches),
            run.stop.requested,
            run.saver.time_due(),
            run.device,
        )
        if stop:
            run.loader.load_state_dict(position)  # these batches are not trained: the checkpoint resumes at them
            stop_on_signal(run)

        loss, micro_batches, sums = forward_backward_adaptive(run, micro_batches, position, n_targets)
        loss = run.dist.all_reduce(loss)  # the global mean: every rank logs and guards the same value
        with run.timer.phase("optimizer"):
            grad_norm, skipped = optimizer_step(run.params, run.optimizer, cfg.optim.max_grad_norm, run.scaler, loss)
        if profile is not None:
            report_profile(run, profile)
        lr = float(run.scheduler.get_last_lr()[0])  # a number: some optimizers (torchao) keep lr as a tensor
        run.scheduler.step()
        c.step += 1

        indices = step_indices(run, micro_batches)
        run.guard.record(skipped, run.step, indices)  # raises after train.max_skipped_steps in a row
        if run.dist.is_main:
            run.advisor.record_step(run.step, loss, grad_norm, indices)  # kept on the device until the log step
        c.tokens_seen += step_tokens
        run.window.add(loss, skipped, step_tokens, indices if cfg.log.example_indices else None, len(indices), wait)
        run.window.add_sums(sums)  # a preference objective's rewards, margins, accuracy (read at the log step)
        run.window.note_rates(lr, grad_norm)
        now = time.perf_counter()
        c.loop_time_s += now - tick
        c.peak_flop_s += (now - tick) * (run.facts.peak_flops or 0.0)  # the whole run's MFU in summary.json
        tick = now
        step, last = c.step, c.step == run.max_steps
        run.compile_auto.record_step(now - step_start, run.compiled)  # compile: auto learns from measured steps
        if not run.compiled:
            compile_if(run, run.compile_auto.after_eager_steps(run.max_steps - step))

        if step % cfg.log.every_steps == 0 or step == end:
            log_step(run, lr, grad_norm, eta=(now - loop_start) / (step - first_step) * (run.max_steps - step))
        else:
            run.reporter.advance(step)
        paused = time.perf_counter()
        if cfg.train.eval_every and step % cfg.train.eval_every == 0 and not last:
            run_eval(run, f"at step {step}")
        run.saver.maybe_save(step, last, run.state_dict, time_due if run.dist.enabled else None)
        paused = time.perf_counter() - paused
        tick += paused  # evaluation and checkpoint pauses are neither training time nor the next window's
        run.window.timed_from += paused
    log_open_window(run)
    run.reporter.stop()


def log_open_window(run: Run) -> None:
    """A run resumed at its last step between log steps trains nothing: log the window its checkpoint left open."""
    if run.window.steps and run.step == run.max_steps:  # a loop that ran logged its last step itself
        w = run.window  # NaN: rates that a checkpoint of an older version did not keep
        norm = torch.tensor(float("nan")) if w.last_grad_norm is None else w.last_grad_norm
        log_step(run, float("nan") if w.last_lr is None else w.last_lr, norm, 0.0)


def note_start(run: Run) -> None:
    """Where this process's seconds before the first step went, and what it runs on: the ``start`` event
    (``doctor`` and the limits read it)."""
    run.startup_s = time.perf_counter() - run.started_at + run.startup_phases.get("imports", 0.0)
    run.startup_phases["until_loop"] = round(run.startup_s - sum(run.startup_phases.values()), 3)
    run.metrics.event("start", run.step, startup_s=round(run.startup_s, 3), phases=run.startup_phases,
                      max_steps=run.max_steps, env=run_environment(run))


def report_profile(run: Run, profile: StepProfile) -> None:
    """A profiled step's time split, to metrics.jsonl and the console; the trace is on disk."""
    phases = profile.finish()
    run.metrics.write({"step": profile.step, "profile": phases, "profile_ops": profile.split})
    total = sum(phases.values())
    split = ", ".join(f"{k[:-2]} {v * 1e3:.1f} ms ({v / total:.0%})" for k, v in phases.items())
    run.reporter.info(f"profile of step {profile.step}: {split}; {describe_split(profile.split)}; trace {profile.trace}")


def compile_if(run: Run, reason: str | None) -> None:
    """Compile the decoder now when ``train.compile`` (via ``run.compile_auto``) gave a reason."""
    if reason:
        run.reporter.info(reason)
        run.compiled = compile_decoder(run.model, run.reporter.warn)
    elif run.compile_auto.skip_note:
        run.reporter.info(run.compile_auto.skip_note)
        run.compile_auto.skip_note = None  # said once


def step_indices(run: Run, micro_batches: list[Batch]) -> list[int]:
    """The step's example indices in global order; gathered from all ranks only when
    ``log.example_indices`` asks for them (a collective of host objects every step)."""
    local = [mb.indices for mb in micro_batches]
    if not (run.dist.enabled and run.cfg.log.example_indices):
        return [i for part in local for i in part]
    ranks = run.dist.all_gather_object(local)
    return [i for m in range(len(local)) for part in ranks for i in part[m]]  # rank shares are contiguous


def log_step(run: Run, lr: float, grad_norm: torch.Tensor, eta: float) -> None:
    """Write the window's record to metrics.jsonl and the console: the loop's only planned host syncs
    (a non-fused optimizer, gradient clipping or a GradScaler may add their own inside the step)."""
    w, now = run.window, time.perf_counter()
    span = max(now - w.started, 1e-9)
    tokens_per_s = w.tokens / span
    rec = {
        "step": run.step,
        "loss": w.mean_loss(),
        "lr": lr,
        "grad_norm": grad_norm.item(),
        "tokens": run.counters.tokens_seen,
        "tokens_per_s": tokens_per_s,  # real (non-pad) input tokens
        "samples_per_s": w.rows / span,
        "steps_per_s": w.steps / span,
        "mfu": window_mfu(run, tokens_per_s),  # never above 100%: the peak is measured again first
        "data_wait_pct": 100.0 * w.data_wait_s / span,
        "peak_memory_bytes": peak_memory_bytes(run.device),
        "elapsed_s": run.counters.loop_time_s,
        "skipped_steps": int(run.guard.total),
    }
    if run.device.type == "cuda":
        rec["reserved_memory_bytes"] = int(torch.cuda.max_memory_reserved(run.device))
    rec.update(mean_metrics(w.sums, reduce=run.dist.all_reduce))  # every rank: the sums are all-reduced
    rec.update(router_means(w.sums, reduce=run.dist.all_reduce))  # a mixture-of-experts model's aux loss
    rec.update(source_losses(w.sums, lambda: source_names(run.cfg.data.sources()), reduce=run.dist.all_reduce))  # loss/NAME
    if run.cfg.log.example_indices:
        rec["example_indices"] = w.indices
    run.metrics.write(rec)
    run.reporter.log_step(rec, run.max_steps, eta)
    run.counters.last_train_loss = rec["loss"]
    w.reset()
    # other work started or ended on this CPU: the thread count follows it, until the decoder is compiled
    # (inductor's CPU kernels are built for the thread count at compile time)
    note = None if run.compiled else run.cpu_threads.recheck()
    if note:
        run.reporter.info(note)
        run.metrics.event("cpu_threads", run.step, threads=torch.get_num_threads(), why=run.cpu_threads.why)
        follow_threads(run)  # a CPU's peak is its matmul probe on the new count
    if run.dist.is_main:
        if run.advisor.windows == 0:  # the first estimate of this process, for doctor to hold against what happened
            run.metrics.event("estimate", run.step, eta_s=round(eta, 2),
                              train_s=round(run.counters.loop_time_s / max(run.step, 1) * run.max_steps, 2))
        advise(run, rec, span)


def advise(run: Run, rec: dict, window_s: float) -> None:
    """The advisor's judgement of this window: each new cause warned once, on the console and in events.jsonl."""
    c = run.counters
    times = RunTimes(
        wall_s=wall_time(run), train_s=c.loop_time_s, eval_s=c.eval_s, evals_done=c.evals,
        evals_planned=planned_evals(run.max_steps, run.cfg.train.eval_every), checkpoint_s=run.saver.stall_s,
        steps_done=c.step, max_steps=run.max_steps, window_s=window_s,
    )
    for advice in run.advisor.observe(rec, times, run.compiled):
        run.reporter.warn(advice.message)
        run.metrics.event("advice", run.step, cause=advice.cause, message=advice.message, **advice.fields)


def run_environment(run: Run) -> dict[str, object]:
    """What the run ran on and with, for events.jsonl (``doctor`` shows it)."""
    import platform

    import transformers

    return {
        "trainforge": __version__, "python": platform.python_version(), "torch": torch.__version__,
        "transformers": transformers.__version__, "device": describe(run.device), "precision": run.precision.name,
        "world_size": run.dist.world_size, "host": platform.node(),
    }


def wall_time(run: Run) -> float:
    """Seconds since set-up began; the first run of a process counts the imports before it too."""
    return time.perf_counter() - run.started_at + run.startup_phases.get("imports", 0.0)


def time_ledger(run: Run, wall_s: float, end_s: float) -> dict[str, float]:
    """Where this process's wall time went, in seconds (``metrics/limits.py`` ranks the parts besides training):
    after a resume, the counters less what the checkpoint's earlier processes had spent (``Run.earlier``)."""
    c, before = run.counters, run.earlier
    compile_s = (run.compile_auto.measured() or {}).get("compile_s", 0.0)
    step_s = c.loop_time_s / max(c.step, 1)
    loop_s, data_wait_s = c.loop_time_s - before.get("loop_time_s", 0.0), c.data_wait_s - before.get("data_wait_s", 0.0)
    parts = {
        "startup_s": run.startup_s or 0.0,
        "train_s": loop_s - data_wait_s - compile_s,  # steps computing (eval and checkpoint pauses excluded)
        "data_wait_s": data_wait_s,
        "compile_s": compile_s,
        "eval_s": c.eval_s - before.get("eval_s", 0.0),
        "checkpoint_s": run.saver.stall_s,
        "skipped_s": (float(run.guard.total) - before.get("skipped", 0.0)) * step_s,
        "end_s": end_s,
        "wall_s": wall_s,
    }
    return {**{k: round(v, 3) for k, v in parts.items()}, "startup": run.startup_phases}


def finish(run: Run) -> RunResult:
    """Final eval, final/ (HF format, written atomically), summary.json, sample."""
    cfg, out, c, facts = run.cfg, run.out, run.counters, run.facts
    finish_start, eval_before_final = time.perf_counter(), c.eval_s
    run_eval(run, "after training")
    final_eval_s = c.eval_s - eval_before_final
    if c.eval_before and c.last_eval:
        run.reporter.info(f"eval loss {c.eval_before['eval_loss']:.4f} before -> {c.last_eval['eval_loss']:.4f} after")

    # FSDP: every rank hands its shards to rank 0, which writes a plain (unsharded) HF directory
    weights = full_model_state(run.model) if run.dist.mode == "fsdp" else None
    nonfinite = final_weights_check(run.model, weights, run.reporter.warn) if run.dist.is_main else {}

    template = trained_chat_template(facts.data_format, cfg.data, run.tokenizer, facts.data_stats.get("source_formats"))
    if template:  # final/ (and its exports) render chats as the run trained them, in any loader
        run.tokenizer.chat_template = template

    def write_final(tmp: Path) -> None:
        save_model(run.model, tmp, weights, run.reporter.warn)  # weights readable as config.json; adapter keys kept
        run.tokenizer.save_pretrained(tmp)

    final_dir = out / "final"
    if run.dist.is_main:
        with writing(final_dir):  # disk full: RunDirWriteError naming it (rundir/writing.py)
            atomic_write_dir(final_dir, write_final)
        run.reporter.info(f"saved {final_dir}")
    peak = int(run.dist.all_reduce(torch.tensor(peak_memory_bytes(run.device), device=run.device), "max").item())

    trainable, total = count_parameters(run.model)
    tokens_per_s = c.tokens_seen / max(c.loop_time_s, 1e-9)
    summary = {
        "trainforge_version": __version__,
        "steps": c.step,
        "wall_time_s": 0.0,
        "train_time_s": c.loop_time_s,
        "tokens": c.tokens_seen,
        "tokens_per_s": tokens_per_s,
        # over the whole run: a resume on other processes or another device changed the peak part-way
        "mfu": run_mfu(c.tokens_seen, facts, c.peak_flop_s),
        "flops_per_token": facts.flops_per_token,
        "compiled": run.compiled,
        "compile": run.compile_auto.measured(),
        "optimizer": {"name": run.cfg.optim.name, "offload": run.cfg.optim.offload, "state_bytes": measured_state_bytes(run.optimizer)},  # this run's compile seconds and steady step times, once measured
        "data_wait_s": c.data_wait_s,
        "skipped_steps": int(run.guard.total),
        "micro_batch_size": run.loader.batch_size,
        "grad_accum": run.grad_accum,
        "oom_backoffs": c.oom_backoffs,
        "resumed_from_step": run.resumed_from,
        **run.saver.summary(),
        "peak_memory_bytes": peak,  # the largest of any process
        "world_size": run.dist.world_size,
        "distributed": run.dist.mode,
        "final_train_loss": c.last_train_loss,
        "eval_loss_before": c.eval_before.get("eval_loss"),
        "eval_loss": c.last_eval.get("eval_loss"),
        "eval_ppl": c.last_eval.get("eval_ppl"),
        "eval_batches": len(run.eval_set),
        "objective": run.objective.name,
        **({"reference": run.objective.reference} if run.objective.unit == "pair" else {}),
        **{k: v for k, v in c.last_eval.items() if k.startswith(("eval_reward", "eval_logps", "eval_kl"))},  # per evaluation (train.eval_max_batches: auto chose it from the run's length)
        "device": str(run.device),
        **({"cuda_allocator": allocator_settings(in_effect=expandable_segments_in_effect())} if run.device.type == "cuda" else {}),
        **({"cpu_threads": torch.get_num_threads(), "cpu_threads_reason": run.cpu_threads.why or "as the process had them"}
           if run.device.type == "cpu" else {}),
        "precision": run.precision.name,
        "precision_reason": facts.precision_reason,
        "parameters": total,
        "trainable_parameters": trainable,
        "weights": weight_storage(run.model),  # parameter counts by role and storage dtype
        "activation_checkpointing": cfg.train.activation_checkpointing,
        **facts.choices,
        "data": {"format": facts.data_format, **facts.data_stats},
        "final_dir": str(final_dir),
        **nonfinite,  # {"nonfinite_weights": True, ...} when final/ holds NaN/Inf
    }
    if cfg.log.sample_prompt and (run.dist.is_main or run.dist.mode == "fsdp"):  # FSDP: generating is collective
        # eager: decoding one token at a time at growing lengths would recompile compiled layers up to dynamo's limit
        with torch.compiler.set_stance("force_eager"):
            text = sample_prompt(run.model, run.tokenizer, cfg.log.sample_prompt, cfg.log.sample_tokens, seed=cfg.train.seed,
                                 autocast=run.precision.autocast(run.device), stop=lambda: run.stop.requested)
        summary["sample"] = text
        run.reporter.info(f"sample ({cfg.log.sample_tokens} tokens after {cfg.log.sample_prompt!r}):\n{text}")
    summary["wall_time_s"] = wall_time(run)
    summary["time"] = time_ledger(run, summary["wall_time_s"], time.perf_counter() - finish_start - final_eval_s)
    summary["limits"] = rank_limits(summary["time"], summary["wall_time_s"])
    summary["advice"] = sorted(run.advisor.given)
    if run.dist.is_main:
        with writing(out / "summary.json"):
            (out / "summary.json").write_text(json.dumps(summary, indent=2))
        run.metrics.summary(summary)
    # steps, tokens and training time count the whole run; the wall time, this process (a resume's own)
    this_process = "," if run.resumed_from is None else f"; this process resumed it at step {run.resumed_from}:"
    run.reporter.info(
        f"done: {c.step} steps, {c.tokens_seen:,} tokens in {c.loop_time_s:.1f}s "
        f"({summary['tokens_per_s']:,.0f} tok/s){this_process} wall time {summary['wall_time_s']:.1f}s"
    )
    run.reporter.info(describe_limits(summary["limits"], summary["wall_time_s"], summary["time"]["train_s"]))
    return RunResult(out, summary, run.model, run.tokenizer)
