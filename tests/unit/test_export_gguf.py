"""``trainforge export --format gguf``, checked by independent readers: transformers' GGUF loader
(``from_pretrained(dir, gguf_file=...)``) and gguf-py's ``GGUFReader`` read the file back; the weights,
logits, tokenizer ids and chat template must be the exported model's.

Tolerances. f16: every weight read back equals the model's weight rounded to f16 exactly (the Q/K
permutation round trip included), so the logits equal those of the model with f16-rounded weights to fp32
accumulation noise (1e-5), and the original fp32 model's within 8 f16 epsilons (2^-10 each) of the largest
logit: a weight's relative rounding is at most 2^-11, and on these 2-layer models a handful of roundings add
up. q8_0: every weight read back is within one quantization step (its 32-block's max |w| / 127) of the
original; the logits were measured at 0.84% of the largest logit on a tiny Llama (seed-fixed), asserted
under 3% (docs/export.md)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from rich.console import Console

pytest.importorskip("gguf")

from trainforge.data.formats import DEFAULT_CHAT_TEMPLATE
from trainforge.metrics.console import ConsoleReporter
from trainforge.model.tokenizer import load_tokenizer
from trainforge.tools.export_gguf import export_gguf
from trainforge.tools.gguf_model import GGUFExportError, llama3_rope_factors

QUIET = ConsoleReporter(Console(quiet=True))
F16_EPS = 2.0**-10
Q8_BOUND = 0.03  # of the largest |logit|; measured 0.0084 on a tiny Llama
TEXTS = ["héllo wörld, naïve café — 日本語 🙂", "def f(x):\n    return {'a': x ** 2}  # ok\n", "  two  spaces\tand\n\nlines"]
TURNS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "continue: alpha beta"},
         {"role": "assistant", "content": "gamma delta"}, {"role": "user", "content": "and then?"}]


def _config(family: str, vocab: int, tok) -> object:
    from transformers import AutoConfig

    shape = {"vocab_size": vocab, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "max_position_embeddings": 256, "eos_token_id": tok.eos_token_id,
             "pad_token_id": tok.pad_token_id, "rms_norm_eps": 1e-5}
    # Qwen3: an explicit head width (written as attention.key_length); transformers' reader ignores that key and
    # takes Qwen3Config's default 128, so the test model uses 128 for the round trip to mean anything
    extra = {"llama": {"rope_theta": 50000.0}, "mistral": {"sliding_window": None},
             "qwen2": {"tie_word_embeddings": True}, "qwen3": {"head_dim": 128, "tie_word_embeddings": True},
             "phi3": {"num_key_value_heads": 4, "pad_token_id": tok.pad_token_id}}[family]
    return AutoConfig.for_model(family, **{**shape, **extra})


def make_model(tmp: Path, tokenizer_dir: Path, family: str = "llama", template: str | None = None) -> Path:
    """A tiny seed-fixed model of ``family`` with the trained BPE tokenizer (and a chat template)."""
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer(tokenizer_dir)
    if template is not None:
        tok.chat_template = template
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(_config(family, len(tok), tok))
    with torch.no_grad():  # norms away from 1 and biases away from 0, so a misplaced one shows in the logits
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.2)
    out = tmp / family
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _read_back(path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits.float()


def _fields(path: Path) -> dict:
    from gguf import GGUFReader

    reader = GGUFReader(path)
    return {name: field.contents() for name, field in reader.fields.items()} | {"tensors": [t.name for t in reader.tensors]}


def _ids(vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "phi3"])
def test_f16_reads_back_with_the_models_weights_logits_tokens_and_template(tmp_path, tiny_tokenizer_dir, family):
    from transformers import AutoModelForCausalLM

    model_dir = make_model(tmp_path, tiny_tokenizer_dir, family, DEFAULT_CHAT_TEMPLATE)
    out = tmp_path / "model.gguf"
    result = export_gguf(model_dir, out, "f16", None, QUIET)
    original = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    back, back_tok = _read_back(out)
    # Mistral is llama.cpp's llama architecture: it reads back as the Llama model it is (same weights and names)
    assert type(back).__name__ == {"mistral": "LlamaForCausalLM"}.get(family, type(original).__name__), result

    own = original.state_dict()
    for name, weight in back.state_dict().items():  # Q/K un-permuted exactly: equal to the f16-rounded weight
        expected = own[name].half().float() if own[name].ndim > 1 else own[name]
        assert torch.equal(weight, expected), name

    ids = _ids(original.config.vocab_size)
    reference = _logits(original, ids)
    rounded = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in rounded.parameters():
            if p.ndim > 1:
                p.copy_(p.half().float())
    got = _logits(back, ids)
    torch.testing.assert_close(got, _logits(rounded, ids), atol=1e-5, rtol=0)
    torch.testing.assert_close(got, reference, atol=8 * F16_EPS * reference.abs().max().item(), rtol=0)

    tok = load_tokenizer(model_dir)
    chat = tok.apply_chat_template(TURNS, tokenize=False, add_generation_prompt=True)
    for text in [*TEXTS, chat]:
        assert back_tok(text, add_special_tokens=False)["input_ids"] == tok(text, add_special_tokens=False)["input_ids"], text
    assert back_tok.chat_template == DEFAULT_CHAT_TEMPLATE
    assert back_tok.eos_token_id == tok.eos_token_id

    meta = _fields(out)
    arch = meta["general.architecture"]
    assert arch == {"mistral": "llama"}.get(family, family)
    config = original.config
    assert meta[f"{arch}.context_length"] == 256 and meta[f"{arch}.block_count"] == 2
    assert meta[f"{arch}.attention.head_count"] == 4
    assert meta[f"{arch}.attention.head_count_kv"] == config.num_key_value_heads
    assert meta[f"{arch}.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-5)
    assert meta[f"{arch}.rope.freq_base"] == pytest.approx(config.rope_parameters["rope_theta"])
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == "gpt-2"
    assert meta["tokenizer.ggml.eos_token_id"] == tok.eos_token_id and meta["tokenizer.chat_template"] == DEFAULT_CHAT_TEMPLATE
    assert ("output.weight" in meta["tensors"]) == (not config.tie_word_embeddings)


def test_q8_0_weights_within_one_step_and_logits_within_the_measured_bound(tmp_path, tiny_tokenizer_dir):
    from transformers import AutoModelForCausalLM

    model_dir = make_model(tmp_path, tiny_tokenizer_dir, "qwen2")
    out = tmp_path / "model.gguf"
    export_gguf(model_dir, out, "q8_0", None, QUIET)
    assert _fields(out)["general.file_type"] == 7  # LlamaFileType.MOSTLY_Q8_0
    original = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    back, _ = _read_back(out)
    own = original.state_dict()
    for name, weight in back.state_dict().items():
        if own[name].ndim < 2:
            assert torch.equal(weight, own[name]), name  # vectors stay f32
            continue
        blocks = own[name].reshape(-1, 32)
        step = blocks.abs().amax(dim=1, keepdim=True) / 127  # one quantization step of each 32-weight block
        err = (weight.reshape(-1, 32) - blocks).abs()
        assert bool((err <= step * 1.01 + 1e-8).all()), name
        assert err.max() > 0, "q8_0 must actually quantize"
    ids = _ids(original.config.vocab_size, 1)
    reference = _logits(original, ids)
    gap = (_logits(back, ids) - reference).abs().max().item() / reference.abs().max().item()
    assert 0 < gap < Q8_BOUND, gap


def test_bf16_weights_are_the_bf16_rounded_weights(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "model.gguf"
    export_gguf(tiny_model_dir, out, "bf16", None, QUIET)
    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).state_dict()
    back, _ = _read_back(out)
    for name, weight in back.state_dict().items():
        expected = original[name].bfloat16().float() if original[name].ndim > 1 else original[name]
        assert torch.equal(weight, expected), name


def test_a_qlora_run_exports_its_dequantized_merge(tmp_path, tiny_model_dir):
    """QLoRA: the GGUF computes what the QLoRA model computed (the adapter merged into the NF4 base it
    trained on, dequantized once), within f16 rounding."""
    pytest.importorskip("bitsandbytes")
    from test_export import make_qlora_run

    from trainforge.hardware.device import PRECISIONS
    from trainforge.model.resolve import load_model, resolve_source

    run = make_qlora_run(tiny_model_dir, tmp_path / "run")
    out = tmp_path / "qlora.gguf"
    export_gguf(run, out, "f16", None, QUIET)
    back, _ = _read_back(out)
    ids = _ids(300, 2)
    qlora = _logits(load_model(resolve_source(run), torch.device("cpu"), PRECISIONS["fp32"]), ids)
    torch.testing.assert_close(_logits(back, ids), qlora, atol=8 * F16_EPS * qlora.abs().max().item(), rtol=0)


def test_refusals_come_before_any_work(tmp_path, tiny_model_dir):
    from transformers import GPT2Config, GPT2LMHeadModel

    tok = load_tokenizer(tiny_model_dir)
    gpt2 = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=2)).save_pretrained(gpt2)
    tok.save_pretrained(gpt2)
    with pytest.raises(GGUFExportError, match=r"model_type 'gpt2'.*llama, mistral, phi3, qwen2, qwen3"):
        export_gguf(gpt2, tmp_path / "a.gguf", "f16", None, QUIET)
    with pytest.raises(GGUFExportError, match=r"--quant 'q4_k'.*f16, bf16, q8_0"):
        export_gguf(tiny_model_dir, tmp_path / "b.gguf", "q4_k", None, QUIET)
    taken = tmp_path / "taken.gguf"
    taken.write_bytes(b"keep me")
    with pytest.raises(GGUFExportError, match="already exists"):
        export_gguf(tiny_model_dir, taken, "f16", None, QUIET)
    assert taken.read_bytes() == b"keep me"
    (tmp_path / "ollama").mkdir()
    (tmp_path / "ollama" / "Modelfile").write_text("mine")
    with pytest.raises(GGUFExportError, match="already holds a Modelfile"):
        export_gguf(tiny_model_dir, tmp_path / "c.gguf", "f16", tmp_path / "ollama", QUIET)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpt2", "ollama", "taken.gguf"]  # nothing half-written


def test_pre_tokenizer_names_follow_the_split_regex():
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    from trainforge.tools.gguf_vocab import _pre_name, _split_regex

    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}
    assert _pre_name(*_split_regex(byte_level)) == "gpt-2"
    qwen = {"type": "Sequence", "pretokenizers": [{"type": "Split", "pattern": {"Regex": PRETOKENIZE_REGEX}},
                                                  {"type": "ByteLevel", "use_regex": False}]}
    assert _pre_name(*_split_regex(qwen)) == "qwen2"
    odd = {"type": "Sequence", "pretokenizers": [{"type": "Split", "pattern": {"Regex": r"\w+"}},
                                                 {"type": "ByteLevel", "use_regex": False}]}
    assert _pre_name(*_split_regex(odd)) is None


def test_llama3_rope_factors_are_transformers_frequency_ratios():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    config = LlamaConfig(hidden_size=512, num_attention_heads=4, rope_parameters=rope, max_position_embeddings=131072)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    dim = 128
    plain = 1.0 / (500000.0 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    np.testing.assert_allclose(llama3_rope_factors(config), (plain / scaled.double()).numpy(), rtol=1e-5)


LLAMA3_TEMPLATE = (  # Meta-Llama-3-8B-Instruct's template
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)


def _render(tok, template: str):
    return lambda messages, gen: tok.apply_chat_template(messages, chat_template=template, tokenize=False,
                                                         add_generation_prompt=gen)


def test_modelfile_for_a_chatml_template(tmp_path, tiny_tokenizer_dir):
    from trainforge.tools.export_ollama import ollama_files

    tok = load_tokenizer(tiny_tokenizer_dir)
    text, warnings = ollama_files(tmp_path / "out" / "m.gguf", tmp_path / "ollama", _render(tok, DEFAULT_CHAT_TEMPLATE), None, False)
    assert warnings == []
    assert text == (
        "FROM ../out/m.gguf\n"
        'TEMPLATE """{{ range .Messages }}'
        '{{ if eq .Role "system" }}<|im_start|>system\n{{ .Content }}<|im_end|>\n'
        '{{ else if eq .Role "user" }}<|im_start|>user\n{{ .Content }}<|im_end|>\n'
        '{{ else if eq .Role "assistant" }}<|im_start|>assistant\n{{ .Content }}<|im_end|>\n'
        '{{ end }}{{ end }}<|im_start|>assistant\n"""\n'
        'PARAMETER stop "<|im_end|>"\n'
    )


def test_modelfile_for_a_llama3_template_drops_the_bos_llama_cpp_adds(tmp_path, tiny_tokenizer_dir):
    from trainforge.tools.export_ollama import chat_shape, ollama_files

    tok = load_tokenizer(tiny_tokenizer_dir)
    tok.bos_token = "<|begin_of_text|>"
    render = _render(tok, LLAMA3_TEMPLATE)
    text, warnings = ollama_files(tmp_path / "m.gguf", tmp_path, render, tok.bos_token, True)
    assert warnings == []
    header = "<|start_header_id|>{role}<|end_header_id|>\n\n"
    branches = "".join(f'{{{{ {kw} eq .Role "{r}" }}}}{header.format(role=r)}{{{{ .Content }}}}<|eot_id|>'
                       for kw, r in (("if", "system"), ("else if", "user"), ("else if", "assistant")))
    assert text == (f'FROM ./m.gguf\nTEMPLATE """{{{{ range .Messages }}}}{branches}{{{{ end }}}}{{{{ end }}}}'
                    f'{header.format(role="assistant")}"""\nPARAMETER stop "<|eot_id|>"\n')
    shape = chat_shape(render, tok.bos_token)  # the shape reproduces the Jinja rendering, BOS included
    assert shape.render(TURNS, True) == render(TURNS, True)
    kept, _ = ollama_files(tmp_path / "m.gguf", tmp_path, render, tok.bos_token, False)  # no BOS added by llama.cpp
    assert 'TEMPLATE """<|begin_of_text|>{{ range' in kept


def test_a_template_outside_the_role_content_shape_gets_no_template_and_a_warning(tmp_path, tiny_tokenizer_dir):
    from trainforge.tools.export_ollama import ollama_files

    tok = load_tokenizer(tiny_tokenizer_dir)
    fixtures = Path(__file__).parents[1] / "fixtures" / "chat_templates"
    for name in ("mistral-v3.jinja", "Qwen-Qwen2.5-7B-Instruct.jinja"):  # system moved into the last user turn; default system
        text, warnings = ollama_files(tmp_path / "m.gguf", tmp_path, _render(tok, (fixtures / name).read_text()), tok.bos_token, False)
        assert text == "FROM ./m.gguf\n" and "no TEMPLATE" in warnings[0], name
    text, warnings = ollama_files(tmp_path / "m.gguf", tmp_path, None, None, False)
    assert text == "FROM ./m.gguf\n" and "no chat template" in warnings[0]
