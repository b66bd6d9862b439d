"""``generate``, ``eval``, ``export`` and ``report`` on encoder-decoder models (T5, BART), in this
process: the encoder reads a prompt (or chat turns) exactly as training read sources, eval of a run
equals its eval_loss, merged (LoRA and QLoRA) and full exports load with ``AutoModelForSeq2SeqLM``
and compute the trained model's logits. The CLI's own paths: tests/integration/test_cli_seq2seq_tools.py."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from rich.console import Console

from conftest import write_jsonl
from seq2seq_models import as_layout, bart_dir, reverse_rows, t5_dir, training_sources  # noqa: F401 (fixtures)
from test_export import make_adapter
from trainforge.config.run import RunConfig
from trainforge.metrics.console import ConsoleReporter
from trainforge.tools.export import export

QUIET = ConsoleReporter(Console(quiet=True))


@pytest.fixture(scope="module")
def bart_chat_run(tmp_path_factory, bart_dir):
    """A BART fine-tuned (full) on chat rows for a few steps: enough for greedy text that is not empty
    (learning itself is tested in test_cli_seq2seq.py)."""
    from trainforge.engine.trainer import train

    d = tmp_path_factory.mktemp("bart-chat")
    write_jsonl(d / "train.jsonl", [as_layout(r, "messages") for r in reverse_rows(64, seed=1)])
    write_jsonl(d / "eval.jsonl", [as_layout(r, "messages") for r in reverse_rows(12, seed=2)])
    cfg = RunConfig.model_validate({
        "model": {"path": str(bart_dir), "method": "full"},
        "data": {"train": str(d / "train.jsonl"), "eval": str(d / "eval.jsonl"), "max_length": 48, "max_target_length": 12,
                 "num_workers": 1},
        "train": {"max_steps": 12, "micro_batch_size": 8, "precision": "fp32", "device": "cpu", "compile": False, "eval_max_batches": None},
        "optim": {"lr": 3.0e-3, "warmup_steps": 1},
        "log": {"every_steps": 4, "report": False, "report_to": []},
    })
    summary = train(cfg, d / "run", QUIET).summary
    return d / "run", d / "eval.jsonl", summary


def _captured_source(monkeypatch, model_dir, prompt=None, chat=None, reporter=QUIET) -> list[int]:
    """The encoder input ``trainforge generate`` hands to the model, for ``--prompt`` or ``--chat``."""
    import trainforge.tools.generate as tool

    seen = {}

    def capture(model, tokenizer, input_ids, *args, **kwargs):
        seen["ids"], seen["stop"] = input_ids[0].tolist(), kwargs.get("stop_strings")
        return ""

    monkeypatch.setattr(tool, "generate", capture)
    tool.run_generate(model_dir, prompt, chat, 4, 0.0, 0, "cpu", "fp32", lambda _: None, reporter)
    assert seen["stop"] is None  # the decoder learned the reply and its EOS: no end-of-turn marker to stop at
    return seen["ids"]


@pytest.mark.parametrize("kind", ["t5", "bart"])
def test_the_encoder_reads_prompts_and_chat_turns_as_training_read_sources(monkeypatch, kind, t5_dir, bart_dir):
    from transformers import AutoTokenizer

    model_dir = {"t5": t5_dir, "bart": bart_dir}[kind]
    tok = AutoTokenizer.from_pretrained(model_dir)
    row = {"source": "reverse: alpha beta gamma", "target": "gamma beta alpha"}
    assert _captured_source(monkeypatch, model_dir, prompt=row["source"]) == training_sources(tok, [row])[0]

    turns = [{"role": "system", "content": "Reverse the words."}, {"role": "user", "content": "reverse: delta zeta"},
             {"role": "assistant", "content": "zeta delta"}, {"role": "user", "content": "reverse: beta alpha"}]
    ids = _captured_source(monkeypatch, model_dir, chat=json.dumps(turns))
    trained = training_sources(tok, [{"messages": [*turns, {"role": "assistant", "content": "alpha beta"}]}], 512)[0]
    assert ids == trained
    text = tok.decode(ids[:-1])  # the whole conversation, earlier reply included, and the assistant's header to come
    assert ids[-1] == tok.eos_token_id and "zeta delta" in text and "reverse: beta alpha" in text
    assert text.rstrip().endswith("<|im_start|>assistant")


def test_a_prompt_longer_than_the_runs_sources_is_cut_as_training_cut_them(bart_chat_run, monkeypatch):
    import io

    from transformers import AutoTokenizer

    run, _, _ = bart_chat_run  # data.max_length: 48 source tokens
    tok = AutoTokenizer.from_pretrained(run / "final")
    row = {"source": "reverse: " + " ".join(["alpha", "beta", "gamma", "delta"] * 12), "target": "x"}
    assert len(training_sources(tok, [row], 10_000)[0]) > 48
    out = io.StringIO()
    ids = _captured_source(monkeypatch, run, prompt=row["source"], reporter=ConsoleReporter(Console(file=out, width=400)))
    assert ids == training_sources(tok, [row], 48)[0] and len(ids) == 48 and ids[-1] == tok.eos_token_id
    assert "data.max_length=48" in out.getvalue() and "cut to its first 47 tokens and EOS" in out.getvalue()


@pytest.mark.parametrize("kind", ["t5", "bart"])
def test_generate_writes_no_more_than_the_decoders_learned_positions_hold(kind, t5_dir, bart_dir):
    """BART's decoder positions are a learned table (64 in the tiny model, 1,024 in bart-large): --max-new-tokens past
    it (or a model that never writes EOS under the default 128) stopped with an IndexError traceback, exit 1.
    T5's relative positions have no such limit."""
    import io

    from trainforge.tools.generate import run_generate

    out, pieces = io.StringIO(), []
    reporter = ConsoleReporter(Console(file=out, width=400))
    model_dir = {"t5": t5_dir, "bart": bart_dir}[kind]
    run_generate(model_dir, "reverse: alpha beta", None, 100, 0.0, 0, "cpu", "fp32", pieces.append, reporter)
    said = "the decoder has 64 positions (max_position_embeddings), its start token takes one: writing at most 63"
    assert (said in out.getvalue()) == (kind == "bart"), out.getvalue()


def _logits(model, input_ids: torch.Tensor, decoder_input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=input_ids, decoder_input_ids=decoder_input_ids).logits.float()


def test_bart_chat_run_eval_generate_and_export(bart_chat_run, monkeypatch, tmp_path):
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    from trainforge.data.prompt import sample_prompt as sample
    from trainforge.model.generate import generate
    from trainforge.tools.evaluate import evaluate_model
    from trainforge.tools.generate import run_generate

    run, eval_file, summary = bart_chat_run
    # eval of the run's own eval file: the same chat -> source/target mapping and target-token mean as the run
    result = evaluate_model(run, str(eval_file), [], QUIET)
    assert result["loss"] == pytest.approx(summary["eval_loss"], rel=1e-5, abs=1e-6)
    evals = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if "eval_loss" in line]
    assert result["format"] == "chat" and result["tokens"] == evals[-1]["eval_tokens"]
    assert abs(result["loss"] - summary["eval_loss_before"]) > 0.1  # the trained model, not the base

    # generate --chat: the decoder's greedy reply, streamed; what the model generates from the training source
    trained = AutoModelForSeq2SeqLM.from_pretrained(run / "final", dtype=torch.float32).eval()
    assert type(trained).__name__ == "BartForConditionalGeneration"
    tok = AutoTokenizer.from_pretrained(run / "final")
    turns = [{"role": "user", "content": "reverse: alpha gamma"}]
    pieces: list[str] = []
    text = run_generate(run, None, json.dumps(turns), 6, 0.0, 0, "cpu", None, pieces.append, QUIET)
    source = torch.tensor([training_sources(tok, [{"messages": [*turns, {"role": "assistant", "content": "x"}]}])[0]])
    with torch.no_grad():
        out = trained.generate(input_ids=source, attention_mask=torch.ones_like(source), max_new_tokens=6, do_sample=False)
    assert text.strip() and text == tok.decode(out[0], skip_special_tokens=True) == "".join(pieces)
    # the end-of-run sample (log.sample_prompt) encodes its prompt the same way and returns the decoder's text
    prompt_source = torch.tensor([training_sources(tok, [{"source": "reverse: alpha gamma", "target": "x"}])[0]])
    sampled = generate(trained, tok, prompt_source, 6, temperature=0.8, seed=3)
    assert sample(trained, tok, "reverse: alpha gamma", 6, seed=3, temperature=0.8) == sampled

    # export --merge of a full run: nothing to merge, written as a plain BART (AutoModelForCausalLM would
    # have taken BART's decoder alone), loaded without peft, the same logits
    out_dir = tmp_path / "exported"
    assert export(run, out_dir, merge=True, dtype=None, reporter=QUIET)["kind"] == "full"
    monkeypatch.setitem(sys.modules, "peft", None)  # importing peft now fails: the directory needs transformers only
    exported = AutoModelForSeq2SeqLM.from_pretrained(out_dir, dtype=torch.float32)
    assert type(exported).__name__ == "BartForConditionalGeneration"
    dec = torch.tensor([[2, 0, 5, 9, 11]])
    torch.testing.assert_close(_logits(exported, source, dec), _logits(trained, source, dec), rtol=0, atol=0)
    assert generate(exported, tok, source, 6, temperature=0.0) == text


@pytest.mark.parametrize("kind, method", [("bart", "lora"), ("t5", "qlora")])
def test_adapters_merge_into_a_plain_seq2seq_model_with_the_adapter_models_logits(tmp_path, monkeypatch, t5_dir, bart_dir, kind, method):
    """LoRA merged into BART; QLoRA into T5's NF4 base dequantized (the base it trained on). The result
    is the base's own class, loads without peft, and computes what trainforge's loading of the run computes."""
    if method == "qlora":
        pytest.importorskip("bitsandbytes")
    import yaml
    from transformers import AutoModelForSeq2SeqLM

    from trainforge.hardware.device import PRECISIONS
    from trainforge.model.resolve import load_model, resolve_source

    base_dir = {"t5": t5_dir, "bart": bart_dir}[kind]
    run = tmp_path / "run"
    make_adapter(base_dir, run / "final", quantized=method == "qlora")  # a SEQ_2_SEQ_LM adapter on these bases
    (run / "config.yaml").write_text(yaml.safe_dump({"model": {"path": str(base_dir), "method": method}}))
    (run / "summary.json").write_text(json.dumps({"precision": "fp32"}))
    g = torch.Generator().manual_seed(0)
    ids, dec = torch.randint(4, 60, (2, 12), generator=g), torch.randint(4, 60, (2, 7), generator=g)
    src = resolve_source(run)
    assert src.encoder_decoder
    reference = _logits(load_model(src, torch.device("cpu"), PRECISIONS["fp32"]), ids, dec)
    base = _logits(AutoModelForSeq2SeqLM.from_pretrained(base_dir, dtype=torch.float32), ids, dec)
    assert (reference - base).abs().max() > 1e-3, "the adapter must change the model for this test to mean anything"

    out = tmp_path / "merged"
    assert export(run, out, merge=True, dtype=None, reporter=QUIET)["kind"] == "merged"
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and not (out / "adapter_config.json").exists()
    monkeypatch.setitem(sys.modules, "peft", None)
    merged = AutoModelForSeq2SeqLM.from_pretrained(out, dtype=torch.float32)
    assert type(merged).__name__ == type(AutoModelForSeq2SeqLM.from_pretrained(base_dir)).__name__
    tol = 1e-4 if method == "qlora" else 1e-5
    torch.testing.assert_close(_logits(merged, ids, dec), reference, atol=tol, rtol=tol)
