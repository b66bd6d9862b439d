"""What generate / eval / export accept: model directories resolved (or refused with what they lack),
chat turns read from stdin, streamed generation, and eval's config built from a run's."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import yaml

from trainforge.data.sources import DataError
from trainforge.model.resolve import ModelSourceError, resolve_source
from trainforge.tools.generate import read_chat

# ---------------------------------------------------------------- chat turns from stdin


def test_chat_turns_from_json_and_from_role_lines():
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert read_chat(json.dumps(msgs)) == msgs
    assert read_chat(json.dumps({"messages": msgs})) == msgs
    assert read_chat("system: be brief\nUser: first line\nsecond line\nassistant: ok\nuser: and now?\n") == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "first line\nsecond line"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "and now?"},
    ]
    assert read_chat("just a question\nover two lines\n") == [{"role": "user", "content": "just a question\nover two lines"}]


@pytest.mark.parametrize(
    "text,match",
    [
        ("", "empty"),
        ("[{\"role\": \"user\"", "does not parse"),
        ('[{"role": "user", "text": "hi"}]', "role"),
        ("user: hi\nassistant: hello", "last turn is the assistant"),
    ],
)
def test_bad_chat_input_is_named(text, match):
    with pytest.raises(DataError, match=match):
        read_chat(text)


# ---------------------------------------------------------------- streamed generation


def test_generation_streams_pieces_that_make_up_the_text(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from trainforge.model.generate import generate
    from trainforge.model.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    ids = tok("alpha beta gamma", return_tensors="pt")["input_ids"]
    pieces: list[str] = []
    text = generate(model, tok, ids, max_new_tokens=24, temperature=0.9, seed=3, write=pieces.append)
    assert len(pieces) > 1, pieces  # handed over while generating, not once at the end
    assert "".join(pieces) == text and text
    assert generate(model, tok, ids, max_new_tokens=24, temperature=0.9, seed=3) == text  # seeded
    greedy = generate(model, tok, ids, max_new_tokens=8, temperature=0.0)
    assert greedy == generate(model, tok, ids, max_new_tokens=8, temperature=0.0, seed=99)


def test_the_sample_takes_ids_tokenized_through_the_data_package(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from trainforge.data.prompt import prompt_ids, sample_prompt
    from trainforge.model.generate import sample
    from trainforge.model.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    ids = prompt_ids(tok, "alpha beta", encoder_decoder=False)
    assert ids.tolist() == tok("alpha beta", return_tensors="pt")["input_ids"].tolist()
    text = sample(model, tok, ids, 6, seed=2)
    assert text.startswith("alpha beta") and sample_prompt(model, tok, "alpha beta", 6, seed=2) == text


# ---------------------------------------------------------------- resolving what the user named


def test_kinds_of_directory_resolve(tmp_path, tiny_model_dir):
    plain = resolve_source(tiny_model_dir)
    assert plain.adapter is None and plain.run_dir is None and plain.method == "full"
    assert plain.tokenizer_dir == tiny_model_dir

    run = tmp_path / "run"
    shutil.copytree(tiny_model_dir, run / "final")
    (run / "config.yaml").write_text(yaml.safe_dump({"model": {"method": "full"}, "data": {"max_length": 64}}))
    (run / "summary.json").write_text(json.dumps({"precision": "fp32", "eval_loss": 1.0}))
    for given in (run, run / "final"):  # the run, or its final/ named directly
        src = resolve_source(given)
        assert src.run_dir == run and src.weights == run / "final" and src.summary["precision"] == "fp32"


def test_a_lora_run_resolves_from_any_directory(tmp_path, tiny_model_dir, toy_data_dir, monkeypatch):
    """A run started with a relative model.path: its config.yaml keeps the paths absolute (RunConfig.anchored),
    and a run written before that finds its base through adapter_config.json's absolute path."""
    from trainforge.config.run import RunConfig

    monkeypatch.chdir(tiny_model_dir.parent)
    cfg = RunConfig.model_validate({"model": {"path": tiny_model_dir.name, "method": "lora"},
                                    "data": {"train": os.path.relpath(toy_data_dir)}})
    anchored = cfg.anchored()
    assert anchored.model.path == tiny_model_dir and anchored.data.train == str(toy_data_dir)
    assert cfg.model.path == type(cfg.model.path)(tiny_model_dir.name)  # the run itself keeps what it was given
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (run / "final" / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(tiny_model_dir)}))
    (run / "final" / "adapter_model.safetensors").write_bytes(b"\x02" + b"\0" * 7 + b"{}")  # safetensors, no tensors
    (run / "config.yaml").write_text(yaml.safe_dump({"model": {"method": "lora", "path": tiny_model_dir.name}}))
    monkeypatch.chdir(tmp_path)  # elsewhere: the relative path names nothing here
    assert resolve_source(run).base == tiny_model_dir


def test_unusable_directories_are_refused_naming_what_they_lack(tmp_path, tiny_model_dir):
    with pytest.raises(ModelSourceError, match="no such directory"):
        resolve_source(tmp_path / "missing")
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(ModelSourceError, match="is a file"):
        resolve_source(tmp_path / "file.txt")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelSourceError, match=r"lacks config.json and weights"):
        resolve_source(empty)

    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    (unfinished / "config.yaml").write_text("model: {}\n")
    with pytest.raises(ModelSourceError, match="without final/"):
        resolve_source(unfinished)

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(tmp_path / "gone")}))
    with pytest.raises(ModelSourceError, match="no adapter weights"):
        resolve_source(adapter)
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(ModelSourceError, match="not a local model directory"):
        resolve_source(adapter)

    no_tokenizer = tmp_path / "no-tokenizer"
    no_tokenizer.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_model_dir / name, no_tokenizer / name)
    with pytest.raises(ModelSourceError, match="no tokenizer files"):
        resolve_source(no_tokenizer)


# ---------------------------------------------------------------- eval's config


def test_eval_config_takes_the_runs_data_settings_and_reads_every_row(tmp_path, tiny_model_dir, toy_data_dir):
    from trainforge.config.run import ConfigError
    from trainforge.tools.evaluate import eval_config

    run = tmp_path / "run"
    shutil.copytree(tiny_model_dir, run / "final")
    written = {
        "model": {"path": str(tmp_path / "moved-away"), "method": "full", "attention": "eager"},
        "data": {"train": str(tmp_path / "gone.jsonl"), "eval": 0.1, "max_length": 48, "packing": False, "max_documents": 5},
        "train": {"micro_batch_size": 3, "eval_max_batches": 2},
    }
    (run / "config.yaml").write_text(yaml.safe_dump(written))
    data = str(toy_data_dir / "pc_eval.jsonl")
    cfg = eval_config(resolve_source(run), data, ["data.max_length=40"])
    assert cfg.data.train == data and cfg.data.eval is None
    assert cfg.data.max_length == 40 and cfg.data.packing is False  # --set wins; the rest is the run's
    assert cfg.data.max_documents is None and cfg.train.eval_max_batches is None  # the whole file
    assert cfg.train.micro_batch_size == 3 and cfg.model.attention == "eager"
    assert cfg.model.path == run / "final"  # the run's base moved away: not needed for a full model

    plain = eval_config(resolve_source(tiny_model_dir), data, [], max_positions=128)
    assert plain.data.max_length == 128  # the model's context, below the 1024 default
    with pytest.raises(ConfigError, match="data.packing"):
        eval_config(resolve_source(tiny_model_dir), data, ["data.packing=sometimes"])
    with pytest.raises(ConfigError, match=r"^--data nope\.jsonl: no file matches 'nope\.jsonl'"):  # not the run's config
        eval_config(resolve_source(run), "nope.jsonl", [])


def test_an_empty_eval_file_is_named_as_the_data_given(tiny_model_dir, tmp_path):
    """``eval --data empty.jsonl`` said "data.train='empty.jsonl': no rows found", a key the user never set."""
    import io

    from rich.console import Console

    from trainforge.metrics.console import ConsoleReporter
    from trainforge.tools.evaluate import evaluate_model

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match=rf"^--data {empty}: no rows found$"):
        evaluate_model(tiny_model_dir, str(empty), [], ConsoleReporter(Console(file=io.StringIO())))


def test_a_prompt_past_the_models_positions_keeps_its_end_and_a_stop_request_ends_the_sample(tiny_model_dir):
    """A 120 KB log.sample_prompt once sampled for 93 s past the model's positions and ignored SIGTERM."""
    from transformers import AutoModelForCausalLM

    from trainforge.data.prompt import fit_context, prompt_ids, sample_prompt
    from trainforge.model.generate import context_room, sample
    from trainforge.model.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    positions = model.config.max_position_embeddings
    assert context_room(model, 8) == positions - 8
    long = prompt_ids(tok, "alpha beta " * 2000, encoder_decoder=False)
    kept, cut = fit_context(long, context_room(model, 8))
    assert kept.shape[1] == positions - 8 and cut == long.shape[1] - kept.shape[1]
    assert kept[0].tolist() == long[0, -kept.shape[1] :].tolist()  # the end of the prompt, next to the reply
    assert sample_prompt(model, tok, "alpha beta " * 2000, 8, seed=1)  # runs within the positions

    ids = prompt_ids(tok, "alpha beta", encoder_decoder=False)
    stopped = tok(sample(model, tok, ids, 40, seed=1, stop=lambda: True))["input_ids"]
    assert len(stopped) <= ids.shape[1] + 1  # at most the token in flight when the request was seen
