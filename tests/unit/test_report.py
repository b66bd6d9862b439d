"""report.html without a browser: the plots are there and inlined, the tables hold the run's numbers,
events are placed where they happened, several runs compare config differences first."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import pytest
import yaml

from trainforge.metrics.report import ReportError, write_report
from trainforge.metrics.report_charts import PANELS
from trainforge.metrics.report_data import config_differences, load_run

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def make_run(path: Path, lr: float = 1e-3, steps: int = 12, finished: bool = True, skipped_at: int | None = 6) -> Path:
    """A run directory as the trainer writes it: metrics, events, config, and summary when finished."""
    path.mkdir(parents=True)
    records = []
    skipped = 0
    for step in range(2, steps + 1, 2):
        skipped += 1 if step == skipped_at else 0
        records.append({
            "step": step, "loss": 5.0 - 0.2 * step, "lr": lr, "grad_norm": 1.0 / step, "tokens": 1000 * step,
            "tokens_per_s": 900.0 + step, "samples_per_s": 3.0, "steps_per_s": 1.0, "mfu": 0.1, "data_wait_pct": 1.5,
            "peak_memory_bytes": 2**30, "elapsed_s": float(step), "skipped_steps": skipped,
        })
        if step % 4 == 0:
            records.append({"step": step, "eval_loss": 5.5 - 0.2 * step, "eval_ppl": 100.0})
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    events = [
        {"event": "checkpoint", "step": 4, "time": 1.0, "pause_s": 0.25},
        {"event": "oom_backoff", "step": 5, "time": 2.0, "micro_batch_size": 2, "grad_accum": 4},
        {"event": "checkpoint", "step": 8, "time": 3.0, "pause_s": 0.5},
        {"event": "stop", "step": 8, "time": 3.0, "signal": "SIGTERM", "saved": True},
        {"event": "resume", "step": 8, "time": 4.0, "checkpoint": "step-00000008"},
    ]
    (path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    config = {"model": {"method": "full"}, "optim": {"lr": lr, "schedule": "cosine"}, "train": {"max_steps": steps}}
    (path / "config.yaml").write_text(yaml.safe_dump(config))
    if finished:
        summary = {"steps": steps, "tokens": 1000 * steps, "tokens_per_s": 950.0, "mfu": 0.1, "peak_memory_bytes": 2**30,
                   "final_train_loss": records[-1].get("loss"), "eval_loss": 3.1, "eval_loss_before": 5.5,
                   "wall_time_s": 75.0, "train_time_s": 60.0, "checkpoint_stall_s": 0.25, "precision": "fp32",
                   "device": "cpu", "resumed_from_step": 8, "skipped_steps": 1}
        (path / "summary.json").write_text(json.dumps(summary))
    return path


def images(page: str) -> dict[str, bytes]:
    """alt text -> PNG bytes of every inlined image."""
    return {alt: base64.b64decode(data) for alt, data in re.findall(r'<img alt="([^"]+)" src="data:image/png;base64,([^"]+)"', page)}


def test_one_run_report_has_every_plot_inlined_and_its_numbers(tmp_path):
    run = make_run(tmp_path / "run-a")
    out = write_report([run])
    assert out == run / "report.html"
    page = out.read_text()

    pngs = images(page)
    assert list(pngs) == [title for title, *_ in PANELS]  # loss (steps, tokens), lr, grad norm, tokens/s, MFU, memory, data wait
    assert all(png.startswith(PNG_SIGNATURE) and len(png) > 5000 for png in pngs.values())
    # self-contained: nothing to fetch, nothing to run
    assert not re.search(r'(src|href)="(?!data:)', page) and "<script" not in page

    table = page.split('<table class="summary">')[1].split("</table>")[0]
    # the wall time is the resumed process's (train time counts the whole run): a resume once read train 0:24, wall 0:15
    for cell in ("finished", "12", "12,000", "950", "10.0%", "1.00 GiB", "3.1000 (5.5000 before training)", "fp32", "1:00",
                 "1:15 (the process resumed at step 8)"):
        assert f"<td>{cell}</td>" in table, cell
    events = page.split('<table class="events">')[1].split("</table>")[0]
    for row in ("<td>4</td><td>checkpoint</td><td>paused 0.25s</td>",
                "<td>5</td><td>out-of-memory back-off</td><td>micro-batch 2 x accumulation 4</td>",
                "<td>6</td><td>skipped steps</td>",
                "<td>8</td><td>checkpoint</td><td>paused 0.50s</td></tr><tr><td>8</td><td>stopped by a signal</td>"
                "<td>SIGTERM, checkpoint saved</td></tr><tr><td>8</td><td>resume</td><td>from step-00000008</td>"):
        assert row in events, row  # a step's events in the order they happened: the resume comes last
    # the pauses of both processes' saves, where summary.json's checkpoint_stall_s (0.25) is the resumed process's
    assert "<td>2 saves, 0.75s</td>" in table
    assert "<summary>config of run-a</summary>" in page


def test_marks_come_from_events_and_skipped_counts(tmp_path):
    run = load_run(make_run(tmp_path / "run", skipped_at=10))
    assert [s for s, _ in run.marks["resume"]] == [8]
    assert [s for s, _ in run.marks["checkpoint"]] == [4, 8]
    assert [s for s, _ in run.marks["oom_backoff"]] == [5]
    assert [s for s, _ in run.marks["skipped"]] == [10]  # the record whose skipped_steps count went up


def test_runs_without_events_file_take_resume_and_oom_from_summary(tmp_path):
    path = make_run(tmp_path / "old")
    (path / "events.jsonl").unlink()
    summary = json.loads((path / "summary.json").read_text())
    summary["oom_backoffs"] = [{"step": 3, "micro_batch_size": 4, "grad_accum": 2}]
    (path / "summary.json").write_text(json.dumps(summary))
    run = load_run(path)
    assert [s for s, _ in run.marks["resume"]] == [8]
    assert [s for s, _ in run.marks["oom_backoff"]] == [3]


def test_several_runs_overlay_and_put_config_differences_first(tmp_path):
    a = make_run(tmp_path / "lr-high", lr=3e-3)
    b = make_run(tmp_path / "lr-low", lr=1e-4, steps=8, finished=False)
    out = write_report([a, b], tmp_path / "compare.html")
    page = out.read_text()
    assert len(images(page)) == len(PANELS)
    assert config_differences([load_run(a), load_run(b)]) == ["optim.lr", "train.max_steps"]

    table = page.split('<table class="summary">')[1].split("</table>")[0]
    assert "<th>lr-high</th><th>lr-low</th>" in table
    first_rows = table.split("<tbody>")[1]
    assert first_rows.startswith('<tr class="group"><th colspan="3">config differences (2 keys differ)</th></tr>')
    assert '<tr class="diff"><th>optim.lr</th><td>0.003</td><td>0.0001</td></tr>' in table
    assert "optim.schedule" not in table  # the same in both: not a difference
    assert table.index("config differences") < table.index("<th>status</th>")
    assert "<td>finished</td><td>stopped by SIGTERM at step 8</td>" in table


def test_stopped_run_and_a_torn_last_line(tmp_path):
    path = make_run(tmp_path / "stopped", steps=8, finished=False)
    with open(path / "metrics.jsonl", "a") as f:
        f.write('{"step": 10, "loss": 1.')  # being written, or torn by a crash
    run = load_run(path)
    assert run.train[-1]["step"] == 8
    assert run.status == "stopped by SIGTERM at step 8"
    page = write_report([path]).read_text()
    assert "<td>stopped by SIGTERM at step 8</td>" in page
    assert "<td>3.4000</td>" in page  # final train loss from the last record when there is no summary


def test_a_run_with_no_steps_yet_still_gets_a_page(tmp_path):
    path = tmp_path / "new"
    path.mkdir()
    (path / "metrics.jsonl").write_text("")
    page = write_report([path]).read_text()
    assert len(images(page)) == len(PANELS)


def test_not_a_run_directory_is_named(tmp_path):
    with pytest.raises(ReportError, match="no metrics.jsonl"):
        write_report([tmp_path])
    with pytest.raises(ReportError, match="no such directory"):
        write_report([tmp_path / "missing"])


def test_a_kto_runs_rewards_panel_plots_its_desirable_and_undesirable_rewards(tmp_path):
    """KTO logs rewards_desirable and rewards_undesirable, not chosen/rejected: its report's Rewards panel said
    'not measured in this run'."""
    from trainforge.metrics.report_charts import PREFERENCE_PANELS

    run = make_run(tmp_path / "kto")
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for r in lines:
        if "loss" in r:
            r.update(rewards_desirable=0.01 * r["step"], rewards_undesirable=-0.01 * r["step"], reward_accuracy=0.6, kl=0.0)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    rewards = dict((title, fn) for title, _, _, fn, _ in PREFERENCE_PANELS)["Rewards"]
    series = rewards(load_run(run), 0, False)
    assert [s.label for s in series] == ["desirable", "undesirable"]
    assert series[0].y == [0.01 * s for s in range(2, 13, 2)] and series[1].y[-1] == pytest.approx(-0.12)
    assert 'alt="Rewards"' in write_report([run]).read_text()


def test_a_mixtures_loss_per_source_gets_its_panel(tmp_path):
    """A mixture logs loss/NAME and eval_loss/NAME: the report plots each source's train and eval loss."""
    from trainforge.metrics.report_charts import _by_source

    run = make_run(tmp_path / "mix")
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for r in lines:
        if "loss" in r:
            r.update({"loss/chat": r["loss"] - 0.5, "loss/code": r["loss"] + 0.5})
        else:
            r.update({"eval_loss/chat": r["eval_loss"] - 0.5, "eval_loss/code": r["eval_loss"] + 0.5})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    series = _by_source(load_run(run), 0, False)
    assert [s.label for s in series] == ["chat", "chat eval", "code", "code eval"]
    assert series[2].y == [5.5 - 0.2 * s for s in range(2, 13, 2)] and series[3].x == [4, 8, 12]
    page = write_report([run]).read_text()
    assert list(images(page))[:3] == ["Loss against steps", "Loss against tokens", "Loss per source"]
    assert 'alt="Loss per source"' not in write_report([make_run(tmp_path / "one")]).read_text()


def test_a_grpo_runs_report_plots_its_reward_each_function_and_completion_length(tmp_path):
    """grpo logs reward, reward_NAME per function and completion_length: the report gets Reward and Completion
    length panels after the loss (none for an SFT run)."""
    from trainforge.metrics.report_charts import RL_PANELS, panels_for

    run = make_run(tmp_path / "grpo")
    assert not any(title == "Reward" for title, *_ in panels_for([load_run(run)]))
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for r in lines:
        if "loss" in r:
            r.update(reward=0.05 * r["step"], reward_final_number=0.04 * r["step"], reward_length=0.01 * r["step"],
                     completion_length=10.0 - 0.5 * r["step"], truncated=0.0)
        else:
            r["eval_reward"] = 0.03 * r["step"]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    data = load_run(run)
    assert [title for title, *_ in panels_for([data])][2:4] == ["Reward", "Completion length"]
    panels = {title: fn for title, _, _, fn, _ in RL_PANELS}
    series = panels["Reward"](data, 0, False)
    assert [s.label for s in series] == ["reward", "final_number", "length", "held-out"]
    assert series[0].y == pytest.approx([0.05 * s for s in range(2, 13, 2)])
    assert series[-1].y == pytest.approx([0.03 * r["step"] for r in lines if "eval_reward" in r])
    assert panels["Completion length"](data, 0, False)[0].y[-1] == pytest.approx(4.0)
    page = write_report([run]).read_text()
    assert 'alt="Reward"' in page and 'alt="Completion length"' in page


def test_a_mixture_of_experts_runs_expert_load_gets_its_panel(tmp_path):
    """A MoE run logs expert_load_max / _min / _even: the report plots them in % after the loss (none for a dense run)."""
    from trainforge.metrics.report_charts import _expert_load, panels_for

    run = make_run(tmp_path / "moe")
    assert not any(title == "Expert load" for title, *_ in panels_for([load_run(run)]))
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for r in lines:
        if "loss" in r:
            r.update(expert_load_max=0.2 + 0.05 * r["step"], expert_load_min=0.1, expert_load_even=0.125,
                     expert_load_max_by_layer=[0.2, 0.2 + 0.05 * r["step"]], expert_load_min_by_layer=[0.1, 0.12])
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    data = load_run(run)
    assert [title for title, *_ in panels_for([data])][2] == "Expert load"
    series = _expert_load(data, 0, False)
    assert [s.label for s in series] == ["most-loaded expert (worst layer)", "least-loaded expert (lowest layer)", "even load"]
    assert series[0].y == pytest.approx([20 + 5 * s for s in range(2, 13, 2)]) and series[2].y[0] == pytest.approx(12.5)
    assert 'alt="Expert load"' in write_report([run]).read_text()
