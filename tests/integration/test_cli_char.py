"""End to end: ``examples/char-shakespeare.yaml`` (``model.tokenizer: char``) through the real CLI.

A generated ~50 KB play stands in for tiny Shakespeare (the repository ships no text); the
example's model is shrunk with ``--set`` so the run takes seconds on a CPU.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from integration_helpers import run_cli, show

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "char-shakespeare.yaml"
SPECIALS = ["<|endoftext|>", "<|pad|>", "<|unk|>"]
SHRINK = [
    "model.init.hidden_size=32",
    "model.init.intermediate_size=64",
    "model.init.num_hidden_layers=1",
    "model.init.num_attention_heads=2",
    "model.init.max_position_embeddings=64",
    "data.max_length=64",
    "train.micro_batch_size=4",
    "train.eval_every=2",
    "train.eval_max_batches=2",
    "log.every_steps=2",
    "log.sample_tokens=40",
    "log.report=false",
    "checkpoint.every_steps=4",
]


def play(size: int = 50_000, seed: int = 0) -> str:
    """Speeches in the shape of tiny Shakespeare, with a few characters outside ASCII."""
    rng = random.Random(seed)
    names = ["ROMEO", "JULIET", "MERCUTIO", "NURSE", "FRIAR LAURENCE"]
    words = "thou art my love what light through yonder window breaks ’tis the east and Juliet is sun fair moon née".split()
    parts: list[str] = []
    while sum(map(len, parts)) < size:
        lines = [
            " ".join(rng.choice(words) for _ in range(rng.randint(3, 9))).capitalize() + rng.choice(".,!?;:")
            for _ in range(rng.randint(1, 4))
        ]
        parts.append(f"{rng.choice(names)}:\n" + "\n".join(lines) + "\n\n")
    return "".join(parts)


def _args(corpus: Path, run: Path, steps: int) -> list:
    overrides = [f"data.train={corpus}", f"train.max_steps={steps}", *SHRINK]
    return ["train", EXAMPLE, *[a for o in overrides for a in ("--set", o)], "--output", run]


@pytest.fixture(scope="module")
def char_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("char")
    text = play()
    corpus = tmp / "input.txt"
    corpus.write_text(text)
    run = tmp / "run"
    proc = run_cli(_args(corpus, run, 4), tmp)
    assert proc.returncode == 0, show(proc)
    return tmp, text, corpus, run, proc


def test_final_holds_the_char_tokenizer(char_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, text, _, run, proc = char_run
    chars = sorted(set(text))
    assert f"tokenizer: characters of the data, {len(chars) + 3} tokens" in proc.stdout, show(proc)

    tok = AutoTokenizer.from_pretrained(run / "final")
    assert tok.get_vocab() == {t: i for i, t in enumerate(chars + SPECIALS)}
    assert (tok.eos_token, tok.pad_token, tok.unk_token) == tuple(SPECIALS)
    speech = text[:500]
    ids = tok(speech)["input_ids"]
    assert ids == [chars.index(c) for c in speech] and tok.decode(ids) == speech

    model = AutoModelForCausalLM.from_pretrained(run / "final")
    assert model.config.vocab_size == len(chars) + 3 and model.config.hidden_size == 32

    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["data"]["format"] == "text"
    assert summary["data"]["too_long"] == "split" and summary["eval_loss"] is not None


def test_sample_decodes_to_plain_characters(char_run):
    _, text, _, run, proc = char_run
    summary = json.loads((run / "summary.json").read_text())
    sample = summary["sample"]
    assert sample.startswith("ROMEO:")  # the example's prompt, then the continuation
    assert 6 < len(sample) <= 6 + 40  # one character per token; specials are skipped
    assert set(sample) <= set(text), sample  # nothing but the data's characters: no spaces added, no <|...|>
    assert " ".join(sample.split()) in " ".join(proc.stdout.split()), show(proc)  # the console may wrap lines


def test_resume_rebuilds_the_same_vocabulary(char_run):
    tmp, _, corpus, run, _ = char_run
    proc = run_cli(_args(corpus, run, 6), tmp)
    assert proc.returncode == 0, show(proc)
    assert "resuming from" in proc.stdout, show(proc)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["resumed_from_step"] == 4 and summary["steps"] == 6
