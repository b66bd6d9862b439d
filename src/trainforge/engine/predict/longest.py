"""The longest ``data.max_length`` that fits at micro-batch 1, by the memory model (no training), and what
each long-context lever buys: ``trainforge plan --longest`` and ``data.max_length: auto`` (``auto_length``: at the
run's micro-batch, capped by the model's positions).

A step's predicted peak grows with the row length (linearly where attention keeps no length x length
matrix, which is what every path trainforge trains with does), so the search needs few traces: two
lengths give a line, the line's crossing of the budget a first guess, and from there a bracketed
search (the secant between the nearest lengths that fit and do not, bisection when that stalls) ends
when the two differ by one ``GRANULE``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...config.base import MAX_TOKENS
from ...config.run import RunConfig
from ...hardware.device import Precision
from ...hardware.profiles import GIB, HardwareProfile
from .fit import FIT_MARGIN, QUICK_SHARE, MemoryPrediction, predict_memory, rough_skeleton_bytes
from .levers import Levers, tiling_covers, with_levers

GRANULE = 256  # lengths are searched in multiples of this
FIRST = 4096  # the first length traced
MAX_TRACES = 14  # a search that has not closed its bracket by then keeps the longest length that fit


@dataclass
class Longest:
    """The longest row that fits with ``levers``, the prediction there and one ``GRANULE`` beyond."""

    levers: Levers
    length: int  # 0: not even ``GRANULE`` tokens fit
    memory: MemoryPrediction | None  # at ``length``
    beyond: MemoryPrediction | None  # at ``length + GRANULE`` (None when ``length`` is the cap)
    capped: str | None = None  # why the search stopped at a limit other than memory
    traced: dict[int, int] = field(default_factory=dict, repr=False)  # length -> predicted process bytes


def length_cap(cfg: RunConfig) -> tuple[int, str | None]:
    """The longest length the search may return: a learned position table's size, else ``MAX_TOKENS``."""
    from ...model.load import position_limit

    limit, learned = position_limit(cfg.model)
    if learned and limit:
        return limit, f"the model's learned position table ({limit} positions)"
    return MAX_TOKENS, None


def longest_length(
    cfg: RunConfig, tokenizer, precision: Precision, profile: HardwareProfile, levers: Levers,
    margin: float = FIT_MARGIN, world_size: int = 1, mode: str = "ddp", rows: int = 1,
    cap: tuple[int, str | None] | None = None,
) -> Longest:
    """The longest multiple of ``GRANULE`` tokens per row whose step fits in ``margin`` of ``profile`` at ``rows``
    rows with ``levers``, searched over the memory model; ``cap``: (the longest length allowed, why), by default
    ``length_cap``'s (a cap under ``GRANULE`` is the only length tried)."""
    budget = margin * profile.memory_bytes
    cap, why_cap = cap or length_cap(cfg)
    cap = cap // GRANULE * GRANULE or cap
    predictions: dict[int, MemoryPrediction] = {}

    def at(length: int) -> MemoryPrediction:
        if length not in predictions:
            run = with_levers(cfg, levers, length)
            predictions[length] = predict_memory(run, tokenizer, precision, profile, rows, levers.checkpointing,
                                                 cfg.train.grad_accum, world_size, mode)
        return predictions[length]

    lo, hi = 0, cap + GRANULE  # lo fits (0: nothing known), hi does not (cap + GRANULE: never traced)
    first = min(FIRST, cap)
    if at(first).fits(margin):
        lo = first
        second = min(2 * first, cap)
        if second > first:
            (lo, hi) = (second, hi) if at(second).fits(margin) else (lo, second)
    else:
        hi = first
    while hi - lo > GRANULE and len(predictions) < MAX_TRACES:
        guess = _next_guess(lo, hi, predictions, budget, cap)
        if at(guess).fits(margin):
            lo = guess
        else:
            hi = guess
    beyond = at(lo + GRANULE) if lo + GRANULE <= cap else None
    capped = why_cap if lo == cap else None
    return Longest(levers, lo, predictions.get(lo), beyond, capped, {n: p.process for n, p in predictions.items()})


def _next_guess(lo: int, hi: int, predictions: dict[int, MemoryPrediction], budget: float, cap: int) -> int:
    """The next length to trace inside (lo, hi): where the line through the bracket's two ends (without one, nothing
    traced failing yet: through the two longest traced lengths) crosses the budget; exact when memory is linear in
    length, so that the next trace, one ``GRANULE`` beyond, closes the search. The middle, or double, when the line
    says nothing; always at least a ``GRANULE`` past ``lo`` and short of ``hi``."""
    known = sorted(predictions)
    bracketed = hi <= cap
    a, b = (lo, hi) if bracketed and lo in predictions else (known[-2], known[-1]) if len(known) > 1 else (None, None)
    guess = None
    if a is not None and b is not None:
        slope = (predictions[b].process - predictions[a].process) / (b - a)
        if slope > 0:
            guess = a + (budget - predictions[a].process) / slope
    if guess is None:
        guess = (lo + hi) / 2 if bracketed else 2 * max(lo, GRANULE)
    guess = int(guess) // GRANULE * GRANULE
    return max(lo + GRANULE, min(guess, hi - GRANULE if bracketed else cap))


def lever_table(
    cfg: RunConfig, tokenizer, precision: Precision, profile: HardwareProfile, margin: float = FIT_MARGIN,
    world_size: int = 1, mode: str = "ddp",
) -> list[Longest]:
    """The longest length with no lever, with activation checkpointing, with the tiled MLP too, and with activation
    offload too (rows a lever cannot act in, tiling an uncovered family, offload on a CPU, are left out)."""
    ladder = [Levers(), Levers(True)]
    if tiling_covers(cfg):
        ladder.append(Levers(True, True))
    if profile.kind == "gpu":
        ladder.append(Levers(True, ladder[-1].tiled_mlp, True))
    return [longest_length(cfg, tokenizer, precision, profile, levers, margin, world_size, mode) for levers in ladder]


def run_levers(cfg: RunConfig, profile: HardwareProfile) -> Levers:
    """The levers the run would use at its longest length: each one it sets true, and each it leaves to auto
    that can act here (checkpointing; tiling where it covers the model; offload on a GPU with checkpointing)."""
    t = cfg.train
    ckpt = t.activation_checkpointing is not False
    tiled = t.tiled_mlp is True or (t.tiled_mlp == "auto" and tiling_covers(cfg))
    offload = ckpt and (t.activation_offload is True or (t.activation_offload == "auto" and profile.kind == "gpu"))
    return Levers(ckpt, tiled, offload)


def gib(n: float) -> str:
    """Bytes as GiB for messages: one decimal, two under 10 GiB (a small device's figures stay apart)."""
    return f"{n / GIB:.1f} GiB" if n >= 10 * GIB else f"{n / GIB:.2f} GiB"


def auto_cap(cfg: RunConfig) -> tuple[int, str | None]:
    """The longest length ``data.max_length: auto`` may take: the model's positions (a learned table's size, or the
    ``max_position_embeddings`` a rotary model declares: past it its positions run beyond what it was trained on),
    less a grpo completion behind the prompt; ``MAX_TOKENS`` where the model declares none."""
    from ...model.load import position_limit

    limit, learned = position_limit(cfg.model)
    if not limit:
        return MAX_TOKENS, None
    what = f"the model's learned position table ({limit} positions)" if learned else \
        f"the model's max_position_embeddings ({limit})"
    if cfg.train.objective == "grpo":  # the prompt's row leaves room for the completion sampled behind it
        completion = cfg.rl.max_completion_length
        return max(1, limit - completion), f"{what} less rl.max_completion_length ({completion})"
    return limit, what


@dataclass
class AutoLength:
    """What ``data.max_length: auto`` takes here and why; ``length`` 0: not even the shortest row fits."""

    length: int
    why: str
    found: Longest | None  # the search (None: the cap, taken without one)


def auto_rows(cfg: RunConfig) -> int:
    """The rows per pass ``auto`` sizes a row for: the configured micro-batch, one row (grpo: one group) when auto."""
    from .rollout_memory import micro_batch_unit

    rows = cfg.train.micro_batch_size
    return rows if isinstance(rows, int) else micro_batch_unit(cfg)


def auto_length(
    cfg: RunConfig, tokenizer, precision: Precision, profile: HardwareProfile, world_size: int = 1, mode: str = "ddp",
    margin: float = FIT_MARGIN,
) -> AutoLength:
    """``data.max_length: auto`` on ``profile``: the longest length that fits in ``margin`` at the run's micro-batch
    (``auto_rows``) with the levers the run may use (``run_levers``), capped by ``auto_cap``. Where the cap is
    finite and a rough estimate there is far below the device, the cap without a search."""
    rows, levers = auto_rows(cfg), run_levers(cfg, profile)
    cap, why_cap = auto_cap(cfg)
    capacity = f"{margin:.0%} of {gib(profile.memory_bytes)}"
    at_rows = f"{rows} row{'s' if rows != 1 else ''}"
    if cap < MAX_TOKENS:
        rough = rough_skeleton_bytes(with_levers(cfg, levers, cap), tokenizer, precision, rows)
        if rough < QUICK_SHARE * profile.memory_bytes:
            return AutoLength(cap, f"{cap}: capped by {why_cap}; a rough estimate of a step there ({gib(rough)} at "
                                   f"{at_rows}) is far below the {gib(profile.memory_bytes)} of the device", None)
    found = longest_length(cfg, tokenizer, precision, profile, levers, margin, world_size, mode, rows, (cap, why_cap))
    n = found.length
    if n == 0:
        shortest = min(GRANULE, cap)
        return AutoLength(0, f"not even {shortest} tokens per row fit in {capacity} at {at_rows} with {levers.describe()}",
                          found)
    peak = f"predicted {gib(found.memory.process)}"
    if found.capped:
        return AutoLength(n, f"{n}: capped by {found.capped} ({peak} at {at_rows} with {levers.describe()}, under "
                             f"{capacity})", found)
    beyond = f"; {n + GRANULE} tokens: {gib(found.beyond.process)}" if found.beyond else ""
    return AutoLength(n, f"{n}: the longest that fits in {capacity} at {at_rows} with {levers.describe()} ({peak}"
                         f"{beyond})", found)
