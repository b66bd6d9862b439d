"""Model, tokenizer and adapter directories that carry code of their own (``auto_map``), for the tests that
trainforge never runs it. Each ``.py`` file they hold writes ``marker`` the moment it is imported; a test
checks that the marker never appears.

Import the builders: ``from hostile_dirs import custom_code_model, ...`` (tests/ is on the path).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

# the first thing each hostile module does: leave proof that it ran
_PAYLOAD = "from pathlib import Path\nPath({marker!r}).write_text('the directory\\'s code ran')\n"

_CONFIG_CODE = _PAYLOAD + (
    "from transformers import LlamaConfig\n\n\n"
    "class EvilConfig(LlamaConfig):\n"
    "    model_type = 'evil'\n"
)
_MODEL_CODE = _PAYLOAD + (
    "from transformers import LlamaForCausalLM\n"
    "from .configuration_evil import EvilConfig\n\n\n"
    "class EvilForCausalLM(LlamaForCausalLM):\n"
    "    config_class = EvilConfig\n"
)
_TOKENIZER_CODE = _PAYLOAD + (
    "from transformers import PreTrainedTokenizerFast\n\n\n"
    "class EvilTokenizerFast(PreTrainedTokenizerFast):\n"
    "    pass\n"
)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data, indent=2))


def custom_code_model(model_dir: Path, dst: Path, marker: Path) -> Path:
    """``model_dir`` (config, weights, tokenizer) made into ``"model_type": "evil"`` with an ``auto_map`` into
    its own configuration_evil.py and modeling_evil.py."""
    _copy(model_dir, dst)
    _edit_json(
        dst / "config.json",
        model_type="evil",
        architectures=["EvilForCausalLM"],
        auto_map={"AutoConfig": "configuration_evil.EvilConfig", "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"},
    )
    (dst / "configuration_evil.py").write_text(_CONFIG_CODE.format(marker=str(marker)))
    (dst / "modeling_evil.py").write_text(_MODEL_CODE.format(marker=str(marker)))
    return dst


def custom_code_tokenizer(tokenizer_dir: Path, dst: Path, marker: Path) -> Path:
    """``tokenizer_dir`` whose tokenizer_config.json maps AutoTokenizer to its own tokenization_evil.py
    (a model directory works too: its config.json stays as it is)."""
    _copy(tokenizer_dir, dst)
    _edit_json(
        dst / "tokenizer_config.json",
        tokenizer_class="EvilTokenizerFast",
        auto_map={"AutoTokenizer": [None, "tokenization_evil.EvilTokenizerFast"]},
    )
    (dst / "tokenization_evil.py").write_text(_TOKENIZER_CODE.format(marker=str(marker)))
    return dst


def unknown_architecture(model_dir: Path, dst: Path) -> Path:
    """``model_dir`` with a ``model_type`` transformers does not know, and no ``auto_map``."""
    _copy(model_dir, dst)
    _edit_json(dst / "config.json", model_type="mystery")
    return dst


def adapter_on(base: Path, dst: Path) -> Path:
    """A LoRA adapter directory whose ``base_model_name_or_path`` is ``base`` (its weights are a stub:
    nothing may get as far as reading them)."""
    dst.mkdir(parents=True)
    (dst / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "task_type": "CAUSAL_LM",
                "base_model_name_or_path": str(base),
                "r": 4,
                "lora_alpha": 8,
                "target_modules": ["q_proj", "v_proj"],
            }
        )
    )
    (dst / "adapter_model.safetensors").write_bytes(b"\0" * 16)
    return dst


def damaged_weights(model_dir: Path, dst: Path, damage: str) -> Path:
    """``model_dir`` whose weights are damaged: ``header`` (bytes 8-40 of model.safetensors overwritten), ``empty``
    (model.safetensors of 0 bytes) or ``shard`` (split into two indexed shards, the second's header overwritten)."""
    _copy(model_dir, dst)
    weights = dst / "model.safetensors"
    if damage == "shard":
        from safetensors.torch import load_file, save_file

        tensors = load_file(weights)
        weights.unlink()
        names = sorted(tensors)
        shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
        for shard, keys in shards.items():
            save_file({k: tensors[k] for k in keys}, dst / shard)
        weight_map = {k: shard for shard, keys in shards.items() for k in keys}
        (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
        weights = dst / "model-00002-of-00002.safetensors"
    if damage == "empty":
        weights.write_bytes(b"")
    else:
        with open(weights, "r+b") as f:
            f.seek(8)
            f.write(b"\xff" * 32)
    return weights


class _RunsCode:
    """Unpickled, it would call ``Path(marker).write_text``: the payload a weights-only loader must refuse."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (Path(self.marker), "the weights' pickle ran"))


def pickled_weights(model_dir: Path, dst: Path, marker: Path) -> Path:
    """``model_dir`` whose only weights are a pytorch_model.bin that, besides its tensors, pickles a call writing
    ``marker``; returns that file."""
    import torch
    from safetensors.torch import load_file

    _copy(model_dir, dst)
    tensors = load_file(dst / "model.safetensors")
    (dst / "model.safetensors").unlink()
    torch.save({**tensors, "payload": _RunsCode(marker)}, dst / "pytorch_model.bin")
    return dst / "pytorch_model.bin"
