"""``trainforge selftest``: every training path on the device at hand, checked, in about a minute.

The matrix is defined once, here; the CLI and the unit tests run the same cases through the
same runner. A case trains a tiny Llama for a few steps through the real entry point
(``engine.trainer.train``: data preparation, checkpoints, evaluation, ``final/``, a sample)
and is checked against the fp32 run of the same (data, method, head):

    precision {fp32, bf16, fp16 + GradScaler}
  x data      {concat:     text joined and cut into blocks (packing: concat, too_long: split),
               packed:     text documents packed, boundaries kept (packing: true),
               completion: prompt/completion, completion-only loss, one padded example per row,
               chat:       OpenAI-style {"messages": [...]}, assistant-only loss, packed}
  x method    {full: from model.init (untied head), lora: a local "pretrained" model (tied head)}
  x head      {fused: chunked LM-head loss, standard: the model's own head + cross-entropy}
  + compiled  train.compile: true, on one case
  + checkpointing  train.activation_checkpointing: true, on a full and a LoRA case

Beside the training cases, per precision: fused vs standard gradients on a batch with masked
positions, a run stopped after a checkpoint and resumed against the uninterrupted one, and
packed attention against a reference computed one document at a time; once: the non-finite
guard as CUDA runs it (read one step late) and pinned host memory. On CUDA the same matrix runs
on the GPU, which exercises what only runs there: flash-attention varlen over packed documents
(when flash_attn is installed), pinned memory with non-blocking copies, the lagged guard.

Nothing is downloaded: tokenizer, model and data are built locally from fixed seeds, once per
cache directory (``selftest/`` in trainforge's cache).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import random
import shutil
import signal
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

PRECISIONS = ("fp32", "bf16", "fp16")
DATA_SHAPES = ("concat", "packed", "completion", "chat")
METHODS = ("full", "lora")
HEADS = ("fused", "standard")

STEPS = 8  # optimizer steps per case: enough for the loss to fall clearly, few enough to stay fast
CHECKPOINT_EVERY = 4  # a mid-run and an end-of-run checkpoint; the resume check stops after step 4

# ---------------------------------------------------------------- tolerances
#
# Largest gaps measured over the whole matrix (8 steps, hidden 32, AdamW at lr 3e-3 full / 5e-3
# LoRA; AMD EPYC CPU with AVX512-BF16, fp16 emulated; torch 2.13), relative to the fp32 run:
#                     loss (every step)   pre-clip grad norm (every step)
#   bf16              1.9e-3              1.1e-2
#   fp16              9e-5                1.2e-3
# bf16 keeps 8 significant bits (unit roundoff 2^-8 = 3.9e-3), fp16 11 (4.9e-4). Under autocast
# only the matmuls round; the loss, softmax statistics, norms and the AdamW update stay fp32, so
# step 1's loss differs by ~1e-4 and the gap grows only as rounding differences move the weights
# apart over the steps (AdamW normalizes each update, so a tiny gradient difference can flip the
# sign of a near-zero coordinate's update: the grad norm diverges faster than the loss).
# The tolerances are 5-10x the worst gap measured (other CPUs, GPU kernels and TF32 "fp32" on
# Ampere+ round differently), and far below what a precision bug does:
#   - a loss or gradient scaled wrong (a wrong token count, a loss divided twice): gaps >= 50%
#   - gradients left scaled by the GradScaler: AdamW is nearly scale-invariant and clipping hides
#     the size, so the loss barely moves; the pre-clip grad norm is off by the scale (2^16)
#   - a loss or reduction accumulated in bf16 instead of fp32: a sum of ~500 token losses of ~5
#     has a bf16 ulp of 16 (2^-8 x 4096): gaps of several percent
#   - an fp16 overflow let through: inf/NaN (finiteness check); not skipped and backed off by the
#     scaler: its saved scale does not match the overflows counted (exact check)
LOSS_TOL = {"fp32": 1e-5, "bf16": 1e-2, "fp16": 1e-3}
GRAD_NORM_TOL = {"fp32": 1e-4, "bf16": 5e-2, "fp16": 1e-2}
# Fused vs standard head, per tensor ||g_fused - g_std|| / ||g_std|| and the loss, on one batch
# from the same weights: both paths round the same products (logits in the compute dtype, softmax
# and loss in fp32) and differ only in summation order and chunking. Measured: fp32 2e-6, bf16
# 7e-6, fp16 5e-4. Tolerance: a few ulps of the compute dtype (bf16 1e-2 ~ 2.5 ulp), what two
# GEMM algorithms for the same product may disagree by; a wrong factor or a lost term is >= 1e-1.
HEAD_GRAD_TOL = {"fp32": 1e-5, "bf16": 1e-2, "fp16": 5e-3}
# Packed rows vs each document alone: max |logit difference| / max |reference logit|, the packed
# rows under the precision, the reference in fp32 (flash-attention: in the half dtype). Measured:
# fp32 4e-7, bf16 9e-3, fp16 1e-3 (the whole 2-layer model's rounding). A document that attends to
# its neighbour gives ~1 (the check measures that too and requires it to stand out).
ATTENTION_TOL = {"fp32": 1e-5, "bf16": 3e-2, "fp16": 5e-3}
MIN_DECREASE = 0.05  # the eval loss after training must be at least 5% below the one before
# Resume on CUDA: kernels such as the embedding backward add with atomics in no fixed order, so
# two identical runs differ in the last bits; bitwise equality is promised (and checked) on CPU.
CUDA_RESUME_TOL = 1e-3  # max |weight difference| / max |weight|


# ---------------------------------------------------------------- the matrix


@dataclass(frozen=True)
class Case:
    """One training path: precision x data shape x method x head (x compiled)."""

    precision: str
    data: str
    method: str
    head: str
    compiled: bool = False
    checkpointing: bool = False  # train.activation_checkpointing

    @property
    def name(self) -> str:
        return (
            f"{self.precision}-{self.data}-{self.method}-{self.head}"
            + ("-compiled" if self.compiled else "")
            + ("-checkpointing" if self.checkpointing else "")
        )

    @property
    def reference(self) -> "Case":
        """The fp32 eager case of the same data, method and head: what this one must track."""
        return Case("fp32", self.data, self.method, self.head)


QUICK = {("concat", "full", "fused"), ("packed", "full", "fused"), ("completion", "full", "fused"), ("chat", "full", "fused"),
         ("packed", "full", "standard"), ("chat", "lora", "fused"), ("completion", "lora", "standard")}
"""The ``--quick`` subset, per precision: every data shape, LoRA and the standard head."""


def matrix(quick: bool = False, compiled_precision: str | None = "bf16") -> list[Case]:
    """The cases, fp32 references first. ``quick``: ``QUICK`` per precision and no compile.
    ``compiled_precision``: the precision of the compiled case (None: none)."""
    cases = [
        Case(p, d, m, h)
        for p in PRECISIONS
        for d in DATA_SHAPES
        for m in METHODS
        for h in HEADS
        if not quick or (d, m, h) in QUICK
    ]
    if compiled_precision and not quick:
        cases.append(Case(compiled_precision, "packed", "full", "fused", compiled=True))
    # activation checkpointing recomputes each layer in backward: it must track the plain run
    cases += [Case("fp32", "packed", "full", "fused", checkpointing=True), Case(compiled_precision or "bf16", "chat", "lora", "fused", checkpointing=True)]
    return cases


CASES = matrix()
"""The full matrix (as on CPU), for test parametrization."""

CHECKS = (
    *(f"head-grads-{p}" for p in PRECISIONS),
    *(f"attention-{p}" for p in PRECISIONS),
    *(f"resume-{p}" for p in PRECISIONS),
    "nonfinite-guard",
    "pinned-memory",
)
"""The checks beside the training cases; every one is cheap, ``--quick`` runs them all."""


@dataclass
class Result:
    """The outcome of one case or check, as the table and the ``--out`` JSON show it."""

    name: str
    kind: str  # "train" or "check"
    status: str = "ok"  # "ok" | "FAILED" | "skipped"
    error: str = ""
    detail: str = ""
    seconds: float = 0.0
    losses: list[float] = field(default_factory=list)  # per step, from metrics.jsonl
    grad_norms: list[float] = field(default_factory=list)
    overflows: list[int] = field(default_factory=list)  # fp16 steps the GradScaler skipped
    loss_gap: float | None = None  # largest |loss - fp32 loss| / fp32 loss over the compared steps
    grad_norm_gap: float | None = None
    tokens_per_s: float | None = None
    eval_loss: float | None = None

    @property
    def ok(self) -> bool:
        return self.status != "FAILED"

    def fail(self, message: str) -> None:
        self.status = "FAILED"
        self.error = f"{self.error}; {message}" if self.error else message


class CheckOutcome(Exception):
    """How a check ends other than by passing (a control-flow signal inside selftest, never shown to a user as an error)."""


class CheckFailed(CheckOutcome):
    """A selftest check did not hold."""


class Skip(CheckOutcome):
    """A case or check that does not apply on this device."""


# ---------------------------------------------------------------- assets: tokenizer, model, data

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau".split()
# The "pretrained" model learns the word cycle forwards; the training data of the cases runs it
# backwards: something new for LoRA to learn, and as learnable as any order from scratch.
FORWARD, BACKWARD = 1, -1


def _cycle(start: int, n: int, stride: int = BACKWARD) -> list[str]:
    return [WORDS[(start + stride * i) % len(WORDS)] for i in range(n)]


def _texts(n: int, seed: int, stride: int = BACKWARD) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [{"text": " ".join(_cycle(rng.randrange(len(WORDS)), rng.randrange(5, 40), stride)) + "."} for _ in range(n)]


def _prompt_completions(n: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        start, k, m = rng.randrange(len(WORDS)), rng.randrange(2, 8), rng.randrange(2, 7)
        words = _cycle(start, k + m)
        rows.append({"prompt": "continue: " + " ".join(words[:k]), "completion": " " + " ".join(words[k:])})
    return rows


def _chats(n: int, seed: int) -> list[dict[str, Any]]:
    """OpenAI-style rows: a system turn on some, one or two user/assistant exchanges."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        messages = [{"role": "system", "content": "You continue word cycles."}] if i % 3 == 0 else []
        for _ in range(1 + (i % 2)):
            start, k = rng.randrange(len(WORDS)), rng.randrange(2, 6)
            words = _cycle(start, 2 * k)
            messages.append({"role": "user", "content": " ".join(words[:k])})
            messages.append({"role": "assistant", "content": " ".join(words[k:])})
        rows.append({"messages": messages})
    return rows


MODEL_INIT = {
    "architecture": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,  # grouped-query attention, as current Llama-family models have
    "max_position_embeddings": 128,
}
PRETRAIN_STEPS = 60
ASSETS_VERSION = 1  # bump when what build_assets makes changes in a way the content hash cannot see


@dataclass(frozen=True)
class Assets:
    root: Path
    tokenizer: Path
    pretrained: Path  # a "downloaded" model directory (tied embeddings), what LoRA adapts
    data: dict[str, tuple[Path, Path]]  # data shape -> (train, eval) JSONL


def build_assets(parent: Path, cache_dir: Path | None = None) -> Assets:
    """Tokenizer, a tiny pretrained-style Llama directory and the JSONL files of every data shape,
    from fixed seeds, in a directory of ``parent`` named by a hash of their contents: built once,
    reused by later runs (the token cache then hits too)."""
    files = {
        "text": (_texts(240, 1), _texts(24, 2)),
        "completion": (_prompt_completions(240, 3), _prompt_completions(24, 4)),
        "chat": (_chats(200, 5), _chats(24, 6)),
        "pretrain": (_texts(400, 7, FORWARD), []),
    }
    blob = json.dumps([ASSETS_VERSION, files, MODEL_INIT, PRETRAIN_STEPS], sort_keys=True)
    root = parent / hashlib.blake2b(blob.encode(), digest_size=8).hexdigest()
    root.mkdir(parents=True, exist_ok=True)
    data = {}
    for kind, (train, held_out) in files.items():
        data[kind] = (root / f"{kind}_train.jsonl", root / f"{kind}_eval.jsonl")
        for path, rows in zip(data[kind], (train, held_out)):
            if not path.is_file():
                _atomic_text(path, "".join(json.dumps(r) + "\n" for r in rows))
    tok_dir, model_dir = root / "tokenizer", root / "pretrained"
    if not (tok_dir / "tokenizer.json").is_file():
        from ..model.tokenizer import train_bpe_tokenizer

        texts = [r["text"] for r in files["text"][0] + files["pretrain"][0]]
        texts += [r["prompt"] + r["completion"] for r in files["completion"][0]]
        texts += [m["content"] for r in files["chat"][0] for m in r["messages"]] + ["<|im_start|>user\n<|im_end|>\n"] * 20
        _atomic_dir(tok_dir, train_bpe_tokenizer(texts, vocab_size=320).save_pretrained)
    if not (model_dir / "config.json").is_file():
        _pretrain(root, tok_dir, data["pretrain"][0], model_dir, cache_dir)
    shapes = {"concat": data["text"], "packed": data["text"], "completion": data["completion"], "chat": data["chat"]}
    return Assets(root, tok_dir, model_dir, shapes)


def _pretrain(root: Path, tokenizer: Path, text: Path, model_dir: Path, cache_dir: Path | None) -> None:
    """The "pretrained" model LoRA adapts: the tiny Llama (tied embeddings) trained briefly on
    forward word cycles. LoRA on random weights barely learns in a few steps."""
    from ..config import RunConfig
    from ..engine.trainer import train

    out = root / "pretrain-run"
    shutil.rmtree(out, ignore_errors=True)
    cfg = {
        "model": {"init": {**MODEL_INIT, "tie_word_embeddings": True}, "tokenizer": str(tokenizer)},
        "data": {"train": str(text), "eval": None, "max_length": 64, "num_workers": 1, "cache_dir": _str(cache_dir)},
        "train": {"max_steps": PRETRAIN_STEPS, "micro_batch_size": 8, "precision": "fp32", "device": "cpu", "compile": False, "seed": 1234},
        "optim": {"lr": 3e-3, "warmup_steps": 0, "schedule": "constant"},
        "checkpoint": {"every_minutes": None},
        "log": {"every_steps": PRETRAIN_STEPS, "tensorboard": False, "report": False},
    }
    with _rng_kept():
        train(RunConfig.model_validate(cfg), out, _quiet(), resume="never")
    _atomic_dir(model_dir, lambda tmp: (out / "final").rename(tmp))
    shutil.rmtree(out, ignore_errors=True)


def _atomic_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _atomic_dir(target: Path, write: Callable[[Path], Any]) -> None:
    """``write(tmp)`` fills a directory that then appears at ``target`` whole (or not at all)."""
    tmp = target.with_name(f".{target.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    write(tmp)
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)


def _str(path: Path | None) -> str | None:
    return str(path) if path is not None else None


@contextlib.contextmanager
def _rng_kept() -> Iterator[None]:
    state = torch.random.get_rng_state()
    try:
        yield
    finally:
        torch.random.set_rng_state(state)


def case_config(case: Case, assets: Assets, device: str, cache_dir: Path | None = None) -> dict[str, Any]:
    """The run config of a case: a few steps with checkpoints, eval, final save and a sample."""
    train_file, eval_file = assets.data[case.data]
    data: dict[str, Any] = {
        "train": str(train_file),
        "eval": str(eval_file),
        "max_length": 64,
        "num_workers": 1,  # tiny data: a process pool would cost more than it saves
        "cache_dir": _str(cache_dir),
        "packing": {"concat": "concat", "packed": True, "completion": False, "chat": True}[case.data],
    }
    if case.data == "concat":
        data["too_long"] = "split"
    if case.method == "lora":
        model = {"path": str(assets.pretrained), "method": "lora", "lora": {"r": 8, "alpha": 16}}
    else:
        model = {"init": dict(MODEL_INIT), "tokenizer": str(assets.tokenizer), "method": "full"}
    return {
        "model": model,
        "data": data,
        "train": {
            "max_steps": STEPS,
            "micro_batch_size": 4,
            "grad_accum": 2,  # loss normalization and (fp16) loss scaling across micro-batches
            "precision": case.precision,
            "device": device,
            "fused_loss": case.head == "fused",
            "compile": case.compiled,
            "activation_checkpointing": case.checkpointing,
            "eval_max_batches": 2,
            "seed": 0,
        },
        # LoRA trains only its low-rank update (B starts at zero): a larger step
        "optim": {"lr": 5e-3 if case.method == "lora" else 3e-3, "warmup_steps": 0, "schedule": "constant"},
        "checkpoint": {"every_steps": CHECKPOINT_EVERY, "every_minutes": None, "keep_last": 2},
        # no end-of-run sample when compiled: each new generation length would compile a graph
        "log": {"every_steps": 1, "tensorboard": False, "report": False,
                "sample_prompt": None if case.compiled else "alpha beta", "sample_tokens": 6},
    }


# ---------------------------------------------------------------- the runner


def _quiet():
    from rich.console import Console

    from ..metrics.console import ConsoleReporter

    return ConsoleReporter(Console(quiet=True))


def _error_text(e: BaseException) -> str:
    frames = traceback.extract_tb(e.__traceback__)
    where = next((f"{Path(f.filename).name}:{f.lineno}" for f in reversed(frames) if "/trainforge/" in f.filename), "")
    return f"{type(e).__name__}: {e}" + (f" (at {where})" if where else "")


def _relative_gap(values: list[float], reference: list[float]) -> float:
    return max((abs(v - r) / max(abs(r), 1e-12) for v, r in zip(values, reference)), default=0.0)


def _fmt(values: list[float]) -> str:
    return "[" + ", ".join(f"{v:.4f}" for v in values) + "]"


class SelfTest:
    """Runs cases and checks on one device and remembers the results (each fp32 reference runs once)."""

    def __init__(
        self,
        device: str = "cpu",
        workdir: Path | None = None,
        cache_dir: Path | None = None,
        threads: int | None = 1,
        assets: Assets | None = None,
    ):
        """``workdir``: where the runs go (default: a temporary directory, removed by ``close``).
        ``cache_dir``: token, probe and asset cache (default: trainforge's, ``$TRAINFORGE_CACHE``).
        ``threads``: CPU threads while running. 1 by default: these tiny shapes run fastest on one
        core, and two threads sharing a busy machine wait on each other (measured 10-100x slower
        per op on 2 cores under load); None leaves torch's setting."""
        self.device = torch.device(device)
        self._tmp = None if workdir else tempfile.TemporaryDirectory(prefix="trainforge-selftest-")
        self.workdir = Path(workdir or self._tmp.name)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.cache_dir = cache_dir
        self.threads = threads if self.device.type == "cpu" else None
        self._assets = assets
        if self.device.type == "cuda":
            from ..hardware import configure_backends

            configure_backends(self.device)  # as every run does (TF32 matmuls on Ampere+): checks see the same numerics
        self.results: dict[str, Result] = {}
        self.weights: dict[str, dict[str, torch.Tensor]] = {}  # final weights of each finished case

    @property
    def assets(self) -> Assets:
        if self._assets is None:
            from ..config import default_cache_dir

            with self._threads():
                self._assets = build_assets((self.cache_dir or default_cache_dir()) / "selftest", self.cache_dir)
        return self._assets

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()

    def tolerance(self, table: dict[str, float], precision: str) -> float:
        """``table[precision]``; "fp32" on a GPU with TF32 matmuls on has fp16's unit roundoff (10 bits)."""
        if precision == "fp32" and self.device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
            return table["fp16"]
        return table[precision]

    @contextlib.contextmanager
    def _threads(self) -> Iterator[None]:
        before = torch.get_num_threads()
        if self.threads:
            torch.set_num_threads(self.threads)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    def _attempt(self, result: Result, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` into ``result``: a failure is recorded, never raised (the matrix goes on)."""
        t = time.perf_counter()
        try:
            with self._threads():
                return fn()
        except Skip as e:
            result.status, result.detail = "skipped", str(e)
        except CheckFailed as e:
            result.fail(str(e))
        except Exception as e:  # noqa: BLE001 - every failure is reported with where it happened
            result.fail(_error_text(e))
        finally:
            result.seconds += time.perf_counter() - t
        return None

    # ---------------------------------------------------------------- training cases

    def case(self, case: Case) -> Result:
        """Train ``case`` (its fp32 reference first), check it, remember the result."""
        if case.name in self.results:
            return self.results[case.name]
        reference = self.case(case.reference) if case != case.reference else None
        result = Result(case.name, "train")
        self._attempt(result, lambda: self._train_case(case, result))
        if result.status == "ok" and reference is not None:
            self._compare(case, result, reference)
        self.results[case.name] = result
        return result

    def _train_case(self, case: Case, result: Result) -> None:
        from ..config import RunConfig
        from ..engine.trainer import train
        from ..hardware import PRECISIONS as MODES
        from ..metrics.tracker import read_metrics
        from ..model.generate import sample

        if case.precision == "bf16" and self.device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise Skip("this GPU has no bf16")
        out = self.workdir / case.name
        shutil.rmtree(out, ignore_errors=True)
        cfg = RunConfig.model_validate(case_config(case, self.assets, str(self.device), self.cache_dir))
        graphs_before = _compiled_graphs()
        run = train(cfg, out, _quiet(), resume="never")
        steps = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
        result.losses = [r["loss"] for r in steps]
        result.grad_norms = [r["grad_norm"] for r in steps]
        s = run.summary
        result.tokens_per_s, result.eval_loss = s["tokens_per_s"], s["eval_loss"]
        self.weights[case.name] = {k: v.detach().to("cpu", copy=True) for k, v in run.model.state_dict().items()}

        if [r["step"] for r in steps] != list(range(1, STEPS + 1)):
            raise CheckFailed(f"metrics.jsonl has steps {[r['step'] for r in steps]}, expected 1..{STEPS}")
        bad = [i + 1 for i, loss in enumerate(result.losses) if not math.isfinite(loss)]
        if bad:
            raise CheckFailed(f"non-finite loss at steps {bad}: {_fmt(result.losses)}")
        result.overflows = [i + 1 for i, g in enumerate(result.grad_norms) if not math.isfinite(g)]
        if result.overflows and case.precision != "fp16":
            raise CheckFailed(f"non-finite grad norm at steps {result.overflows}: {_fmt(result.grad_norms)}")
        if s["skipped_steps"]:
            raise CheckFailed(f"{s['skipped_steps']} steps skipped as non-finite")
        self._check_scaler(case, result, out)
        # learning, robust to batch-to-batch noise: the training loss falls from the first half of
        # the run to the second, and the eval loss (the same batches before and after) falls clearly
        half = STEPS // 2
        first, second = sum(result.losses[:half]) / half, sum(result.losses[half:]) / (STEPS - half)
        if not second < first:
            raise CheckFailed(f"training loss did not decrease: mean {first:.4f} over steps 1-{half}, {second:.4f} after")
        before, after = s["eval_loss_before"], s["eval_loss"]
        if not (after is not None and math.isfinite(after) and after < (1 - MIN_DECREASE) * before):
            raise CheckFailed(f"eval loss {before} before training, {after} after: not finite or not {MIN_DECREASE:.0%} lower")
        saved = sorted(p.name for p in (out / "checkpoints").glob("step-*"))
        if saved != [f"step-{CHECKPOINT_EVERY:08d}", f"step-{STEPS:08d}"]:
            raise CheckFailed(f"checkpoints {saved}, expected steps {CHECKPOINT_EVERY} and {STEPS}")
        weights = "adapter_model.safetensors" if case.method == "lora" else "model.safetensors"
        if not ((out / "final" / weights).is_file() and (out / "final" / "tokenizer.json").is_file()):
            raise CheckFailed(f"final/ lacks {weights} or the tokenizer: {sorted(p.name for p in (out / 'final').iterdir())}")
        if case.compiled:
            if not s["compiled"] or _compiled_graphs() == graphs_before:
                raise CheckFailed("train.compile: true, but no graph was compiled: the decoder ran eagerly")
            return
        if not s.get("sample"):
            raise CheckFailed("no sample was generated at the end of the run")
        with MODES[case.precision].autocast(self.device):  # generation under mixed precision, as users may run it
            text = sample(run.model, run.tokenizer, "alpha beta", 6)
        if not text.startswith("alpha beta"):
            raise CheckFailed(f"a sample under {case.precision} autocast does not continue its prompt: {text!r}")

    def _check_scaler(self, case: Case, result: Result, out: Path) -> None:
        """fp16: the GradScaler ran, and each overflow (a step whose unscaled grad norm is not
        finite) was skipped and backed the scale off, exactly: the saved scale must be the initial
        one times the back-off factor once per overflow (no growth within ``STEPS`` steps).
        Other precisions: no loss scaling at all."""
        from ..checkpoint import load_checkpoint_state

        scaler = load_checkpoint_state(out / "checkpoints" / f"step-{STEPS:08d}").get("scaler")
        if case.precision != "fp16":
            if scaler is not None:
                raise CheckFailed(f"{case.precision} saved a GradScaler state: loss scaling is on where it must not be")
            return
        if scaler is None:
            raise CheckFailed("fp16 ran without a GradScaler: small gradients underflow, overflows reach the weights")
        initial = torch.amp.GradScaler(self.device.type).state_dict()["scale"]
        expected = initial * scaler["backoff_factor"] ** len(result.overflows)
        if scaler["scale"] != expected:
            raise CheckFailed(
                f"loss scale {scaler['scale']:g} after {len(result.overflows)} overflows (steps {result.overflows}), "
                f"expected {expected:g}: overflows were not handled by the scaler"
            )

    def _compare(self, case: Case, result: Result, reference: Result) -> None:
        if not reference.ok:
            result.fail(f"its fp32 reference {reference.name} failed: nothing to compare with")
            return
        if reference.status == "skipped":
            return
        # an fp16 overflow skips that step's update (correctly): from there on the run differs from
        # fp32 by design, so both are compared up to and including the first overflow's loss
        n = result.overflows[0] if result.overflows else STEPS
        result.loss_gap = _relative_gap(result.losses[:n], reference.losses[:n])
        result.grad_norm_gap = _relative_gap(result.grad_norms[: n - 1 if result.overflows else n], reference.grad_norms)
        tol, gtol = LOSS_TOL[case.precision], GRAD_NORM_TOL[case.precision]
        result.detail = f"grad norm vs fp32 {result.grad_norm_gap:.1e} (tol {gtol:.0e}), loss tol {tol:.0e}"
        if result.overflows:
            result.detail += f"; step {', '.join(map(str, result.overflows))} overflowed: skipped, scale lowered"
        if result.loss_gap > tol:
            result.fail(
                f"loss departs from fp32 by {result.loss_gap:.2%} (tolerance {tol:.2%}): "
                f"{_fmt(result.losses)} vs fp32 {_fmt(reference.losses)}"
            )
        if result.grad_norm_gap > gtol:
            result.fail(
                f"grad norm departs from fp32 by {result.grad_norm_gap:.2%} (tolerance {gtol:.2%}): "
                f"{_fmt(result.grad_norms)} vs fp32 {_fmt(reference.grad_norms)}"
            )

    # ---------------------------------------------------------------- checks

    def check(self, name: str) -> Result:
        """Run one check of ``CHECKS`` and remember its result."""
        if name in self.results:
            return self.results[name]
        if name not in CHECKS:
            raise ValueError(f"unknown check {name!r}; known: {', '.join(CHECKS)}")
        kind, _, precision = name.rpartition("-")
        if precision not in PRECISIONS:
            kind, precision = name, "fp32"
        result = Result(name, "check")
        if precision == "bf16" and self.device.type == "cuda" and not torch.cuda.is_bf16_supported():
            result.status, result.detail = "skipped", "this GPU has no bf16"
        else:
            detail = self._attempt(result, lambda: getattr(self, "_check_" + kind.replace("-", "_"))(precision))
            if result.status == "ok":
                result.detail = detail
        self.results[name] = result
        return result

    def _check_head_grads(self, precision: str) -> str:
        """Fused vs standard LM-head loss: the loss and every gradient, on two packed rows with
        masked positions (prompts, a fully masked document, document ends, padding), for the
        untied full model and LoRA on the tied "pretrained" one."""
        from ..config import LoraSettings, ModelSettings
        from ..engine.loss import fused_head
        from ..engine.step import loss_sum
        from ..hardware import PRECISIONS as MODES
        from ..model.load import apply_lora, build_model
        from ..model.tokenizer import load_tokenizer

        mode, tol = MODES[precision], self.tolerance(HEAD_GRAD_TOL, precision)
        half = mode.autocast_dtype is not None  # flash-attention (CUDA) serves bf16/fp16 only
        tok = load_tokenizer(self.assets.tokenizer)
        notes = []
        for label in ("full", "lora"):
            with _rng_kept():
                if label == "full":
                    model = build_model(ModelSettings(init=dict(MODEL_INIT), tokenizer=self.assets.tokenizer), tok, 0, self.device, half)
                else:
                    base = build_model(ModelSettings(path=self.assets.pretrained), tok, 0, self.device, half)
                    model = apply_lora(base, LoraSettings(r=4, alpha=8))
                    torch.manual_seed(1)
                    for n, p in model.named_parameters():
                        if "lora_B" in n:  # B starts at zero, which would make A's gradient zero on both paths
                            torch.nn.init.normal_(p, std=0.02)
            model = model.to(self.device)
            if fused_head(model) is None:
                raise CheckFailed(f"{label}: the model has no fused head path: the comparison would be standard vs standard")
            batch = _masked_batch(len(tok), self.device)
            runs = {}
            for fused in (True, False):
                model.zero_grad(set_to_none=True)
                loss = loss_sum(model, batch, mode, fused=fused)
                loss.backward()
                runs[fused] = loss.item(), {n: p.grad.detach().float() for n, p in model.named_parameters() if p.grad is not None}
            (loss_f, g_f), (loss_s, g_s) = runs[True], runs[False]
            if g_f.keys() != g_s.keys() or not g_s:
                raise CheckFailed(f"{label}: gradients of different tensors: fused {sorted(g_f)}, standard {sorted(g_s)}")
            gaps = {n: float((g_f[n] - g_s[n]).norm() / g_s[n].norm().clamp_min(1e-30)) for n in g_s}
            worst, gap = max(gaps.items(), key=lambda kv: kv[1])
            loss_gap = abs(loss_f - loss_s) / abs(loss_s)
            if gap > tol or loss_gap > tol:
                raise CheckFailed(
                    f"{label}: fused and standard head differ under {precision}: loss {loss_f:.5f} vs {loss_s:.5f}; "
                    f"gradient of {worst} by {gap:.2e} (relative norm; tolerance {tol:.0e})"
                )
            notes.append(f"{label} {max(gap, loss_gap):.1e}")
        return f"fused vs standard: {', '.join(notes)} (tol {tol:.0e})"

    def _check_resume(self, precision: str) -> str:
        """Stop a run after a checkpoint as SIGTERM does, resume it, and compare the final weights
        and every step's loss with the uninterrupted run of the same case."""
        from ..config import RunConfig
        from ..engine import trainer
        from ..engine.preempt import Interrupted, StopRequest
        from ..metrics.tracker import read_metrics

        case = Case(precision, "packed", "full", "fused")
        whole = self.case(case)
        if whole.status == "skipped":
            raise Skip(whole.detail)
        if not whole.ok:
            raise CheckFailed(f"the uninterrupted run {case.name} failed: nothing to compare with")
        cfg = RunConfig.model_validate(case_config(case, self.assets, str(self.device), self.cache_dir))
        out = self.workdir / f"resume-{precision}"
        shutil.rmtree(out, ignore_errors=True)
        stop = StopRequest()
        run = trainer.setup(cfg, out, _StopAfter(CHECKPOINT_EVERY, stop), "never", stop)
        try:
            trainer.train_loop(run)
            raise CheckFailed(f"the run did not stop after step {CHECKPOINT_EVERY} when asked to")
        except Interrupted:
            pass
        finally:
            run.saver.close()
            run.metrics.close()
        resumed = trainer.train(cfg, out, _quiet(), resume="auto")
        if resumed.summary["resumed_from_step"] != CHECKPOINT_EVERY:
            raise CheckFailed(f"resumed from step {resumed.summary['resumed_from_step']}, expected {CHECKPOINT_EVERY}")
        losses = [r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
        expected = self.weights[case.name]
        got = {k: v.detach().cpu() for k, v in resumed.model.state_dict().items()}
        diff = max(float((got[k].float() - v.float()).abs().max()) for k, v in expected.items())
        if self.device.type == "cpu":
            exact = losses == whole.losses and diff == 0.0
            if not exact:
                raise CheckFailed(
                    f"the resumed run differs from the uninterrupted one: largest weight difference {diff:.2e}; "
                    f"losses {_fmt(losses)} vs {_fmt(whole.losses)}"
                )
            return f"stopped at step {CHECKPOINT_EVERY}, resumed: bitwise equal to the uninterrupted run"
        scale = max(float(v.float().abs().max()) for v in expected.values())
        loss_gap = _relative_gap(losses, whole.losses)
        if diff / scale > CUDA_RESUME_TOL or loss_gap > LOSS_TOL[precision] or len(losses) != len(whole.losses):
            raise CheckFailed(
                f"the resumed run differs from the uninterrupted one: weights by {diff / scale:.2e} (tolerance "
                f"{CUDA_RESUME_TOL:.0e}), losses {_fmt(losses)} vs {_fmt(whole.losses)}"
            )
        return f"stopped at step {CHECKPOINT_EVERY}, resumed: weights within {diff / scale:.1e} of the uninterrupted run"

    def _check_attention(self, precision: str) -> str:
        """Packed rows (several documents, position_ids restarting at 0) against each document run
        on its own, through every attention implementation that handles packed rows here."""
        from ..hardware import PRECISIONS as MODES

        mode, tol = MODES[precision], self.tolerance(ATTENTION_TOL, precision)
        notes = []
        for impl in attention_implementations(self.device):
            if impl == "flash_attention_2" and mode.autocast_dtype is None:
                continue  # flash-attention computes in fp16/bf16 only
            gap, leak = packed_attention_gap(impl, mode, self.device)
            if not leak > 10 * tol:  # the measure must tell a leak from rounding, or it proves nothing
                raise CheckFailed(f"{impl}: rows without document boundaries differ by only {leak:.1e}: the check cannot see a leak")
            if not gap <= tol:
                raise CheckFailed(
                    f"{impl}: packed documents differ from one-at-a-time by {gap:.2e} (tolerance {tol:.0e}; "
                    f"attention across documents gives {leak:.1e})"
                )
            notes.append(f"{impl.removeprefix('trainforge_')} {gap:.1e}")
        return f"{', '.join(notes)} vs per document (tol {tol:.0e}; a leak: {leak:.0e})"

    def _check_nonfinite_guard(self, precision: str) -> str:
        """The non-finite guard as CUDA runs it (its streak read one step late, from pinned memory
        there) and the optimizer's update skip, on this device."""
        from ..config import OptimSettings
        from ..engine.nonfinite import NonFiniteError, NonFiniteGuard, skip_update_if
        from ..engine.optim import build_optimizer

        guard = NonFiniteGuard(2, self.device, lagged=True)
        raised_at = None
        for step, bad in enumerate([False, True, True, False, False], 1):
            try:
                guard.record(torch.tensor(bad, device=self.device), step, [step])
            except NonFiniteError as e:
                raised_at = step
                if "training stopped at step 3" not in str(e):
                    raise CheckFailed(f"the guard named the wrong step: {e}") from None
                break
        if raised_at != 4:  # the streak of steps 2-3 is read at step 4: one step late
            raise CheckFailed(f"the lagged guard raised at step {raised_at}, expected 4 (one step after the streak)")
        if int(guard.total) != 2:
            raise CheckFailed(f"the guard counted {int(guard.total)} skipped steps, expected 2")
        layer = torch.nn.Linear(4, 4).to(self.device)
        opt = build_optimizer(layer, OptimSettings(lr=0.1), self.device)
        before = layer.weight.detach().clone()
        layer(torch.ones(2, 4, device=self.device)).sum().backward()
        skip_update_if(opt, torch.tensor(True, device=self.device))
        if not torch.equal(layer.weight, before):
            raise CheckFailed("a step flagged non-finite changed the weights")
        skip_update_if(opt, torch.tensor(False, device=self.device))
        if torch.equal(layer.weight, before):
            raise CheckFailed("a good step did not change the weights")
        kind = "fused AdamW skips on the device" if opt.defaults.get("fused") else "AdamW skips after a host check"
        return f"streak read one step late; {kind}"

    def _check_pinned_memory(self, precision: str) -> str:
        """CUDA: training batches come from pinned host memory and arrive intact, asynchronously."""
        if self.device.type != "cuda":
            raise Skip("CUDA only: pinned host memory needs a GPU")
        from ..config import RunConfig
        from ..data.plan import get_tokenizer, plan_data

        case = Case("fp32", "chat", "full", "fused")
        cfg = RunConfig.model_validate(case_config(case, self.assets, str(self.device), self.cache_dir))
        plan = plan_data(cfg, get_tokenizer(cfg, _quiet()), _quiet(), pin=True)
        batch = plan.collate(plan.train_rows[:4], [0, 1, 2, 3])
        host = [t for t in (batch.input_ids, batch.labels, batch.position_ids) if t is not None]
        if not all(t.is_pinned() for t in host):
            raise CheckFailed("the collator did not pin the batch's host memory")
        moved = batch.to(self.device)
        torch.cuda.synchronize(self.device)
        if not (torch.equal(moved.input_ids.cpu(), batch.input_ids) and torch.equal(moved.labels.cpu(), batch.labels)):
            raise CheckFailed("a non-blocking copy from pinned memory arrived changed")
        return "batches pinned; non-blocking copies arrive intact"

    # ---------------------------------------------------------------- everything

    def run(self, cases: list[Case], checks: list[str], on_result: Callable[[Result], None] | None = None) -> list[Result]:
        """Every case, then every check, in order; ``on_result`` sees each result as it comes."""
        for item in [*cases, *checks]:
            seen = set(self.results)
            self.case(item) if isinstance(item, Case) else self.check(item)
            for name in self.results:
                if name not in seen and on_result:
                    on_result(self.results[name])
        wanted = [c.name for c in cases] + list(checks)
        return [self.results[n] for n in wanted]


class _StopAfter:
    """A quiet reporter that asks the loop to stop after ``step``, as the SIGTERM handler does."""

    def __init__(self, step: int, stop):
        self._inner, self._step, self._stop = _quiet(), step, stop

    def log_step(self, rec: dict[str, Any], *args: Any) -> None:
        self._inner.log_step(rec, *args)
        if rec["step"] == self._step:
            self._stop.signum = signal.SIGTERM

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _masked_batch(vocab: int, device: torch.device):
    """Two packed rows: documents of several lengths, masked prompts, a fully masked document, padding."""
    from ..data.formats import IGNORE
    from ..data.loader import Batch

    gen = torch.Generator().manual_seed(0)
    docs_per_row = [[(12, 5), (30, 0), (7, 6), (9, 9)], [(20, 3), (25, 25), (11, 0)]]  # (length, prompt tokens)
    width = 64
    ids, pos = torch.zeros(2, width, dtype=torch.long), torch.zeros(2, width, dtype=torch.long)
    labels = torch.full((2, width), IGNORE, dtype=torch.long)
    for r, docs in enumerate(docs_per_row):
        at = 0
        for n, prompt in docs:
            toks = torch.randint(2, vocab, (n,), generator=gen)
            ids[r, at : at + n], pos[r, at : at + n] = toks, torch.arange(n)
            target = toks[1:].clone()
            target[: max(prompt - 1, 0)] = IGNORE
            labels[r, at : at + n - 1] = target  # a document's last token predicts nothing
            at += n
        pos[r, at:] = torch.arange(width - at)  # padding: a "document" of its own, no targets
    return Batch(ids, labels, pos, int(ids.numel()), int((labels != IGNORE).sum()), [0, 1]).to(device)


def attention_implementations(device: torch.device) -> list[str]:
    """The attention paths a packed row takes on this device: per-document SDPA (CPU default),
    stock SDPA (a block-diagonal mask from position_ids), flash-attention varlen (CUDA, installed)."""
    import importlib.util

    from ..model.packed_attention import register

    impls = [register(), "sdpa"]
    if device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        impls.append("flash_attention_2")
    return impls


def packed_attention_gap(impl: str, precision, device: torch.device) -> tuple[float, float]:
    """(gap, leak): max |logits of packed rows - logits of each document alone| / max |reference|,
    the packed rows under ``precision``, the reference in fp32 one document at a time (for
    flash-attention, which has no fp32, in its half dtype); ``leak``: the same measure for the
    rows run without document boundaries, which is what a broken mask would give."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    fields = {k: v for k, v in MODEL_INIT.items() if k != "architecture"}
    lengths = [[7, 12, 1, 20, 8], [30, 18]]  # documents per row; a one-token document too
    width = max(sum(r) for r in lengths)
    with _rng_kept():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=96, **fields), attn_implementation=impl)
        ids = torch.randint(0, 96, (len(lengths), width))
    with torch.no_grad():
        for p in model.parameters():  # larger than the init: attention far from uniform, so a leak shows
            if p.ndim > 1:
                p.mul_(4.0)
    model = model.to(device).eval()
    if impl == "flash_attention_2":
        model = model.to(precision.autocast_dtype)
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
    ids, pos = ids.to(device), pos.to(device)
    with torch.no_grad():
        reference = []
        for b, row in enumerate(lengths):
            starts = [sum(row[:i]) for i in range(len(row))]
            docs = [model(input_ids=ids[b : b + 1, s : s + n], use_cache=False).logits.float() for s, n in zip(starts, row)]
            reference.append(torch.cat(docs, dim=1))
        reference = torch.cat(reference)
        with precision.autocast(device):
            packed = model(input_ids=ids, position_ids=pos, use_cache=False).logits.float()
            leaky = model(input_ids=ids, use_cache=False).logits.float()
    scale = reference.abs().max()
    return float((packed - reference).abs().max() / scale), float((leaky - reference).abs().max() / scale)


# ---------------------------------------------------------------- the command


def plan(device: torch.device, quick: bool = False) -> tuple[list[Case], list[str]]:
    """The cases and checks ``trainforge selftest`` runs on ``device``: the compiled case in the
    precision ``auto`` picks on a GPU (fp16 on GPUs without bf16), bf16 elsewhere."""
    compiled = "fp16" if device.type == "cuda" and not torch.cuda.is_bf16_supported() else "bf16"
    return matrix(quick, compiled), list(CHECKS)


def run_selftest(device: str = "auto", quick: bool = False, console=None, cache_dir: Path | None = None) -> list[Result]:
    """``trainforge selftest``: run the matrix and the checks on ``device``, print the table and
    any failure; returns the results (the caller turns failures into the exit code)."""
    from rich.console import Console
    from rich.markup import escape
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from transformers.utils import logging as hf_logging

    from ..hardware import describe, pick_device

    if console is None:
        console = Console(highlight=False)
        if not console.is_terminal:  # a log file or a pipe: wide enough for the table's details
            console.width = max(console.width, 160)
    dev = pick_device(device)
    cases, checks = plan(dev, quick)
    where = "cpu (1 thread: fastest for these tiny shapes)" if dev.type == "cpu" else describe(dev)
    console.print(
        f"trainforge selftest on {where}, torch {torch.__version__}: {len(cases)} training paths "
        f"({'the quick subset' if quick else 'the full matrix'}, {STEPS} steps each on a tiny Llama) and {len(checks)} checks"
    )
    if any(c.compiled for c in cases):
        console.print("  the compiled case takes tens of seconds the first time (torch caches the compiled graphs)")
    hf_logging.disable_progress_bar()
    st = SelfTest(str(dev), cache_dir=cache_dir)
    progress = Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console, transient=True, disable=not console.is_terminal,
    )
    task = progress.add_task("preparing", total=len(cases) + len(checks))
    t = time.perf_counter()

    def advance(r: Result) -> None:
        progress.update(task, advance=1, description=r.name)

    try:
        with progress:
            results = st.run(cases, checks, advance)
    finally:
        st.close()
    console.print(render_table(results))
    failed = [r for r in results if not r.ok]
    for r in failed:
        console.print(f"[bold red]FAILED[/bold red] {r.name}: {escape(r.error)}", soft_wrap=True)
    skipped = sum(r.status == "skipped" for r in results)
    verdict = f"{len(failed)} of {len(results)} FAILED" if failed else f"all {len(results) - skipped} passed"
    console.print(
        f"selftest: {verdict}" + (f", {skipped} skipped" if skipped else "") + f" in {time.perf_counter() - t:.0f}s",
        style="bold red" if failed else "bold green",
    )
    return results


def render_table(results: list[Result]):
    """path | result | loss vs fp32 | tokens/s | time | detail (the error of a failure)."""
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="trainforge selftest")
    table.add_column("path", no_wrap=True)
    table.add_column("result", no_wrap=True)
    table.add_column("loss vs fp32", justify="right", no_wrap=True)
    table.add_column("tokens/s", justify="right", no_wrap=True)
    table.add_column("time", justify="right", no_wrap=True)
    table.add_column("detail", overflow="fold")
    for r in results:
        status = {"ok": "[green]ok[/green]", "FAILED": "[bold red]FAILED[/bold red]", "skipped": "[dim]skipped[/dim]"}[r.status]
        if r.loss_gap is not None:
            gap = f"{100 * r.loss_gap:.2g}%"
        else:
            gap = "reference" if r.kind == "train" and r.name.startswith("fp32-") and r.status == "ok" else ""
        tps = f"{r.tokens_per_s:,.0f}" if r.tokens_per_s else ""
        table.add_row(r.name, status, gap, tps, f"{r.seconds:.1f}s", escape(r.detail if r.ok else r.error))
    return table


def results_json(results: list[Result], device: str) -> dict[str, Any]:
    """The ``--out`` file: the device and every result with its per-step losses."""
    from .. import __version__

    return {
        "trainforge_version": __version__,
        "torch_version": torch.__version__,
        "device": device,
        "passed": all(r.ok for r in results),
        "results": [asdict(r) for r in results],
    }
