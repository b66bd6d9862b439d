"""The built-in rewards: final_number, exact, regex, python_syntax and length. Pure Python on the completion's text:
none executes it (python_syntax only parses it with ``ast``). docs/rewards.md describes each one."""

from __future__ import annotations

import ast
import math
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from ..config.errors import shown
from ..config.rewards import RewardSettings
from .reward_errors import RewardError

MAX_NUMBER_CHARS = 64
"""A longer run of digits is not read as a number: Fraction of a huge literal costs time and memory."""

# Thousands separators only in groups of three ("1,234,567"), so a list "1,2,3" reads as three numbers; an optional
# decimal part and an optional "/denominator" (3/4); or a bare ".5". No exponent: "1e999999999" would cost seconds.
_NUMBER = re.compile(r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+(?:\.\d+)?)?|\.\d+")
_FRAC = re.compile(r"\\[dt]?frac\s*\{\s*([\d.,]+)\s*\}\s*\{\s*([\d.,]+)\s*\}")
_LATEX_NOISE = re.compile(r"\\[!,; ]|\\left|\\right|\\\$|\$")  # thin spaces (1\,000), sizing, dollar signs
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*")
_MINUS = "-\u2212"  # ASCII hyphen-minus and the Unicode minus sign
_PY_FENCE = re.compile(r"```[ \t]*([\w+.-]*)[^\n`]*\n(.*?)(?:```|\Z)", re.DOTALL)
_PY_TAGS = ("", "python", "py", "python3", "py3")

Scorer = Callable[[list[str], list[dict[str, Any]]], list[float]]
"""(completions, rows) -> one score per completion."""


def _clean(text: str) -> str:
    """LaTeX of a number made plain: 1{,}000 -> 1,000; 1\\,000 -> 1000; \\frac{3}{4} -> 3/4; $ signs gone."""
    text = text.replace("{,}", ",")
    text = _FRAC.sub(r"\1/\2", text)
    return _LATEX_NOISE.sub("", text)


def _to_fraction(token: str) -> Fraction | None:
    """One matched number token as an exact fraction; None for a zero denominator or an overlong token."""
    if len(token) > MAX_NUMBER_CHARS:
        return None
    num, _, den = token.replace(",", "").partition("/")
    try:
        value = Fraction(num) / Fraction(den) if den else Fraction(num)
    except (ValueError, ZeroDivisionError):
        return None
    return value


def _signed(text: str, m: re.Match[str]) -> Fraction | None:
    """The number matched by ``m``, negative where a minus sign stands right before it (and not after a word or a
    number: 5-3 reads as 5 and 3)."""
    value = _to_fraction(m.group())
    start = m.start()
    if value is not None and start > 0 and text[start - 1] in _MINUS and (start < 2 or not text[start - 2].isalnum()):
        value = -value
    return value


def _number(text: str, last: bool) -> Fraction | None:
    """The first (or last) number in ``text``; only that one is converted (a text of 100,000 numbers stays fast)."""
    matches = reversed(list(_NUMBER.finditer(text))) if last else _NUMBER.finditer(text)
    for m in matches:
        value = _signed(text, m)
        if value is not None:
            return value
    return None


def _boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (braces matched, nested ones included), or of \\boxed N."""
    matches = list(_BOXED.finditer(text))
    if not matches:
        return None
    i = matches[-1].end()
    if i >= len(text) or text[i] != "{":
        return text[i:].split(maxsplit=1)[0].rstrip("$") if text[i:].strip() else None
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1: j]
    return text[i + 1:]  # never closed (a truncated completion): what follows


def extract_number(text: str) -> Fraction | None:
    """The final answer of ``text`` as an exact number: after the last GSM8K "####", else in the last \\boxed{},
    else the last number in the text; None where there is none."""
    if "####" in text:
        after = _number(_clean(text.rsplit("####", 1)[1]), last=False)
        if after is not None:
            return after
    boxed = _boxed(text)
    if boxed is not None:
        inside = _number(_clean(boxed), last=True)
        if inside is not None:
            return inside
    return _number(_clean(text), last=True)


def reference_number(value: Any) -> Fraction | None:
    """A row's answer field as a number: an int or float, or text read like a completion ("#### 42", "\\boxed{7}",
    "$1,200")."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return Fraction(value)
    if isinstance(value, float):
        return Fraction(repr(value)) if math.isfinite(value) else None
    if isinstance(value, str):
        return extract_number(value)
    return None


def python_code(completion: str) -> str:
    """The Python source of a completion: its ```python (or untagged) fenced blocks joined, else the whole text;
    "" where it has fenced blocks in other languages only."""
    blocks = [m.group(2) for m in _PY_FENCE.finditer(completion)]
    if not blocks:
        return completion
    tags = [m.group(1).lower() for m in _PY_FENCE.finditer(completion)]
    return "\n".join(b for b, t in zip(blocks, tags) if t in _PY_TAGS)


def parses(code: str) -> bool:
    """Whether ``ast.parse`` accepts ``code`` (which holds more than whitespace); nothing is compiled or run."""
    if not code.strip():
        return False
    try:
        with warnings.catch_warnings():  # an invalid escape in a string literal warns; it is not an error
            warnings.simplefilter("ignore")
            ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # ValueError: a NUL byte; deep nesting overflows
        return False
    return True


def length_score(length: int, lowest: int, highest: int | None) -> float:
    """1.0 inside [lowest, highest]; below, length / lowest; above, 1 - (length - highest) / highest, at least 0."""
    if length < lowest:
        return length / lowest
    if highest is not None and length > highest:
        return max(0.0, 1.0 - (length - highest) / highest)
    return 1.0


@dataclass(frozen=True)
class Builtin:
    """A built-in reward made from its settings: ``field`` the row field it reads (None: none)."""

    name: str
    field: str | None
    score: Scorer

    def check_value(self, value: Any, row_name: str) -> None:
        """Raise RewardError where the row's reference answer cannot be compared."""
        if self.name == "final_number" and reference_number(value) is None:
            raise RewardError(f"{row_name}: the final_number reward reads a number from the row field {self.field!r}, "
                              f"and {shown(value, 120)} holds none; give the answer as a number, text ending in "
                              "'#### N', or \\boxed{N}, or point field: at the field that holds it")
        if self.name == "exact" and (isinstance(value, bool) or not isinstance(value, (str, int, float))):
            raise RewardError(f"{row_name}: the exact reward compares the completion with the row field "
                              f"{self.field!r}, which is {type(value).__name__} {shown(value, 120)}; give it as text")


def make_builtin(settings: RewardSettings, count_tokens: Callable[[str], int] | None) -> Builtin:
    """The Builtin of a ``name:`` entry of ``rl.rewards``."""
    name, field = settings.name, settings.field
    if name == "final_number":
        def final_number(completions: list[str], rows: list[dict[str, Any]]) -> list[float]:
            scores = []
            for completion, row in zip(completions, rows):
                got = extract_number(completion)
                scores.append(float(got is not None and got == reference_number(row[field])))
            return scores
        return Builtin(name, field, final_number)
    if name == "exact":
        def exact(completions: list[str], rows: list[dict[str, Any]]) -> list[float]:
            return [float(c.strip() == str(r[field]).strip()) for c, r in zip(completions, rows)]
        return Builtin(name, field, exact)
    if name == "regex":
        compiled = re.compile(settings.pattern or "")
        return Builtin(name, None, lambda completions, rows: [float(compiled.search(c) is not None) for c in completions])
    if name == "python_syntax":
        return Builtin(name, None, lambda completions, rows: [float(parses(python_code(c))) for c in completions])
    if name == "length":
        lowest, highest = settings.length_range()
        measure = count_tokens if settings.unit == "tokens" else len

        def length(completions: list[str], rows: list[dict[str, Any]]) -> list[float]:
            if measure is None:  # a set built only to check rows (no tokenizer yet) scores nothing
                raise RewardError("rl.rewards: the length reward with unit: tokens needs the model's tokenizer, and "
                                  "none was given to the rewards; use unit: chars")
            return [length_score(measure(c), lowest, highest) for c in completions]
        return Builtin(name, None, length)
    raise RewardError(f"rl.rewards: unknown built-in reward {shown(name)}")
