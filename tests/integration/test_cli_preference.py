"""End to end: preference tuning through ``trainforge train`` on pairs with a known preference (the toy
cycle continued vs the same words backwards). Held-out reward accuracy must rise far above chance, the
metrics the field expects must be in metrics.jsonl, and ``final/`` must load with transformers / PEFT
and give, under trainforge's own eval code, the reward accuracy summary.json reports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from integration_helpers import root_conftest, run_cli, show

conftest = root_conftest()
PAIR_KEYS = {"rewards_chosen", "rewards_rejected", "reward_margin", "reward_accuracy", "logps_chosen", "logps_rejected"}
KTO_KEYS = {"rewards_desirable", "rewards_undesirable", "reward_accuracy", "kl", "logps"}


def preference_config(model_dir: Path, data_dir: Path, objective: str, method: str) -> dict:
    cfg = conftest.finetune_settings(model_dir, data_dir)
    cfg["model"]["method"] = method
    files = ("kto_train.jsonl", "kto_eval.jsonl") if objective == "kto" else ("pref_train.jsonl", "pref_eval.jsonl")
    cfg["data"].update(train=str(data_dir / files[0]), eval=str(data_dir / files[1]), max_length=64)
    cfg["train"].update(objective=objective, max_steps=30, micro_batch_size=8, grad_accum=1, eval_every=15,
                        eval_max_batches=None)
    cfg["optim"].update(lr=1e-2 if method == "lora" else 3e-3, warmup_steps=0)
    cfg["log"]["every_steps"] = 5
    if objective == "orpo":
        cfg["preference"] = {"beta": 0.5}
    cfg["log"]["report"] = method == "lora"  # one run draws report.html: its reward panels are checked
    return cfg


def recomputed_eval(run: Path, model: torch.nn.Module, tokenizer, reference: torch.nn.Module | None = None) -> dict:
    """The eval metrics of ``model`` on the run's eval pairs, built and scored as the trainer does; ``reference``:
    the starting weights of a full fine-tune (a copy of ``model`` would be the trained weights)."""
    from rich.console import Console

    from trainforge.config.run import load_config
    from trainforge.data.loader import eval_batches
    from trainforge.data.plan import plan_data
    from trainforge.engine.evaluate import evaluate
    from trainforge.engine.objective import PairObjective, build_objective
    from trainforge.hardware.device import PRECISIONS
    from trainforge.metrics.console import ConsoleReporter

    cfg = load_config(run / "config.yaml")
    plan = plan_data(cfg, tokenizer, ConsoleReporter(Console(quiet=True)))
    batches = eval_batches(plan.eval_rows, plan.eval_collate, cfg.train.micro_batch_size)
    objective = PairObjective(cfg.train.objective, cfg.preference, "model", reference) if reference is not None else build_objective(cfg, model)
    return evaluate(model, batches, PRECISIONS["fp32"], torch.device("cpu"), objective=objective)


@pytest.mark.parametrize("objective,method", [("dpo", "lora"), ("dpo", "full"), ("orpo", "lora"), ("orpo", "full"), ("kto", "lora"), ("kto", "full")])
def test_preference_run_learns_the_known_preference_and_final_loads(tmp_path, tiny_model_dir, toy_data_dir, objective, method):
    config = conftest.write_config(tmp_path / "run.yaml", preference_config(tiny_model_dir, toy_data_dir, objective, method))
    proc = run_cli(["train", config, "--output", tmp_path / "run"], tmp_path)
    assert proc.returncode == 0, show(proc)
    run = tmp_path / "run"
    summary = json.loads((run / "summary.json").read_text())
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    assert summary["objective"] == objective
    assert summary["reference"] == ({"lora": "adapters", "full": "model"}[method] if objective in ("dpo", "kto") else "none")
    keys = KTO_KEYS if objective == "kto" else PAIR_KEYS
    assert keys <= set(train[-1]), train[-1]
    assert {f"eval_{k}" for k in keys} <= set(evals[-1])
    if objective == "dpo":  # policy == reference before the first step: every reward is 0
        assert evals[0]["eval_reward_accuracy"] == 0.0 and evals[0]["eval_loss"] == pytest.approx(0.693147, abs=1e-5)
    assert summary["eval_reward_accuracy"] >= 0.8, evals  # 60 held-out pairs: chance is 0.5
    if objective == "kto":  # desirable completions rewarded above undesirable ones, on held-out rows
        assert summary["eval_rewards_desirable"] > 0 > summary["eval_rewards_undesirable"], summary
    else:
        assert summary["eval_reward_margin"] > evals[0]["eval_reward_margin"]
    assert "objective: " + objective in proc.stdout and "reward acc" in proc.stdout
    if method == "lora":
        page = (run / "report.html").read_text()
        assert 'alt="Reward accuracy"' in page and 'alt="Rewards"' in page

    final = run / "final"
    from trainforge.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(final)
    if method == "lora":
        from peft import AutoPeftModelForCausalLM

        model = AutoPeftModelForCausalLM.from_pretrained(final)
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(final)
    reference = None
    if objective in ("dpo", "kto") and method == "full":  # the reference is the starting weights
        from transformers import AutoModelForCausalLM

        reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    got = recomputed_eval(run, model, tokenizer, reference)
    assert got["eval_reward_accuracy"] == pytest.approx(summary["eval_reward_accuracy"], abs=1e-6)
    assert got["eval_loss"] == pytest.approx(summary["eval_loss"], rel=1e-4)
    if objective == "dpo":  # trainforge eval on the run's eval file: the run's last evaluation, same reference
        proc = run_cli(["eval", run, "--data", toy_data_dir / "pref_eval.jsonl", "--json"], tmp_path)
        assert proc.returncode == 0, show(proc)
        figures = json.loads(proc.stdout[proc.stdout.index("{"):])
        assert figures["objective"] == "dpo" and figures["reference"] == summary["reference"]
        assert figures["reward_accuracy"] == pytest.approx(summary["eval_reward_accuracy"], abs=1e-6)
        assert figures["loss"] == pytest.approx(summary["eval_loss"], rel=1e-4)
    if objective == "kto" and method == "lora":  # a kto run on pairs: eval says how to score them, in eval's terms
        proc = run_cli(["eval", run, "--data", toy_data_dir / "pref_eval.jsonl"], tmp_path)
        assert proc.returncode == 2 and "data.train" not in proc.stderr and "data.format:" not in proc.stderr, show(proc)
        assert "score them with --set train.objective=dpo" in proc.stderr, show(proc)
        assert "for KTO on the pairs, --set data.format=unpaired" in proc.stderr, show(proc)
        proc = run_cli(["eval", run, "--data", toy_data_dir / "pref_eval.jsonl", "--set", "train.objective=dpo", "--json"], tmp_path)
        assert proc.returncode == 0 and json.loads(proc.stdout[proc.stdout.index("{"):])["objective"] == "dpo", show(proc)


def llama_factory_rows(pairs: list[dict]) -> tuple[list[dict], list[dict]]:
    """The pairs in LLaMA-Factory's ShareGPT layout (its dpo_en_demo.json: the prompt's turns, then one message per
    side; every third with a system turn, some others with a top-level system), and the same converted by hand to
    TRL's message-list layout."""
    shared, by_hand = [], []
    for k, p in enumerate(pairs):
        turns = ([{"from": "system", "value": "continue the words"}] if k % 3 == 0 else []) + [{"from": "human", "value": p["prompt"]}]
        row = {"conversations": turns, "chosen": {"from": "gpt", "value": p["chosen"]}, "rejected": {"from": "gpt", "value": p["rejected"]}}
        messages = [{"role": "system", "content": "continue the words"}] if k % 3 == 0 else []
        if k % 3 == 1:  # a top-level system where the turns hold none
            row["system"] = "be brief"
            messages = [{"role": "system", "content": "be brief"}]
        messages.append({"role": "user", "content": p["prompt"]})
        shared.append(row)
        by_hand.append({"prompt": messages, "chosen": [{"role": "assistant", "content": p["chosen"]}],
                        "rejected": [{"role": "assistant", "content": p["rejected"]}]})
    return shared, by_hand


def test_llama_factory_sharegpt_pairs_train_as_the_rows_converted_by_hand(tmp_path, tiny_model_dir, toy_data_dir):
    """LLaMA-Factory's DPO layout was refused ("'chosen' and 'rejected' must both be strings or both be message lists,
    got dict and dict"; under data.on_bad_row: skip every row was skipped). Now a run on its JSON array trains exactly
    as one on the same rows converted by hand; and a pair missing a side says which, where."""
    shared, by_hand = llama_factory_rows(conftest.toy_preference_pairs(32, seed=11))
    (tmp_path / "dpo_demo.json").write_text(json.dumps(shared, indent=2))
    conftest.write_jsonl(tmp_path / "by_hand.jsonl", by_hand)
    losses = []
    for name, skip in (("dpo_demo.json", True), ("by_hand.jsonl", False)):
        cfg = preference_config(tiny_model_dir, toy_data_dir, "dpo", "full")
        cfg["data"].update(train=str(tmp_path / name), eval=None, on_bad_row="skip" if skip else "error", max_length=512)
        cfg["train"].update(max_steps=3, micro_batch_size=4, eval_every=None)
        cfg["log"].update(every_steps=1, report=False)
        config = conftest.write_config(tmp_path / f"{name}.yaml", cfg)
        proc = run_cli(["train", config, "--output", tmp_path / name.split(".")[0]], tmp_path)
        assert proc.returncode == 0, show(proc)
        records = [json.loads(line) for line in (tmp_path / name.split(".")[0] / "metrics.jsonl").read_text().splitlines()]
        losses.append([(r["loss"], r["reward_margin"]) for r in records if "loss" in r])
    assert len(losses[0]) == 3 and losses[0] == losses[1]
    rows = conftest.toy_preference_pairs(4, seed=12)
    del rows[2]["rejected"]
    conftest.write_jsonl(tmp_path / "pairs.jsonl", rows)
    cfg["data"].update(train=str(tmp_path / "pairs.jsonl"), on_bad_row="error")
    proc = run_cli(["train", conftest.write_config(tmp_path / "bad.yaml", cfg), "--output", tmp_path / "bad"], tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, show(proc)
    assert f"pairs.jsonl:3: the 'rejected' field is missing (fields: ['chosen', 'prompt']): a preference pair needs " in proc.stderr, show(proc)


def test_sft_on_kto_rows_names_the_objective_and_the_format_that_reads_them_for_sft(tmp_path, tiny_model_dir, toy_data_dir):
    """SFT on LLaMA-Factory's KTO rows ({messages, label}) was refused with only "set train.objective to kto": a user
    who wanted SFT had to guess data.format: chat. Both ways are named, and the second trains."""
    rows = [{"messages": [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["completion"]}],
             "label": r["label"]} for r in conftest.toy_kto_rows(24, seed=13)]
    conftest.write_jsonl(tmp_path / "kto.jsonl", rows)
    cfg = conftest.finetune_settings(tiny_model_dir, toy_data_dir)
    cfg["data"].update(train=str(tmp_path / "kto.jsonl"), eval=None)
    cfg["train"].update(max_steps=2, grad_accum=1)
    proc = run_cli(["train", conftest.write_config(tmp_path / "sft.yaml", cfg), "--output", tmp_path / "refused"], tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, show(proc)
    said = " ".join(proc.stderr.split())
    assert "holds unpaired rows" in said and "set train.objective to kto; or, for SFT," in said, show(proc)
    assert "data.format: chat ({messages, label} rows)" in said, show(proc)
    cfg["data"]["format"] = "chat"
    proc = run_cli(["train", conftest.write_config(tmp_path / "chat.yaml", cfg), "--output", tmp_path / "sft"], tmp_path)
    assert proc.returncode == 0, show(proc)
    assert json.loads((tmp_path / "sft" / "summary.json").read_text())["objective"] == "sft"


def test_a_dpo_run_resumed_on_pairs_whose_sides_were_swapped_is_refused(tmp_path, tiny_model_dir, toy_data_dir):
    """Every row's chosen and rejected swapped in the same file: the counts of tokens and pairs stay, and the resume
    trained on (reward accuracy 0%) with the precomputed reference of the old sides, though the checkpoint's token
    store key differed. Refused now (exit 2), as an edited SFT row is; the file put back, the run goes on."""
    cfg = preference_config(tiny_model_dir, toy_data_dir, "dpo", "lora")
    data = conftest.write_jsonl(tmp_path / "pairs.jsonl", conftest.toy_preference_pairs(64, seed=5))
    cfg["data"].update(train=str(data), eval=None)  # the eval pairs overlapped some: a swap changed the rows dropped
    cfg["train"].update(max_steps=2, eval_every=None)
    cfg["preference"] = {"reference": "precompute"}
    cfg["log"]["report"] = False
    config = conftest.write_config(tmp_path / "run.yaml", cfg)
    run, more = tmp_path / "run", ["--set", "train.max_steps=3"]
    proc = run_cli(["train", config, "--output", run], tmp_path)
    assert proc.returncode == 0, show(proc)

    rows = [json.loads(line) for line in data.read_text().splitlines()]
    original = data.read_text()
    conftest.write_jsonl(data, [{**r, "chosen": r["rejected"], "rejected": r["chosen"]} for r in rows])
    proc = run_cli(["train", config, "--output", run, *more], tmp_path)
    assert proc.returncode == 2, show(proc)
    message = " ".join(proc.stderr.split())
    assert "the training data differ from the checkpoint's" in message and "sides swapped" in message, show(proc)
    assert "Traceback" not in proc.stderr and json.loads((run / "summary.json").read_text())["steps"] == 2

    data.write_text(original)
    proc = run_cli(["train", config, "--output", run, *more], tmp_path)
    assert proc.returncode == 0 and "resuming from" in proc.stdout, show(proc)
    assert json.loads((run / "summary.json").read_text())["steps"] == 3
