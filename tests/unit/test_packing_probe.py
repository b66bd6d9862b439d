"""data.packing settled by measurement: where a run trains on transformers' stock attention, two documents packed
into one row must give the logits each gives alone. GPT-OSS's mask ignores the restarting position_ids (its
documents leaked on eager): under auto it packs on its own eager attention run per document (sinks intact); on
eager asked for by name packing resolves off, and given is refused. Falcon and GPT-Neo (attention of their own)
and Gemma 2 (soft-capped, on eager) build a per-document mask: they stay packed."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from trainforge.config.run import RunConfig, TrainSettings
from trainforge.engine.packing_check import settle_packing
from trainforge.errors import TrainforgeError
from trainforge.model.doc_eager import register
from trainforge.model.packing_probe import packing_leak
from trainforge.tools.family_shrink import shrink_config, tiny_config

VOCAB = 64
CPU = torch.device("cpu")
DOC_EAGER = register()


def _packed_and_alone(family: str, attn: str) -> float:
    """The largest logit gap between two documents packed into one row and each run alone (an independent check)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family, VOCAB), attn_implementation=attn).eval()
    a, b = torch.tensor([5, 9, 13, 2, 40]), torch.tensor([7, 33, 21, 8, 11, 50])
    with torch.no_grad():
        packed = model(input_ids=torch.cat([a, b])[None], position_ids=torch.tensor([list(range(5)) + list(range(6))]),
                       use_cache=False).logits[0]
        alone = torch.cat([model(input_ids=x[None], use_cache=False).logits[0] for x in (a, b)])
    return (packed - alone).abs().max().item()


@pytest.mark.parametrize(("family", "attn", "leaks"), [("gpt_oss", "eager", True), ("gpt_oss", DOC_EAGER, False),
                                                        ("falcon", "sdpa", False), ("gpt_neo", "eager", False),
                                                        ("gemma2", "eager", False), ("mpt", DOC_EAGER, True)])
def test_the_probe_finds_what_packed_rows_compute(family, attn, leaks):
    why = packing_leak(shrink_config(tiny_config(family, VOCAB)), attn, AutoModelForCausalLM)
    assert (why is not None) == leaks == (_packed_and_alone(family, attn) > 1e-4)
    if leaks:
        assert "attend to each other" in why


def test_the_probe_leaves_the_random_state_and_runs_once(monkeypatch):
    import trainforge.model.packing_probe as probe

    runs: list[str] = []
    real = probe._probe
    monkeypatch.setattr(probe, "_DECIDED", {})
    monkeypatch.setattr(probe, "_probe", lambda *a: runs.append(a[1]) or real(*a))
    config = shrink_config(tiny_config("gpt_neo", VOCAB))
    torch.manual_seed(3)
    state = torch.get_rng_state()
    for _ in range(2):
        assert packing_leak(config, "eager", AutoModelForCausalLM) is None
    assert torch.equal(torch.get_rng_state(), state) and runs == ["eager"]


def _run(tokenizer_dir, architecture: str, attention: str = "auto", **data) -> RunConfig:
    return RunConfig.model_validate({
        "model": {"init": {"architecture": architecture}, "tokenizer": str(tokenizer_dir), "attention": attention},
        "data": {"train": "builtin:python-stdlib", **data},
    })


def _settle(cfg: RunConfig, said: list[str]) -> RunConfig:
    from trainforge.model.tokenizer import load_tokenizer

    return settle_packing(cfg, load_tokenizer(cfg.model.tokenizer), CPU, said.append)


def test_gpt_oss_packs_on_its_eager_attention_per_document_with_its_sinks():
    """auto: the stock eager mask leaks, the model's own eager function per document does not: taken, packing on."""
    from trainforge.model.load import exact_attention

    config = tiny_config("gpt_oss", VOCAB)
    assert exact_attention(config, "auto", "trainforge_packed_sdpa", lambda _: None) == DOC_EAGER
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=DOC_EAGER)
    ids = torch.tensor([[5, 9, 13, 2, 40, 7, 33, 21, 8, 11, 50]])
    model(input_ids=ids, position_ids=torch.tensor([list(range(5)) + list(range(6))]), use_cache=False).logits.sum().backward()
    sinks = [p for n, p in model.named_parameters() if n.endswith("self_attn.sinks")]
    assert sinks and all(p.grad is not None and p.grad.abs().sum() > 0 for p in sinks)  # the sinks take part


def test_gpt_oss_on_eager_by_name_trains_one_example_per_row_and_packing_given_is_refused(tiny_tokenizer_dir):
    """The real (20B-sized) config is never built: the probe runs a tiny copy of it."""
    said: list[str] = []
    assert _settle(_run(tiny_tokenizer_dir, "gpt_oss"), said).data.packing is True and said == []  # auto: per document
    cfg = _run(tiny_tokenizer_dir, "gpt_oss", attention="eager")
    assert cfg.data.packing is True  # nothing assumed from the config alone
    assert _settle(cfg, said).data.packing is False
    assert len(said) == 1 and said[0].startswith("data.packing false: transformers' eager attention of GptOssForCausalLM")
    with pytest.raises(TrainforgeError, match=r"data.packing: true, but transformers. eager attention of GptOssForCausalLM "
                                              r"lets packed documents attend to each other .* set data.packing: false") as e:
        _settle(_run(tiny_tokenizer_dir, "gpt_oss", attention="eager", packing=True), [])
    assert e.value.exit_code == 2
    with pytest.raises(TrainforgeError, match=r"train.objective: grpo packs its rollouts into one row .* eager") as e:
        grpo = _run(tiny_tokenizer_dir, "gpt_oss", attention="eager", packing=False)
        _settle(grpo.model_copy(update={"train": TrainSettings(objective="grpo")}), [])
    assert e.value.exit_code == 2
    concat = _run(tiny_tokenizer_dir, "gpt_oss", attention="eager", packing="concat")
    assert _settle(concat, []) is concat  # one stream, no documents to keep apart


@pytest.mark.parametrize("family", ["falcon", "gpt_neo", "gemma2"])
def test_models_whose_stock_mask_separates_documents_stay_packed(tiny_tokenizer_dir, family):
    said: list[str] = []
    for data in ({}, {"packing": True}):
        cfg = _run(tiny_tokenizer_dir, family, **data)
        assert _settle(cfg, said).data.packing is True
    assert said == []


def test_a_model_on_a_document_kernel_is_not_probed(tiny_tokenizer_dir, monkeypatch):
    import trainforge.model.packing_probe as probe

    monkeypatch.setattr(probe, "_probe", lambda *a: pytest.fail("llama trains on packed_sdpa: nothing to probe"))
    cfg = _run(tiny_tokenizer_dir, "llama")
    assert _settle(cfg, []) is cfg


def test_the_attention_the_run_takes_is_found_without_building_it(tiny_tokenizer_dir):
    from trainforge.engine.packing_check import run_attention
    from trainforge.model.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_tokenizer_dir)

    def attn(family: str, device: torch.device | None, attention: str = "auto") -> str | None:
        cfg = RunConfig.model_validate({"model": {"init": {"architecture": family}, "attention": attention},
                                        "data": {"train": "builtin:python-stdlib"}})
        found = run_attention(cfg, tok, device)
        return None if found is None else found[0]

    assert attn("llama", CPU) is None and attn("llama", None) is None  # packed_sdpa, varlen / flex
    assert attn("llama", CPU, "sdpa") == "sdpa" and attn("llama", torch.device("mps")) == "sdpa"  # stock: probed
    assert attn("llama", None, "flash_attention_2") is None
    assert attn("gpt_oss", None) == "eager" and attn("falcon", CPU) == "sdpa"


def test_prepare_builds_the_rows_the_run_will_train_on(tmp_path, tiny_tokenizer_dir):
    import json

    from rich.console import Console

    from trainforge.data.plan import prepare_only
    from trainforge.metrics.console import ConsoleReporter

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x + {i}\n"}) + "\n" for i in range(40)))
    cfg = RunConfig.model_validate({
        "model": {"init": {"architecture": "gpt_oss"}, "tokenizer": str(tiny_tokenizer_dir), "attention": "eager"},
        "data": {"train": str(data), "max_length": 64, "cache_dir": str(tmp_path / "cache"), "num_workers": 1},
    })
    console = Console(record=True, width=400)
    stats = prepare_only(cfg, ConsoleReporter(console))
    assert "data.packing false: transformers' eager attention of GptOssForCausalLM" in console.export_text()
    assert stats["rows"] == stats["train_sequences"]  # one example per row


def test_per_document_eager_is_plain_eager_on_rows_without_a_reset_and_in_generation():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("gpt_oss", VOCAB), attn_implementation="eager").eval()
    ids = torch.tensor([[5, 9, 13, 2, 40, 7]])
    with torch.no_grad():
        plain = model(input_ids=ids, use_cache=False).logits
        greedy = model.generate(ids, max_new_tokens=4, do_sample=False)
        model.set_attn_implementation(DOC_EAGER)
        assert torch.equal(model(input_ids=ids, use_cache=False).logits, plain)
        assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False), greedy)  # a KV cache: no reset
