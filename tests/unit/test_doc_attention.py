"""Packed documents on CUDA without a row x row mask: selection, document planning, the varlen
wrapper (kernel replaced by a per-document SDPA reference on CPU) and FlexAttention's document mask."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trainforge.model import doc_attention
from trainforge.model.doc_attention import FLEX_NAME, VARLEN_NAME, choose, plan_documents

LENGTHS = [[7, 12, 1, 20, 8], [30, 18]]  # documents per row; a one-token document too
WIDTH = 48


def positions(lengths=LENGTHS, width=WIDTH) -> torch.Tensor:
    rows = []
    for row in lengths:
        pos = torch.cat([torch.arange(n) for n in row])
        rows.append(torch.cat([pos, torch.arange(width - len(pos))]))  # the rest: one padding "document"
    return torch.stack(rows)


@pytest.mark.parametrize(
    "requested, device, capability, half, varlen, expected",
    [
        ("auto", "cuda", (9, 0), True, True, VARLEN_NAME),  # H100, bf16
        ("auto", "cuda", (8, 0), True, True, VARLEN_NAME),  # A100
        ("auto", "cuda", (9, 0), False, True, FLEX_NAME),  # fp32: the flash kernel has none
        ("auto", "cuda", (7, 5), True, True, FLEX_NAME),  # T4, 2080 Ti: below sm80
        ("auto", "cuda", (9, 0), True, False, FLEX_NAME),  # a torch without varlen_attn
        ("auto", "cuda", None, True, True, FLEX_NAME),
        ("sdpa", "cuda", (9, 0), True, True, "sdpa"),  # an explicit choice passes through
        ("auto", "cpu", None, True, True, "auto"),  # CPU is the caller's (packed_sdpa)
    ],
)
def test_choose(requested, device, capability, half, varlen, expected):
    assert choose(requested, device, capability, half, varlen) == expected


def test_attention_implementation_on_cuda_never_builds_a_row_mask(monkeypatch):
    """auto on a CUDA device takes varlen or flex, never stock sdpa (its packed-row mask is row x row)."""
    from trainforge.model.load import AttentionUnavailable, attention_implementation

    cuda = torch.device("cuda")
    doc_attention.register(VARLEN_NAME)  # transformers' modules imported before CUDA is faked: they probe it on import

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for capability, half, expected in [((9, 0), True, VARLEN_NAME), ((9, 0), False, FLEX_NAME), ((7, 0), True, FLEX_NAME)]:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert attention_implementation("auto", cuda, half_precision=half) == expected
    assert attention_implementation("flex", torch.device("cpu")) == FLEX_NAME
    assert attention_implementation("auto", cuda, encoder_decoder=True) == "sdpa"
    # an encoder-decoder whose transformers class has no SDPA (was a traceback under auto)
    assert attention_implementation("auto", cuda, encoder_decoder=True, model_type="switch_transformers") == "eager"
    assert attention_implementation("auto", cuda, encoder_decoder=True, model_type="t5") == "sdpa"
    with pytest.raises(AttentionUnavailable, match="model.attention: varlen.*lacks CUDA"):
        attention_implementation("varlen", torch.device("cpu"))
    if doc_attention.has_varlen():  # asked by name where the kernel cannot run: refused before the first forward
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
        with pytest.raises(AttentionUnavailable, match="lacks bf16 or fp16"):
            attention_implementation("varlen", cuda, half_precision=False)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
        with pytest.raises(AttentionUnavailable, match="lacks an sm80\\+ GPU \\(this one is sm75\\)"):
            attention_implementation("varlen", cuda)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
        assert attention_implementation("varlen", cuda) == VARLEN_NAME


def test_config_refuses_document_kernels_for_encoder_decoders():
    from trainforge.config.run import RunConfig

    init = {"architecture": "t5", "d_model": 32, "d_kv": 8, "d_ff": 64, "num_layers": 1, "num_heads": 4}
    with pytest.raises(ValueError, match="model.attention: .*flex is for packed decoder-only rows"):
        RunConfig.model_validate({"model": {"init": init, "tokenizer": "char", "attention": "flex"}, "data": {"train": "builtin:python-functions"}})


def test_plan_documents_finds_each_document():
    plan = plan_documents(positions(), rows=2)
    lengths = [7, 12, 1, 20, 8, 0, 30, 18]  # row 0 ends in no padding (48 tokens exactly)
    expected = [n for n in lengths if n] + []
    seg = (plan.cu_seqlens[1:] - plan.cu_seqlens[:-1]).tolist()
    assert seg == expected and plan.cu_seqlens.dtype == torch.int32
    assert plan.max_len == 30 and int(plan.cu_seqlens[-1]) == 2 * WIDTH
    ids = plan.doc_ids
    assert ids[0, 0] != ids[1, 0]  # documents of different rows never share an id
    assert (ids[0, :7] == ids[0, 0]).all() and ids[0, 7] != ids[0, 6]


def test_plan_documents_splits_at_row_ends():
    """A row that continues its previous row's document still starts a document of its own."""
    pos = torch.tensor([[0, 1, 2, 3], [4, 5, 0, 1]])
    plan = plan_documents(pos, rows=2)
    assert plan.cu_seqlens.tolist() == [0, 4, 6, 8]


def reference_varlen(q, k, v, cu, max_len, scale):
    """The varlen kernel's contract, one document at a time with causal SDPA."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    bounds = cu.tolist()
    assert max_len == max(e - s for s, e in zip(bounds, bounds[1:]))
    outs = [
        F.scaled_dot_product_attention(*(x[s:e].transpose(0, 1) for x in (q, k, v)), is_causal=True, scale=scale).transpose(0, 1)
        for s, e in zip(bounds, bounds[1:])
    ]
    return torch.cat(outs)


def use_kernel(monkeypatch, kernel) -> None:
    """Stand ``kernel`` in for the flash varlen kernel (CUDA only), computing in fp32 as well as bf16/fp16."""
    monkeypatch.setattr(doc_attention, "varlen_kernel", kernel)
    monkeypatch.setattr(doc_attention, "VARLEN_DTYPES", (torch.bfloat16, torch.float16, torch.float32))


def test_an_fp32_forward_attends_per_document_without_the_half_only_kernel(monkeypatch):
    """Outside autocast with fp32 weights (the fused head's probe at set-up, an fp32 eval) the flash kernel cannot
    run: each document is attended with SDPA instead, the same logits as the documents run alone."""
    def refuse(*args):
        raise RuntimeError("FlashAttention only supports fp16 and bf16")

    monkeypatch.setattr(doc_attention, "varlen_kernel", refuse)
    doc_attention.register(VARLEN_NAME)
    model = tiny_llama(VARLEN_NAME)
    ids = torch.randint(0, 96, (2, WIDTH), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=positions(), use_cache=False).logits
        torch.testing.assert_close(packed, one_at_a_time(model, ids), atol=1e-4, rtol=1e-4)


def tiny_llama(impl: str, kv_heads: int = 2, head_dim: int = 8):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=kv_heads, max_position_embeddings=64, head_dim=head_dim,
    )
    model = AutoModelForCausalLM.from_config(config, attn_implementation=impl)
    with torch.no_grad():
        for p in model.parameters():  # attention far from uniform, so a leak across documents shows
            if p.ndim > 1:
                p.mul_(4.0)
    return model


def one_at_a_time(model, ids: torch.Tensor) -> torch.Tensor:
    """Logits of every document run alone (the padding tail too), rows concatenated."""
    out = []
    for b, row in enumerate(LENGTHS):
        starts = [sum(row[:i]) for i in range(len(row))]
        spans = list(zip(starts, row)) + ([(sum(row), WIDTH - sum(row))] if sum(row) < WIDTH else [])
        out.append(torch.cat([model(input_ids=ids[b : b + 1, s : s + n], use_cache=False).logits for s, n in spans], dim=1))
    return torch.cat(out)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_varlen_wrapper_matches_documents_run_alone(monkeypatch, kv_heads):
    """Layout, offsets and grouped-query heads of the varlen path, with the kernel replaced by its
    contract (the real kernel needs CUDA: see test_varlen_kernel_on_cuda). Gradients too."""
    use_kernel(monkeypatch, reference_varlen)
    doc_attention.register(VARLEN_NAME)
    model = tiny_llama(VARLEN_NAME, kv_heads)
    ids = torch.randint(0, 96, (2, WIDTH), generator=torch.Generator().manual_seed(1))
    packed = model(input_ids=ids, position_ids=positions(), use_cache=False).logits
    packed.square().mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    alone = one_at_a_time(model, ids)
    alone.square().mean().backward()
    torch.testing.assert_close(packed, alone, atol=1e-4, rtol=1e-4)
    for g, ref in zip(grads, (p.grad for p in model.parameters())):
        torch.testing.assert_close(g, ref, atol=1e-4, rtol=1e-3)
    leaky = model(input_ids=ids, use_cache=False).logits  # no documents: what a broken mask gives
    assert (leaky - alone).abs().max() > 1e-2


def test_varlen_gets_the_autocast_dtype(monkeypatch):
    """Under autocast with fp32 weights RoPE returns fp32 queries; the flash kernel has no fp32, so
    the wrapper hands it the autocast dtype."""
    seen = []

    def recording(q, k, v, cu, max_len, scale):
        seen.append((q.dtype, k.dtype, v.dtype))
        return reference_varlen(q, k, v, cu, max_len, scale)

    use_kernel(monkeypatch, recording)
    doc_attention.register(VARLEN_NAME)
    model = tiny_llama(VARLEN_NAME)
    ids = torch.randint(0, 96, (2, WIDTH), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=ids, position_ids=positions(), use_cache=False)
    assert seen and all(dtypes == (torch.bfloat16,) * 3 for dtypes in seen)


def _varlen_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    """torch 2.10's signature: causal by flag, no scale (always 1/sqrt(head_dim)), no GQA flag (its flash
    kernel takes key/value heads that divide the query heads, unchecked)."""
    assert is_causal and query.shape[1] % key.shape[1] == 0
    return reference_varlen(query, key, value, cu_seq_q, max_q, None)


def _varlen_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)):
    assert window_size == (-1, 0) and query.shape[1] % key.shape[1] == 0
    return reference_varlen(query, key, value, cu_seq_q, max_q, scale)


def _varlen_2_13(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1),
                 enable_gqa=False):
    assert window_size == (-1, 0) and enable_gqa == (key.shape[1] != query.shape[1])
    return reference_varlen(query, key, value, cu_seq_q, max_q, scale)


@pytest.mark.parametrize("kernel", [_varlen_2_10, _varlen_2_11, _varlen_2_13])
@pytest.mark.parametrize("scale", [None, 0.125, 0.3])
def test_varlen_kernel_calls_each_torch_signature_with_the_models_scale(monkeypatch, kernel, scale):
    """The wrapper around torch's varlen_attn, against the signatures of torch 2.10 (is_causal, no scale:
    a model's own scale is folded into the queries), 2.11 (scale, window_size) and 2.13 (enable_gqa)."""
    from torch.nn.attention import varlen

    monkeypatch.setattr(varlen, "varlen_attn", kernel)
    monkeypatch.setattr(doc_attention, "_VARLEN_ARGS", None)
    gen = torch.Generator().manual_seed(3)
    cu = torch.tensor([0, 5, 6, 16], dtype=torch.int32)
    q = torch.randn(16, 4, 16, generator=gen)
    k, v = torch.randn(16, 2, 16, generator=gen), torch.randn(16, 2, 16, generator=gen)
    out = doc_attention.varlen_kernel(q, k, v, cu, 10, scale)
    torch.testing.assert_close(out, reference_varlen(q, k, v, cu, 10, scale), atol=1e-5, rtol=1e-5)


def test_flex_gets_one_dtype_under_autocast(monkeypatch):
    """FlexAttention before torch 2.11 refuses fp32 queries and keys (RoPE under autocast) beside
    bf16 values: the wrapper hands it the autocast dtype for all three."""
    seen = []

    def recording(q, k, v, **kwargs):
        seen.append((q.dtype, k.dtype, v.dtype))
        from torch.nn.attention.flex_attention import flex_attention

        return flex_attention(q.float(), k.float(), v.float(), **kwargs).to(q.dtype)

    monkeypatch.setattr(doc_attention, "_flex_fn", lambda: recording)
    doc_attention.register(FLEX_NAME)
    model = tiny_llama(FLEX_NAME).eval()
    ids = torch.randint(0, 96, (2, WIDTH), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=ids, position_ids=positions(), use_cache=False)
    assert seen and all(dtypes == (torch.bfloat16,) * 3 for dtypes in seen)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_flex_document_mask_matches_documents_run_alone(kv_heads):
    """FlexAttention's document mask, forward on CPU (torch has no FlexAttention backward on CPU)."""
    doc_attention.register(FLEX_NAME)
    model = tiny_llama(FLEX_NAME, kv_heads).eval()
    ids = torch.randint(0, 96, (2, WIDTH), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=positions(), use_cache=False).logits
        alone = one_at_a_time(model, ids)
    torch.testing.assert_close(packed, alone, atol=1e-4, rtol=1e-4)


def test_generation_with_a_cache_takes_the_stock_path(monkeypatch):
    """A KV cache (queries shorter than keys) is not a packed row: stock SDPA serves the decoding
    steps; the prompt's own pass (one document) is the kernel's. Same tokens as stock SDPA."""
    called = []

    def counting(*args):
        called.append(1)
        return reference_varlen(*args)

    use_kernel(monkeypatch, counting)
    doc_attention.register(VARLEN_NAME)
    model = tiny_llama(VARLEN_NAME).eval()
    prompt = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=3, do_sample=False)
        model.set_attn_implementation("sdpa")
        stock = model.generate(prompt, max_new_tokens=3, do_sample=False)
    assert len(called) == 2  # the prompt's pass through both layers, no decoding step
    assert torch.equal(out, stock)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("impl,head_dim", [(VARLEN_NAME, 8), (FLEX_NAME, 16), (FLEX_NAME, 8)])
def test_document_kernels_on_cuda(impl, head_dim):
    """The real kernels on a GPU against documents run alone, forward and gradients, in bf16. FlexAttention's
    CUDA kernel refuses heads under 16 wide: those go through packed SDPA."""
    if impl == VARLEN_NAME and (torch.cuda.get_device_capability() < (8, 0) or not doc_attention.has_varlen()):
        pytest.skip("torch's varlen kernel needs sm80+ and torch >= 2.10")
    doc_attention.register(impl)
    model = tiny_llama(impl, head_dim=head_dim).cuda()
    ids = torch.randint(0, 96, (2, WIDTH), generator=torch.Generator().manual_seed(3)).cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        packed = model(input_ids=ids, position_ids=positions().cuda(), use_cache=False).logits.float()
        packed.square().mean().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        model.set_attn_implementation("sdpa")
        alone = one_at_a_time(model, ids).float()
        alone.square().mean().backward()
    scale = alone.abs().max()
    assert (packed - alone).abs().max() / scale < 2e-2
    for g, ref in zip(grads, (p.grad for p in model.parameters())):
        assert (g - ref).abs().max() <= 5e-2 * ref.abs().max() + 1e-6


WINDOWED = {"architecture": "mistral", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "sliding_window": 8}


@pytest.mark.parametrize("impl", ["packed_sdpa", "flex"])
def test_a_sliding_window_shorter_than_the_documents_is_applied_within_each(tiny_tokenizer_dir, impl):
    """Documents up to 30 tokens under an 8-token window (Mistral v0.1, Gemma's local layers): the document
    kernels mask the window too, so each document's logits equal its own run alone under transformers'
    stock SDPA with its sliding-window mask; without the window they would not. FlexAttention forward
    only: torch has no FlexAttention backward on a CPU."""
    from trainforge.config.run import ModelSettings
    from trainforge.model.load import build_model
    from trainforge.model.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_tokenizer_dir)
    warned = []
    model = build_model(ModelSettings(init=WINDOWED, tokenizer=tiny_tokenizer_dir, attention=impl), tok, 0,
                        torch.device("cpu"), False, warn=warned.append).eval()
    assert model.config._attn_implementation.startswith("trainforge_") and warned == []
    ids = torch.randint(0, 96, (2, WIDTH), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=positions(), use_cache=False).logits
        kernel = model.config._attn_implementation
        model.set_attn_implementation("sdpa")
        alone = one_at_a_time(model, ids)
        torch.testing.assert_close(packed, alone, atol=1e-4, rtol=1e-4)
        model.config.sliding_window = None  # the same weights without the window: documents past 8 tokens differ
        for layer in model.model.layers:
            layer.self_attn.sliding_window = None
        model.set_attn_implementation(kernel)
        unwindowed = model(input_ids=ids, position_ids=positions(), use_cache=False).logits
    assert (unwindowed - alone).abs().max() > 1e-3


def test_soft_capped_attention_goes_to_eager_and_a_kernel_asked_for_by_name_is_refused(tiny_tokenizer_dir):
    """Gemma 2 soft-caps its attention logits, which no document kernel applies: auto hands it to transformers'
    eager attention (with its document mask) and says so; packed_sdpa by name is refused."""
    from transformers import Gemma2Config, LlamaConfig, MistralConfig

    from trainforge.config.run import ModelSettings
    from trainforge.model.load import AttentionUnavailable, build_model
    from trainforge.model.tokenizer import load_tokenizer

    assert doc_attention.uncovered_attention(Gemma2Config())[0] == "eager"
    assert doc_attention.uncovered_attention(MistralConfig(sliding_window=16)) is None  # windows the kernels apply
    assert doc_attention.uncovered_attention(LlamaConfig()) is None


def test_attention_sinks_go_to_eager(tiny_tokenizer_dir):
    """GPT-OSS adds learned attention sinks, passed to the attention function as an extra argument the document
    kernels ignored (on CUDA: silently another attention; on CPU: transformers' 'no sdpa' traceback). A model
    class transformers gives no SDPA path trains on its eager attention under auto, as Gemma 2 does (GPT-OSS's run
    per document, as its stock mask lets packed documents meet)."""
    from transformers import GptOssConfig

    from trainforge.config.run import ModelSettings
    from trainforge.model.load import AttentionUnavailable, build_model
    from trainforge.model.tokenizer import load_tokenizer

    stock, why = doc_attention.uncovered_attention(GptOssConfig())
    assert stock == "eager" and "GptOssForCausalLM" in why
    tok = load_tokenizer(tiny_tokenizer_dir)
    gpt_oss = {"architecture": "gpt_oss", "hidden_size": 32, "intermediate_size": 32, "num_hidden_layers": 2, "head_dim": 8,
               "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
               "max_position_embeddings": 64, "sliding_window": 8}
    gemma2 = {"architecture": "gemma2", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "head_dim": 8,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "sliding_window": 8}
    for init, why in ((gpt_oss, "sinks"), (gemma2, "soft-capped at 50")):
        warned = []
        model = build_model(ModelSettings(init=init, tokenizer=tiny_tokenizer_dir), tok, 0, torch.device("cpu"), False,
                            warn=warned.append)
        # GPT-OSS's eager mask lets packed documents meet: its eager attention run per document (test_packing_probe.py)
        want = "trainforge_doc_eager" if init is gpt_oss else "eager"
        assert model.config._attn_implementation == want and why in warned[0]
        with pytest.raises(AttentionUnavailable, match=f"model.attention: packed_sdpa would change.*{why.split()[0]}"):
            build_model(ModelSettings(init=init, tokenizer=tiny_tokenizer_dir, attention="packed_sdpa"), tok, 0,
                        torch.device("cpu"), False)


def test_the_skeleton_of_a_soft_capped_model_takes_the_attention_its_run_takes(tiny_tokenizer_dir):
    """The plan's meta-device skeleton (built by every train before the model, and by plan) of Gemma 2 used the
    causal document kernel, which transformers refuses for a model without SDPA: train and plan stopped with a
    traceback before any work. It takes the stock attention training takes (eager) instead."""
    from trainforge.config.run import ModelSettings
    from conftest import TINY_LLAMA_INIT
    from trainforge.model.load import build_model_skeleton
    from trainforge.model.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_tokenizer_dir)
    gemma2 = {"architecture": "gemma2", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "head_dim": 8,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "sliding_window": 8}
    skeleton = build_model_skeleton(ModelSettings(init=gemma2, tokenizer=tiny_tokenizer_dir), tok, None, False)
    assert skeleton.config._attn_implementation == "eager"
    assert next(skeleton.parameters()).is_meta
    llama = build_model_skeleton(ModelSettings(init=TINY_LLAMA_INIT, tokenizer=tiny_tokenizer_dir), tok, None, False)
    assert llama.config._attn_implementation == "trainforge_causal_sdpa"  # the kernels' linear-memory stand-in


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("impl", [VARLEN_NAME, FLEX_NAME])
def test_sliding_windows_on_cuda(impl, tiny_tokenizer_dir):
    """An 8-token window inside packed documents on a GPU (varlen hands windowed layers to FlexAttention),
    bf16, against each document alone under transformers' SDPA with its window mask."""
    from trainforge.config.run import ModelSettings
    from trainforge.model.load import build_model
    from trainforge.model.tokenizer import load_tokenizer

    if impl == VARLEN_NAME and (torch.cuda.get_device_capability() < (8, 0) or not doc_attention.has_varlen()):
        pytest.skip("torch's varlen kernel needs sm80+ and torch >= 2.10")
    attention = impl.removeprefix("trainforge_")
    model = build_model(ModelSettings(init=WINDOWED | {"head_dim": 16}, tokenizer=tiny_tokenizer_dir, attention=attention),
                        load_tokenizer(tiny_tokenizer_dir), 0, torch.device("cuda"), True).cuda().eval()
    ids = torch.randint(0, 96, (2, WIDTH), generator=torch.Generator().manual_seed(4)).cuda()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        packed = model(input_ids=ids, position_ids=positions().cuda(), use_cache=False).logits.float()
        model.set_attn_implementation("sdpa")
        alone = one_at_a_time(model, ids).float()
    assert (packed - alone).abs().max() / alone.abs().max() < 2e-2


def flash_contract(q, k, v, cu, max_len, scale):
    """The varlen kernel's contract as torch's flash kernel keeps it: fp16/bf16 only (it raises on fp32)."""
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError("FlashAttention only support fp16 and bf16 data type")
    return reference_varlen(q.float(), k.float(), v.float(), cu, max_len, scale).to(q.dtype)


def test_selftest_attention_check_runs_the_varlen_kernel_in_half_precision_only(monkeypatch):
    """selftest's attention check computes its fp32 reference one document at a time: through the varlen
    kernel itself that reference handed the flash kernel fp32 queries, which it refuses (the check raised
    on every sm80+ GPU). The reference runs on stock SDPA; the packed rows still take the kernel."""
    from trainforge.hardware.device import PRECISIONS
    from trainforge.tools.selftest.probes import packed_attention_gap

    calls = []

    def recording(*args):
        calls.append(args[0].dtype)
        return flash_contract(*args)

    use_kernel(monkeypatch, recording)
    gap, leak = packed_attention_gap(doc_attention.register(VARLEN_NAME), PRECISIONS["bf16"], torch.device("cpu"))
    assert calls and set(calls) == {torch.bfloat16}
    assert gap < 0.05 < leak


def test_the_fused_head_stays_on_a_varlen_model_with_fp32_weights(monkeypatch):
    """A full fine-tune keeps fp32 weights and trains under bf16 autocast; the fused head's probe runs at set-up,
    outside autocast. On an H200 the probe's fp32 forward reached the half-only flash kernel, failed, and every such
    run took the model's full logits instead (0.94x HF's memory where the plan said 0.73x)."""
    from trainforge.engine.loss import fused_head

    def half_only(q, k, v, cu, max_len, scale):
        if q.dtype == torch.float32:
            raise RuntimeError("FlashAttention only supports fp16 and bf16")
        return reference_varlen(q, k, v, cu, max_len, scale)

    monkeypatch.setattr(doc_attention, "varlen_kernel", half_only)
    doc_attention.register(VARLEN_NAME)
    assert fused_head(tiny_llama(VARLEN_NAME)) is not None
