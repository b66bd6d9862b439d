"""Activation offload (engine/offload.py): the checkpointed layers' inputs leave through the hooks, and come
back for the recompute; loss and gradients are unchanged."""

from __future__ import annotations

import copy

import pytest

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from trainforge.config.run import LoraSettings
from trainforge.engine.offload import BoundaryOffload, TracedOffload, checkpointed_layers, install_offload
from trainforge.model.load import apply_lora, enable_activation_checkpointing

CPU = torch.device("cpu")
TOKENS, HIDDEN, LAYERS = 64, 32, 3
IDS = torch.randint(0, 80, (2, TOKENS), generator=torch.Generator().manual_seed(3))


def tiny(checkpointing: bool = True) -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=80, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=TOKENS)
    model = AutoModelForCausalLM.from_config(config)
    if checkpointing:
        enable_activation_checkpointing(model)
    return model.train()


def step(model: torch.nn.Module) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=IDS, labels=IDS).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_boundaries_go_through_the_hooks_and_gradients_are_unchanged():
    model = tiny()
    plain = step(model)
    offload = BoundaryOffload(CPU, copy=True, min_bytes=0)
    assert install_offload(model, offload) == LAYERS
    unpacked = []
    unpack = offload.unpack
    offload.unpack = lambda packed: unpacked.append(1) or unpack(packed)
    got = step(model)
    # one boundary per layer (its input hidden states), the layer's inside left to the checkpoint
    assert offload.count == LAYERS and offload.bytes == LAYERS * IDS.numel() * HIDDEN * 4
    assert len(unpacked) == LAYERS  # each came back once, for its layer's recompute
    torch.testing.assert_close(got[0], plain[0], rtol=0, atol=0)
    assert got[1].keys() == plain[1].keys()
    for name in plain[1]:
        torch.testing.assert_close(got[1][name], plain[1][name], rtol=0, atol=0, msg=name)


def test_lora_with_offload_and_installing_twice_wraps_once():
    model = apply_lora(tiny(), LoraSettings(r=4, target_modules=["q_proj", "down_proj"]))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.2)
    reference = copy.deepcopy(model)
    offload = BoundaryOffload(CPU, copy=True, min_bytes=0)
    install_offload(model, offload)
    install_offload(model, offload)
    got, plain = step(model), step(reference)
    assert offload.count == LAYERS
    for name in plain[1]:
        torch.testing.assert_close(got[1][name], plain[1][name], rtol=0, atol=0, msg=name)


def test_without_checkpointing_there_is_nothing_to_offload():
    model = tiny(checkpointing=False)
    assert checkpointed_layers(model) == [] and install_offload(model, BoundaryOffload(CPU, copy=True)) == 0


def test_a_cpu_offload_without_copy_moves_nothing_and_small_boundaries_stay():
    model = tiny()
    quiet, small = BoundaryOffload(CPU), BoundaryOffload(CPU, copy=True)  # default floor: 64 KiB; these are 16 KiB
    install_offload(model, quiet)
    step(model)
    install_offload(model, small)
    step(model)
    assert quiet.count == small.count == 0


def test_the_traced_stand_in_keeps_only_shapes():
    model = tiny()
    traced = TracedOffload(min_bytes=0)
    install_offload(model, traced)
    loss = model(input_ids=IDS, labels=IDS).loss
    loss.backward()  # the recompute runs on uninitialised boundaries: values are not the point, shapes are
    assert traced.count == LAYERS and traced.bytes == LAYERS * IDS.numel() * HIDDEN * 4


def test_each_boundary_brings_the_one_below_back_early_and_a_new_forward_links_afresh():
    """Backward recomputes top down: unpacking layer k's boundary starts the copy back of layer k-1's (the CPU path
    copies as CUDA's does), which is then used as is; two micro-batches' forwards never link across."""
    model = tiny()
    plain = step(model)
    offload = BoundaryOffload(CPU, copy=True, min_bytes=0)
    install_offload(model, offload)
    order = []
    load = offload._load
    offload._load = lambda packed, early: order.append(early) or load(packed, early)
    got = step(model)
    assert offload.prefetched == LAYERS - 1 and order == [False] + [True] * (LAYERS - 1)  # the top one alone waits
    for name in plain[1]:
        torch.testing.assert_close(got[1][name], plain[1][name], rtol=0, atol=0, msg=name)
    model.zero_grad(set_to_none=True)
    for _ in range(2):  # accumulation: each forward's boundaries link among themselves
        (model(input_ids=IDS, labels=IDS).loss / 2).backward()
    assert offload.prefetched == 3 * (LAYERS - 1) and offload._last is None
    model.zero_grad(set_to_none=True)
    model(input_ids=IDS, labels=IDS).loss  # a forward that never reaches backward (an out-of-memory retry's first try)
    got_again = step(model)  # its boundaries went with its graph: this forward links only its own
    assert offload.prefetched == 4 * (LAYERS - 1)
    for name in plain[1]:
        torch.testing.assert_close(got_again[1][name], plain[1][name], rtol=0, atol=0, msg=name)
    off = BoundaryOffload(CPU, copy=True, min_bytes=0, prefetch=False)
    install_offload(model, off)
    step(model)
    assert off.prefetched == 0 and off.count == LAYERS


def test_the_traced_stand_in_brings_the_boundary_below_back_early_as_the_run_does():
    """The plan's stand-in allocates each boundary again when the run would: the top one at its recompute, every
    other one early, when the layer above comes back (so the trace holds the one more boundary a backward holds)."""
    model = tiny()
    traced = TracedOffload(min_bytes=0)
    install_offload(model, traced)
    order = []
    load = traced._load
    traced._load = lambda packed, early: order.append(early) or load(packed, early)
    model(input_ids=IDS, labels=IDS).loss.backward()
    assert traced.prefetched == LAYERS - 1 and order == [False] + [True] * (LAYERS - 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_boundaries_go_to_pinned_memory_and_come_back_early_with_the_same_gradients():
    device = torch.device("cuda")
    model = tiny().to(device)
    ids = IDS.to(device)

    def cuda_step() -> dict:
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain = cuda_step()
    offload = BoundaryOffload(device, min_bytes=0)
    install_offload(model, offload)
    got = cuda_step()
    torch.cuda.synchronize()
    assert offload.count == LAYERS and offload.prefetched == LAYERS - 1
    for name in plain:
        torch.testing.assert_close(got[name], plain[name], rtol=1e-5, atol=1e-6, msg=name)
