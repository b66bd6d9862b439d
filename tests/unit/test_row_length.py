"""The row length at set-up (engine/row_length.py): ``data.max_length: auto`` takes the longest length that fits here,
as ``plan --longest`` finds it, capped by the model's positions, and a resumed run its checkpoint's; a length that
does not fit even with the long-context levers is refused (exit 4) naming the longest that does."""

from __future__ import annotations

import json

import pytest
import torch

import trainforge.engine.row_length as row_length
import trainforge.tools.plan_longest as plan_longest
from trainforge.config.errors import ConfigError
from trainforge.config.run import RunConfig
from trainforge.dist import DistContext
from trainforge.engine.oom import OutOfMemory
from trainforge.engine.predict.fit import predict_memory
from trainforge.engine.predict.levers import Levers, with_levers
from trainforge.engine.predict.longest import GRANULE, auto_cap, auto_length, longest_length, run_levers
from trainforge.engine.predict.trace_cache import reusing_traces
from trainforge.engine.resume import check_settings
from trainforge.errors import EXIT_OUT_OF_MEMORY
from trainforge.hardware.device import PRECISIONS
from trainforge.hardware.profiles import GIB, HardwareProfile
from trainforge.rundir.checkpoint import inspect_checkpoint
from trainforge.tools.plan import VocabOnly
from trainforge.tools.plan_decisions import with_auto_length

VOCAB = VocabOnly(256)
BF16 = PRECISIONS["bf16"]
CPU = torch.device("cpu")
SMALL_GIB = 0.02  # the test device: a few thousand tokens of the model below fit, so every trace stays short
# one layer and no tiled MLP: each trace of a step takes about a second on a busy 2-core machine
SHAPE = {"architecture": "llama", "hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 1,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1 << 20}


@pytest.fixture(scope="module", autouse=True)
def shared_traces():
    """A step traced once for the whole module: the tests search the same model on the same device (a trace is
    keyed by every setting, so only equal settings share one)."""
    with reusing_traces():
        yield


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("rows") / "d.jsonl"
    path.write_text('{"text": "alpha beta gamma"}\n')
    return path


@pytest.fixture
def config(data_file):
    def make(shape: dict | None = None, max_length: int | str = "auto", **train) -> RunConfig:
        train = {"precision": "bf16", "micro_batch_size": "auto", "tiled_mlp": False, **train}
        return RunConfig.model_validate({"model": {"init": shape or SHAPE, "tokenizer": "char"},
                                         "data": {"train": str(data_file), "max_length": max_length}, "train": train})
    return make


def device(gib: float) -> HardwareProfile:
    return HardwareProfile("tiny", "a tiny device", gib, {"fp32": 1.0, "bf16": 2.0, "fp16": 2.0}, 100.0, True,
                           fixed_gib=0.0, allocator_overhead=0.0, kind="cpu")


@pytest.fixture
def small_machine(monkeypatch):
    """This machine, as set-up and ``plan --longest`` see it, is the SMALL_GIB test device."""
    monkeypatch.setattr(row_length, "this_profile", lambda *a, **k: device(SMALL_GIB))
    monkeypatch.setattr(row_length, "device_memory", lambda d: (int(SMALL_GIB * GIB), "the test device"))
    monkeypatch.setattr(plan_longest, "resolve_profile", lambda hardware, cfg: (device(SMALL_GIB), None))
    monkeypatch.setattr(plan_longest, "lever_table", lambda *a, **k: [])  # the run's own row only (each row is a search)
    monkeypatch.setattr(plan_longest, "plan_tokenizer", lambda cfg: VOCAB)  # the same object: its traces are shared


def test_auto_takes_the_longest_that_fits_as_plan_longest_finds_it(config, tmp_path, small_machine):
    cfg = config()
    decided = row_length.decide_length(cfg, VOCAB, BF16, CPU, DistContext(), tmp_path / "run", "auto")
    plan = plan_longest.longest_plan(cfg)
    planned, row = with_auto_length(cfg, VOCAB, BF16, device(SMALL_GIB))
    n = decided.length
    assert n == plan["run"]["longest"] == plan["auto"]["max_length"] == planned.data.max_length
    assert 0 < n < 8192 and n % GRANULE == 0  # the memory, not a cap, decides: a short, checkable answer
    at = lambda length: predict_memory(with_levers(cfg, Levers(True), length), VOCAB, BF16, device(SMALL_GIB), 1, True)  # noqa: E731
    assert at(n).fits(0.9) and not at(n + GRANULE).fits(0.9)  # the last length that fits in 90%
    assert decided.why.startswith(f"{n}: the longest that fits in 90% of") and "at 1 row with checkpointing" in decided.why
    assert row == [{"setting": "max_length", "choice": str(n), "why": decided.why}]  # plan's decision row says the same


def test_auto_takes_the_micro_batch_the_run_sets(config):
    one = auto_length(config(), VOCAB, BF16, device(SMALL_GIB)).length
    two = auto_length(config(micro_batch_size=2), VOCAB, BF16, device(SMALL_GIB))
    assert 0 < two.length < one and "at 2 rows" in two.why


def test_auto_is_capped_by_the_model_positions(config):
    roomy = device(8.0)
    rope = config({**SHAPE, "max_position_embeddings": 1000})
    assert auto_cap(rope) == (1000, "the model's max_position_embeddings (1000)")
    choice = auto_length(rope, VOCAB, BF16, roomy)  # far below the device there: the cap, without a search
    assert choice.length == 1000 and choice.found is None and "capped by the model's max_position_embeddings" in choice.why
    gpt2 = config({"architecture": "gpt2", "n_embd": 64, "n_layer": 1, "n_head": 4, "n_positions": 512})
    assert auto_length(gpt2, VOCAB, BF16, roomy).length == 512
    assert auto_cap(gpt2)[1] == "the model's learned position table (512 positions)"
    grpo = rope.model_copy(update={"train": rope.train.model_copy(update={"objective": "grpo"}),
                                   "rl": rope.rl.model_copy(update={"max_completion_length": 200})})
    assert auto_cap(grpo)[0] == 800  # the completion is sampled behind the prompt's row
    # a search whose cap is under one granule tries the cap itself
    found = longest_length(rope, VOCAB, BF16, roomy, Levers(True), cap=(128, "a short table"))
    assert (found.length, found.capped, sorted(found.traced)) == (128, "a short table", [128])


def test_auto_is_for_decoder_only_models_and_is_resolved_before_it_is_read(config):
    cfg = config()
    assert cfg.data.max_length == "auto"
    with pytest.raises(ConfigError, match="must be resolved"):
        cfg.row_tokens()
    with pytest.raises(ValueError, match="max_length: auto is for decoder-only models"):
        RunConfig.model_validate({"model": {"init": {"architecture": "t5", "d_model": 32, "num_layers": 1, "num_heads": 2,
                                                     "d_ff": 64, "d_kv": 16}},
                                  "data": {"train": str(config().data.train), "max_length": "auto"}})
    with pytest.raises(ValueError, match="greater than 0 and at most"):
        config(max_length=0)


def fake_checkpoint(run_dir, step: int, length: int):
    """A complete checkpoint as resuming reads it before anything loads: meta.json (its fixed settings) and state.pt."""
    path = run_dir / "checkpoints" / f"step-{step:08d}"
    path.mkdir(parents=True)
    (path / "state.pt").write_bytes(b"")
    (path / "meta.json").write_text(json.dumps({"step": step, "files": {}, "fixed": {"data.max_length": length}}))
    return path


def test_a_resumed_auto_run_takes_its_checkpoint_length(config, tmp_path, small_machine):
    cfg = config()
    out = tmp_path / "run"
    fresh = row_length.decide_length(cfg, VOCAB, BF16, CPU, DistContext(), out, "auto").length
    fake_checkpoint(out, 2, 512)
    newest = fake_checkpoint(out, 4, 768)
    assert fresh not in (512, 768)  # resolving again here would give another length
    decided = row_length.decide_length(cfg, VOCAB, BF16, CPU, DistContext(), out, "auto")
    assert (decided.length, decided.why) == (768, "768: as in the checkpoint being resumed")
    assert row_length.resumed_length(out, str(out)) == 768  # --resume a run directory
    assert row_length.resumed_length(tmp_path / "elsewhere", str(out / "checkpoints" / "step-00000002")) == 512
    assert row_length.resumed_length(out, "never") is None
    assert row_length.resumed_length(tmp_path / "new", "auto") is None
    # the checkpoint binds the resolved length: auto resumes it, another number is refused
    info = inspect_checkpoint(newest)
    check_settings(info, cfg)
    with pytest.raises(Exception, match="data.max_length: 768 in the checkpoint, 512 now"):
        check_settings(info, cfg.model_copy(update={"data": cfg.data.model_copy(update={"max_length": 512})}))


def test_a_length_that_does_not_fit_with_the_levers_is_refused_naming_the_longest(config, small_machine):
    cfg = config(max_length=16384)  # one row: a CPU run with micro_batch_size auto starts there
    longest = longest_length(cfg, VOCAB, BF16, device(SMALL_GIB), run_levers(cfg, device(SMALL_GIB))).length
    with pytest.raises(OutOfMemory) as e:
        row_length.refuse_what_cannot_fit(cfg, VOCAB, BF16, CPU, DistContext())
    message = str(e.value)
    assert e.value.exit_code == EXIT_OUT_OF_MEMORY
    assert message.startswith("data.max_length 16,384 does not fit even with the long-context levers: predicted")
    assert f"the longest that fits (in 90%) is {longest:,} tokens: set data.max_length: {longest} or less" in message
    assert "train.tiled_mlp: auto (it is off)" in message and "of the test device" in message
    row_length.refuse_what_cannot_fit(with_length(cfg, longest), VOCAB, BF16, CPU, DistContext())  # that one runs


def with_length(cfg: RunConfig, n: int) -> RunConfig:
    return cfg.model_copy(update={"data": cfg.data.model_copy(update={"max_length": n})})


def test_what_the_levers_make_fit_is_not_refused_by_the_rough_estimate(config, monkeypatch):
    # a wide MLP: the rough estimate counts its intermediates for the whole row, the tiled MLP keeps one tile's
    cfg = config({**SHAPE, "intermediate_size": 1024}, max_length=16384, micro_batch_size=1, tiled_mlp="auto")
    levers = run_levers(cfg, device(1.0))
    assert levers == Levers(True, True)
    traced = predict_memory(with_levers(cfg, levers), VOCAB, BF16, device(1.0), 1, True).process
    rough = row_length.rough_skeleton_estimate(cfg, VOCAB, BF16, 1, True).total
    capacity = int(1.1 * traced)
    assert rough > 2 * capacity  # the rough estimate alone refuses it
    monkeypatch.setattr(row_length, "this_profile", lambda *a, **k: device(capacity / GIB))
    monkeypatch.setattr(row_length, "device_memory", lambda d: (capacity, "the test device"))
    row_length.refuse_what_cannot_fit(cfg, VOCAB, BF16, CPU, DistContext())


def test_prepare_resolves_auto_as_a_run_here_does(config):
    from rich.console import Console

    from trainforge.metrics.console import ConsoleReporter

    cfg = config({**SHAPE, "max_position_embeddings": 128}, precision="fp32", device="cpu")
    resolved = row_length.resolve_here(cfg, ConsoleReporter(Console(quiet=True)))
    assert resolved.data.max_length == 128 and cfg.data.max_length == "auto"
    given = config(max_length=512)
    assert row_length.resolve_here(given) is given


def test_the_cpu_profile_counts_the_modeling_code_a_run_holds():
    """A plan on a CPU takes its process's RSS as a run's fixed cost; run before anything imported transformers'
    modeling code (0.16 GiB here) it was that much under a run's, and plan --longest under a 1.5 GiB cap predicted
    27,904 tokens where 12,032 fit. Measured in a fresh interpreter, as `trainforge plan` starts."""
    import subprocess
    import sys

    code = ("import sys, torch; from trainforge.hardware.device import this_profile, process_rss_bytes, CPU_RUN_EXTRA_GIB; "
            "p = this_profile(torch.device('cpu'), timing=False); "
            "print('transformers.modeling_utils' in sys.modules, p.fixed_gib - CPU_RUN_EXTRA_GIB, process_rss_bytes() / 2**30)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    imported, fixed, now = done.stdout.split()[-3:]
    assert imported == "True", done.stderr[-2000:]
    assert float(fixed) >= 0.95 * float(now)  # measured with the modeling code loaded, not before it
