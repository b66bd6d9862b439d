"""End to end: a mixture of sources given by token shares, through the real CLI.

One run trains a two-source mixture (short rows against rows about five times longer) and is checked for the
shares it met, the per-source figures in summary.json and on the console, and the loss per source in
metrics.jsonl (training and eval). Then the same output with another share: the cache is reused (nothing is
tokenized again) and the resume is refused. Bad mixtures exit 2 naming the source.
"""

from __future__ import annotations

import json
import math

import pytest

from integration_helpers import root_conftest, run_cli, show

conftest = root_conftest()
write_config, write_jsonl = conftest.write_config, conftest.write_jsonl


@pytest.fixture
def mixture_config(tmp_path, finetune_config, toy_data_dir):
    long_rows = [{"prompt": r["prompt"], "completion": r["completion"] * 5} for r in conftest.toy_prompt_completions(200, seed=9)]
    long = write_jsonl(tmp_path / "long.jsonl", long_rows)
    cfg = finetune_config
    cfg["data"].update(
        train=[{"path": str(toy_data_dir / "pc_train.jsonl"), "share": 0.7}, {"path": str(long), "share": 0.3}],
        eval=0.1, cache_dir=str(tmp_path / "cache"),
    )
    cfg["train"]["max_steps"] = 4
    return cfg


def test_shares_are_met_and_reported_per_source_and_a_changed_mixture_does_not_resume(tmp_path, mixture_config):
    config = write_config(tmp_path / "mix.yaml", mixture_config)
    run = tmp_path / "run"
    proc = run_cli(["train", config, "--output", run], tmp_path)
    assert proc.returncode == 0, show(proc)

    sources = json.loads((run / "summary.json").read_text())["data"]["sources"]
    assert [s["name"] for s in sources] == ["pc_train", "long"]
    for s, asked in zip(sources, (0.7, 0.3)):
        assert s["share_asked"] == asked and abs(s["share"] - asked) <= 0.01, s
        assert s["documents"] > 0 and s["tokens"] > 0 and s["epochs"] > 0, s
    # the long source holds more tokens than 30% of the mixture: it is subsampled, the short one repeated
    assert sources[1]["epochs_per_mixture_epoch"] < 1 < sources[0]["epochs_per_mixture_epoch"]
    assert "source pc_train:" in proc.stdout and "source long:" in proc.stdout and "mixture over the run:" in proc.stdout

    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    for r in train:
        assert math.isfinite(r["loss/pc_train"]) and math.isfinite(r["loss/long"]), r
        # the window's loss is the token-weighted mean of the sources' (a step divides by all its targets)
        assert min(r["loss/pc_train"], r["loss/long"]) <= r["loss"] + 1e-6 <= max(r["loss/pc_train"], r["loss/long"]) + 2e-6
    for r in evals:  # held out of each source, evaluated apart
        assert math.isfinite(r["eval_loss/pc_train"]) and math.isfinite(r["eval_loss/long"]), r
    assert "| pc_train " in proc.stdout

    # plan: the mixture's tokens per epoch and each source's epochs over the planned run, from the token cache
    proc = run_cli(["plan", config, "--json"], tmp_path)
    assert proc.returncode == 0, show(proc)
    planned = json.loads(proc.stdout)["data"]
    assert planned["mixture_tokens"] == sum(s["mixture_tokens"] for s in sources)
    assert [s["share"] for s in planned["sources"]] == [s["share"] for s in sources]
    assert all(s["epochs"] > 0 for s in planned["sources"]), planned

    # another share: the same token cache (nothing tokenized again), and the checkpoint refuses the changed mixture
    mixture_config["data"]["train"][0]["share"], mixture_config["data"]["train"][1]["share"] = 0.5, 0.5
    mixture_config["train"]["max_steps"] = 6
    changed = write_config(tmp_path / "mix2.yaml", mixture_config)
    proc = run_cli(["train", changed, "--output", run], tmp_path)
    assert proc.returncode == 2, show(proc)
    assert "cannot resume" in proc.stderr and "'share': 0.5" in proc.stderr, show(proc)
    proc = run_cli(["prepare", changed], tmp_path)
    assert proc.returncode == 0, show(proc)
    assert "cache hit" in proc.stdout and "share 50.0%" in proc.stdout, show(proc)


@pytest.mark.parametrize("case", ["sum", "mixed", "pairs", "empty", "format", "key"])
def test_bad_mixtures_exit_2_naming_the_source(tmp_path, mixture_config, toy_data_dir, case):
    train = mixture_config["data"]["train"]
    if case == "sum":
        train[1]["share"], named = 0.2, "shares sum to 0.9"
    elif case == "mixed":
        train[1]["weight"], named = 2.0, "long.jsonl') gives both share and weight"
    elif case == "pairs":
        train[1]["path"], named = str(toy_data_dir / "pref_train.jsonl"), "data.train[1]"
    elif case == "format":  # text rows read as chat: refused before a tokenizer is built, naming the source
        train[1].update(path=str(toy_data_dir / "text_train.jsonl"), format="chat")
        named = "data.train[1] ('" + str(toy_data_dir / "text_train.jsonl") + "'): format 'chat' (data.train[1].format) needs a 'messages'"
    elif case == "key":
        train[1]["fromat"], named = "text", "data.train.1.fromat: unknown key; did you mean 'format'?"
    else:
        bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "x"}] * 3)  # no completion: every row bad, skipped
        train[1]["path"], named = str(bad), "data.train[1]"
        mixture_config["data"].update(on_bad_row="skip", format="prompt_completion")
    proc = run_cli(["train", write_config(tmp_path / "bad.yaml", mixture_config), "--output", tmp_path / "run"], tmp_path)
    assert proc.returncode == 2, show(proc)
    assert named in proc.stderr, show(proc)
    if case == "pairs":
        assert "preference rows" in proc.stderr, show(proc)
    if case == "empty":
        assert "no training example" in proc.stderr, show(proc)


def test_sources_read_each_their_way_train_prepare_and_refuse_a_changed_source(tmp_path, finetune_config):
    """A chat mixture (ShareGPT rows) with a text source (format: text) and GSM8K-shaped {question, answer} rows
    (their own fields): each read its way, its format in the per-source figures; a source's template changed
    tokenizes that source alone, and the run's checkpoint refuses the changed mixture."""
    words = conftest.WORDS
    chat = write_jsonl(tmp_path / "chat.jsonl", [
        {"conversations": [{"from": "human", "value": f"continue: {words[i % 19]}"},
                           {"from": "gpt", "value": f"{words[(i + 1) % 19]} {words[(i + 2) % 19]}"}]} for i in range(60)])
    code = tmp_path / "code"
    code.mkdir()
    for i in range(12):
        (code / f"f{i}.txt").write_text(f"def f{i}(x):\n    return x + {i}\n")
    math = write_jsonl(tmp_path / "math.jsonl", [
        {"question": f"alpha has {i} beta and gets 2 more; how many?", "answer": f"{i} + 2 = {i + 2}\n#### {i + 2}"}
        for i in range(40)])
    cfg = finetune_config
    cfg["data"].update(format="chat", eval=0.2, max_length=128, cache_dir=str(tmp_path / "cache"), train=[
        {"path": str(chat), "share": 0.6},
        {"path": str(code), "share": 0.2, "format": "text"},
        {"path": str(math), "share": 0.2, "format": "prompt_completion", "fields": {"prompt": "question", "completion": "answer"}},
    ])
    cfg["train"].update(max_steps=2, eval_every=2, eval_max_batches=None)  # every source's held-out rows
    run = tmp_path / "run"
    proc = run_cli(["train", write_config(tmp_path / "mix.yaml", cfg), "--output", run], tmp_path)
    assert proc.returncode == 0, show(proc)

    data = json.loads((run / "summary.json").read_text())["data"]
    assert data["format"] == "chat+text+prompt_completion", data
    assert [(s["name"], s["format"]) for s in data["sources"]] == [("chat", "chat"), ("code", "text"), ("math", "prompt_completion")]
    for line in ("source chat (chat):", "source code (text):", "source math (prompt_completion):"):
        assert line in proc.stdout, show(proc)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval_loss" in r]
    assert evals and all(math_ok(r, "eval_loss/") for r in evals), evals  # each source's own held-out rows

    # the chat source's own template: only it is tokenized again
    cfg["data"]["train"][0]["chat_template"] = (
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}")
    changed = write_config(tmp_path / "mix2.yaml", cfg)
    proc = run_cli(["prepare", changed], tmp_path)
    assert proc.returncode == 0, show(proc)
    tokenized = [line for line in proc.stdout.splitlines() if "data: tokenizing source" in line]
    assert len(tokenized) == 1 and "tokenizing source 0 (" in tokenized[0], show(proc)
    assert "source 1 (" in proc.stdout and "source 2 (" in proc.stdout and proc.stdout.count("cache hit") >= 2, show(proc)
    proc = run_cli(["train", changed, "--output", run], tmp_path)
    assert proc.returncode == 2 and "cannot resume" in proc.stderr and "data.train" in proc.stderr, show(proc)


def math_ok(record: dict, prefix: str) -> bool:
    """Finite per-source values under ``prefix`` for all three sources of the mixed-format mixture."""
    return all(math.isfinite(record.get(f"{prefix}{name}", math.nan)) for name in ("chat", "code", "math"))
