"""A training step under a preference objective: the step's loss is the mean over pairs of the paper's formula
(written out on unpacked, unfused logits), and its gradient is the same whether the pairs come in one
micro-batch or one per micro-batch (accumulation divides by the pairs of the whole step)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from conftest import make_store
from test_preference import PAIRS, TOL, paper_losses, reference_logps, tiny_llama

from trainforge.config.run import RunConfig
from trainforge.config.preference import PreferenceSettings
from trainforge.data.loader import RowCollator
from trainforge.data.packing import pair_rows
from trainforge.engine.objective import PAIRS as PAIR_COUNT
from trainforge.config.preference import resolve_reference
from trainforge.engine.objective import PairObjective, mean_metrics
from trainforge.engine.step import forward_backward
from trainforge.hardware.device import PRECISIONS

FP32 = PRECISIONS["fp32"]


def pair_batches(tmp_path, per_row: bool):
    """The three test pairs as collated batches: all in one micro-batch, or a micro-batch per row of one pair."""
    sequences = [(p + reply, [False] * len(p) + [True] * len(reply)) for p, c, r in PAIRS for reply in (c, r)]
    store = make_store(tmp_path / f"store-{per_row}", sequences, vocab_size=64)
    collate = RowCollator(store, pad_id=0, mode=True, max_length=16 if per_row else 48)
    rows = pair_rows(store, np.arange(len(PAIRS)), max_length=16 if per_row else 48)
    if per_row:
        assert len(rows) == len(PAIRS)  # one pair per row: three micro-batches
        return [collate([r], [i]) for i, r in enumerate(rows)]
    assert len(rows) == 1
    return [collate(rows, [0])]


def moved_policy() -> tuple[torch.nn.Module, torch.nn.Module]:
    policy = tiny_llama()
    reference = copy.deepcopy(policy).requires_grad_(False)
    with torch.no_grad():  # a policy that moved away from its reference
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return policy, reference


def assert_steps_equal(policy: torch.nn.Module, want: torch.Tensor, losses: list, grads: list) -> None:
    """Each step's loss and gradients equal the direct formula's ``want`` (backpropagated here) to 1e-5."""
    want.backward()
    for loss in losses:
        torch.testing.assert_close(loss, want.detach(), **TOL)
    for g in grads:
        for k, v in policy.named_parameters():
            torch.testing.assert_close(g[k], v.grad, **TOL, msg=k)


@pytest.mark.parametrize("name", ["dpo", "ipo", "simpo", "orpo"])
def test_a_step_is_the_mean_pair_loss_and_the_same_in_one_or_three_micro_batches(tmp_path, name):
    policy, reference = moved_policy()
    objective = PairObjective(name, PreferenceSettings(beta=0.1, simpo_gamma=0.5), "model" if name in ("dpo", "ipo") else "none", reference)

    grads, losses = [], []
    for per_row in (False, True):
        metrics: dict = {}
        loss = forward_backward(policy, pair_batches(tmp_path, per_row), FP32, torch.device("cpu"), objective=objective, metrics=metrics)
        grads.append({k: v.grad.clone() for k, v in policy.named_parameters()})
        policy.zero_grad()
        losses.append(loss)
        assert int(metrics[PAIR_COUNT]) == len(PAIRS)

    want = paper_losses(reference_logps(policy), reference_logps(reference), name)
    assert_steps_equal(policy, want, losses, grads)


def test_the_unfused_path_gives_the_same_loss_and_metrics(tmp_path):
    policy, reference = moved_policy()
    objective = PairObjective("dpo", PreferenceSettings(), "model", reference)
    batch = pair_batches(tmp_path, False)[0]
    fused, unfused = {}, {}
    a = objective.loss_sum(policy, batch, FP32, True, fused)
    b = objective.loss_sum(policy, batch, FP32, False, unfused)
    torch.testing.assert_close(a, b, **TOL)
    for k, v in mean_metrics(fused).items():
        assert mean_metrics(unfused)[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k


def test_reference_free_dpo_compares_log_probabilities_against_zero(tmp_path):
    policy, _ = moved_policy()
    batch = pair_batches(tmp_path, False)[0]
    got = PairObjective("dpo", PreferenceSettings(beta=0.1), "none").loss_sum(policy, batch, FP32)
    p = reference_logps(policy)
    want = -torch.nn.functional.logsigmoid(0.1 * (p.chosen - p.rejected)).sum()
    torch.testing.assert_close(got, want, **TOL)


def test_the_reference_follows_the_method_and_the_objective():
    assert resolve_reference("dpo", "auto", "lora") == "adapters"
    assert resolve_reference("dpo", "auto", "qlora") == "adapters"
    assert resolve_reference("dpo", "auto", "full") == "model"
    assert resolve_reference("ipo", "model", "lora") == "model"
    assert resolve_reference("dpo", "none", "full") == "none"
    assert resolve_reference("orpo", "auto", "full") == resolve_reference("simpo", "model", "lora") == "none"


def preference_settings(tiny_model_dir, toy_data_dir, objective: str, method: str) -> dict:
    from conftest import finetune_settings

    cfg = finetune_settings(tiny_model_dir, toy_data_dir)
    cfg["model"]["method"] = method
    files = ("kto_train.jsonl", "kto_eval.jsonl") if objective == "kto" else ("pref_train.jsonl", "pref_eval.jsonl")
    cfg["data"].update(train=str(toy_data_dir / files[0]), eval=str(toy_data_dir / files[1]))
    cfg["train"].update(objective=objective, max_steps=6, eval_every=3, eval_max_batches=2)
    cfg["optim"]["lr"] = 1e-2
    cfg["checkpoint"] = {"every_steps": 2, "keep_last": 5}
    cfg["log"].update(every_steps=3)  # records at 3 and 6: the resume at 4 carries step 4's sums into the record of 6
    return cfg


@pytest.mark.parametrize("objective,method,reference", [
    ("dpo", "full", "auto"), ("dpo", "lora", "auto"), ("ipo", "full", "auto"), ("simpo", "full", "auto"), ("orpo", "lora", "auto"),
    ("kto", "full", "auto"), ("dpo", "full", "precompute"),
])
def test_a_crashed_preference_run_resumes_exactly(objective, method, reference, tiny_model_dir, toy_data_dir, tmp_path, monkeypatch):
    """Crashed in step 5, resumed from the step-4 checkpoint: the same weights and the same metric records
    (rewards included: a half-filled log window carries over) as the uninterrupted run. A full fine-tune's
    reference stays the starting weights, not the checkpoint's."""
    import trainforge.engine.trainer as trainer
    from test_resume import Crash, crash_in_step, train, train_records

    cfg = preference_settings(tiny_model_dir, toy_data_dir, objective, method)
    cfg["preference"] = {"reference": reference}
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    train(cfg, whole)
    original = trainer.forward_backward_adaptive
    crash_in_step(monkeypatch, 5)
    with pytest.raises(Crash):
        train(cfg, cut)
    monkeypatch.setattr(trainer, "forward_backward_adaptive", original)
    resumed, _ = train(cfg, cut)
    assert resumed.summary["resumed_from_step"] == 4
    a, b = train_records(whole), train_records(cut)
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            assert x[k] == pytest.approx(y[k], rel=1e-6, abs=1e-7), (x["step"], k)
    assert "reward_accuracy" in a[-2] and "eval_reward_accuracy" in a[-1]
    wa = torch.load(whole / "checkpoints" / "step-00000006" / "state.pt", weights_only=True)["model"]
    wb = torch.load(cut / "checkpoints" / "step-00000006" / "state.pt", weights_only=True)["model"]
    for k, v in wa.items():
        assert torch.equal(v, wb[k]), k


def test_an_objective_and_data_that_do_not_match_are_refused_naming_the_key(tmp_path):
    from types import SimpleNamespace

    from trainforge.config.run import ConfigError, load_config
    from trainforge.data.plan import rows_for
    from trainforge.data.sources import DataError

    with pytest.raises(ConfigError, match="data.packing: train.objective dpo"):
        load_config(None, ["train.objective=dpo", "data.packing=false"])
    with pytest.raises(ConfigError, match="data.format: preference rows"):
        load_config(None, ["data.format=preference"])
    with pytest.raises(ConfigError, match="train.objective"):
        load_config(None, ["train.objective=cpo"])
    with pytest.raises(ConfigError, match="preference.reference: kto compares"):
        load_config(None, ["train.objective=kto", "preference.reference=none"])
    # pairs named as such: auto would refuse them under kto too, so the message names unpaired alone (it said 'or auto')
    with pytest.raises(ConfigError, match=r"data.format: train.objective kto reads unpaired rows; for KTO on pairs set "
                       r"data.format: unpaired \(each chosen reply a desirable example") as e:
        load_config(None, ["train.objective=kto", "data.format=preference"])
    assert "or auto" not in str(e.value)
    pairs, text = SimpleNamespace(format="preference"), SimpleNamespace(format="text")
    with pytest.raises(DataError, match="set train.objective to dpo"):
        rows_for(load_config(None), pairs)
    with pytest.raises(DataError, match="train.objective=orpo needs preference rows"):
        rows_for(load_config(None, ["train.objective=orpo"]), text)
    # SFT on KTO rows: the objective, or the format that reads them for SFT (a user had to guess data.format: chat)
    with pytest.raises(DataError, match=r"holds unpaired rows .*: set train.objective to kto; or, for SFT, to learn every "
                       r"row's reply as a target, whatever its 'label': data.format: chat \(\{messages, label\} rows\) or "
                       r"data.format: prompt_completion \(\{prompt, completion, label\} string rows\)$"):
        rows_for(load_config(None), SimpleNamespace(format="unpaired"))
    with pytest.raises(DataError, match="train.objective=kto needs unpaired rows"):
        rows_for(load_config(None, ["train.objective=kto"]), pairs)
    with pytest.raises(DataError, match=r"or, for SFT, to learn the chosen replies as targets: data.format: prompt_completion "
                       r"and data.fields: \{completion: chosen\}.*data.format: chat and data.fields: \{messages: chosen\}"):
        rows_for(load_config(None), pairs)  # SFT on pairs: the objective, or how to learn the chosen replies
    # the other kind of preference rows: the objective is the fix, not a data.fields rename
    with pytest.raises(DataError, match=r"holds preference rows .*: set train.objective to dpo, ipo, orpo or simpo; or, "
                       r"for KTO on the pairs, data.format: unpaired \(each chosen reply a desirable example"):
        rows_for(load_config(None, ["train.objective=kto"]), pairs)
    with pytest.raises(DataError, match=r"holds unpaired rows .*: set train.objective to kto$"):
        rows_for(load_config(None, ["train.objective=dpo"]), SimpleNamespace(format="unpaired"))
    # a tool that builds the data settings itself (eval's --data) names the sources and the fix as the user gives them
    cfg = load_config(None, ["train.objective=kto"])
    cfg = cfg.model_copy(update={"data": cfg.data.named_as("--data pairs.jsonl", "score them with --set train.objective={}")})
    with pytest.raises(DataError, match=r"but --data pairs\.jsonl holds preference rows .*: score them with --set train\.objective=dpo;"):
        rows_for(cfg, pairs)
    # ... and the KTO alternative as a --set too, not as a config key ('data.format: unpaired' is no eval option)
    cfg = cfg.model_copy(update={"data": cfg.data.named_as("--data pairs.jsonl", "score them with --set train.objective={}",
                                                           "--set {}={}")})
    with pytest.raises(DataError, match=r"; or, for KTO on the pairs, --set data\.format=unpaired \(") as e:
        rows_for(cfg, pairs)
    assert "data.format:" not in str(e.value)
    assert "data.train" not in cfg.data.source_label() and "data.train=" in load_config(None).data.source_label()
    # an encoder-decoder: the objective the message named was refused in turn ("dpo is for decoder-only models");
    # it says so, and how to learn the chosen replies as targets
    t5 = RunConfig.model_validate({"model": {"init": {"architecture": "t5", "d_model": 32}},
                                   "data": {"train": "builtin:python-function-pairs", "max_length": 16}})
    with pytest.raises(DataError, match=r"this model is an encoder-decoder .*data.fields: \{completion: chosen\}") as e:
        rows_for(t5, pairs)
    assert "set train.objective" not in str(e.value)
    with pytest.raises(DataError, match=r"holds unpaired rows .*this model is an encoder-decoder \(source -> target rows\); "
                       r"to learn every row's reply as a target, whatever its 'label': data.format: chat"):
        rows_for(t5, SimpleNamespace(format="unpaired"))
    # {prompt, completion, label: 1} rows are prompt/completion data: the message says why, and how to find the row
    with pytest.raises(DataError, match=r"is prompt_completion data \(told apart by a 'label' of true or false, not 1/0"):
        rows_for(load_config(None, ["train.objective=kto"]), SimpleNamespace(format="prompt_completion"))


KTO = [  # (prompt, completion, desirable); each example's KL sample is its prompt with the next one's completion
    ([5, 6, 7], [8, 9, 10, 11], True),
    ([20, 21], [22, 23], False),
    ([30, 31, 32, 33], [34], True),
]


def kto_batches(tmp_path, per_row: bool):
    sequences, labels = [], []
    for i, (prompt, completion, good) in enumerate(KTO):
        other = KTO[(i + 1) % len(KTO)][1]
        for reply in (completion, other):
            sequences.append((prompt + reply, [False] * len(prompt) + [True] * len(reply)))
            labels.append(good)
    store = make_store(tmp_path / f"kto-{per_row}", sequences, vocab_size=64)
    store.desirable = np.asarray(labels)
    width = 11 if per_row else 48  # 11: the longest example with its KL sample, too short for two
    rows = pair_rows(store, np.arange(len(KTO)), max_length=width)
    collate = RowCollator(store, pad_id=0, mode=True, max_length=width)
    if per_row:
        assert len(rows) == len(KTO)
        return [collate([r], [i]) for i, r in enumerate(rows)]
    return [collate(rows, [0])]


def test_a_kto_step_follows_the_paper_with_the_steps_kl_in_one_or_three_micro_batches(tmp_path):
    """The reference point is KL(policy || reference) estimated on the mismatched samples of the whole step
    (clamped at 0, no gradient): three micro-batches give the loss and gradient of one."""
    from test_preference import padded_logps

    policy, reference = moved_policy()
    settings = PreferenceSettings(beta=0.5, desirable_weight=1.0, undesirable_weight=1.5)
    objective = PairObjective("kto", settings, "model", reference)
    grads, losses = [], []
    for per_row in (False, True):
        batches = kto_batches(tmp_path, per_row)
        metrics: dict = {}
        losses.append(forward_backward(policy, batches, FP32, torch.device("cpu"), objective=objective, metrics=metrics))
        grads.append({k: v.grad.clone() for k, v in policy.named_parameters()})
        policy.zero_grad()
        assert int(metrics[PAIR_COUNT]) == len(KTO)

    def logps(model, kl: bool) -> torch.Tensor:
        return torch.stack([padded_logps(model, p, KTO[(i + 1) % len(KTO)][1] if kl else c) for i, (p, c, _) in enumerate(KTO)])

    with torch.no_grad():
        ref, ref_kl = logps(reference, False), logps(reference, True)
        kl = (logps(policy, True) - ref_kl).mean().clamp(min=0)
    ratio = logps(policy, False) - ref
    good = torch.tensor([g for *_, g in KTO])
    want = torch.where(good, 1.0 * (1 - torch.sigmoid(0.5 * (ratio - kl))), 1.5 * (1 - torch.sigmoid(0.5 * (kl - ratio)))).mean()
    assert_steps_equal(policy, want, losses, grads)


def test_a_precomputed_reference_trains_as_the_frozen_copy_and_is_computed_once(tiny_model_dir, toy_data_dir, tmp_path):
    """reference: precompute gives the losses, rewards and weights of a frozen copy of the starting weights, with
    no second copy and no reference forward in the steps; the table is cached beside the token store and a
    second run loads it."""
    from test_resume import train, train_records

    cfg = preference_settings(tiny_model_dir, toy_data_dir, "dpo", "full")
    cfg["data"]["cache_dir"] = str(tmp_path / "cache")
    copy_run, _ = train({**cfg, "preference": {"reference": "model"}}, tmp_path / "copy")
    first, console = train({**cfg, "preference": {"reference": "precompute"}}, tmp_path / "pre")
    assert "computed with the starting weights" in console and first.summary["reference"] == "precompute"
    tables = list((tmp_path / "cache").rglob("reference/*/train.npy"))
    assert len(tables) == 1 and len(list((tmp_path / "cache").rglob("reference/*/eval.npy"))) == 1
    for a, b in zip(train_records(tmp_path / "copy"), train_records(tmp_path / "pre")):
        assert a.keys() == b.keys()
        for k in a:
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), (a["step"], k)
    _, again = train({**cfg, "preference": {"reference": "precompute"}}, tmp_path / "again")
    assert "loaded from the cache" in again and "computed with" not in again
    assert copy_run.summary["eval_reward_accuracy"] == pytest.approx(first.summary["eval_reward_accuracy"])


@pytest.mark.parametrize("objective, key", [
    ("ipo", "label_smoothing=0.1"), ("simpo", "label_smoothing=0.1"), ("dpo", "simpo_gamma=1.0"),
    ("orpo", "desirable_weight=1.33"), ("dpo", "undesirable_weight=2"), ("simpo", "reference=precompute"),
    ("orpo", "reference=model"),
])
def test_a_preference_key_the_objective_does_not_read_is_refused(objective, key):
    """A setting that would change nothing (a TRL user's SimPO label smoothing) is named, not silently dropped."""
    from trainforge.config.run import ConfigError, load_config

    name = key.split("=")[0]
    with pytest.raises(ConfigError, match=f"preference.{name}: .* has no effect on train.objective {objective}"):
        load_config(None, [f"train.objective={objective}", f"preference.{key}"])


def test_preference_keys_the_objective_reads_or_leaves_at_their_default_are_accepted():
    from trainforge.config.run import load_config

    assert load_config(None, ["train.objective=dpo", "preference.label_smoothing=0.1"]).preference.label_smoothing == 0.1
    assert load_config(None, ["train.objective=simpo", "preference.simpo_gamma=1.0"]).preference.simpo_gamma == 1.0
    assert load_config(None, ["train.objective=kto", "preference.desirable_weight=1.33"]).preference.desirable_weight == 1.33
    assert load_config(None, ["train.objective=ipo", "preference.label_smoothing=0.0", "preference.simpo_gamma=0.5"])
    assert load_config(None, ["train.objective=orpo", "preference.reference=none"]).preference.reference == "none"


def test_kto_reward_accuracy_is_0_while_the_policy_is_its_reference(tmp_path):
    """Before the first step every reward equals the reference point (beta x KL = 0): no example is on the side its
    label asks for. It counted a tie as right for undesirable examples, so a run began at the share of undesirable
    examples in its eval batches (100% on one of them), not at 0 as DPO does."""
    policy = tiny_llama()
    objective = PairObjective("kto", PreferenceSettings(beta=0.1), "model", copy.deepcopy(policy).requires_grad_(False))
    metrics: dict = {}
    forward_backward(policy, kto_batches(tmp_path, False), FP32, torch.device("cpu"), objective=objective, metrics=metrics)
    assert int(metrics[PAIR_COUNT]) == len(KTO) and float(metrics["reward_accuracy"]) == 0.0


def test_the_kto_line_counts_each_label_and_says_the_weights_that_balance_them():
    """TRL's KTOTrainer warns when desirable_weight x desirable / (undesirable_weight x undesirable) is outside the
    paper's 1 to 4/3; a run on 160 desirable and 20 undesirable examples said nothing of it."""
    from trainforge.engine.objective import describe_objective

    def line(good: int, bad: int, **weights) -> str:
        labels = np.repeat(np.asarray([True] * good + [False] * bad), 2)  # two sequences an example
        return describe_objective(PairObjective("kto", PreferenceSettings(**weights), "adapters"), labels)

    assert line(100, 100).endswith("; train examples: 100 desirable, 100 undesirable")
    assert line(160, 20).endswith("; train examples: 160 desirable, 20 undesirable (weighted 8.00 to 1; the KTO paper keeps "
                                  "this within 1 to 4/3: set preference.desirable_weight to 0.12-0.17, or "
                                  "preference.undesirable_weight to 6.00-8.00)")
    assert line(160, 20, undesirable_weight=7.0).endswith("160 desirable, 20 undesirable")
    assert line(50, 0).endswith("(one label only: the KTO paper trains on both)")
    dpo = describe_objective(PairObjective("dpo", PreferenceSettings(), "adapters"))
    assert dpo == "objective: dpo (beta 0.1), reference: the same model with its LoRA adapters off"


def test_eval_of_full_weights_without_a_starting_model_says_what_to_give(tmp_path):
    """trainforge eval of a plain model directory on pairs: its reference (the model it was tuned from) is unknown,
    and the error says so, not that "this run" did not load one; a run whose start is gone names that directory."""
    from pathlib import Path

    from trainforge.config.run import ConfigError, load_config
    from trainforge.model.resolve import ModelSource
    from trainforge.tools.evaluate_preference import eval_objective

    cfg = load_config(None, ["train.objective=dpo"])
    plain = ModelSource(path=Path("models/chatml"), weights=tmp_path)
    with pytest.raises(ConfigError, match=r"a model directory does not name \(it is not a trainforge run\); give it with "
                                          r"--set model.path=DIR \(the model before preference tuning\)"):
        eval_objective(cfg, plain, torch.device("cpu"), None)
    gone = ModelSource(path=Path("run"), weights=tmp_path, run_config={"model": {"path": str(tmp_path / "gone")}})
    with pytest.raises(ConfigError, match=r"gone, which is not a directory now"):
        eval_objective(cfg, gone, torch.device("cpu"), None)
