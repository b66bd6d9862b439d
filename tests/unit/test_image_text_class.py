"""Image-text checkpoints whose causal-LM class is their language model alone (Mllama, Emu3): the published
directory (the full config) loads as the whole image-text model, whose vision parts stay frozen. Before,
``AutoModelForCausalLM`` built the language model from the text sub-config, and final/ was a directory of a
text-only model no auto class loads."""

from __future__ import annotations

import pytest
import torch

from trainforge.model.multimodal import image_text_class


def test_the_image_text_class_goes_to_the_families_whose_causal_class_is_text_only():
    from transformers import AutoModelForImageTextToText

    assert image_text_class("mllama") is AutoModelForImageTextToText
    assert image_text_class("emu3") is AutoModelForImageTextToText
    assert image_text_class("gemma3") is None  # its causal-LM class is already the image-text one
    assert image_text_class("llama") is None and image_text_class(None) is None


@pytest.mark.parametrize("family, cls, frozen", [("mllama", "MllamaForConditionalGeneration", "model.vision_model."),
                                                 ("emu3", "Emu3ForConditionalGeneration", "model.vqmodel.")])
def test_the_published_directory_trains_its_language_model(family, cls, frozen, tiny_tokenizer_dir, tmp_path):
    from transformers import AutoModelForImageTextToText

    from trainforge.config.run import ModelSettings
    from trainforge.model.load import build_model
    from trainforge.model.tokenizer import load_tokenizer
    from trainforge.tools.family_shrink import tiny_config

    tok = load_tokenizer(tiny_tokenizer_dir)
    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(tiny_config(family, len(tok))).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    warned: list[str] = []
    model = build_model(ModelSettings(path=tmp_path), tok, 0, torch.device("cpu"), False, warn=warned.append)
    assert type(model).__name__ == cls and any(f"image-text model ({cls})" in w for w in warned)
    params = dict(model.named_parameters())
    assert any(n.startswith(frozen) for n in params)
    assert all(not p.requires_grad for n, p in params.items() if n.startswith(frozen))
    assert all(p.requires_grad for n, p in params.items() if "layers.0." in n and not n.startswith(frozen))
    lora = build_model(ModelSettings(path=tmp_path, method="lora"), tok, 0, torch.device("cpu"), False)
    adapted = [n for n, p in lora.named_parameters() if p.requires_grad]
    assert adapted and not any(frozen in n for n in adapted)


def test_a_causal_class_that_is_one_part_of_a_composite_model_is_refused():
    """MusicGen's causal-LM class is its audio-code decoder alone: its published directory (text encoder, audio
    encoder, decoder) stopped with a traceback in transformers ('no attribute dropout'); now exit 2 before loading."""
    from trainforge.hf_dir import UnsupportedModelDir
    from trainforge.model.multimodal import refuse_a_part

    with pytest.raises(UnsupportedModelDir, match="musicgen checkpoint .* is not a language model.*its decoder alone") as err:
        refuse_a_part("musicgen")
    assert err.value.exit_code == 2
    for fine in ("llama", "mllama", "gemma3", "exaone", None):  # exaone: Llama's class takes its config
        refuse_a_part(fine)
