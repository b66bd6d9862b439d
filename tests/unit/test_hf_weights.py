"""hf_weights.check_weights: what a model directory's weight files must be before anything loads them."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from hostile_dirs import damaged_weights, pickled_weights
from safetensors.torch import load_file

from trainforge.hf_weights import DamagedWeights, check_weights, weight_files


def test_sound_weights_pass_safetensors_shards_and_plain_bin_alike(tmp_path, tiny_model_dir):
    check_weights(tiny_model_dir)
    sharded = tmp_path / "sharded"
    damaged_weights(tiny_model_dir, sharded, "shard")
    second = sharded / "model-00002-of-00002.safetensors"
    shutil.copy(tiny_model_dir / "model.safetensors", second)  # a sound header again (the index is not compared)
    check_weights(sharded)
    assert [f.name for f in weight_files(sharded)] == ["model-00001-of-00002.safetensors", second.name]

    plain = tmp_path / "bin"
    shutil.copytree(tiny_model_dir, plain)
    torch.save(load_file(plain / "model.safetensors"), plain / "pytorch_model.bin")
    (plain / "model.safetensors").unlink()
    check_weights(plain)  # tensors only: the weights-only loader takes it


def test_safetensors_beside_a_pickle_are_what_loads_so_only_they_are_checked(tmp_path, tiny_model_dir):
    both = tmp_path / "both"
    pickled_weights(tiny_model_dir, both, tmp_path / "ran")
    shutil.copy(tiny_model_dir / "model.safetensors", both / "model.safetensors")
    assert weight_files(both) == [both / "model.safetensors"]  # from_pretrained prefers safetensors
    check_weights(both)
    assert not (tmp_path / "ran").exists()


@pytest.mark.parametrize("damage", ["header", "empty", "shard"])
def test_damaged_safetensors_are_named(tmp_path, tiny_model_dir, damage):
    bad = damaged_weights(tiny_model_dir, tmp_path / "m", damage)
    with pytest.raises(DamagedWeights, match="is empty" if damage == "empty" else "corrupt header") as e:
        check_weights(tmp_path / "m", "model.path")
    assert str(e.value).startswith(f"model.path: {bad}: ")


def test_a_pickle_that_needs_code_is_refused_without_running_it(tmp_path, tiny_model_dir):
    marker = tmp_path / "ran"
    bad = pickled_weights(tiny_model_dir, tmp_path / "m", marker)
    with pytest.raises(DamagedWeights, match="holds pickled objects; refused") as e:
        check_weights(tmp_path / "m")
    assert str(bad) in str(e.value) and "safetensors" in str(e.value)
    assert not marker.exists()


def test_an_index_that_does_not_parse_or_names_a_missing_shard_is_named(tmp_path, tiny_model_dir):
    model = tmp_path / "m"
    damaged_weights(tiny_model_dir, model, "shard")
    index = model / "model.safetensors.index.json"
    (model / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(DamagedWeights, match="names the shard model-00002-of-00002.safetensors, which .* lacks"):
        check_weights(model)
    index.write_text(json.dumps({"weight_map": {"a": "../elsewhere.safetensors"}}))
    with pytest.raises(DamagedWeights, match="not a file of the directory"):
        check_weights(model)
    index.write_text("[1, 2")
    with pytest.raises(DamagedWeights, match=f"{index}: cannot be read"):
        check_weights(model)


def test_a_bin_that_is_no_checkpoint_is_damaged_not_pickled_objects(tmp_path, tiny_model_dir):
    bad = pickled_weights(tiny_model_dir, tmp_path / "m", tmp_path / "ran")
    bad.write_bytes(b"F" * 100)  # an opcode the unpickler does not know: no object is named
    with pytest.raises(DamagedWeights, match=r"cannot be read as torch weights \(.*\); download or save the model"):
        check_weights(tmp_path / "m")
