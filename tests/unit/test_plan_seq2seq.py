"""`trainforge plan` on encoder-decoder models and on tied embeddings: the traced step against a real one."""

from __future__ import annotations

import pytest
import torch

from conftest import TINY_LLAMA_INIT
from seq2seq_models import build_bart, build_t5
from trainforge.config.run import RunConfig
from trainforge.data.loader import Batch
from trainforge.engine.optim import build_optimizer
from trainforge.engine.step import forward_backward, optimizer_step
from trainforge.engine.predict.trace import StepTracer, _trace, trace_training_step
from trainforge.hardware.device import PRECISIONS
from trainforge.model.load import build_model
from trainforge.model.tokenizer import load_tokenizer
from trainforge.tools.plan import VocabOnly

SOURCE, TARGET, ROWS = 24, 16, 4  # multiples of 8: the collator's padded widths equal the limits


@pytest.fixture(scope="module")
def seq2seq_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("s2s-plan")
    return {"t5": build_t5(root / "t5"), "bart": build_bart(root / "bart")}


def seq2seq_config(model_dir, method: str, checkpointing: bool) -> RunConfig:
    return RunConfig.model_validate({
        "model": {"path": str(model_dir), "method": method},
        "data": {"train": str(model_dir / "config.json"), "max_length": SOURCE, "max_target_length": TARGET},
        "train": {"activation_checkpointing": checkpointing},
    })


def real_seq2seq_peak(cfg: RunConfig, tokenizer, precision) -> tuple[int, dict[str, int]]:
    """Live tensor peak of a real steady-state step on full source and target rows."""
    model = build_model(cfg.model, tokenizer, 0, torch.device("cpu"), precision.autocast_dtype is not None,
                        precision.autocast_dtype, bool(cfg.train.activation_checkpointing))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = build_optimizer(model, cfg.optim, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    src = torch.randint(3, len(tokenizer), (ROWS, SOURCE), generator=g)
    tgt = torch.randint(3, len(tokenizer), (ROWS, TARGET), generator=g)
    batch = Batch(src, tgt, None, src.numel() + tgt.numel(), tgt.numel(), list(range(ROWS)), torch.ones_like(src), tgt)

    def step() -> None:
        loss = forward_backward(model, [batch], precision, torch.device("cpu"))
        optimizer_step(params, opt, 1.0, None, loss)

    step()
    tracer = StepTracer()
    tracer.track_training_state(model, opt, params)
    with tracer:
        step()
    tracer.close()
    return tracer.peak, tracer.peak_parts


@pytest.mark.parametrize("kind", ["t5", "bart"])
@pytest.mark.parametrize("method,precision,checkpointing", [("full", "fp32", False), ("lora", "bf16", True)])
def test_seq2seq_traced_peak_matches_a_real_step(seq2seq_dirs, kind, method, precision, checkpointing):
    cfg = seq2seq_config(seq2seq_dirs[kind], method, checkpointing)
    tok = load_tokenizer(seq2seq_dirs[kind])
    prec = PRECISIONS[precision]
    predicted = trace_training_step(cfg, tok, prec, ROWS, checkpointing)
    measured, parts = real_seq2seq_peak(cfg, tok, prec)
    # exact: the same parameters (one embedding shared by encoder, decoder and head) in the same dtypes
    assert predicted.parts["weights"] == parts["weights"]
    assert predicted.parts["optimizer"] == parts["optimizer"]
    assert abs(predicted.peak / measured - 1) < 0.1, (predicted.parts, parts)
    assert predicted.tokens == ROWS * (SOURCE + TARGET)  # a step's tokens count both sides


def test_layerdrop_is_traced_as_the_full_step(tmp_path):
    """LayerDrop draws a random scalar per layer and branches on it (every transformers release with
    layerdrop > 0; 5.17-5.2x with any): a fake tensor has no value, so the trace keeps every layer."""
    full = build_bart(tmp_path / "plain")
    dropping = build_bart(tmp_path / "layerdrop", encoder_layerdrop=0.5, decoder_layerdrop=0.5)
    prec = PRECISIONS["fp32"]
    traced = [
        trace_training_step(seq2seq_config(d, "full", False), load_tokenizer(d), prec, ROWS, False) for d in (full, dropping)
    ]
    assert traced[1].peak == traced[0].peak and traced[1].parts == traced[0].parts
    def work(trace):  # the ops, less LayerDrop's draw and comparison (5.17-5.2x draw even at layerdrop 0)
        return [(op.name, op.flops) for op in trace.ops if op.name not in ("rand", "lt")]

    assert work(traced[1]) == work(traced[0]) and len(traced[1].ops) - len(work(traced[1])) >= 2 * 4


def test_seq2seq_stacks_are_extrapolated_together_exactly(tmp_path):
    """Encoder and decoder of 7 layers each, traced at 2 and 4 of each and extrapolated: the full trace."""
    d = tmp_path / "d.jsonl"
    d.write_text('{"source": "a", "target": "b"}\n')
    init = {"architecture": "t5", "d_model": 32, "d_kv": 8, "d_ff": 64, "num_heads": 4, "num_layers": 7,
            "num_decoder_layers": 7, "feed_forward_proj": "gated-gelu", "tie_word_embeddings": False}
    cfg = RunConfig.model_validate({"model": {"init": init}, "data": {"train": str(d), "max_length": 16, "max_target_length": 8}})
    full = _trace(cfg, VocabOnly(300), PRECISIONS["fp32"], 2, False, 1, "cpu", None)
    extrapolated = trace_training_step(cfg, VocabOnly(300), PRECISIONS["fp32"], 2, False)
    assert extrapolated.fewer_ops is not None
    assert extrapolated.parts == full.parts


def test_tied_embeddings_are_counted_once(tmp_path):
    """A decoder-only model whose LM head is its input embedding: one weight, one gradient, one Adam state."""
    d = tmp_path / "d.jsonl"
    d.write_text('{"text": "alpha beta"}\n')
    tied = RunConfig.model_validate({"model": {"init": {**TINY_LLAMA_INIT, "tie_word_embeddings": True}},
                                     "data": {"train": str(d), "max_length": 16}})
    untied = RunConfig.model_validate({"model": {"init": dict(TINY_LLAMA_INIT)}, "data": {"train": str(d), "max_length": 16}})
    vocab = VocabOnly(300)
    a = trace_training_step(tied, vocab, PRECISIONS["fp32"], 2, False)
    b = trace_training_step(untied, vocab, PRECISIONS["fp32"], 2, False)
    head = 300 * TINY_LLAMA_INIT["hidden_size"] * 4  # fp32 bytes of one vocabulary x hidden matrix
    assert b.parts["weights"] - a.parts["weights"] == head
    assert b.parts["optimizer"] - a.parts["optimizer"] == 2 * head + 4  # two moments, and its fp32 step count


def test_a_prepared_seq2seq_cache_is_found_by_the_plan(seq2seq_dirs, tmp_path):
    """An encoder-decoder's source -> target entry is keyed apart from a decoder-only one: after
    ``trainforge prepare`` the plan read the decoder-only key and kept saying the data was not prepared."""
    import json

    from trainforge.data.prepare import prepare_data
    from trainforge.tools.plan import data_facts

    model_dir = seq2seq_dirs["t5"]
    path = tmp_path / "s2s.jsonl"
    path.write_text("".join(json.dumps({"source": f"reverse: alpha beta {i}", "target": f"{i} beta alpha"}) + "\n" for i in range(12)))
    cfg = RunConfig.model_validate({
        "model": {"path": str(model_dir), "method": "full"},
        "data": {"train": str(path), "eval": None, "max_length": SOURCE, "cache_dir": str(tmp_path / "cache")},
    })
    tok = load_tokenizer(model_dir)
    assert not data_facts(cfg, tok)["prepared"]
    prepare_data(cfg.data, tok, cfg.train.seed, log=lambda *_: None, seq2seq=True)
    facts = data_facts(cfg, tok)
    assert facts["prepared"] and facts["train_rows"] == 12
