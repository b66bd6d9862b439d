"""Models whose layers carry a state along the sequence (Mamba, linear attention) never get packed rows: the state runs
past the position reset that keeps packed documents apart in attention (Falcon-H1 leaked 3e-4 in log-probs from the
document before, and trained other weights)."""

from __future__ import annotations

import json

import pytest

from trainforge.hf_dir import model_kind, recurrent_layers


@pytest.mark.parametrize("config, expected", [
    ({"model_type": "falcon_h1"}, "Mamba"),
    ({"model_type": "something_new", "mamba_d_state": 16}, "Mamba"),
    ({"model_type": "something_new", "ssm_state_size": 16}, "Mamba"),
    ({"model_type": "qwen3_5", "layer_types": ["linear_attention", "full_attention"]}, "linear-attention"),
    ({"model_type": "hybrid", "layers_block_type": ["mamba", "attention"]}, "Mamba"),
    ({"model_type": "gemma2", "layer_types": ["sliding_attention", "full_attention"]}, None),
    ({"model_type": "llama"}, None),
])
def test_recurrent_layers_are_told_from_the_config(config, expected):
    assert recurrent_layers(config) == expected


def test_packing_resolves_to_false_for_a_recurrent_model_and_is_refused_when_given(tmp_path):
    from trainforge.config.run import ConfigError, RunConfig

    model = tmp_path / "falcon"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "falcon_h1", "vocab_size": 64}))
    assert model_kind(model).recurrent == "Mamba"
    raw = {"model": {"init": {"architecture": "falcon_h1"}}, "data": {"train": "builtin:python-stdlib"}}
    assert RunConfig.model_validate(raw).data.packing is False  # unset: one example per row
    assert RunConfig.model_validate({**raw, "data": {**raw["data"], "packing": "concat"}}).data.packing == "concat"
    with pytest.raises((ConfigError, ValueError), match=r"data.packing: the model \(falcon_h1\) has Mamba layers, whose state runs "
                                                        r"along the row .* set data.packing: false"):
        RunConfig.model_validate({**raw, "data": {**raw["data"], "packing": True}})
    llama = {**raw, "model": {"init": {"architecture": "llama"}}}
    assert RunConfig.model_validate(llama).data.packing is True  # attention-only models pack as before


def test_layer_types_under_text_config_and_filled_in_by_the_config_class_are_seen(tmp_path):
    """Qwen3.5 keeps its linear-attention layer types under text_config, and a model built from model.init gets them
    from its config class (the user names only the architecture): both were read as attention-only and packed."""
    from transformers import CONFIG_MAPPING

    from trainforge.config.run import load_config
    from trainforge.hf_dir import init_kind

    CONFIG_MAPPING["qwen3_5"]().save_pretrained(tmp_path)
    assert model_kind(tmp_path).recurrent == "linear-attention"
    assert init_kind({"architecture": "qwen3_5_text"}).recurrent == "linear-attention"
    # the built-in default leaves packing to the model: a Mamba given by --set is not refused for the default's packing
    mamba = load_config(None, ["model.init={architecture: mamba, hidden_size: 64, num_hidden_layers: 2}"])
    assert mamba.data.packing is False and load_config(None).data.packing is True
