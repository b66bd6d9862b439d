"""benchmarks/gpu_suite.py keeps working: its --tiny run on the CPU writes a complete report."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

SUITE = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_suite.py"


def load_suite(monkeypatch, name: str = "gpu_suite"):
    """benchmarks/gpu_suite.py as a module (registered under ``name``: its dataclasses look their module up)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, SUITE)
    suite = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, suite)
    spec.loader.exec_module(suite)
    return suite


@pytest.mark.slow
def test_tiny_suite_reports_every_variant(tmp_path):
    """The LoRA part (HF + PEFT against trainforge): every variant has a status, the ones that run
    report positive tokens/s, finite losses and memory, trainforge has plan's prediction beside it,
    and --table renders the part's JSON."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(SUITE.parents[1] / "src"), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, str(SUITE), "--tiny", "--part", "3", "--out", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "part-3.json").read_text())
    assert report["tiny"] and report["environment"]["versions"]["torch"]
    (row,) = report["rows"]
    results = row["results"]
    assert set(results) == {"hf-peft", "hf-peft-liger", "trainforge", "trainforge-fp8"}
    assert results["hf-peft-liger"]["status"] == "skipped" and "CUDA" in results["hf-peft-liger"]["reason"]
    assert results["trainforge-fp8"]["fp8"].startswith("tensorwise") and results["trainforge"].get("fp8") is None
    for name in ("hf-peft", "trainforge", "trainforge-fp8"):
        r = results[name]
        assert r["status"] == "ok", r
        assert r["tokens_per_s"] > 0 and math.isfinite(r["late_loss"]) and r["peak_memory_bytes"] > 0
    tf = results["trainforge"]
    profile = tf["profile"]  # the profiled warm-up step: phases and where the op time went
    assert profile["phases"]["forward_s"] > 0 and profile["by_kind_s"]["matmul"] > 0 and profile["top"]
    assert tf["speed_vs_baseline"] > 0 and 0.5 < tf["loss_vs_baseline"] < 2.0
    assert tf["plan"]["tokens_per_s"] > 0 and tf["plan"]["peak_memory_bytes"] > 0 and "speed_error" in tf["plan"]
    table = subprocess.run([sys.executable, str(SUITE), "--table", str(tmp_path)], capture_output=True, text=True, env=env, timeout=120)
    assert table.returncode == 0, table.stderr
    assert "| llama-8b-shape-lora | trainforge |" in table.stdout and "skipped: needs CUDA" in table.stdout
    assert "Where trainforge's profiled step went" in table.stdout and "| llama-8b-shape-lora | trainforge-fp8 | (host ops) |" in table.stdout


def test_spent_budget_skips_variants_and_still_writes_the_part(tmp_path):
    """With no budget left, no variant starts: each is reported skipped with the reason, the part's JSON
    is written all the same, and the table says why. The short part (``first``) runs its 1B row in two
    pieces: one row in the report, with every variant of both pieces, and no work files in --out."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(SUITE.parents[1] / "src"), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, str(SUITE), "--tiny", "--part", "first", "--out", str(tmp_path / "out"),
                           "--work", str(tmp_path / "work"), "--budget", "0"], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "part-first.json").read_text())
    rows = {row["row"]["name"]: row for row in report["rows"]}
    assert report["complete"] and list(rows) == ["llama-1b-shape", "llama-8b-shape-lora"]
    assert list(rows["llama-1b-shape"]["results"]) == ["hf", "trainforge", "hf-liger", "trainforge-compiled"]
    assert rows["llama-1b-shape"]["row"]["variants"] == ["hf", "trainforge", "hf-liger", "trainforge-compiled"]
    assert list(rows["llama-8b-shape-lora"]["results"]) == ["hf-peft", "trainforge"]
    results = [r for row in rows.values() for r in row["results"].values()]
    assert all(r["status"] == "skipped" for r in results) and "budget" in done.stdout
    assert "budget" in rows["llama-1b-shape"]["results"]["trainforge-compiled"]["reason"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["part-first.json"]


def test_the_default_allocator_variant_runs_on_the_users_setting_which_trainforge_keeps(monkeypatch):
    """Part 1's last variant measures what expandable segments save: its process starts with torch's
    default allocator asked for by name, as a user would, and trainforge's own request then stands aside."""
    from trainforge.hardware.allocator import allocator_settings, prefer_expandable_segments

    suite = load_suite(monkeypatch)
    assert suite.DEFAULT_ALLOCATOR in suite.parts(tiny=False)["1"][0].variants
    env = suite.variant_env(suite.DEFAULT_ALLOCATOR, {"PATH": "/bin"})
    prefer_expandable_segments(env, "2.11.0+cu130")
    assert allocator_settings(env)["settings"] == "expandable_segments:False" and allocator_settings(env)["set_by"] == "user"
    ours = suite.variant_env("trainforge", {"PATH": "/bin"})
    prefer_expandable_segments(ours, "2.11.0+cu130")
    assert allocator_settings(ours)["set_by"] == "trainforge"


@pytest.mark.slow
def test_a_part_run_again_into_the_same_folder_measures_trainforge_again(tmp_path, monkeypatch):
    """A part started again with the same --out (the device's call timed out, or after a fix): trainforge's run
    directory of the first call held a finished run, and train refused it ('already holds a run'), so every
    trainforge variant of the second call failed. Each call measures a fresh run."""
    suite = load_suite(monkeypatch)
    row = suite.parts(tiny=True)["1"][0]
    row.steps = 3
    work = tmp_path / "work"
    work.mkdir()
    run = {"row": suite.asdict(row), "work": str(work), "model_dir": str(work / "model"), "profile_step": 1,
           "out": str(work / "trainforge")}
    run["data"] = suite.write_data(work, row)
    suite.prepare_model(run)
    Path(run["out"]).mkdir()
    for _ in range(2):
        result = suite.run_trainforge(run, "trainforge")
        assert len(result["steps"]) == 3
        # each step row holds the tokens seen so far, ending at the run's total (the suite once summed the
        # running totals: on an H200 trainforge read 30x HF where it was 1.17x)
        total = json.loads((Path(run["out"]) / "run" / "summary.json").read_text())["tokens"]
        tokens = [s["tokens"] for s in result["steps"]]
        assert tokens[-1] == total and 0 < tokens[0] < tokens[1] < tokens[2]


def test_a_report_that_summed_running_totals_is_recounted(monkeypatch):
    """--table on a report from before the fix: trainforge's steady and whole tokens/s, tokens and MFU are
    recounted to what equal steps give, the ratios and plan's errors follow, HF's figures stay, and the table
    marks the recounted rows."""
    suite = load_suite(monkeypatch, "gpu_suite_recount")
    n, per_step, seconds = 40, 8000, 0.2

    def steps(total):  # step k at k * seconds (the first one 2 s later), `total(k)` tokens recorded
        return [{"step": k, "elapsed_s": 2.0 + k * seconds, "tokens": total(k), "loss": 1.0} for k in range(1, n + 1)]

    truth = suite.summarize({"steps": steps(lambda k: k * per_step), "flops_per_token": 1e9}, 10, 1e15)
    summed = suite.summarize({"steps": steps(lambda k: per_step * k * (k + 1) // 2), "flops_per_token": 1e9}, 10, 1e15)
    hf = suite.summarize({"steps": steps(lambda k: k * 2 * per_step), "flops_per_token": 1e9}, 10, 1e15)
    for r in (truth, summed, hf):
        r["peak_memory_bytes"] = 2**30
    summed["plan"] = {"tokens_per_s": truth["tokens_per_s"] * 1.1, "peak_memory_bytes": 1}
    report = {"part": "first", "environment": {"device": "GPU", "versions": {"torch": "x"}},
              "rows": [{"row": {"name": "r", "steps": n, "method": "full"}, "results": {"hf": hf, "trainforge": summed}}]}
    suite.add_ratios(report["rows"][0]["results"], "hf")
    assert summed["speed_vs_baseline"] > 10
    suite.recount_summed_totals(report)
    tf = report["rows"][0]["results"]["trainforge"]
    for key in ("tokens_per_s", "tokens_per_s_whole", "tokens", "mfu"):
        assert math.isclose(tf[key], truth[key], rel_tol=1e-9), key
    assert math.isclose(tf["speed_vs_baseline"], 0.5) and math.isclose(tf["plan"]["speed_error"], 0.1)
    assert report["rows"][0]["results"]["hf"]["tokens_per_s"] == hf["tokens_per_s"] and "recounted" not in hf
    suite.recount_summed_totals(report)  # once only
    assert math.isclose(tf["tokens_per_s"], truth["tokens_per_s"])
    assert "(r)" in suite.table([report]) and "recounted from a report" in suite.table([report])


def test_reuse_takes_a_finished_variant_and_a_failed_run_never_returns_an_old_result(tmp_path, monkeypatch):
    """A second device call (`--reuse`) takes what the first finished with the same spec, without running it; a
    changed spec runs again. Without --reuse, a variant that fails reports the failure, not the result.json an
    earlier call left in its folder (launch only checked that the file existed)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_suite_reuse", SUITE)
    suite = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_suite_reuse", suite)  # its dataclasses look their module up
    spec.loader.exec_module(suite)
    out = tmp_path / "trainforge"
    calls = []

    def child(argv, **kwargs):
        calls.append(argv)
        if len(calls) in (1, 4):  # runs that write their result; the fourth then fails at its end
            Path(argv[-1]).write_text(json.dumps({"status": "ok", "tokens_per_s": 5.0}))
            return subprocess.CompletedProcess(argv, 0 if len(calls) == 1 else 1, "", "CUDA error in teardown")
        return subprocess.CompletedProcess(argv, 1, "", "CUDA error: an illegal memory access")

    monkeypatch.setattr(suite.subprocess, "run", child)
    run_spec = {"row": {"name": "r"}, "work": str(tmp_path)}
    assert suite.launch("trainforge", run_spec, out, 10.0) == {"status": "ok", "tokens_per_s": 5.0}
    assert suite.launch("trainforge", run_spec, out, 10.0, reuse=True) == {"status": "ok", "tokens_per_s": 5.0, "reused": True}
    assert len(calls) == 1
    changed = suite.launch("trainforge", {**run_spec, "row": {"name": "r", "steps": 3}}, out, 10.0, reuse=True)
    assert changed["status"] == "failed" and "illegal memory access" in changed["reason"] and len(calls) == 2
    again = suite.launch("trainforge", run_spec, out, 10.0)
    assert again["status"] == "failed" and len(calls) == 3
    # a result written before the process failed is no result, now nor for a later --reuse
    assert suite.launch("trainforge", run_spec, out, 10.0)["status"] == "failed" and len(calls) == 4
    assert suite.launch("trainforge", run_spec, out, 10.0, reuse=True)["status"] == "failed" and len(calls) == 5


@pytest.mark.slow
def test_the_grpo_row_runs_trl_and_trainforge_and_plan_prices_its_rollout(tmp_path, monkeypatch):
    """Part 4's GRPO row at its tiniest (one prompt's 8 completions of 6 tokens, 2 steps), each variant's runner in
    this process (a process each would cost more in imports than the runs): TRL's GRPOTrainer + PEFT and trainforge
    report tokens learned per second and the late reward, not a loss ratio; plan's prediction prices the rollout's
    KV cache and no speed (it predicts the learning step only); the table says so."""
    import importlib.util
    from dataclasses import asdict

    pytest.importorskip("trl", reason="the GRPO row's baseline is TRL's GRPOTrainer (the bench extra)")
    spec_ = importlib.util.spec_from_file_location("gpu_suite_grpo", SUITE)
    suite = importlib.util.module_from_spec(spec_)
    monkeypatch.setitem(sys.modules, "gpu_suite_grpo", suite)
    spec_.loader.exec_module(suite)
    (row,) = suite.parts(tiny=True)["4"]
    row.steps = 2
    work = tmp_path / "work"
    work.mkdir()
    spec = {"row": asdict(row), "work": str(work), "model_dir": str(work / "model"), "profile_step": 1}
    spec["data"] = suite.write_data(work, row)
    suite.prepare_model(spec)
    results = {}
    for variant, run in (("trl-grpo-peft", suite.run_trl_grpo), ("trainforge", suite.run_trainforge)):
        (work / variant).mkdir()
        raw = run({**spec, "out": str(work / variant)}, variant)
        raw.pop("flops_model", None)
        results[variant] = suite.summarize({**raw, "peak_memory_bytes": 2**30}, 1, None)
        r = results[variant]
        assert r["status"] == "ok" and r["tokens_per_s"] > 0 and r["late_loss"] is None and 0 <= r["late_reward"] <= 1, r
    results["trainforge"]["plan"] = suite.plan_prediction(spec, "h100")  # no op timed here: seconds, not tens
    suite.add_ratios(results, suite.baseline_of(spec["row"]))
    plan = results["trainforge"]["plan"]
    assert plan["kv_cache_bytes"] > 0 and plan["peak_phase"] in ("rollout", "learning") and plan["speed_error"] is None
    assert results["trainforge"]["speed_vs_baseline"] > 0 and "loss_vs_baseline" not in results["trainforge"]
    report = {"part": "4", "environment": {"device": "cpu", "versions": {"torch": "x"}}, "token_accounting": 2,
              "rows": [{"row": spec["row"], "results": results}]}
    text = suite.table([report])
    assert "| qwen-0.5b-shape-grpo | trl-grpo-peft |" in text and "| reward " in text and " / n/a" in text, text


def test_the_moe_row_adapts_the_same_weights_on_both_sides(tmp_path, monkeypatch):
    """Part 5 (Qwen3-30B-A3B's layers): HF + PEFT and trainforge put LoRA on the same weights of the same model:
    attention's projections and every layer's 3-D expert weights, never the router; HF runs transformers'
    grouped_mm experts with the router's loss on, as trainforge does by default."""
    import torch
    from transformers import AutoModelForCausalLM

    from trainforge.config.model import LoraSettings
    from trainforge.model.load import apply_lora

    suite = load_suite(monkeypatch)
    (full,) = suite.parts(tiny=False)["5"]
    assert full.arch["architecture"] == "qwen3_moe" and full.arch["num_experts"] == 128 and full.arch["num_hidden_layers"] == 12
    assert full.method == "lora" and full.variants[:2] == ["hf-peft", "trainforge"] and suite.MOE_HF_EXPERTS == "grouped_mm"
    (row,) = suite.parts(tiny=True)["5"]
    spec = {"row": suite.asdict(row), "work": str(tmp_path), "model_dir": str(tmp_path / "model"), "data": {"train": "x"}}
    suite.prepare_model(spec)

    def adapted(model) -> set[str]:  # the base weights that got adapters: '<layer>.<module path>[.<3-D parameter>]'
        out = set()
        for name, module in model.named_modules():
            if len(getattr(module, "lora_A", ())):  # PEFT's layers; a ParamWrapper names the parameter it adapts
                param = getattr(module, "parameter_name", None)
                out.add(name.replace(".base_layer", "").split("layers.")[1] + (f".{param}" if param else ""))
        return out

    hf = suite.hf_lora_config(row.arch)
    from peft import get_peft_model

    base = lambda: AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)  # noqa: E731
    theirs = adapted(get_peft_model(base(), hf))
    lora = suite.trainforge_config(spec)["model"]["lora"]
    ours = adapted(apply_lora(base(), LoraSettings(r=lora["r"], alpha=lora["alpha"], target_modules=lora["target_modules"])))
    assert theirs == ours
    per_layer = {n.split(".", 1)[1] for n in ours}
    assert {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"} <= per_layer
    assert {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"} <= per_layer
    assert not any(n.endswith("mlp.gate") for n in per_layer) and len({n.split(".")[0] for n in ours}) == row.arch["num_hidden_layers"]


@pytest.mark.slow
def test_the_longest_row_part_searches_both_trainers_and_the_table_shows_it(tmp_path):
    """Part 6 (the longest QLoRA row, bench_long_context.py's search): both trainers' searches and the table
    measurements at HF's longest are in part-6.json, HF + PEFT's probes ran in one process, both bases were NF4,
    and --table prints the section."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(SUITE.parents[1] / "src"), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, str(SUITE), "--tiny", "--part", "6", "--out", str(tmp_path / "out"),
                           "--work", str(tmp_path / "work")], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "part-6.json").read_text())
    long = report["long"]
    assert report["complete"] and report["rows"] == [] and long["status"] == "ok", long.get("reason")
    assert long["settings"]["method"] == "qlora" and long["settings"]["hf_search"] == "in-process"
    by_run = {x["run"]: x for x in long["longest"]}
    assert set(by_run) == {"trainforge", "hf-peft"}
    assert all(x["longest"] > 0 and x["probes"] for x in by_run.values())
    assert all(p.get("in_process") for p in by_run["hf-peft"]["probes"])
    assert not any(p.get("in_process") for p in by_run["trainforge"]["probes"])
    hf = by_run["hf-peft"]["longest"]
    at_hf = {r["run"]: r for r in long["table"] if r["length"] == hf}
    assert at_hf["trainforge"]["status"] == at_hf["hf-peft"]["status"] == "ok" and at_hf["trainforge"]["peak_gib"] > 0
    assert any("longest under the cap" in line for line in long["summary"])
    assert long["command"].startswith("python benchmarks/bench_long_context.py --shape tiny")
    ok = [r for x in by_run.values() for r in x["probes"] if r["status"] == "ok"]
    assert ok and all(r["nf4_layers"] > 0 for r in ok)  # both bases quantized: bitsandbytes' 4-bit layers
    table = subprocess.run([sys.executable, str(SUITE), "--table", str(tmp_path / "out")], capture_output=True, text=True,
                           env=env, timeout=120)
    assert table.returncode == 0, table.stderr
    assert "Longest row under a 1 GiB cap (tiny shape, qlora r16" in table.stdout
    assert "trainforge / hf-peft longest" in table.stdout
