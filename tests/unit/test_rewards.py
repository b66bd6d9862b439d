"""rl.rewards: the built-ins on real answer shapes (GSM8K, MATH's \\boxed{}, fenced code), weighting and None, the
user's own function loaded from a file, and every way a reward fails (exit 2, the function and the row named)."""

from __future__ import annotations

import math
import textwrap
from fractions import Fraction
from pathlib import Path

import pytest
from pydantic import ValidationError

from trainforge.config.rewards import RewardSettings
from trainforge.errors import EXIT_BAD_INPUT
from trainforge.rl.reward_builtins import extract_number, length_score, parses, python_code
from trainforge.rl.rewards import RewardError, RewardScores, RewardSet

GSM8K_ANSWER = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
                "altogether in April and May.\n#### 72")


def reward_set(*entries: dict, timeout_s: float = 5.0) -> RewardSet:
    return RewardSet.from_settings([RewardSettings(**e) for e in entries], timeout_s)


def scores(rs: RewardSet, completions: list[str], rows: list[dict]) -> RewardScores:
    return rs.score(["p"] * len(completions), completions, rows)


# ---- final_number -------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "number"), [
    (GSM8K_ANSWER, 72),
    ("She pays 3 * $12 = $36.\n#### $1,236", 1236),
    ("#### 18\n\nTo check: 9 + 9 = 18, then 20 more", 18),  # the number after ####, not the last one
    ("The probability is $\\boxed{\\frac{3}{4}}$.", Fraction(3, 4)),
    ("so x = \\boxed{-\\dfrac{1}{2}}", Fraction(-1, 2)),
    ("We get $\\boxed{1{,}000}$ ways", 1000),
    ("Total: \\boxed{2,\\!016}", 2016),
    ("\\boxed{x^{2} = 49, so x = 7}", 7),  # nested braces; the last number in the box
    ("It is 5 - 3 = 2 apples; the answer is 2.50 dollars", Fraction(5, 2)),
    ("The temperature fell to -12 degrees", -12),
    ("The list 1,2,3 sums to 6", 6),
    ("a ratio of 3/4", Fraction(3, 4)),
    ("no numbers here", None),
    ("9" * 200, None),  # too long to be an answer; never turned into a huge Fraction
])
def test_extract_number_reads_real_answer_shapes(text: str, number: object) -> None:
    assert extract_number(text) == number


def test_final_number_compares_numerically_with_gsm8k_and_plain_answers() -> None:
    rs = reward_set({"name": "final_number"})
    rows = [{"answer": GSM8K_ANSWER}, {"answer": GSM8K_ANSWER}, {"answer": 72}, {"answer": "0.75"}, {"answer": "$1,000"},
            {"answer": GSM8K_ANSWER}]
    completions = ["48/2 = 24, 48 + 24 = 72.\n#### 72", "I think it is 71", "The answer is 72.0",
                   "$\\boxed{\\frac{3}{4}}$", "1000", "no idea"]
    assert scores(rs, completions, rows).each["final_number"] == [1.0, 0.0, 1.0, 1.0, 1.0, 0.0]


def test_final_number_reads_the_configured_field() -> None:
    rs = reward_set({"name": "final_number", "field": "solution"})
    assert rs.required_fields == {"solution"}
    assert scores(rs, ["#### 5"], [{"solution": "#### 5", "answer": "6"}]).total == [1.0]


# ---- exact, regex, python_syntax, length --------------------------------------------------------------------

def test_exact_compares_stripped_text() -> None:
    rs = reward_set({"name": "exact"})
    got = scores(rs, ["  Paris\n", "paris", "42"], [{"answer": "Paris"}, {"answer": "Paris"}, {"answer": 42}])
    assert got.each["exact"] == [1.0, 0.0, 1.0]


def test_regex_searches_the_completion() -> None:
    rs = reward_set({"name": "regex", "pattern": r"(?s)^<think>.*</think>\s*\S"})
    got = scores(rs, ["<think>a\nb</think> 42", "42 <think>x</think>", "<think>unclosed"], [{}, {}, {}])
    assert got.each["regex"] == [1.0, 0.0, 0.0]
    assert rs.required_fields == set()


FENCED = "Here is the function:\n\n```python\ndef add(a, b):\n    return a + b\n```\n\nIt adds two numbers."


@pytest.mark.parametrize(("completion", "ok"), [
    (FENCED, True),
    ("def f(x):\n    return x * 2\n", True),  # bare code
    ("Here:\n```python\ndef f(:\n    pass\n```", False),
    ("```py\nimport os\nprint(os.getcwd())\n```", True),
    ("```\nx = [i for i in range(3)]\n```", True),  # untagged fence
    ("```javascript\nconst x = 1;\n```", False),  # fenced, but no Python
    ("```python\nwhile True:\n    pass", True),  # truncated fence: what follows the opening is the code
    ("This is prose, not code.", False),
    ("   \n", False),
    ("x = '\\d'", True),  # an invalid escape warns; it still parses
    ("x = 1\x00", False),  # a NUL byte: ast.parse raises ValueError
    ("(" * 1000 + ")" * 1000, False),  # too deep for the parser
])
def test_python_syntax_parses_without_running(completion: str, ok: bool) -> None:
    assert parses(python_code(completion)) is ok


def test_python_syntax_reward_never_executes(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    code = f"```python\nopen({str(marker)!r}, 'w').write('x')\n```"
    assert scores(reward_set({"name": "python_syntax"}), [code], [{}]).total == [1.0]
    assert not marker.exists()


def test_length_scores_against_a_target_and_a_range() -> None:
    assert [length_score(n, 10, 10) for n in (0, 5, 10, 15, 20, 30)] == [0.0, 0.5, 1.0, 0.5, 0.0, 0.0]
    assert [length_score(n, 4, 8) for n in (2, 4, 6, 8, 12)] == [0.5, 1.0, 1.0, 1.0, 0.5]
    assert length_score(10**6, 5, None) == 1.0  # min_length only: no upper limit
    rs = reward_set({"name": "length", "target": 4}, {"name": "length", "max_length": 2})
    assert rs.names == ["length", "length_2"]
    got = scores(rs, ["abcd", "ab", "abcdef"], [{}, {}, {}])
    assert got.each == {"length": [1.0, 0.5, 0.5], "length_2": [0.0, 1.0, 0.0]}


def test_length_in_tokens_uses_the_given_counter() -> None:
    settings = [RewardSettings(name="length", target=2, unit="tokens")]
    rs = RewardSet.from_settings(settings, 5.0, count_tokens=lambda text: len(text.split()))
    assert scores(rs, ["one two", "one two three four"], [{}, {}]).total == [1.0, 0.0]
    unscored = RewardSet.from_settings(settings, 5.0)  # a set that only checks rows needs no tokenizer
    unscored.check_row({"prompt": "p"}, "line 1")
    with pytest.raises(RewardError, match="unit: tokens needs the model's tokenizer"):
        scores(unscored, ["one"], [{}])


# ---- weighting, names, None ---------------------------------------------------------------------------------

def write(tmp_path: Path, text: str, name: str = "my_rewards.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_weighted_sum_and_none_is_no_opinion(tmp_path: Path) -> None:
    path = write(tmp_path, """
        def picky(prompts, completions, answer, **kwargs):
            # an opinion only on completions that mention a number
            return [None if not any(ch.isdigit() for ch in c) else 0.5 for c in completions]
    """)
    rs = reward_set({"name": "final_number", "weight": 2.0}, {"function": f"{path}:picky", "weight": -1.0},
                    {"name": "regex", "pattern": "####", "weight": 0.25})
    assert rs.names == ["final_number", "picky", "regex"]
    assert rs.describe() == f"final_number x2, picky ({path}) x-1, regex x0.25"
    assert rs.weights == {"final_number": 2.0, "picky": -1.0, "regex": 0.25}
    got = scores(rs, ["#### 7", "seven", "8"], [{"answer": "7"}] * 3)
    assert got.each["final_number"] == [1.0, 0.0, 0.0]
    assert got.each["picky"][0] == 0.5 and math.isnan(got.each["picky"][1]) and got.each["picky"][2] == 0.5
    assert got.total == [2.0 - 0.5 + 0.25, 0.0, -0.5]


def test_duplicate_names_are_made_unique(tmp_path: Path) -> None:
    path = write(tmp_path, "def final_number(prompts, completions, **kw):\n    return [1.0] * len(completions)\n")
    rs = reward_set({"name": "final_number"}, {"function": f"{path}:final_number"}, {"name": "final_number"})
    assert rs.names == ["final_number", "final_number_2", "final_number_3"]
    assert scores(rs, ["1"], [{"answer": 2}]).each["final_number_2"] == [1.0]


# ---- user functions -----------------------------------------------------------------------------------------

def test_user_function_gets_every_row_field_as_lists(tmp_path: Path) -> None:
    path = write(tmp_path, """
        from helper import bonus  # a module beside the file imports at load time

        SEEN = []

        def score(prompts, completions, **fields):
            SEEN.append((list(prompts), list(completions), fields))
            return [bonus() + len(c) for c in completions]
    """)
    (tmp_path / "helper.py").write_text("def bonus():\n    return 0.5\n")
    rs = reward_set({"function": f"{path}:score"})
    rows = [{"prompt": "a", "answer": "1", "level": 3}, {"prompt": "b", "answer": "2"}]
    got = rs.score(["a", "b"], ["xy", "xyz"], rows)
    assert got.total == [2.5, 3.5]
    assert rs.required_fields == set()
    module = rs._entries[0].reward.fn.__globals__  # the loaded module's namespace
    assert module["SEEN"] == [(["a", "b"], ["xy", "xyz"], {"prompt": ["a", "b"], "answer": ["1", "2"], "level": [3, None]})]


@pytest.mark.parametrize(("body", "message"), [
    ("raise KeyError('solution')", (r"score \(.*my_rewards.py\) raised KeyError: 'solution' at .*my_rewards.py "
                                    r"line 3 scoring 2 completions \(first: prompts.jsonl line 7\)")),
    ("return [1.0]", r"returned 1 values for 2 completions \(first: prompts.jsonl line 7\)"),
    ("return 1.0", r"returned float 1.0; return a list of float \| None"),
    ("return [1.0, 'high']", r"returned str 'high' for completion 1 \(prompts.jsonl line 9\); return a float"),
    ("return [float('nan'), 1.0]", r"returned nan for completion 0 \(prompts.jsonl line 7\); return a finite float"),
    ("return [1.0, float('inf')]", r"returned inf for completion 1 \(prompts.jsonl line 9\)"),
    ("import time\n    time.sleep(2)", (r"did not return within rl.reward_timeout_s=0.2s scoring 2 completions "
                                        r"\(first: prompts.jsonl line 7\); it is still running")),
])
def test_user_function_failures_name_the_function_and_the_row(tmp_path: Path, body: str, message: str) -> None:
    path = write(tmp_path, f"\ndef score(prompts, completions, **kw):\n    {body}\n")
    rs = reward_set({"function": f"{path}:score"}, timeout_s=0.2)
    with pytest.raises(RewardError, match=message) as e:
        rs.score(["p", "q"], ["a", "b"], [{}, {}], where=["prompts.jsonl line 7", "prompts.jsonl line 9"])
    assert e.value.exit_code == EXIT_BAD_INPUT


@pytest.mark.parametrize("params", ["prompts, completions", "prompts, completions, solution, **kw", "prompts"])
def test_user_function_that_cannot_take_the_arguments(tmp_path: Path, params: str) -> None:
    path = write(tmp_path, f"def score({params}):\n    return [1.0] * len(prompts)\n")
    with pytest.raises(RewardError, match=r"score \(.*\) cannot be called as score\(prompts, completions, \*\*row_fields\) "
                                          r"with the fields of these rows \(answer, level; first: line 1\): .*; take the "
                                          r"fields you need by name and add \*\*kwargs"):
        reward_set({"function": f"{path}:score"}).score(["p"], ["c"], [{"answer": "1", "level": 2}], where=["line 1"])


def test_user_function_error_without_locations_shows_the_first_prompt(tmp_path: Path) -> None:
    path = write(tmp_path, "def score(prompts, completions, **kw):\n    raise ValueError('bad')\n")
    with pytest.raises(RewardError, match=r"raised ValueError: bad .*first: the row with prompt 'What is 2\+2\?'"):
        reward_set({"function": f"{path}:score"}).score(["What is 2+2?"], ["4"], [{"answer": "4"}])


def test_a_file_is_imported_once_while_unchanged(tmp_path: Path) -> None:
    log = tmp_path / "imports.log"
    source = f"open({str(log)!r}, 'a').write('x')\ndef f(prompts, completions, **kw):\n    return [VALUE] * len(completions)\n"
    path = write(tmp_path, source.replace("VALUE", "1.0"))
    first = reward_set({"function": f"{path}:f"})  # the set that checks rows, then the one that scores
    second = reward_set({"function": f"{path}:f"})
    assert log.read_text() == "x"
    assert first.score(["p"], ["c"], [{}]).total == second.score(["p"], ["c"], [{}]).total == [1.0]
    write(tmp_path, source.replace("VALUE", "2.50"))  # edited (its size changed): imported again
    assert reward_set({"function": f"{path}:f"}).score(["p"], ["c"], [{}]).total == [2.5]
    assert log.read_text() == "xx"


def test_user_function_may_return_tuples_bools_and_numpy(tmp_path: Path) -> None:
    path = write(tmp_path, """
        import numpy as np
        def a(prompts, completions, **kw):
            return (True, None)
        def b(prompts, completions, **kw):
            return np.array([0.25, 2], dtype=np.float32)
    """)
    rs = reward_set({"function": f"{path}:a"}, {"function": f"{path}:b"})
    assert rs._entries[0].reward.fn.__globals__ is rs._entries[1].reward.fn.__globals__  # the file ran once
    got = scores(rs, ["x", "y"], [{}, {}])
    assert got.each["a"][0] == 1.0 and math.isnan(got.each["a"][1])
    assert got.total == [1.25, 2.0]


@pytest.mark.parametrize(("source", "message"), [
    ("import nonexistent_module_xyz\n", r"raised ModuleNotFoundError: .*nonexistent_module_xyz.* at .*broken.py line 1"),
    ("x = 1\ndef score(:\n", r"raised SyntaxError: .*line 2"),
    ("import sys\nsys.exit(3)\n", r"raised SystemExit: 3 at .*broken.py line 2"),
])
def test_user_file_that_fails_to_load(tmp_path: Path, source: str, message: str) -> None:
    broken = write(tmp_path, source, "broken.py")
    with pytest.raises(RewardError, match=r"loading the reward file .*broken.py " + message) as e:
        reward_set({"function": f"{broken}:score"})
    assert e.value.exit_code == EXIT_BAD_INPUT
    assert "run `python " in str(e.value)


def test_user_file_without_the_function(tmp_path: Path) -> None:
    good = write(tmp_path, "LIMIT = 3\ndef helper(p, c):\n    return c\ndef score_b(p, c):\n    return c\n", "good.py")
    with pytest.raises(RewardError, match=r"does not define a function 'score'; the functions it defines: helper, "
                                          r"score_b; give function: .*good.py:NAME"):
        reward_set({"function": f"{good}:score"})
    with pytest.raises(RewardError, match=r"defines LIMIT as a int, not a function"):
        reward_set({"function": f"{good}:LIMIT"})


@pytest.mark.parametrize(("spec", "message"), [
    ("missing.py:score", r"missing.py does not exist \(relative to the current directory"),
    ("rewards.txt:score", r"rewards.txt is not a .py file"),
    ("rewards.py", r"give FILE.py:NAME"),
    ("rewards.py:my-score", r"'my-score' is not a Python function name"),
    ("sub.py:score", r"sub.py is a directory"),
])
def test_function_spec_is_checked_at_config_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spec: str,
                                                 message: str) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub.py").mkdir()
    with pytest.raises(ValidationError, match=message):
        RewardSettings(function=spec)


def test_relative_function_path_is_read_from_the_current_directory(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    write(tmp_path, "def score(prompts, completions, **kw):\n    return [0.5 for _ in completions]\n")
    monkeypatch.chdir(tmp_path)
    assert reward_set({"function": "my_rewards.py:score"}).score(["p"], ["c"], [{}]).total == [0.5]


# ---- rows and config ----------------------------------------------------------------------------------------

def test_check_row_names_the_row_and_the_field(tmp_path: Path) -> None:
    rs = reward_set({"name": "final_number"})
    rs.check_row({"prompt": "2+2?", "answer": "#### 4"}, "prompts.jsonl line 1")
    with pytest.raises(RewardError, match=r"prompts.jsonl line 12: the final_number reward reads the row field "
                                          r"'answer', which this row lacks \(its fields: 'prompt', 'solution'\); add it "
                                          r"to every row, or set field:") as e:
        rs.check_row({"prompt": "2+2?", "solution": "4"}, "prompts.jsonl line 12")
    assert e.value.exit_code == EXIT_BAD_INPUT
    with pytest.raises(RewardError, match=r"line 3: .*holds none; give the answer as a number"):
        rs.check_row({"answer": "four"}, "prompts.jsonl line 3")
    with pytest.raises(RewardError, match=r"has as null"):
        rs.check_row({"answer": None}, "prompts.jsonl line 4")
    with pytest.raises(RewardError, match=r"exact reward compares .* which is list"):
        reward_set({"name": "exact"}).check_row({"answer": ["a"]}, "x")
    path = write(tmp_path, "def f(prompts, completions, **kw):\n    return [1.0] * len(completions)\n")
    with pytest.raises(RewardError, match=r"the row has a field 'completions'.*rename that field"):
        reward_set({"function": f"{path}:f"}).check_row({"completions": 1}, "x")


def test_score_checks_rows_it_was_not_shown_before() -> None:
    with pytest.raises(RewardError, match=r"line 2: the exact reward reads the row field 'answer'"):
        reward_set({"name": "exact"}).score(["a", "b"], ["x", "y"], [{"answer": "x"}, {}], where=["line 1", "line 2"])


@pytest.mark.parametrize(("entry", "message"), [
    ({}, "give one of name"),
    ({"name": "exact", "function": f"{__file__}:f"}, "give one of name"),
    ({"name": "bleu"}, r"unknown reward 'bleu'; the built-ins are final_number, exact, regex, python_syntax, length"),
    ({"name": "lenght"}, r"unknown reward 'lenght'; did you mean length\? the built-ins are"),
    ({"name": "regex"}, r"the regex reward needs pattern"),
    ({"name": "regex", "pattern": "(unclosed"}, r"not a valid Python regular expression: missing \), unterminated"),
    ({"name": "python_syntax", "pattern": "x"}, r"pattern has no effect on python_syntax \(only regex reads it\)"),
    ({"name": "regex", "pattern": "x", "field": "y"}, r"field has no effect on regex \(only final_number and exact read it\)"),
    ({"name": "length"}, r"the length reward needs target"),
    ({"name": "length", "target": 5, "max_length": 9}, r"give target, or min_length and/or max_length, not both"),
    ({"name": "length", "min_length": 9, "max_length": 5}, r"min_length 9 is above max_length 5"),
    ({"name": "length", "target": 0}, r"greater than 0"),
    ({"name": "exact", "weight": float("nan")}, r"finite number"),
])
def test_config_errors_are_actionable(entry: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        RewardSettings(**entry)


def test_an_entry_spelling_every_default_out_validates() -> None:
    # a run's written config.yaml does, and doctor and resume read it back
    written = RewardSettings(name="final_number").model_dump()
    assert written["pattern"] is None and RewardSettings(**written).name == "final_number"
    with pytest.raises(ValidationError, match="unit has no effect on final_number"):
        RewardSettings(**{**written, "unit": "tokens"})


def test_set_up_errors() -> None:
    with pytest.raises(RewardError, match="rl.rewards is empty"):
        RewardSet.from_settings([], 5.0)
    with pytest.raises(RewardError, match="rl.reward_timeout_s must be a positive number"):
        RewardSet.from_settings([RewardSettings(name="exact")], 0)


def test_unique_names_skip_names_other_entries_have() -> None:
    from trainforge.rl.rewards import _unique_names

    assert _unique_names(["a", "a", "a_2", "b"]) == ["a", "a_3", "a_2", "b"]


def test_empty_batch() -> None:
    assert reward_set({"name": "exact"}).score([], [], []) == RewardScores(total=[], each={"exact": []})
