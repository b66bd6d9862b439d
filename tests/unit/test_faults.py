"""Non-finite steps never reach the weights; out-of-memory backs off with the same global batch;
the memory estimate warns before a run that cannot fit."""

from __future__ import annotations

from collections.abc import Container

import copy
import io

import pytest
import torch
from rich.console import Console

import trainforge.engine.step as step_module
import trainforge.engine.setup as engine_setup
import trainforge.engine.trainer as trainer
from trainforge.config.run import RunConfig
from trainforge.engine.predict.memory import GIB, estimate_memory, memory_warning
from trainforge.engine.nonfinite import NonFiniteError, NonFiniteGuard, skip_update_if
from trainforge.engine.oom import OutOfMemory, fetch_step, forward_backward_adaptive, smallest_factor
from trainforge.engine.step import forward_backward
from trainforge.hardware.device import PRECISIONS
from trainforge.metrics.console import ConsoleReporter
from trainforge.metrics.tracker import read_metrics


def quiet() -> tuple[ConsoleReporter, io.StringIO]:
    buf = io.StringIO()
    return ConsoleReporter(Console(file=buf, width=400)), buf


def train(config: dict, out, resume: str = "auto"):
    rep, buf = quiet()
    return trainer.train(RunConfig.model_validate(config), out, rep, resume=resume), buf.getvalue()


def state(run, step: int) -> dict:
    return torch.load(run / "checkpoints" / f"step-{step:08d}" / "state.pt")


def same_weights_and_optimizer(a: dict, b: dict) -> bool:
    if any(not torch.equal(a["model"][k], v) for k, v in b["model"].items()):
        return False
    return all(torch.equal(a["optimizer"]["state"][p][k], v) for p, s in b["optimizer"]["state"].items() for k, v in s.items())


def poison_steps(monkeypatch, steps: Container[int]) -> None:
    """Make the loss of the given steps NaN, as a corrupt batch or an overflow would (test_hostile_runtime
    poisons every step from one on, as ``optim.lr: .inf`` does)."""
    now = {"step": 0}
    adaptive, loss_sum = trainer.forward_backward_adaptive, step_module.loss_sum

    def watched(run, *args, **kwargs):
        now["step"] = run.step + 1
        return adaptive(run, *args, **kwargs)

    monkeypatch.setattr(trainer, "forward_backward_adaptive", watched)
    monkeypatch.setattr(step_module, "loss_sum", lambda *a, **k: loss_sum(*a, **k) * (float("nan") if now["step"] in steps else 1.0))


@pytest.fixture
def config(finetune_config) -> dict:
    cfg = copy.deepcopy(finetune_config)
    cfg["train"]["max_steps"] = 5
    cfg["checkpoint"] = {"every_steps": 1, "keep_last": 10}
    cfg["log"] = {"every_steps": 1, "example_indices": True, "report": False}
    return cfg


# ---------------------------------------------------------------- non-finite loss / gradients


def test_nan_batch_leaves_weights_and_optimizer_untouched_and_is_counted(config, tmp_path, monkeypatch):
    poison_steps(monkeypatch, {3})
    result, log = train(config, tmp_path / "run")
    run = tmp_path / "run"
    assert same_weights_and_optimizer(state(run, 3), state(run, 2)), "the NaN step changed the weights"
    assert not same_weights_and_optimizer(state(run, 4), state(run, 3)), "training did not go on after it"
    records = {r["step"]: r for r in read_metrics(run / "metrics.jsonl") if "loss" in r}
    assert [records[s]["skipped_steps"] for s in range(1, 6)] == [0, 0, 1, 1, 1]
    assert result.summary["skipped_steps"] == 1 and result.summary["steps"] == 5
    all_finite = [p for p in result.model.parameters() if not torch.isfinite(p).all()]
    assert not all_finite


def test_a_run_of_nan_steps_stops_naming_the_steps_and_examples(config, tmp_path, monkeypatch):
    config["train"]["max_skipped_steps"] = 2
    poison_steps(monkeypatch, {3, 4})
    with pytest.raises(NonFiniteError) as e:
        train(config, tmp_path / "run")
    message = str(e.value)
    records = {r["step"]: r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in r}
    step3 = [i for mb in records[3]["example_indices"] for i in mb]
    assert "stopped at step 4" in message and "steps 3-4" in message and "max_skipped_steps=2" in message
    assert f"step 3: {step3}" in message and "step 4: [" in message
    newest = tmp_path / "run" / "checkpoints" / "step-00000003"  # step 3 was skipped: it holds step 2's weights
    assert f"the newest checkpoint, {newest}, holds the last good weights" in message
    assert 4 not in records  # stopped before logging or saving step 4
    assert not (tmp_path / "run" / "checkpoints" / "step-00000004").exists()
    assert same_weights_and_optimizer(state(tmp_path / "run", 3), state(tmp_path / "run", 2))


def test_guard_read_one_step_late_stops_one_step_later():
    guard = NonFiniteGuard(limit=2, device=torch.device("cpu"), lagged=True)
    bad, good = torch.tensor(True), torch.tensor(False)
    guard.record(bad, 1, [1])
    guard.record(good, 2, [2])  # a finite step resets the streak
    guard.record(bad, 3, [3])
    guard.record(bad, 4, [4])  # the streak reaches 2 here, but is only read at the next step
    with pytest.raises(NonFiniteError, match=r"stopped at step 4.*steps 3-4.*step 3: \[3\]; step 4: \[4\]"):
        guard.record(good, 5, [5])
    assert int(guard.total) == 3


@pytest.mark.parametrize("fused", [True, False])
def test_skip_update_if_leaves_parameters_and_state_alone(fused):
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p], lr=0.1, fused=fused, foreach=None if fused else True)
    p.grad = torch.ones(3)
    skip_update_if(opt, torch.tensor(False))
    before = p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()}
    p.grad = torch.full((3,), float("nan"))
    skip_update_if(opt, torch.tensor(True))
    assert torch.equal(p.detach(), before[0])
    assert all(torch.equal(opt.state[p][k], v) for k, v in before[1].items())
    p.grad = torch.ones(3)
    skip_update_if(opt, torch.tensor(False))
    assert not torch.equal(p.detach(), before[0])


# ---------------------------------------------------------------- out of memory


def simulate_oom_above(monkeypatch, rows: int) -> None:
    """Micro-batches of more than ``rows`` rows raise the CUDA out-of-memory error."""
    loss_sum = step_module.loss_sum

    def limited(model, batch, precision, fused=True):
        if batch.input_ids.shape[0] > rows:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return loss_sum(model, batch, precision, fused)

    monkeypatch.setattr(step_module, "loss_sum", limited)


def test_smallest_factor():
    assert [smallest_factor(n) for n in (2, 3, 4, 6, 9, 15, 16, 49)] == [2, 3, 2, 2, 3, 3, 2, 7]


def test_oom_backoff_halves_micro_batch_with_the_same_examples_and_gradient(config, tmp_path, monkeypatch):
    rep, _ = quiet()
    run = trainer.setup(RunConfig.model_validate(config), tmp_path / "run", rep)
    run.batches = iter(run.loader)
    position = run.loader.state_dict()
    batches = fetch_step(run)
    expected_loss = forward_backward(run.model, batches, run.precision, run.device)
    expected = {n: p.grad.clone() for n, p in run.model.named_parameters()}
    run.optimizer.zero_grad(set_to_none=True)

    run.loader.load_state_dict(position)
    run.batches = iter(run.loader)
    simulate_oom_above(monkeypatch, rows=2)
    loss, used, _ = forward_backward_adaptive(run, fetch_step(run), position)

    assert (run.loader.batch_size, run.grad_accum) == (2, 4)  # 4 x 2 became 2 x 4: global batch 8
    assert [i for b in used for i in b.indices] == [i for b in batches for i in b.indices]
    torch.testing.assert_close(loss, expected_loss, rtol=0, atol=1e-6)
    for name, p in run.model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=0, atol=1e-6, msg=name)
    assert run.counters.oom_backoffs == [{"step": 1, "micro_batch_size": 2, "grad_accum": 4}]
    run.metrics.close()


def test_oom_backoff_is_kept_in_checkpoints_and_reused_on_resume(config, tmp_path, monkeypatch):
    config["train"]["max_steps"] = 3
    with monkeypatch.context() as m:
        simulate_oom_above(m, rows=2)
        result, log = train(config, tmp_path / "run")
    assert "out of memory at step 1 with micro-batch 4: retrying the step with micro-batch 2 x accumulation 4" in log
    assert (result.summary["micro_batch_size"], result.summary["grad_accum"]) == (2, 4)
    assert state(tmp_path / "run", 3)["micro_batch_size"] == 2

    config["train"]["max_steps"] = 4  # no memory limit now: the resumed run keeps 2 x 4 all the same
    result, log = train(config, tmp_path / "run")
    assert "micro-batch 2 x accumulation 4, as chosen after running out of memory" in log
    assert (result.summary["micro_batch_size"], result.summary["grad_accum"]) == (2, 4)
    step4 = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r.get("step") == 4 and "loss" in r][0]
    assert [len(mb) for mb in step4["example_indices"]] == [8]  # 4 micro-batches of 2 per step


def test_oom_with_a_single_row_is_an_error_with_advice(config, tmp_path, monkeypatch):
    config["train"].update(micro_batch_size=1, grad_accum=1)
    simulate_oom_above(monkeypatch, rows=0)
    with pytest.raises(OutOfMemory, match="even with a micro-batch of 1 row.*data.max_length"):
        train(config, tmp_path / "run")


# ---------------------------------------------------------------- memory estimate


def test_memory_estimate_counts_weights_grads_adam_and_activations(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    n = sum(p.numel() for p in model.parameters())
    est = estimate_memory(model, micro_batch_size=4, seq_len=64, precision=PRECISIONS["fp32"])
    assert (est.weights, est.grads, est.optimizer) == (4 * n, 4 * n, 8 * n)
    c = model.config
    per_token = c.num_hidden_layers * 4 * (9 * c.hidden_size + 4 * c.intermediate_size) + 8 * c.vocab_size
    assert est.activations == 4 * 64 * per_token
    assert estimate_memory(model, 8, 64, PRECISIONS["fp32"]).activations == 2 * est.activations
    assert memory_warning(est, est.total - est.weights, torch.device("cpu")) is None  # weights already loaded
    warning = memory_warning(est, GIB // 1024, torch.device("cpu"))
    assert "may not fit" in warning and "micro_batch_size" in warning and "0.00 GiB available" in warning


def test_a_config_with_one_mlp_width_per_layer_is_estimated_at_its_widest(tiny_model_dir):
    """Gemma 3n's checkpoints list intermediate_size per layer: the estimate added the list to an int (TypeError at
    setup, before any step); it now takes the widest layer."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    from trainforge.engine.predict.memory import mlp_width

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    flat = estimate_memory(model, 4, 64, PRECISIONS["fp32"])
    widths = [model.config.intermediate_size // 2, model.config.intermediate_size]
    model.config = SimpleNamespace(**{**model.config.to_dict(), "intermediate_size": widths})  # strict configs refuse a list
    assert estimate_memory(model, 4, 64, PRECISIONS["fp32"]) == flat
    assert mlp_width(SimpleNamespace(intermediate_size=None), 32) == 128 and mlp_width(SimpleNamespace(), 8) == 32


def test_run_warns_when_memory_is_short(config, tmp_path, monkeypatch):
    monkeypatch.setattr(engine_setup, "available_memory_bytes", lambda device: 1024)
    config["train"]["max_steps"] = 1
    _, log = train(config, tmp_path / "run")
    assert "warning: this run may not fit: estimated memory" in log


# ---------------------------------------------------------------- signals


def test_first_signal_sets_the_flag_and_hands_both_signals_back_to_the_os():
    import os
    import signal

    from trainforge.stop import StopRequest

    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with StopRequest() as stop:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested and stop.name == "SIGINT"
        assert signal.getsignal(signal.SIGINT) == signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def test_a_signal_during_set_up_stops_before_the_model_loads_and_saves_nothing(config, tmp_path, monkeypatch):
    """Ctrl-C while the data tokenized (minutes on a large corpus) printed 'finishing the current step', then
    loaded the model, evaluated, saved a checkpoint of step 0 and only then stopped; it stops at the end of the
    stage, without a checkpoint, and before training a step the same holds for the evaluation before training."""
    import signal

    from trainforge.stop import Interrupted, StopRequest

    loads = []
    monkeypatch.setattr(engine_setup, "build_run_model", lambda *a, **k: loads.append(1))
    stop = StopRequest()
    stop.signum = signal.SIGINT  # as the handler leaves it, while the data tokenizes
    with pytest.raises(Interrupted, match=r"^SIGINT during set-up, before the first step: nothing trained, nothing saved; "
                                          r"to go on, run the same command with --output "):
        with trainer.open_run(RunConfig.model_validate(config), tmp_path / "early", quiet()[0], "auto", stop):
            pass
    assert not loads and not (tmp_path / "early" / "checkpoints").exists()
    monkeypatch.undo()

    evaluate = trainer.run_eval

    def signal_while_evaluating(run, label):
        run.stop.signum = signal.SIGTERM
        return evaluate(run, label)

    monkeypatch.setattr(trainer, "run_eval", signal_while_evaluating)
    with pytest.raises(Interrupted, match="^SIGTERM during set-up, before the first step"):
        train(config, tmp_path / "eval")
    assert not list((tmp_path / "eval" / "checkpoints").glob("step-*"))
    events = [e for e in read_metrics(tmp_path / "eval" / "events.jsonl") if e.get("event") == "stop"]
    assert events and events[-1]["step"] == 0 and events[-1]["saved"] is False


def test_a_signal_while_tokenizing_stops_at_the_next_chunk_and_caches_nothing(config, tmp_path, monkeypatch):
    """Ctrl-C while a large corpus tokenized still tokenized all of it (minutes) before stopping at the end of the
    stage: the build checks the stop between chunks, stops at the next one and leaves no cache entry behind."""
    import signal

    import trainforge.data.prepare as prepare
    from trainforge.stop import Interrupted, StopRequest

    chunks = prepare._chunks
    monkeypatch.setattr(prepare, "_chunks", lambda rows: chunks(rows, 2))  # many chunks from the fixture's rows
    cfg = RunConfig.model_validate({**config, "data": {**config["data"], "cache_dir": str(tmp_path / "cache"), "num_workers": 1}})
    stop, tokenized = StopRequest(), []
    chunk = prepare._tokenize_chunk

    def tokenize(rows):
        tokenized.append(len(rows))
        if len(tokenized) == 2:
            stop.signum = signal.SIGINT  # as the handler leaves it, mid-build
        return chunk(rows)

    monkeypatch.setattr(prepare, "_tokenize_chunk", tokenize)
    with pytest.raises(Interrupted, match="^SIGINT during set-up, before the first step"):
        with trainer.open_run(cfg, tmp_path / "run", quiet()[0], "auto", stop):
            pass
    assert len(tokenized) == 2  # the third chunk was never started
    assert not [p for p in (tmp_path / "cache").rglob("stats.json")]  # no complete entry: the next run builds it anew
