"""Models whose attention layers take no attention function by name (Falcon: transformers' own code picks eager, SDPA or
flash itself): trainforge's document kernels cannot plug in; the model runs its own attention, and whether its
mask keeps packed documents apart is measured at setup (test_packing_probe.py); X-MOD's language adapter is settled
from its config."""

from __future__ import annotations

import json

import pytest
import torch

from trainforge.config.run import ModelSettings, RunConfig
from trainforge.errors import TrainforgeError
from trainforge.hf_dir import attention_of, fixed_attention, init_kind, model_kind
from trainforge.tools.family_shrink import tiny_config

VOCAB = 64


def test_attention_of_its_own_is_read_from_transformers_modeling_code():
    assert "falcon" in fixed_attention("falcon")
    assert fixed_attention("llama") is None and fixed_attention("gpt_oss") is None
    assert fixed_attention("no_such_model") is None and fixed_attention(None) is None  # unknown: nothing to say
    # an image-text model's language model is another model type: its layers decide
    assert attention_of({"model_type": "fuyu", "text_config": {"model_type": "persimmon"}}) is None
    assert init_kind({"architecture": "falcon"}).fixed_attention and not init_kind({"architecture": "llama"}).fixed_attention


def test_packing_is_left_to_the_setup_probe(tmp_path):
    """Attention of its own says nothing about packed documents by itself: Falcon's mask separates them (the probe
    measures it at setup: test_packing_probe.py)."""
    model = tmp_path / "falcon"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "falcon", "vocab_size": 64}))
    assert model_kind(model).fixed_attention
    raw = {"model": {"init": {"architecture": "falcon"}}, "data": {"train": "builtin:python-stdlib"}}
    assert RunConfig.model_validate(raw).data.packing is True
    assert RunConfig.model_validate({**raw, "data": {**raw["data"], "packing": True}}).data.packing is True


def _tiny_falcon(tmp_path, tok_dir):
    from transformers import AutoModelForCausalLM

    from trainforge.model.tokenizer import load_tokenizer

    tok = load_tokenizer(tok_dir)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("falcon", len(tok))).save_pretrained(tmp_path / "falcon")
    tok.save_pretrained(tmp_path / "falcon")
    return tmp_path / "falcon", tok


def test_falcon_trains_with_its_own_attention_and_a_named_kernel_is_refused(tmp_path, tiny_tokenizer_dir):
    from trainforge.data.formats import IGNORE
    from trainforge.data.loader import Batch
    from trainforge.engine.step import loss_sum
    from trainforge.hardware.device import PRECISIONS
    from trainforge.model.load import build_model, build_model_skeleton

    path, tok = _tiny_falcon(tmp_path, tiny_tokenizer_dir)
    model = build_model(ModelSettings(path=path), tok, seed=0)  # attention auto: packed_sdpa on a CPU, elsewhere
    assert model.config._attn_implementation == "sdpa"
    ids = torch.randint(3, len(tok), (2, 10), generator=torch.Generator().manual_seed(0))
    labels = torch.roll(ids, -1, 1)
    labels[:, -1] = IGNORE
    batch = Batch(ids, labels, torch.arange(10).repeat(2, 1), 20, 18, [0, 1])
    loss = loss_sum(model, batch, PRECISIONS["fp32"])
    assert torch.isfinite(loss)
    loss.backward()
    # the plan's skeleton takes the same attention (its causal kernel would fail in Falcon's lookup)
    assert build_model_skeleton(ModelSettings(path=path), tok, None, False).config._attn_implementation == "sdpa"
    with pytest.raises(TrainforgeError, match=r"model.attention: packed_sdpa would change this model's attention: "
                                              r"transformers' falcon layers .* use auto or sdpa") as e:
        build_model(ModelSettings(path=path, attention="packed_sdpa"), tok, seed=0)
    assert e.value.exit_code == 2


def test_xmod_takes_its_only_language_and_refuses_to_guess_among_several():
    from transformers import AutoModelForCausalLM

    from trainforge.model.inputs import ModelInputUnknown, settle_inputs

    config = tiny_config("xmod", VOCAB)
    assert list(config.languages) == ["en_XX"] and config.default_language is None
    assert "en_XX" in settle_inputs(config) and config.default_language == "en_XX"
    assert settle_inputs(config) is None  # set: nothing more to do
    model = AutoModelForCausalLM.from_config(config)
    assert model(input_ids=torch.tensor([[5, 6, 7]])).logits.shape == (1, 3, VOCAB)
    several = tiny_config("xmod", VOCAB)
    several.languages = ["en_XX", "de_DE"]
    with pytest.raises(ModelInputUnknown, match="en_XX, de_DE and no default_language .* set default_language") as e:
        settle_inputs(several)
    assert e.value.exit_code == 2


def test_a_saved_xmod_without_a_default_language_loads_for_generation_and_export(tmp_path, tiny_tokenizer_dir):
    """The base an adapter trained on, a merged export, ``generate``: each load settles the language as training did."""
    from transformers import AutoModelForCausalLM

    from trainforge.hardware.device import PRECISIONS
    from trainforge.model.resolve import load_model, resolve_source
    from trainforge.model.tokenizer import load_tokenizer

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("xmod", VOCAB)).save_pretrained(tmp_path / "xmod")
    load_tokenizer(tiny_tokenizer_dir).save_pretrained(tmp_path / "xmod")
    assert json.loads((tmp_path / "xmod" / "config.json").read_text()).get("default_language") is None
    model = load_model(resolve_source(tmp_path / "xmod"), torch.device("cpu"), PRECISIONS["fp32"])
    assert model(input_ids=torch.tensor([[5, 6, 7]]), use_cache=False).logits.shape == (1, 3, VOCAB)
