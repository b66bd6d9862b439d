"""trainforge never runs code from a model, tokenizer or adapter directory (``hf_dir.refuse_custom_code``), and
every transformers load passes ``trust_remote_code=False``, so transformers can neither prompt nor import it."""

from __future__ import annotations

import builtins
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from hostile_dirs import adapter_on, custom_code_model, custom_code_tokenizer, unknown_architecture

from trainforge.config.run import ModelSettings
from trainforge.errors import TrainforgeError
from trainforge.hardware.device import PRECISIONS
from trainforge.hf_dir import CustomCodeError, UnsupportedModelDir, refuse_custom_code
from trainforge.model import load, resolve, tokenizer


@pytest.fixture
def marker(tmp_path):
    path = tmp_path / "MARKER"
    yield path
    assert not path.exists(), "a directory's own Python code was executed"


@pytest.fixture
def no_prompt(monkeypatch):
    """transformers asking 'Do you wish to run the custom code?' fails the test (it would read stdin)."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"prompted: {args}")

    monkeypatch.setattr(builtins, "input", refuse)


def test_a_model_directory_with_auto_map_is_refused_naming_it_and_its_code(tiny_model_dir, tmp_path, marker):
    evil = custom_code_model(tiny_model_dir, tmp_path / "evil", marker)
    with pytest.raises(CustomCodeError) as e:
        refuse_custom_code(evil)
    msg = str(e.value)
    assert msg.startswith(f"{evil} needs custom code (config.json auto_map: ")
    assert "configuration_evil.EvilConfig" in msg and "modeling_evil.EvilForCausalLM" in msg
    assert msg.endswith("trainforge loads only architectures that transformers ships")
    assert isinstance(e.value, TrainforgeError) and e.value.exit_code == 2


def test_a_tokenizer_with_auto_map_is_refused(tiny_tokenizer_dir, tmp_path, marker):
    evil = custom_code_tokenizer(tiny_tokenizer_dir, tmp_path / "evil-tok", marker)
    with pytest.raises(CustomCodeError, match=r"tokenizer_config.json auto_map: AutoTokenizer=tokenization_evil.EvilTokenizerFast"):
        refuse_custom_code(evil)


def test_an_unknown_model_type_is_refused_naming_it(tiny_model_dir, tmp_path):
    odd = unknown_architecture(tiny_model_dir, tmp_path / "odd")
    with pytest.raises(UnsupportedModelDir, match=rf"^{odd}: config.json names model_type 'mystery', which transformers does not know"):
        refuse_custom_code(odd)


def test_an_adapter_on_a_refused_base_is_refused_naming_both(tiny_model_dir, tmp_path, marker):
    evil = custom_code_model(tiny_model_dir, tmp_path / "evil", marker)
    adapter = adapter_on(evil, tmp_path / "adapter")
    with pytest.raises(CustomCodeError, match=rf"^the adapter in {adapter} adapts {evil}: {evil} needs custom code"):
        refuse_custom_code(adapter)


def test_adapters_naming_each_other_end_the_check(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    adapter_on(b, a)
    adapter_on(a, b)
    refuse_custom_code(a)  # no recursion error: nothing to refuse, and resolve_source says what is missing


def test_ordinary_directories_pass(tiny_model_dir, tiny_tokenizer_dir, tmp_path):
    refuse_custom_code(tiny_model_dir)
    refuse_custom_code(tiny_tokenizer_dir)
    refuse_custom_code(tmp_path)  # nothing there to refuse


def test_auto_map_beside_a_shipped_architecture_loads_transformers_own_class(tiny_model_dir, tmp_path, marker, no_prompt):
    """Hub snapshots of models transformers has since adopted keep their auto_map: the shipped class loads."""
    snapshot = custom_code_model(tiny_model_dir, tmp_path / "adopted", marker)
    config = json.loads((snapshot / "config.json").read_text())
    config.update(model_type="llama", architectures=["LlamaForCausalLM"])
    (snapshot / "config.json").write_text(json.dumps(config))
    refuse_custom_code(snapshot)
    model = load.build_model(ModelSettings(path=snapshot), tokenizer.load_tokenizer(snapshot), 0, torch.device("cpu"), False)
    assert type(model).__name__ == "LlamaForCausalLM" and type(model).__module__.startswith("transformers.")


def test_model_settings_refuse_at_validation(tiny_model_dir, tiny_tokenizer_dir, tmp_path, marker):
    evil = custom_code_model(tiny_model_dir, tmp_path / "evil", marker)
    with pytest.raises(ValueError, match=rf"model.path: {evil} needs custom code"):
        ModelSettings(path=evil)
    evil_tok = custom_code_tokenizer(tiny_tokenizer_dir, tmp_path / "evil-tok", marker)
    with pytest.raises(ValueError, match=rf"model.tokenizer: {evil_tok} needs custom code"):
        ModelSettings(path=tiny_model_dir, tokenizer=evil_tok)


# --- defence in depth: with trainforge's own check switched off, transformers still refuses (no prompt, no code)


def test_load_tokenizer_without_the_check_still_runs_no_code(tiny_tokenizer_dir, tmp_path, marker, no_prompt, monkeypatch):
    evil = custom_code_tokenizer(tiny_tokenizer_dir, tmp_path / "evil-tok", marker)
    monkeypatch.setattr(tokenizer, "refuse_custom_code", lambda *a, **k: None)
    # transformers' refusal, passed on as a TokenizerError naming the directory (exit 2)
    with pytest.raises(tokenizer.TokenizerError, match=r"cannot be loaded: .*contains custom code"):
        tokenizer.load_tokenizer(evil)


def test_loading_models_without_the_check_still_runs_no_code(tiny_model_dir, tmp_path, marker, no_prompt, monkeypatch):
    evil = custom_code_model(tiny_model_dir, tmp_path / "evil", marker)
    monkeypatch.setattr(resolve, "refuse_custom_code", lambda *a, **k: None)
    monkeypatch.setattr(load, "refuse_custom_code", lambda *a, **k: None)
    src = resolve.resolve_source(evil)
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        resolve.load_model(src, torch.device("cpu"), PRECISIONS["fp32"])
    cfg = ModelSettings.model_construct(path=evil, init=None, method="full", attention="sdpa", lora=None, tokenizer=None)
    tok = tokenizer.load_tokenizer(tiny_model_dir)
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        load.build_model(cfg, tok, 0, torch.device("cpu"), False)
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        load.build_model_skeleton(cfg, tok, None, False)


def test_the_hostile_directories_are_armed(tiny_model_dir, tiny_tokenizer_dir, tmp_path):
    """Trusted, their code does run and writes the marker: the tests above would notice if trainforge ran it."""
    marker = tmp_path / "ARMED"
    evil = custom_code_model(tiny_model_dir, tmp_path / "evil", marker)
    code = f"from transformers import AutoConfig; AutoConfig.from_pretrained({str(evil)!r}, trust_remote_code=True)"
    env = dict(os.environ, HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1")
    subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, timeout=120)
    assert marker.is_file()
    marker.unlink()
    evil_tok = custom_code_tokenizer(tiny_tokenizer_dir, tmp_path / "evil-tok", marker)
    code = f"from transformers import AutoTokenizer; AutoTokenizer.from_pretrained({str(evil_tok)!r}, trust_remote_code=True)"
    subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, timeout=120)
    assert marker.is_file()
    shutil.rmtree(tmp_path / "modules", ignore_errors=True)


def test_every_loader_checks_even_past_validation(tiny_model_dir, tiny_tokenizer_dir, tmp_path, marker, no_prompt):
    """Settings built without validation (selftest, tools) still meet the check where the load happens."""
    evil = custom_code_model(tiny_model_dir, tmp_path / "evil", marker)
    cfg = ModelSettings.model_construct(path=evil, init=None, method="full", attention="sdpa", lora=None, tokenizer=None)
    tok = tokenizer.load_tokenizer(tiny_tokenizer_dir)
    for call in (
        lambda: load.build_model(cfg, tok, 0, torch.device("cpu"), False),
        lambda: load.build_model_skeleton(cfg, tok, None, False),
        lambda: load.decoder_start_token_id(cfg, tok),
        lambda: tokenizer.load_tokenizer(evil),
        lambda: resolve.resolve_source(evil),
    ):
        with pytest.raises(CustomCodeError, match=rf"{evil} needs custom code"):
            call()
