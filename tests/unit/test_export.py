"""``trainforge export``: LoRA / DoRA / QLoRA adapters merged into a plain model whose logits equal
the adapter model's; copies without --merge; refusals that name what is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from rich.console import Console

from trainforge.metrics.console import ConsoleReporter
from trainforge.model.resolve import ModelSourceError
from trainforge.tools.export import export

QUIET = ConsoleReporter(Console(quiet=True))


def _ids(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 300, (2, 24), generator=g)


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits.float()


def make_adapter(base_dir: Path, out: Path, use_dora: bool = False, quantized: bool = False) -> Path:
    """A LoRA adapter on ``base_dir`` whose B matrices are not zero (so merging changes the weights);
    an encoder-decoder base (T5, BART) gets a SEQ_2_SEQ_LM adapter."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoTokenizer

    from trainforge.config.run import dir_is_encoder_decoder
    from trainforge.model.load import auto_model_class

    extra = {}
    if quantized:
        from trainforge.model.load import nf4_config

        extra["quantization_config"] = nf4_config(torch.float32)
    seq2seq = dir_is_encoder_decoder(Path(base_dir))
    base = auto_model_class(seq2seq).from_pretrained(base_dir, dtype=torch.float32, **extra)
    task = "SEQ_2_SEQ_LM" if seq2seq else "CAUSAL_LM"
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", use_dora=use_dora, task_type=task)
    model = get_peft_model(base, config)
    torch.manual_seed(7)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0.0, 0.05)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(base_dir).save_pretrained(out)
    return out


def make_qlora_run(base_dir: Path, run: Path) -> Path:
    """A QLoRA run directory as training leaves it: the adapter in final/, its config and summary."""
    make_adapter(base_dir, run / "final", quantized=True)
    (run / "config.yaml").write_text(yaml.safe_dump({"model": {"path": str(base_dir), "method": "qlora"}}))
    (run / "summary.json").write_text(json.dumps({"precision": "fp32"}))
    return run


def _adapter_model(base_dir: Path, adapter: Path) -> torch.nn.Module:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter)


@pytest.mark.parametrize("use_dora", [False, True], ids=["lora", "dora"])
def test_merged_logits_equal_the_adapter_models(tmp_path, tiny_model_dir, use_dora):
    from transformers import AutoModelForCausalLM

    adapter = make_adapter(tiny_model_dir, tmp_path / "adapter", use_dora=use_dora)
    out = tmp_path / "merged"
    result = export(adapter, out, merge=True, dtype=None, reporter=QUIET)
    assert result["kind"] == "merged" and result["dtype"] == "fp32"  # the tiny base is stored in fp32

    names = {p.name for p in out.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= names, names
    assert not names & {"adapter_config.json", "adapter_model.safetensors"}, names
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "float32"

    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert not hasattr(merged, "peft_config")
    ids = _ids()
    reference = _logits(_adapter_model(tiny_model_dir, adapter), ids)
    base = _logits(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32), ids)
    assert (reference - base).abs().max() > 1e-3, "the adapter must change the model for this test to mean anything"
    torch.testing.assert_close(_logits(merged, ids), reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype,torch_dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_merge_in_half_precision_within_its_tolerance(tmp_path, tiny_model_dir, dtype, torch_dtype):
    from transformers import AutoModelForCausalLM

    adapter = make_adapter(tiny_model_dir, tmp_path / "adapter")
    out = tmp_path / "merged"
    assert export(adapter, out, merge=True, dtype=dtype, reporter=QUIET)["dtype"] == dtype
    merged = AutoModelForCausalLM.from_pretrained(out)
    assert merged.dtype == torch_dtype
    assert all(p.dtype == torch_dtype for p in merged.parameters())
    ids = _ids(1)
    reference = _logits(_adapter_model(tiny_model_dir, adapter), ids)
    got = _logits(merged, ids)
    eps = torch.finfo(torch_dtype).eps  # bf16: 2^-7, fp16: 2^-10, relative rounding of each weight and activation
    torch.testing.assert_close(got, reference, atol=8 * eps * reference.abs().max().item(), rtol=0.0)


def test_qlora_merges_into_the_dequantized_base(tmp_path, tiny_model_dir):
    """A QLoRA run's adapter is merged into the NF4 base it trained on, dequantized: the merged
    model computes what the QLoRA model computed, not what the adapter on the original base would."""
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM

    from trainforge.hardware.device import PRECISIONS
    from trainforge.model.resolve import load_model, resolve_source

    run = make_qlora_run(tiny_model_dir, tmp_path / "run")

    out = tmp_path / "merged"
    export(run, out, merge=True, dtype="fp32", reporter=QUIET)
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = _ids(2)
    qlora = _logits(load_model(resolve_source(run), torch.device("cpu"), PRECISIONS["fp32"]), ids)
    torch.testing.assert_close(_logits(merged, ids), qlora, atol=1e-4, rtol=1e-4)
    on_original = _logits(_adapter_model(tiny_model_dir, run / "final"), ids)
    assert (on_original - qlora).abs().max() > 1e-3  # the quantization error is real: merging into the original would differ


def test_without_merge_copies_the_adapter_with_its_tokenizer(tmp_path, tiny_model_dir):
    adapter = make_adapter(tiny_model_dir, tmp_path / "adapter")
    for p in adapter.glob("tokenizer*"):
        p.unlink()  # the tokenizer lives with the base only: export brings it along
    out = tmp_path / "copy"
    result = export(adapter, out, merge=False, dtype=None, reporter=QUIET)
    assert result["kind"] == "adapter"
    names = {p.name for p in out.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= names, names
    assert (out / "adapter_model.safetensors").read_bytes() == (adapter / "adapter_model.safetensors").read_bytes()


def test_a_full_model_exports_as_a_plain_directory_in_the_asked_dtype(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "full"
    result = export(tiny_model_dir, out, merge=True, dtype="bf16", reporter=QUIET)  # nothing to merge: written as is
    assert result["kind"] == "full"
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16
    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    for (name, a), (_, b) in zip(model.named_parameters(), original.named_parameters()):
        assert torch.equal(a, b.to(torch.bfloat16)), name
    assert {p.stat().st_mode & 0o777 for p in out.glob("*.safetensors")} == {(out / "config.json").stat().st_mode & 0o777}


def test_refusals_name_the_problem(tmp_path, tiny_model_dir):
    adapter = make_adapter(tiny_model_dir, tmp_path / "adapter")
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "x").write_text("keep me")
    with pytest.raises(ModelSourceError, match="not an empty directory"):
        export(adapter, taken, merge=True, dtype=None, reporter=QUIET)
    assert (taken / "x").read_text() == "keep me"
    with pytest.raises(ModelSourceError, match="--dtype"):
        export(adapter, tmp_path / "a", merge=False, dtype="bf16", reporter=QUIET)
    with pytest.raises(ModelSourceError, match="--dtype 'int4'"):
        export(adapter, tmp_path / "b", merge=True, dtype="int4", reporter=QUIET)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "no temporary directory left behind"


def test_a_runs_chat_template_travels_with_final_and_its_export(tmp_path, tiny_model_dir, toy_data_dir):
    """A run that trained chats with data.chat_template saved final/ with a tokenizer that had none: the exported
    model (a plain HF directory for transformers, vLLM, ...) then failed apply_chat_template or rendered chats
    unlike training."""
    from conftest import finetune_settings, toy_prompt_completions, write_jsonl
    from transformers import AutoTokenizer

    from trainforge.config.run import RunConfig
    from trainforge.engine.trainer import train

    template = (Path(__file__).parents[1] / "fixtures" / "chat_templates" / "HuggingFaceH4-zephyr-7b-beta.jinja").read_text()
    chats = [{"messages": [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["completion"]}]}
             for r in toy_prompt_completions(40)]
    settings = finetune_settings(tiny_model_dir, toy_data_dir)
    settings["data"] = {"train": str(write_jsonl(tmp_path / "chats.jsonl", chats)), "eval": None, "max_length": 64,
                        "chat_template": template}
    settings["train"]["max_steps"] = 1
    train(RunConfig.model_validate(settings), tmp_path / "run", QUIET)
    out = tmp_path / "merged"
    export(tmp_path / "run", out, merge=True, dtype=None, reporter=QUIET)
    for directory in (tmp_path / "run" / "final", out):
        assert AutoTokenizer.from_pretrained(directory).chat_template == template


def test_a_chat_run_on_a_tokenizer_without_a_template_saves_the_default_it_trained_with(tmp_path, tiny_model_dir, toy_data_dir):
    """Chats on a base tokenizer without a chat template train with trainforge's ChatML default; final/ and its
    export had no template, so ``apply_chat_template`` raised (and vLLM rendered no turns) for the chat model
    just trained. They carry the default now, rendering as training did; ``generate --chat`` on final/ still
    stops at the default's end-of-turn text. A text run on the same tokenizer gets no template."""
    from conftest import finetune_settings, toy_prompt_completions, write_jsonl
    from transformers import AutoTokenizer

    from trainforge.config.run import RunConfig
    from trainforge.data.formats import DEFAULT_CHAT_TEMPLATE
    from trainforge.engine.trainer import train
    from trainforge.model.resolve import resolve_source
    from trainforge.tools.generate import chat_template

    assert AutoTokenizer.from_pretrained(tiny_model_dir).chat_template is None
    chats = [{"messages": [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["completion"]}]}
             for r in toy_prompt_completions(40)]
    settings = finetune_settings(tiny_model_dir, toy_data_dir)
    settings["data"] = {"train": str(write_jsonl(tmp_path / "chats.jsonl", chats)), "eval": None, "max_length": 64}
    settings["train"]["max_steps"] = 1
    train(RunConfig.model_validate(settings), tmp_path / "run", QUIET)
    out = tmp_path / "merged"
    export(tmp_path / "run", out, merge=True, dtype=None, reporter=QUIET)
    turns = [{"role": "user", "content": "continue: alpha"}]
    for directory in (tmp_path / "run" / "final", out):
        tok = AutoTokenizer.from_pretrained(directory)
        assert tok.chat_template == DEFAULT_CHAT_TEMPLATE
        assert tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=True) == (
            "<|im_start|>user\ncontinue: alpha<|im_end|>\n<|im_start|>assistant\n")
    src = resolve_source(tmp_path / "run")
    assert chat_template(src, AutoTokenizer.from_pretrained(tmp_path / "run" / "final")) == (DEFAULT_CHAT_TEMPLATE, ["<|im_end|>"])

    settings["data"] = {"train": str(toy_data_dir / "text_train.jsonl"), "eval": None, "max_length": 64}
    train(RunConfig.model_validate(settings), tmp_path / "text-run", QUIET)
    assert AutoTokenizer.from_pretrained(tmp_path / "text-run" / "final").chat_template is None
