"""Cross-entropy fused with the LM head, in chunks, over target positions only.

The usual path materializes fp32 logits for every position (batch x seq x vocab: 270 MB
for 8 x 1024 x 8192), then softmax and their gradient, all of the same size. Here the
head is applied to a chunk of target positions at a time (``CHUNK``, ``CPU_CHUNK``); the loss and the gradients with
respect to the hidden states and the head weight are computed right there, in the
forward, and the logits chunk is dropped. Positions with no target (prompt tokens under
completion-only loss, padding) never get logits at all.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch._subclasses.fake_tensor import is_fake

from ..data.formats import IGNORE
from ..hardware.device import cuda_has_native_bf16, fp32_out_addmm_in
from ..model.kernels import liger_linear_cross_entropy, transforms_logits, uses_liger_loss
from ..model.tiled_mlp import run_tiles
from .head_exact import decoder_stack, head_mismatch

CHUNK = 4096  # at most this many target positions per head matmul on GPU: large enough for efficient GEMMs
LOGITS_CHUNK_BYTES = 256 * 2**20  # ... and at most this much fp32 logits per chunk: at a 128k vocabulary, 4096
# positions made 2 GiB of logits plus as much log-probabilities (trainforge plan showed it: 8B QLoRA on 24 GB)
MIN_CHUNK = 256
CPU_CHUNK = 512  # on CPU a chunk's fp32 logits should stay in cache: 512 rows ran 1.6x faster than 4096 at a
# 4k vocabulary (bf16, fwd+bwd of 2,048 positions) and no slower at 32k
_chunk_device: str | None = None  # set by ``chunk_as``: the device type whose chunk size a plan traces


_FP32_OUT_ADDMM = hasattr(torch.ops.aten.addmm, "dtype_out") and fp32_out_addmm_in()  # see fp32_out_addmm_in
_FAKE_FP32_OUT_ADDMM = _FP32_OUT_ADDMM and fp32_out_addmm_in(fake=True)


def chunk_for(device_type: str, vocab: int = 0) -> int:
    """Target positions per head matmul on ``device_type`` (or the device a plan traces for) at this
    vocabulary size: on a GPU as many as keep one chunk's fp32 logits within ``LOGITS_CHUNK_BYTES``."""
    if (_chunk_device or device_type) == "cpu":
        return CPU_CHUNK
    fit = LOGITS_CHUNK_BYTES // (4 * vocab) if vocab else CHUNK
    return max(MIN_CHUNK, min(CHUNK, fit // MIN_CHUNK * MIN_CHUNK))


@contextlib.contextmanager
def chunk_as(device_type: str) -> Iterator[None]:
    """Chunk as on ``device_type`` while a plan traces a step for it on (fake) CPU tensors."""
    global _chunk_device
    before, _chunk_device = _chunk_device, device_type
    try:
        yield
    finally:
        _chunk_device = before


def add_weight_grad(grad_w: torch.Tensor, g: torch.Tensor, h: torch.Tensor) -> None:
    """``grad_w += g.T @ h`` for one chunk, in the fp32 accumulator ``grad_w``.

    The general path materializes the product, parameter-sized, in the compute dtype, then an fp32 copy
    of it, then adds. At a 128k vocabulary that is three passes over a 1 GiB buffer per chunk. On CUDA
    (sm80+), and on fake CUDA tensors a plan traces, the GEMM accumulates in fp32 straight into the
    buffer instead: ``addmm`` with ``out_dtype``, which also skips rounding each chunk's product to bf16.
    In fp32 the same GEMM adds in place on any device."""
    if g.dtype == grad_w.dtype:
        torch.addmm(grad_w, g.t(), h, out=grad_w)
    elif g.dtype in (torch.bfloat16, torch.float16) and grad_w.dtype == torch.float32 and _fp32_out_gemm(g):
        torch.addmm(grad_w, g.t(), h.to(g.dtype), out_dtype=torch.float32, out=grad_w)
    else:
        grad_w += (g.t() @ h).float()


def chunk_grads(g: torch.Tensor, w: torch.Tensor, h: torch.Tensor, grad_h: torch.Tensor, grad_w: torch.Tensor | None,
                grad_b: torch.Tensor | None) -> None:
    """One chunk's gradients from ``g``, the loss's gradient by its logits: the hidden states' written into ``grad_h``,
    the head's weight and bias added to their fp32 accumulators (None: frozen)."""
    torch.matmul(g, w, out=grad_h)
    if grad_w is not None:
        add_weight_grad(grad_w, g, h)
    if grad_b is not None:
        grad_b.add_(g.sum(0, dtype=torch.float32))


def _fp32_out_gemm(t: torch.Tensor) -> bool:
    """Whether a low-precision GEMM can write an fp32 result on ``t``'s device (``addmm(..., out_dtype=)``)."""
    if is_fake(t):  # a plan's trace: fake CPU tensors standing for the device it chunks for
        return _FAKE_FP32_OUT_ADDMM and _chunk_device == "cuda"
    if not _FP32_OUT_ADDMM:
        return False
    return t.is_cuda and cuda_has_native_bf16(t.device)  # sm80+: the GEMM with an fp32 output


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, compute_dtype, groups=None, group_sums=None):  # no annotations: autograd.Function checks none
        # the head's matmuls run in ``compute_dtype`` (bf16/fp16 under mixed precision: that is their speed);
        # logits, softmax statistics, the loss and the weight-gradient accumulator stay fp32
        with torch.autocast(hidden.device.type, enabled=False):  # dtypes are explicit here; autocast would recast per chunk
            # a plan's fake step has no label values: it takes the worst case, every position a target
            keep = None if is_fake(labels) else (labels != IGNORE).nonzero().flatten()
            dense = keep is None or len(keep) == len(labels)  # every position a target (pretraining): slices, no gather/scatter
            h_all = hidden if dense else hidden.index_select(0, keep)
            y_all = labels if dense else labels.index_select(0, keep)
            # a mixture's loss per source: each target's loss added to its group's sum (group_sums: (2, K), no grad)
            g_all = None if groups is None else (groups if dense else groups.index_select(0, keep))
            h_all = h_all.to(compute_dtype)
            w = weight.to(compute_dtype)  # cast once per call, not once per chunk
            b = bias.to(compute_dtype) if bias is not None else None
            grad_kept = torch.empty_like(h_all)  # d loss / d hidden at the target positions, in compute dtype
            grad_w = torch.zeros_like(weight, dtype=torch.float32) if weight.requires_grad else None
            grad_b = torch.zeros_like(bias, dtype=torch.float32) if bias is not None and bias.requires_grad else None
            total = torch.zeros((), device=hidden.device, dtype=torch.float32)
            chunk = chunk_for(hidden.device.type, weight.shape[0])

            def one_chunk(i: int) -> None:
                s = i * chunk
                h, y = h_all[s : s + chunk], y_all[s : s + chunk]
                # one fused pass from the (bf16) logits to fp32 log-probabilities: no separate upcast copy
                log_p = torch.log_softmax(torch.nn.functional.linear(h, w, b), dim=-1, dtype=torch.float32)
                picked = log_p.gather(1, y[:, None]).squeeze(1)
                total.sub_(picked.sum())
                if g_all is not None:
                    g_chunk = g_all[s : s + chunk]
                    group_sums[0].index_add_(0, g_chunk, -picked)
                    group_sums[1].index_add_(0, g_chunk, torch.ones_like(picked))
                # d(sum CE)/d logits = softmax - onehot, computed in place over the fp32 chunk
                g = log_p.exp_()
                g[torch.arange(len(y), device=g.device), y] -= 1.0
                chunk_grads(g.to(compute_dtype), w, h, grad_kept[s : s + chunk], grad_w, grad_b)

            # every chunk in order; a plan's fake step traces three and counts the middle one's ops for the rest
            run_tiles(-(-len(y_all) // chunk), one_chunk)
            # the gradient handed back has the hidden state's dtype, zero where there is no target
            if dense:
                grad_h = grad_kept.to(hidden.dtype)
            else:
                grad_h = torch.zeros_like(hidden).index_copy_(0, keep, grad_kept.to(hidden.dtype))
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        return total

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w, grad_b = ctx.saved_tensors
        return (
            grad_h * grad_out.to(grad_h.dtype),
            grad_w * grad_out if grad_w is not None else None,
            grad_b * grad_out if grad_b is not None else None,
            None,
            None,
            None,
            None,
        )


class _LinearTokenLogProbs(torch.autograd.Function):
    """Log-probabilities of the target tokens through the head, chunked, without the full logits.

    Unlike the summed cross-entropy above, the caller combines these values non-linearly (a
    preference loss compares sums of them per sequence), so the gradient cannot be formed in the
    forward: the backward recomputes each chunk's logits (one more head matmul) and applies the
    upstream gradient of each token. Only the log-sum-exp per target is kept between the two.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, compute_dtype):
        with torch.autocast(hidden.device.type, enabled=False):
            keep = (labels != IGNORE).nonzero().flatten()
            h_all, y_all = hidden.index_select(0, keep).to(compute_dtype), labels.index_select(0, keep)
            w = weight.to(compute_dtype)
            b = bias.to(compute_dtype) if bias is not None else None
            out = torch.empty(len(y_all), device=hidden.device, dtype=torch.float32)
            lse = torch.empty_like(out)
            chunk = chunk_for(hidden.device.type, weight.shape[0])

            def one_chunk(i: int) -> None:
                s = i * chunk
                logits = torch.nn.functional.linear(h_all[s : s + chunk], w, b).float()
                lse[s : s + chunk] = torch.logsumexp(logits, dim=-1)
                out[s : s + chunk] = logits.gather(1, y_all[s : s + chunk, None]).squeeze(1) - lse[s : s + chunk]

            run_tiles(-(-len(y_all) // chunk), one_chunk)
        ctx.save_for_backward(h_all, weight, bias, y_all, lse, keep)
        ctx.compute_dtype, ctx.hidden_shape, ctx.hidden_dtype = compute_dtype, hidden.shape, hidden.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        h_all, weight, bias, y_all, lse, keep = ctx.saved_tensors
        dt = ctx.compute_dtype
        with torch.autocast(h_all.device.type, enabled=False):
            w = weight.to(dt)
            b = bias.to(dt) if bias is not None else None
            grad_kept = torch.empty_like(h_all)
            grad_w = torch.zeros_like(weight, dtype=torch.float32) if weight.requires_grad else None
            grad_b = torch.zeros_like(bias, dtype=torch.float32) if bias is not None and bias.requires_grad else None
            chunk = chunk_for(h_all.device.type, weight.shape[0])

            def one_chunk(i: int) -> None:
                s = i * chunk
                h, y, up = h_all[s : s + chunk], y_all[s : s + chunk], grad_out[s : s + chunk].float()
                # d log p_y / d logits = onehot(y) - softmax, times each token's upstream gradient
                g = torch.exp_(torch.nn.functional.linear(h, w, b).float() - lse[s : s + chunk, None]).neg_()
                g[torch.arange(len(y), device=g.device), y] += 1.0
                chunk_grads((g * up[:, None]).to(dt), w, h, grad_kept[s : s + chunk], grad_w, grad_b)

            run_tiles(-(-len(y_all) // chunk), one_chunk)
            grad_h = torch.zeros(ctx.hidden_shape, device=h_all.device, dtype=ctx.hidden_dtype)
            grad_h.index_copy_(0, keep, grad_kept.to(ctx.hidden_dtype))
        return grad_h, grad_w, grad_b, None, None


def linear_token_logprobs(
    hidden: torch.Tensor, head: torch.nn.Linear, labels: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """log p(label) of every position whose label is not IGNORE, in position order, as fp32 (K,).

    ``hidden``: (N, H) final hidden states; ``labels``: (N,). Differentiable with any upstream
    gradient (a preference loss sums them per sequence and compares the sums); no full logits."""
    device_type = hidden.device.type
    compute_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else hidden.dtype
    return _LinearTokenLogProbs.apply(hidden, head.weight, head.bias if bias is None else bias, labels, compute_dtype)


def linear_cross_entropy(
    hidden: torch.Tensor, head: torch.nn.Linear, labels: torch.Tensor, bias: torch.Tensor | None = None,
    groups: torch.Tensor | None = None, group_sums: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sum of next-token cross-entropy over positions whose label is not IGNORE, as an fp32 scalar.

    ``hidden``: (N, H) final hidden states; ``labels``: (N,) targets aligned with them. Under
    autocast the head's matmuls run in the autocast dtype, as ``head(hidden)`` would.
    ``bias``: added to the logits instead of the head's own (BART's ``final_logits_bias``).
    ``groups`` (N,) and ``group_sums`` (2, K): each target's loss and a count of 1 are added in place to its group's
    column (a mixture's loss per source); not under liger's kernel, which gives no per-token losses.
    """
    device_type = hidden.device.type
    compute_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else hidden.dtype
    if uses_liger_loss(head, hidden):  # train.kernels: liger on CUDA (model/kernels.py marked the head)
        return liger_linear_cross_entropy(hidden, head.weight, head.bias if bias is None else bias, labels, compute_dtype, IGNORE)
    return _LinearCrossEntropy.apply(hidden, head.weight, head.bias if bias is None else bias, labels, compute_dtype, groups, group_sums)


def _plain_base(model: torch.nn.Module) -> torch.nn.Module | None:
    """The transformers model under a PEFT wrapper, or None when the head cannot be called apart:
    FSDP (the head's weight lives in shards only the root's forward gathers), or a DDP wrapper
    (its forward hooks exchange the gradients: submodules called directly would bypass them)."""
    from torch.distributed.fsdp import FSDPModule

    if any(isinstance(m, FSDPModule) for m in model.modules()):
        return None
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base if getattr(base, "config", None) is not None else None


# Encoder-decoder classes whose logits are lm_head(decoder output x scale) + bias, and how they scale
# (transformers 5: T5 when config.scale_decoder_outputs, the original T5 and Flan-T5; mT5 never).
# Others take the model's own head; tests/unit/test_seq2seq.py checks each entry against it.
SEQ2SEQ_HEADS = {
    "T5ForConditionalGeneration": lambda base: base.model_dim**-0.5 if base.config.scale_decoder_outputs else None,
    "MT5ForConditionalGeneration": lambda base: None,
    "BartForConditionalGeneration": lambda base: None,
    "MBartForConditionalGeneration": lambda base: None,
}


def seq2seq_fused_head(model: torch.nn.Module):
    """A function (input_ids, attention_mask, decoder_input_ids) -> (decoder output as the head sees
    it, lm_head, logits bias) for the encoder-decoders of ``SEQ2SEQ_HEADS``; None for the others."""
    base = _plain_base(model)
    if base is None or type(base).__name__ not in SEQ2SEQ_HEADS:
        return None
    head = base.get_output_embeddings()
    if type(head) is not torch.nn.Linear:
        return None  # LoRA on the head, or quantized
    scale = SEQ2SEQ_HEADS[type(base).__name__](base)
    bias = getattr(base, "final_logits_bias", None)  # BART: a (1, vocab) buffer added to the logits

    def run(input_ids: torch.Tensor, attention_mask: torch.Tensor, decoder_input_ids: torch.Tensor):
        encoded = base.get_encoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        hidden = base.get_decoder()(
            input_ids=decoder_input_ids, encoder_hidden_states=encoded, encoder_attention_mask=attention_mask,
            use_cache=False,
        ).last_hidden_state
        return (hidden * scale if scale is not None else hidden), head, (bias[0] if bias is not None else None)

    return run


def fused_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Linear] | None:
    """(decoder, lm_head) when the model computes ``logits = lm_head(decoder(...).last_hidden_state)`` exactly, else
    None: the standard path (``head_choice`` says why)."""
    choice = head_choice(model)
    return None if isinstance(choice, str) else choice


def head_choice(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Linear] | str:
    """(decoder, lm_head) for the fused head, or why the model takes its own head: wrapped for data parallelism,
    a head that is not a plain Linear (LoRA on the head, quantized), logits transformed by a config field
    (soft-capping, scaling), or anything between the decoder and the head (``head_exact``: decided once per model)."""
    base = _plain_base(model)
    if base is None:
        return "the model is wrapped for data parallelism (FSDP/DDP): its own forward computes the logits"
    if transforms_logits(base.config):
        return "its config scales or soft-caps the logits after the head"
    get_head = getattr(base, "get_output_embeddings", None)
    head = get_head() if get_head is not None else None
    if head is None:
        return "it exposes no output embedding (get_output_embeddings)"
    if type(head) is not torch.nn.Linear:
        return f"its output embedding is {type(head).__name__}, not a plain Linear (LoRA on the head, quantized)"
    decoder = decoder_stack(base, head)
    if decoder is None:
        return "it exposes no decoder stack (get_decoder)"
    why = head_mismatch(base, decoder, head)
    return (decoder, head) if why is None else f"its logits are not lm_head(decoder output): {why}"


def loss_head_fact(model: torch.nn.Module, fused: bool, encoder_decoder: bool, say: Callable[[str], None],
                   warn: Callable[[str], None] | None = None) -> str:
    """What computes the loss, for summary.json: ``fused`` (the chunked head) or ``model`` (the model's logits); where
    ``train.fused_loss`` is on but the model cannot take the fused head, ``say`` gets why (decided here, once), and
    ``warn`` where the probe failed rather than found a difference: that is a path trainforge should take and did not
    (on an H200 an fp32 probe reached a bf16-only kernel, and runs quietly held full logits)."""
    if not fused:
        return "model"
    if encoder_decoder:
        return "fused" if seq2seq_fused_head(model) is not None else "model"
    choice = head_choice(model)
    if isinstance(choice, str):
        line = f"loss: the model's own head, full logits per micro-batch (train.fused_loss cannot apply: {choice})"
        if warn is not None and "failed on a probe" in choice:
            warn(line + "; please report it")
        else:
            say(line)
        return "model"
    return "fused"


def kernels_for_head(kernels: list[str] | str, loss_head: str) -> list[str] | str:
    """The kernels a run uses, for summary.json: Liger's fused linear cross-entropy serves the fused head only, so
    a run on the model's own head (``loss_head: model``) does not list it."""
    if loss_head == "fused" or not isinstance(kernels, list):
        return kernels
    return [k for k in kernels if k != "fused_linear_cross_entropy"] or "torch"
