"""Reading a Hugging Face model directory (hf_dir): a model's kind, read once per version of its config.json."""

from __future__ import annotations

import json
import os

from trainforge import hf_dir
from trainforge.config.run import ModelSettings, RunConfig


def write(path, name, data) -> None:
    (path / name).write_text(json.dumps(data))


def test_config_json_is_parsed_once_per_version(tmp_path):
    write(tmp_path, "config.json", {"model_type": "t5"})
    reads = hf_dir._read_json.cache_info().misses
    for _ in range(5):
        assert hf_dir.model_kind(tmp_path) == hf_dir.ModelKind("t5", True)
        assert hf_dir.read_config(tmp_path)["model_type"] == "t5"
    assert hf_dir._read_json.cache_info().misses == reads + 1
    # a rewrite is a new version (another size, mtime or inode), read again
    write(tmp_path, "config.json", {"model_type": "llama", "is_encoder_decoder": False})
    stamp = (tmp_path / "config.json").stat().st_mtime_ns
    os.utime(tmp_path / "config.json", ns=(stamp + 10**9, stamp + 10**9))
    assert hf_dir.model_kind(tmp_path) == hf_dir.ModelKind("llama", False)
    assert hf_dir._read_json.cache_info().misses == reads + 2


def test_read_config_hands_out_copies(tmp_path):
    write(tmp_path, "config.json", {"model_type": "llama", "num_hidden_layers": 2})
    hf_dir.read_config(tmp_path)["num_hidden_layers"] = 99
    assert hf_dir.read_config(tmp_path)["num_hidden_layers"] == 2


def test_kinds_of_adapters_unreadable_and_missing_configs(tmp_path):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    write(adapter, "adapter_config.json", {"task_type": "SEQ_2_SEQ_LM"})
    assert hf_dir.model_kind(adapter) == hf_dir.ModelKind(None, True)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    assert hf_dir.model_kind(broken) == hf_dir.ModelKind(None, False) and hf_dir.read_config(broken) == {}
    assert hf_dir.model_kind(tmp_path / "missing") == hf_dir.ModelKind(None, False)
    assert hf_dir.init_kind({"architecture": "bart"}) == hf_dir.ModelKind("bart", True)
    assert hf_dir.init_kind({"architecture": "t5", "is_encoder_decoder": False}) == hf_dir.ModelKind("t5", False)


def test_the_resolved_config_carries_the_kind(tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_text(json.dumps({"source": "a", "target": "b"}) + "\n")
    cfg = RunConfig.model_validate({"model": {"init": {"architecture": "t5", "d_model": 32}},
                                    "data": {"train": str(train), "max_length": 16, "max_target_length": 8}})
    assert cfg.model.kind == hf_dir.ModelKind("t5", True) and cfg.row_tokens() == 16 + 8
    assert cfg.data.packing is False and "packing" in cfg.data.model_fields_set  # resolved on the input
    plain = ModelSettings(init={"architecture": "llama", "hidden_size": 32})
    assert plain.kind == hf_dir.ModelKind("llama", False)


def test_training_from_an_adapter_directory_says_to_merge_it_first(tmp_path, tiny_model_dir, toy_data_dir):
    """model.path at a LoRA run's final/ (adapter_config.json, no config.json), as when DPO follows a LoRA SFT run:
    train and plan once ended in transformers' traceback ("Unrecognized model ... model_type"), exit 1."""
    import shutil

    import pytest
    from conftest import finetune_settings

    from trainforge.engine.trainer import train
    from trainforge.errors import EXIT_BAD_INPUT, TrainforgeError

    adapter = tmp_path / "sft" / "final"
    adapter.mkdir(parents=True)
    write(adapter, "adapter_config.json", {"peft_type": "LORA", "base_model_name_or_path": str(tiny_model_dir)})
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / name, adapter / name)
    settings = finetune_settings(tiny_model_dir, toy_data_dir)
    settings["model"] = {"path": str(adapter), "method": "lora"}
    with pytest.raises(hf_dir.AdapterNotModel) as e:
        train(RunConfig.model_validate(settings), tmp_path / "dpo")
    assert isinstance(e.value, TrainforgeError) and e.value.exit_code == EXIT_BAD_INPUT
    assert str(e.value) == (
        f"model.path: {adapter} is a PEFT adapter (adapter_config.json, no config.json), not a model to train from; "
        f"merge it into its base first, `trainforge export {adapter} --merge --out DIR`, and set model.path: DIR"
    )
    assert not (tmp_path / "dpo").exists()
