"""Encoder-decoder models (T5, BART): config, source -> target data, batches, loss, and the training
paths carried over from decoder-only models (precision, resume, LoRA, checkpointing), on tiny models."""

from __future__ import annotations

import copy
import io
import json

import numpy as np
import pytest
import torch
from rich.console import Console

import trainforge.engine.trainer as trainer
from conftest import write_jsonl
from seq2seq_models import bart_dir, build_bart, build_t5, reverse_rows, t5_dir  # noqa: F401 (fixtures)
from trainforge.config.run import ConfigError, ModelSettings, RunConfig, is_encoder_decoder, load_config
from trainforge.data.formats import FieldNames, Pair, Renderer, detect_format
from trainforge.data.loader import TrainLoader
from trainforge.data.packing import single_rows
from trainforge.data.prepare import prepare_data
from trainforge.data.seq2seq import Seq2SeqCollator, tokenize_pairs
from trainforge.data.sources import Row
from trainforge.engine.setup import fp16_safe_precision
from trainforge.engine.step import forward_backward, loss_sum
from trainforge.hardware.device import PRECISIONS
from trainforge.metrics.console import ConsoleReporter
from trainforge.metrics.tracker import MEASURED_FIELDS, read_metrics
from trainforge.model.load import build_model, decoder_start_token_id
from trainforge.model.tokenizer import load_tokenizer

CPU = torch.device("cpu")
FP32 = PRECISIONS["fp32"]
NAMES = FieldNames()


def quiet() -> ConsoleReporter:
    return ConsoleReporter(Console(quiet=True))


@pytest.fixture(scope="module", params=["t5", "bart"])
def model_dir(request, t5_dir, bart_dir):
    return {"t5": t5_dir, "bart": bart_dir}[request.param]


@pytest.fixture(scope="module")
def reverse_data(tmp_path_factory):
    d = tmp_path_factory.mktemp("reverse")
    write_jsonl(d / "train.jsonl", reverse_rows(96, seed=1))
    write_jsonl(d / "eval.jsonl", reverse_rows(16, seed=2))
    return d


def config(model_dir, data_dir, **train) -> dict:
    return {
        "model": {"path": str(model_dir), "method": "full"},
        "data": {"train": str(data_dir / "train.jsonl"), "eval": str(data_dir / "eval.jsonl"), "max_length": 24,
                 "max_target_length": 12},
        "train": {"max_steps": 6, "micro_batch_size": 8, "precision": "fp32", "device": "cpu", **train},
        "optim": {"lr": 2.0e-3, "warmup_steps": 1},
        "log": {"every_steps": 2},
    }


# ---------------------------------------------------------------- config


def test_kind_is_detected_from_the_config(t5_dir, bart_dir, tiny_model_dir):
    assert is_encoder_decoder(ModelSettings(path=t5_dir))
    assert is_encoder_decoder(ModelSettings(path=bart_dir))
    assert not is_encoder_decoder(ModelSettings(path=tiny_model_dir))
    assert is_encoder_decoder(ModelSettings(init={"architecture": "t5", "d_model": 32}, tokenizer=t5_dir))
    assert not is_encoder_decoder(ModelSettings(init={"architecture": "llama"}, tokenizer=t5_dir))


def test_packing_is_off_by_default_and_refused_when_asked(t5_dir, reverse_data, tmp_path):
    cfg = RunConfig.model_validate(config(t5_dir, reverse_data))
    assert cfg.data.packing is False
    assert "packing: false" in cfg.to_yaml()  # the resolved config.yaml trains the same way again
    raw = config(t5_dir, reverse_data)
    raw["data"]["packing"] = True
    path = tmp_path / "c.yaml"
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=r"data\.packing: the model \(t5\) is an encoder-decoder.*set data.packing: false"):
        load_config(path)


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("data.too_long", "split", "split is for text only"),
        ("data.format", "text", "text rows have no source -> target pairs"),
        ("data.train_on_prompt", True, "the encoder reads the source and only the target is learned"),
        ("model.attention", "packed_sdpa", "packed_sdpa is for packed decoder-only rows"),
    ],
)
def test_settings_that_do_not_apply_name_the_key(t5_dir, reverse_data, tmp_path, key, value, message):
    path = tmp_path / "c.yaml"
    path.write_text(json.dumps(config(t5_dir, reverse_data)))
    with pytest.raises(ConfigError, match=f"{key}: the model \\(t5\\) is an encoder-decoder: {message}"):
        load_config(path, [f"{key}={json.dumps(value)}"])


def test_max_target_length_is_for_encoder_decoder_models_only(tiny_model_dir, reverse_data, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(json.dumps(config(tiny_model_dir, reverse_data)))
    with pytest.raises(ConfigError, match="data.max_target_length: only encoder-decoder models"):
        load_config(path)


# ---------------------------------------------------------------- rows -> source -> target


def pair(fmt: str, data: dict, tokenizer=None) -> Pair:
    return Renderer(fmt, NAMES, tokenizer).pair(Row(data, "x.jsonl:1"))


@pytest.mark.parametrize(
    "data, fmt",
    [
        ({"source": "a", "target": "b"}, "source_target"),
        ({"input": "a", "output": "b"}, "source_target"),
        ({"instruction": "a", "input": "x", "output": "b"}, "alpaca"),
        ({"text": "a", "source": "wikipedia"}, "text"),  # a corpus row naming its origin stays text
    ],
)
def test_formats_detected(data, fmt):
    assert detect_format(Row(data, "x:1"), NAMES) == fmt


def test_rows_of_every_format_map_to_source_and_target(t5_dir):
    tok = load_tokenizer(t5_dir)
    assert pair("prompt_completion", {"prompt": "2+2=", "completion": "4"}) == Pair("2+2=", "4", "x.jsonl:1")
    assert pair("source_target", {"source": "a b", "target": "b a"}).target == "b a"
    assert pair("source_target", {"input": "a b", "output": "b a"}) == Pair("a b", "b a", "x.jsonl:1")
    alpaca = pair("alpaca", {"instruction": "Add one.", "input": "2", "output": "3"})
    assert alpaca.source == "### Instruction:\nAdd one.\n\n### Input:\n2\n\n### Response:\n" and alpaca.target == "3"
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Reverse: a b"},
        {"role": "assistant", "content": "b a"},
        {"role": "user", "content": "thanks"},  # after the last reply: nothing to learn from it
    ]
    chat = pair("chat", {"messages": messages}, tok)
    assert chat.target == "b a" and chat.templated
    assert chat.source == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nReverse: a b<|im_end|>\n<|im_start|>assistant\n"
    )
    sharegpt = pair("chat", {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Yo"}]}, tok)
    assert sharegpt == Pair("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", "Yo", "x.jsonl:1", True)
    assert pair("chat", {"messages": [{"role": "user", "content": "Hi"}]}, tok).target is None


def test_pairs_store_source_then_learned_target_with_eos(t5_dir, bart_dir):
    for path, specials in ((t5_dir, ([], [1])), (bart_dir, ([0], [2]))):
        tok = load_tokenizer(path)
        bos, eos = specials
        chunk = tokenize_pairs([Pair("reverse: alpha beta", "beta alpha", "x:1")], tok, 32, 32, "truncate")
        src = tok("reverse: alpha beta", add_special_tokens=False)["input_ids"]
        tgt = tok("beta alpha", add_special_tokens=False)["input_ids"]
        # the tokenizer's own special tokens (T5: ... </s>, BART: <s> ... </s>) on both sides
        assert chunk.ids.tolist() == bos + src + eos + bos + tgt + eos
        assert chunk.learn.tolist() == [0] * (len(bos + src) + 1) + [1] * (len(bos + tgt) + 1)


def test_too_long_sources_and_targets_are_counted_apart(t5_dir):
    tok = load_tokenizer(t5_dir)
    pairs = [
        Pair("reverse: alpha beta gamma delta", "delta", "x:1"),  # source 6 + EOS = 7 tokens
        Pair("reverse: alpha", "delta gamma beta alpha", "x:2"),  # source 3 + EOS, target 4 + EOS = 5 tokens
        Pair("reverse: alpha", "alpha", "x:3"),
        Pair("", None, "x:4"),  # a chat without an assistant turn
    ]
    cut = tokenize_pairs(pairs, tok, 5, 3, "truncate")
    assert (cut.truncated, cut.target_truncated, cut.dropped_masked, cut.lost_tokens) == (1, 1, 1, 2 + 2)
    assert cut.lengths.tolist() == [5 + 2, 4 + 3, 4 + 2]
    first = cut.ids[:5].tolist()
    assert first[-1] == tok.eos_token_id and first[:4] == tok("reverse: alpha beta", add_special_tokens=False)["input_ids"][:4]
    dropped = tokenize_pairs(pairs, tok, 5, 3, "drop")
    assert (dropped.dropped_too_long, dropped.target_dropped_too_long, dropped.lost_tokens) == (1, 1, 7 + 2 + 4 + 5)
    assert dropped.lengths.tolist() == [4 + 2]


def test_prepare_caches_pairs_and_reports_both_sides(t5_dir, reverse_data, tmp_path):
    cfg = RunConfig.model_validate(config(t5_dir, reverse_data))
    data = cfg.data.model_copy(update={"cache_dir": tmp_path, "max_length": 5, "max_target_length": 3})
    tok = load_tokenizer(t5_dir)
    first = prepare_data(data, tok, 0, log=lambda _: None, seq2seq=True)
    again = prepare_data(data, tok, 0, log=lambda _: None, seq2seq=True)
    assert not first.cache_hit and again.cache_hit
    s = again.stats
    assert s["encoder_decoder"] and s["max_target_length"] == 3
    assert s["truncated"] > 0 and s["target_truncated"] > 0 and s["train_target_tokens"] > 0
    # the same rows for a decoder-only model are another store
    plain = prepare_data(data.model_copy(update={"max_target_length": None}), tok, 0, log=lambda _: None)
    assert plain.cache_path != first.cache_path and "encoder_decoder" not in plain.stats


# ---------------------------------------------------------------- batches and loss


def store_of(model_dir, tmp_path, n=6):
    tok = load_tokenizer(model_dir)
    from trainforge.data.store import StoreWriter, TokenStore

    chunk = tokenize_pairs([Pair(r["source"], r["target"], "x") for r in reverse_rows(n, seed=5)], tok, 32, 32, "truncate")
    w = StoreWriter(tmp_path / "store", len(tok))
    w.start_source()
    w.append(chunk.ids, chunk.learn, chunk.lengths)
    w.close({})
    store = TokenStore(tmp_path / "store")
    cfg = ModelSettings(path=model_dir)
    collate = Seq2SeqCollator(store, tok.pad_token_id, decoder_start_token_id(cfg, tok), 32)
    return tok, store, single_rows(store, np.arange(len(store))), collate


def test_batches_pad_to_eight_and_learn_only_the_target(model_dir, tmp_path):
    tok, store, rows, collate = store_of(model_dir, tmp_path)
    b = collate(rows, list(range(len(rows))))
    assert b.input_ids.shape[1] % 8 == 0 and b.labels.shape[1] % 8 == 0
    start = decoder_start_token_id(ModelSettings(path=model_dir), tok)
    for i, row in enumerate(rows):
        ids, learn = store.sequence(i)
        src, tgt = ids[~learn], ids[learn]
        assert b.input_ids[i, : len(src)].tolist() == src.tolist() and b.attention_mask[i].sum() == len(src)
        assert (b.input_ids[i, len(src) :] == tok.pad_token_id).all()
        assert b.labels[i, : len(tgt)].tolist() == tgt.tolist() and (b.labels[i, len(tgt) :] == -100).all()
        assert b.labels[i, len(tgt) - 1] == tok.eos_token_id
        assert b.decoder_input_ids[i, : len(tgt)].tolist() == [start, *tgt[:-1].tolist()]
    assert b.n_targets == int((b.labels != -100).sum()) and b.n_tokens == int(store.lengths.sum())


def test_loss_is_the_models_own_target_loss(model_dir, tmp_path):
    """Our decoder inputs and loss equal the model's when handed the labels (its own shift, mean CE)."""
    tok, _, rows, collate = store_of(model_dir, tmp_path)
    model = build_model(ModelSettings(path=model_dir), tok, seed=0)
    b = collate(rows, list(range(len(rows))))
    for fused in (True, False):
        with torch.no_grad():
            ours = loss_sum(model, b, FP32, fused) / b.n_targets
            theirs = model(input_ids=b.input_ids, attention_mask=b.attention_mask, labels=b.labels).loss
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def grads_after(model, micro_batches, fused=True) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = forward_backward(model, micro_batches, FP32, CPU, fused=fused)
    return loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("fused", [True, False])
def test_four_micro_batches_of_one_equal_one_of_four(model_dir, tmp_path, fused):
    tok, _, rows, collate = store_of(model_dir, tmp_path, n=4)
    model = build_model(ModelSettings(path=model_dir), tok, seed=0)
    loss_whole, whole = grads_after(model, [collate(rows, [0, 1, 2, 3])], fused)
    loss_split, split = grads_after(model, [collate([r], [i]) for i, r in enumerate(rows)], fused)
    assert whole.keys() == split.keys() and len(whole) > 10
    torch.testing.assert_close(loss_split, loss_whole, rtol=0, atol=1e-5)
    for name in whole:
        torch.testing.assert_close(split[name], whole[name], rtol=0, atol=1e-5, msg=name)
    # and the test can fail: a mean of per-micro-batch means weighs short targets up
    model.zero_grad(set_to_none=True)
    for i, r in enumerate(rows):
        mb = collate([r], [i])
        (loss_sum(model, mb, FP32, fused) / mb.n_targets / len(rows)).backward()
    diff = max((p.grad - whole[n]).abs().max().item() for n, p in model.named_parameters() if p.grad is not None)
    assert diff > 1e-4


@pytest.mark.parametrize(
    "builder, overrides",
    [
        (build_t5, {}),  # T5 / Flan-T5: decoder output scaled by d_model ** -0.5 before the tied head
        (build_t5, {"tie_word_embeddings": False}),  # T5 v1.1 layout: no scaling
        (build_bart, {}),
    ],
)
def test_fused_head_equals_the_models_own_head(builder, overrides, tmp_path):
    path = builder(tmp_path / "m", **overrides)
    tok, _, rows, collate = store_of(path, tmp_path)
    model = build_model(ModelSettings(path=path), tok, seed=0)
    if hasattr(model, "final_logits_bias"):  # BART's logits bias: zero at init, learned by some checkpoints
        model.final_logits_bias.normal_(0, 0.5)
    b = collate(rows, list(range(len(rows))))
    loss_fused, fused = grads_after(model, [b], fused=True)
    loss_plain, plain = grads_after(model, [b], fused=False)
    torch.testing.assert_close(loss_fused, loss_plain, rtol=1e-5, atol=1e-5)
    for name in plain:
        torch.testing.assert_close(fused[name], plain[name], rtol=1e-4, atol=1e-5, msg=name)


def test_activation_checkpointing_gives_the_same_gradients(model_dir, tmp_path):
    tok, _, rows, collate = store_of(model_dir, tmp_path, n=4)
    b = collate(rows, [0, 1, 2, 3])
    _, plain = grads_after(build_model(ModelSettings(path=model_dir), tok, seed=0), [b])
    ckpt = build_model(ModelSettings(path=model_dir), tok, seed=0, activation_checkpointing=True)
    ckpt.train()
    _, recomputed = grads_after(ckpt, [b])
    for name in plain:
        torch.testing.assert_close(recomputed[name], plain[name], rtol=0, atol=1e-6, msg=name)


def test_lora_adapts_every_linear_layer_but_the_head(model_dir, tmp_path):
    tok = load_tokenizer(model_dir)
    model = build_model(ModelSettings(path=model_dir, method="lora"), tok, seed=0)
    assert model.peft_config["default"].task_type == "SEQ_2_SEQ_LM"
    targets = set(model.peft_config["default"].target_modules)
    assert targets in ({"q", "k", "v", "o", "wi_0", "wi_1", "wo"}, {"q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"})
    adapted = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any(".encoder." in n for n in adapted) and any("encoder_attn" in n or "EncDecAttention" in n for n in adapted)
    assert all("lora_" in n for n in adapted)


def test_loader_groups_by_length_and_reports_padding(model_dir, tmp_path):
    tok, store, rows, collate = store_of(model_dir, tmp_path, n=6)
    loader = TrainLoader(rows, collate, 3, seed=0, group_by_length=True)
    lengths = store.lengths[loader.epoch_order(0)]
    assert lengths.tolist() == sorted(lengths.tolist(), reverse=True)  # one group: longest first
    assert 0.0 < loader.padding_efficiency() < 1.0


# ---------------------------------------------------------------- precision


def test_precision_auto_avoids_fp16_for_t5_only(t5_dir, bart_dir, reverse_data):
    fp16 = PRECISIONS["fp16"]
    cfg = RunConfig.model_validate(config(t5_dir, reverse_data, precision="auto"))
    precision, why = fp16_safe_precision(cfg, fp16, "auto: compute capability 7.0 has no bf16; fp16 with loss scaling", quiet())
    assert precision.name == "fp32" and why.endswith("but t5 models overflow in fp16, so fp32")
    bart = RunConfig.model_validate(config(bart_dir, reverse_data, precision="auto"))
    assert fp16_safe_precision(bart, fp16, "auto", quiet())[0].name == "fp16"
    asked = RunConfig.model_validate(config(t5_dir, reverse_data, precision="fp16"))
    buf = io.StringIO()
    kept, _ = fp16_safe_precision(asked, fp16, "as configured", ConsoleReporter(Console(file=buf, width=300)))
    assert kept.name == "fp16" and "t5 models are known to overflow in fp16" in buf.getvalue()


def run(cfg: dict, out):
    result = trainer.train(RunConfig.model_validate(cfg), out, quiet())
    return result, [{k: v for k, v in r.items() if k not in MEASURED_FIELDS} for r in read_metrics(out / "metrics.jsonl")]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precision_tracks_fp32(model_dir, reverse_data, tmp_path, precision):
    _, ref = run(config(model_dir, reverse_data, max_steps=4), tmp_path / "fp32")
    result, got = run(config(model_dir, reverse_data, max_steps=4, precision=precision), tmp_path / precision)
    assert result.summary["precision"] == precision and result.summary["skipped_steps"] == 0
    for g, r in zip(got, ref):
        for key in ("loss", "eval_loss"):
            if key in r:
                assert np.isfinite(g[key]) and g[key] == pytest.approx(r[key], rel=0.03), (key, g, r)


# ---------------------------------------------------------------- resume


class Crash(BaseException):
    """The process dying: not an Exception, so nothing in trainforge catches it."""


def test_resume_is_exact(model_dir, reverse_data, tmp_path, monkeypatch):
    cfg = config(model_dir, reverse_data, max_steps=6)
    cfg["checkpoint"] = {"every_steps": 2}
    cfg["log"] = {"every_steps": 1}
    _, reference = run(copy.deepcopy(cfg), tmp_path / "ref")
    original = trainer.forward_backward_adaptive

    def crashing(run_, *args, **kwargs):
        if run_.step + 1 == 5:
            raise Crash
        return original(run_, *args, **kwargs)

    monkeypatch.setattr(trainer, "forward_backward_adaptive", crashing)
    with pytest.raises(Crash):
        run(copy.deepcopy(cfg), tmp_path / "cut")
    monkeypatch.setattr(trainer, "forward_backward_adaptive", original)
    result, resumed = run(copy.deepcopy(cfg), tmp_path / "cut")
    assert result.summary["resumed_from_step"] == 4
    assert resumed == reference
    a = torch.load(tmp_path / "ref" / "checkpoints" / "step-00000006" / "state.pt")["model"]
    b = torch.load(tmp_path / "cut" / "checkpoints" / "step-00000006" / "state.pt")["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_flops_count_a_source_token_in_the_encoder_and_a_target_token_in_the_decoder(t5_dir):
    from trainforge.metrics.flops import flops_per_token, linear_params

    model = build_model(ModelSettings(path=t5_dir), load_tokenizer(t5_dir), seed=0)
    total, _ = linear_params(model)
    encoder, _ = linear_params(model.get_encoder())
    attention = flops_per_token(model, 16) - 6.0 * total  # the decoder-only formula: every matrix per token
    assert flops_per_token(model, 16, 0.0) == pytest.approx(6.0 * encoder + attention)
    assert flops_per_token(model, 16, 1.0) == pytest.approx(6.0 * (total - encoder) + attention)
    assert flops_per_token(model, 16, 0.25) == pytest.approx(0.75 * 6.0 * encoder + 0.25 * 6.0 * (total - encoder) + attention)


def test_qlora_trains_adapters_on_a_4bit_base(model_dir, reverse_data, tmp_path):
    cfg = config(model_dir, reverse_data, max_steps=3, precision="bf16")
    cfg["model"]["method"] = "qlora"
    result, _ = run(cfg, tmp_path / "run")
    s = result.summary
    assert s["weights"]["frozen"]["nf4"] > 0 and set(s["weights"]["trainable"]) == {"float32"}
    assert s["eval_loss"] < s["eval_loss_before"]
    adapter = json.loads((tmp_path / "run" / "final" / "adapter_config.json").read_text())
    assert adapter["task_type"] == "SEQ_2_SEQ_LM"


@pytest.mark.parametrize(
    "init",
    [
        {"architecture": "t5", "d_model": 32, "d_kv": 8, "d_ff": 64, "num_layers": 2, "num_heads": 4},
        {"architecture": "bart", "d_model": 32, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4,
         "decoder_attention_heads": 4, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "max_position_embeddings": 64},
    ],
)
def test_from_scratch_with_a_tokenizer_trained_on_the_data(init, reverse_data, tmp_path):
    from transformers import AutoModelForSeq2SeqLM

    cfg = {
        "model": {"init": init, "tokenizer_vocab_size": 300},
        "data": {"train": str(reverse_data / "train.jsonl"), "eval": str(reverse_data / "eval.jsonl"), "max_length": 24},
        "train": {"max_steps": 3, "micro_batch_size": 8, "precision": "fp32", "device": "cpu"},
    }
    result, _ = run(cfg, tmp_path / "run")
    assert result.summary["eval_loss"] < result.summary["eval_loss_before"]
    model = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "run" / "final")
    tok = result.tokenizer
    # the decoder starts from the tokenizer's pad token; BART's defaults (ids of its own vocabulary) are replaced
    assert model.config.decoder_start_token_id == tok.pad_token_id
    assert model.config.eos_token_id == tok.eos_token_id
    assert getattr(model.config, "forced_eos_token_id", tok.eos_token_id) == tok.eos_token_id


def test_prepare_reports_source_target_rows(t5_dir, reverse_data, tmp_path):
    from trainforge.data.plan import prepare_only

    cfg = RunConfig.model_validate(config(t5_dir, reverse_data))
    cfg.data.cache_dir = tmp_path
    buf = io.StringIO()
    stats = prepare_only(cfg, ConsoleReporter(Console(file=buf, width=300)))
    assert stats["encoder_decoder"] and 0 < stats["row_efficiency"] < 1
    assert "source -> target rows" in buf.getvalue() and "(prepared in " in buf.getvalue()
    again = io.StringIO()
    prepare_only(cfg, ConsoleReporter(Console(file=again, width=300)))
    assert "(reused)" in again.getvalue()  # a cache hit said 'prepared in 0.0s'

