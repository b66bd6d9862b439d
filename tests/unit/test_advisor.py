"""The live advisor on real in-process runs: each cause provoked by a run that has it, silence on a healthy run."""

from __future__ import annotations

import functools
import io
import json
import re
import resource
import time

import pytest
import torch
from rich.console import Console

from conftest import write_jsonl
from trainforge.config.run import RunConfig
from trainforge.engine import setup as engine_setup
from trainforge.engine import trainer
from trainforge.engine.advisor import Advisor, RunTimes
from trainforge.engine.trainer import train
from trainforge.metrics.console import ConsoleReporter
from trainforge.metrics.thresholds import THRESHOLDS, Threshold
from trainforge.metrics.tracker import read_events, read_metrics
from trainforge.model.compile import compile_decoder


@pytest.fixture
def cfg(finetune_config, toy_data_dir):
    c = dict(finetune_config)
    c["data"] = {"train": str(toy_data_dir / "text_train.jsonl"), "eval": str(toy_data_dir / "text_eval.jsonl"), "max_length": 32}
    c["train"] = {**c["train"], "max_steps": 30, "micro_batch_size": 8, "grad_accum": 1}
    c["optim"] = {"lr": 3e-3, "warmup_steps": 4}
    c["log"] = {"every_steps": 3, "report": False}
    return c


def run(cfg: dict, out) -> tuple[dict, list[dict], str]:
    """Train; (summary, the advice events, the console's text)."""
    text = io.StringIO()
    result = train(RunConfig.model_validate(cfg), out, ConsoleReporter(Console(file=text, width=400)))
    advice = [e for e in read_events(out / "events.jsonl") if e["event"] == "advice"]
    return result.summary, advice, text.getvalue()


def causes(advice: list[dict]) -> list[str]:
    return [a["cause"] for a in advice]


def test_a_healthy_run_gets_no_advice_and_says_what_limited_it(cfg, tmp_path):
    summary, advice, console = run(cfg, tmp_path / "run")
    assert advice == [] and summary["advice"] == []
    assert "warning" not in console
    assert "what limited this run" in console
    t = summary["time"]
    assert set(t) >= {"startup_s", "train_s", "data_wait_s", "eval_s", "checkpoint_s", "end_s", "wall_s", "startup"}
    assert t["eval_s"] > 0 and t["wall_s"] >= t["startup_s"] + t["eval_s"]
    assert [x["seconds"] for x in summary["limits"]] == sorted((x["seconds"] for x in summary["limits"]), reverse=True)
    events = read_events(tmp_path / "run" / "events.jsonl")
    kinds = [e["event"] for e in events]
    assert kinds[0] == "start" and kinds.count("eval") == 2 and "estimate" in kinds
    assert {"tokenizer", "data", "model"} <= set(events[0]["phases"]) and events[0]["env"]["torch"] == torch.__version__
    from trainforge.metrics.report import write_report

    page = write_report([tmp_path / "run"], tmp_path / "report.html").read_text()
    assert "limited by" in page and summary["limits"][0]["cause"] in page


def test_data_wait_is_named(cfg, tmp_path, monkeypatch):
    fetch = trainer.fetch_step

    def slow_fetch(run):
        time.sleep(0.12)  # a slow data source: a remote disk, a busy loader
        return fetch(run)

    monkeypatch.setattr(trainer, "fetch_step", slow_fetch)
    cfg["train"]["max_steps"] = 12
    cfg["log"]["every_steps"] = 5
    _, advice, console = run(cfg, tmp_path / "run")
    assert causes(advice) == ["data_wait"]
    assert advice[0]["data_wait_pct"] > 5 and "waited for data" in console
    assert advice[0]["step"] > cfg["log"]["every_steps"]  # the first (warm-up) window is not judged


def test_eval_that_eats_the_run_is_named(cfg, tmp_path, monkeypatch):
    monkeypatch.setitem(THRESHOLDS, "overhead_min_s", Threshold(0.0, "s", "tiny test model"))
    cfg["train"].update(eval_every=1, eval_max_batches=None, max_steps=9)
    summary, advice, _ = run(cfg, tmp_path / "run")
    assert causes(advice) == ["eval_time"]
    assert advice[0]["projected_eval_share"] > 0.1
    assert "evaluation" in [x["cause"] for x in summary["limits"]]


def test_checkpoints_that_eat_the_run_are_named(cfg, tmp_path, monkeypatch):
    monkeypatch.setitem(THRESHOLDS, "overhead_min_s", Threshold(0.0, "s", "tiny test model"))
    cfg["checkpoint"] = {"every_steps": 1, "keep_last": 1}  # a save after every step of a tiny model
    cfg["train"]["max_steps"] = 20
    summary, advice, console = run(cfg, tmp_path / "run")
    assert causes(advice) == ["checkpoint_time"] and "checkpoint.async: true" in console
    assert summary["time"]["checkpoint_s"] > 0


def test_repeated_recompiles_are_named_with_what_changed(cfg, tmp_path, monkeypatch):
    import torch._dynamo

    torch._dynamo.reset()
    monkeypatch.setattr(trainer, "compile_decoder", functools.partial(compile_decoder, backend="eager"))
    # documents of many lengths, unpacked: the shape changes from step to step
    words = "one two three four five six seven eight nine ten".split()
    docs = [{"text": " ".join(words[i % 10] for i in range(n))} for n in range(3, 60, 2)]
    write_jsonl(tmp_path / "lengths.jsonl", docs * 3)
    cfg["data"] = {"train": str(tmp_path / "lengths.jsonl"), "eval": None, "max_length": 256, "packing": False, "too_long": "truncate"}
    cfg["train"].update(compile=True, max_steps=12, micro_batch_size=2)
    cfg["log"]["every_steps"] = 1
    try:
        with torch._dynamo.config.patch(automatic_dynamic_shapes=False):  # every new shape compiles again
            _, advice, _ = run(cfg, tmp_path / "run")
    finally:
        torch._dynamo.reset()
    found = [a for a in advice if a["cause"] == "recompiles"]
    assert found and found[0]["recompiles"] >= THRESHOLDS["recompiles"].value
    assert "size mismatch" in found[0]["reason"] or "mismatch" in found[0]["message"]


def test_finite_loss_and_grad_norm_spikes_name_the_step_and_its_examples(cfg, tmp_path, monkeypatch):
    adaptive, step_fn = trainer.forward_backward_adaptive, trainer.optimizer_step

    def spiky_loss(run, *args, **kwargs):
        loss, batches, sums = adaptive(run, *args, **kwargs)
        return (loss * 20 if run.step + 1 == 20 else loss), batches, sums  # the logged loss of step 20

    def spiky_grad(*args, **kwargs):
        grad_norm, skipped = step_fn(*args, **kwargs)
        spiky_grad.calls += 1
        return (grad_norm * 100 if spiky_grad.calls == 24 else grad_norm), skipped

    spiky_grad.calls = 0
    monkeypatch.setattr(trainer, "forward_backward_adaptive", spiky_loss)
    monkeypatch.setattr(trainer, "optimizer_step", spiky_grad)
    _, advice, console = run(cfg, tmp_path / "run")
    by = {a["cause"]: a for a in advice}
    assert set(by) == {"loss_spike", "grad_norm_spike"}
    assert by["loss_spike"]["spike_step"] == 20 and by["grad_norm_spike"]["spike_step"] == 24
    assert len(by["loss_spike"]["example_indices"]) == 8  # the step's rows, as the non-finite guard names them
    assert "step 20: loss" in console


def test_memory_near_the_cap_is_named_before_an_out_of_memory(cfg, tmp_path, monkeypatch):
    rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30
    monkeypatch.setenv("TRAINFORGE_MEMORY_GIB", f"{rss_gib * 1.02:.4f}")  # a cap just above what the process holds
    cfg["train"]["max_steps"] = 6
    _, advice, _ = run(cfg, tmp_path / "run")
    assert causes(advice) == ["memory"]
    assert advice[0]["peak_memory_bytes"] > 0.9 * advice[0]["capacity_bytes"]


def test_an_impossible_mfu_reprobes_the_peak(cfg, tmp_path, monkeypatch):
    monkeypatch.setattr(engine_setup, "peak_flops", lambda *a, **k: (1e6, "a probe taken under load"))
    cfg["train"]["max_steps"] = 9
    _, advice, console = run(cfg, tmp_path / "run")
    assert causes(advice) == ["impossible_mfu"]
    assert advice[0]["new_peak_flops"] > 1e9 and "measured again" in console
    records = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "mfu" in r]
    # measured again before the first record was written: no impossible figure on the console or in metrics.jsonl
    step_lines = [line for line in console.splitlines() if line.lstrip().startswith("step ") and "|" in line]
    assert step_lines and all(r["mfu"] is None or r["mfu"] <= 1 for r in records)
    # the advice line quotes the impossible figure; the step lines must never show one
    shown = [float(m) for line in step_lines for m in re.findall(r"MFU (\d+(?:\.\d+)?)%", line)]
    assert shown and max(shown) <= 100
    assert records[-1]["mfu"] is not None and records[-1]["mfu"] < 1  # divided by the new peak from then on
    # and so is the whole run's in summary.json (the steps before the probe too: the first peak was wrong all along)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["mfu"] < 1


def test_an_impossible_mfu_that_cannot_be_measured_again_is_not_reported(cfg, tmp_path, monkeypatch):
    """A GPU's peak comes from its profile: where that profile is wrong, MFU is left out, not printed at 4000%."""
    monkeypatch.setattr(engine_setup, "peak_flops", lambda *a, **k: (1e6, "a wrong profile"))
    monkeypatch.setattr(engine_setup, "peak_reprobe", lambda *a, **k: None)
    cfg["train"]["max_steps"] = 6
    summary, advice, console = run(cfg, tmp_path / "run")
    assert causes(advice) == ["impossible_mfu"] and "MFU not reported" in console
    records = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "mfu" in r]
    assert records and all(r["mfu"] is None for r in records) and summary["mfu"] is None
    assert "| MFU" not in console


def test_mfu_follows_the_cpu_thread_count(cfg, tmp_path, monkeypatch):
    """A run that started on 1 thread (a core was busy) and took 2 when the core came free kept dividing by one
    thread's peak, and printed MFU 168.6%. The peak follows the count (the fake peak: 1e13 FLOP/s a thread)."""
    from trainforge.hardware.cpu_threads import CpuThreads
    from trainforge.engine import mfu as engine_mfu
    import trainforge.hardware.cpu_threads as cpu_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpu_threads, "RECHECK_S", 0.0)
    machine = {"free": 1}

    def for_device(setting, device):
        return CpuThreads(setting, available=2, probe=lambda n: 0.016 if n > machine["free"] else 3e-4 / n,
                          others=lambda: 2.0 - machine["free"])

    def peak(*args, **kwargs):
        machine["free"] = 2  # the other work ends once the run has started
        return torch.get_num_threads() * 1e13, "matmul probe"

    monkeypatch.setattr(engine_setup.CpuThreads, "for_device", staticmethod(for_device))
    monkeypatch.setattr(engine_setup, "peak_flops", peak)
    monkeypatch.setattr(engine_mfu, "peak_flops", peak)
    cfg["train"]["max_steps"] = 9
    before = torch.get_num_threads()
    try:
        summary, _, _ = run(cfg, tmp_path / "run")
    finally:
        torch.set_num_threads(before)
    change = [e for e in read_events(tmp_path / "run" / "events.jsonl") if e["event"] == "cpu_threads"]
    assert [e["threads"] for e in change] == [2] and change[0]["step"] == 3
    for r in (r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "mfu" in r):
        threads = 1 if r["step"] <= 3 else 2  # the window of the change ran on 1 thread; the count changed after it
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * summary["flops_per_token"] / (threads * 1e13), rel=1e-9)


def test_a_slowdown_after_warm_up_is_named(cfg, tmp_path, monkeypatch):
    step_fn = trainer.optimizer_step

    def slower(*args, **kwargs):
        slower.calls += 1
        time.sleep(0.1 if slower.calls <= 15 else 0.4)  # from step 16: thermal throttling, another job on the device
        return step_fn(*args, **kwargs)

    slower.calls = 0
    monkeypatch.setattr(trainer, "optimizer_step", slower)
    cfg["log"]["every_steps"] = 5
    _, advice, _ = run(cfg, tmp_path / "run")
    assert "slow" in causes(advice)
    slow = next(a for a in advice if a["cause"] == "slow")
    assert slow["tokens_per_s"] < 0.7 * slow["best_tokens_per_s"]


def test_each_cause_is_said_once():
    advisor = Advisor(capacity=100)
    times = RunTimes(wall_s=10, train_s=5, eval_s=0, evals_done=0, evals_planned=2, checkpoint_s=0, steps_done=3, max_steps=9)
    rec = {"step": 3, "tokens_per_s": 100.0, "peak_memory_bytes": 99}
    assert [a.cause for a in advisor.observe(rec, times)] == ["memory"]
    assert advisor.observe(rec, times) == []


def test_the_threshold_table_in_the_docs_is_the_code(pytestconfig):
    from trainforge.metrics.thresholds import markdown_table

    doc = (pytestconfig.rootpath / "docs" / "advisor.md").read_text()
    assert markdown_table() in doc, "regenerate the table: python -c 'from trainforge.metrics.thresholds import markdown_table; print(markdown_table())'"


def test_summary_time_is_json(cfg, tmp_path):
    cfg["train"]["max_steps"] = 3
    run(cfg, tmp_path / "run")
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert isinstance(s["limits"], list) and isinstance(s["time"]["startup"], dict)


def test_a_grpo_loss_near_zero_is_not_judged_for_spikes_its_grad_norm_is():
    """grpo's loss sits near 0 with either sign: 7x its median is no spike (judge_loss False); the grad norm still is."""
    def window(advisor):
        for step in range(1, 30):
            spike = step == 25
            advisor.record_step(step, torch.tensor(1e-8 if spike else 1e-9), torch.tensor(50.0 if spike else 1.0), [step])
        times = RunTimes(wall_s=10, train_s=5, eval_s=0, evals_done=0, evals_planned=0, checkpoint_s=0, steps_done=29,
                         max_steps=30)
        return sorted(a.cause for a in advisor.observe({"step": 29}, times))

    assert window(Advisor(None)) == ["grad_norm_spike", "loss_spike"]
    assert window(Advisor(None, judge_loss=False)) == ["grad_norm_spike"]
