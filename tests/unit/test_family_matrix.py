"""The family matrix (``trainforge/tools/family_matrix.py``): every causal-LM family of transformers trains full and
LoRA through trainforge, exports and reloads with the same logits, or is refused / skipped with its reason. Each
family is one test (xdist spreads them), and each checks its row of ``docs/models.md`` equals a fresh run, so the
table cannot drift from the code; regenerate it with ``python -m trainforge.tools.family_matrix [FAMILY ...]``.

The whole matrix (about 200 families) costs over ten CPU-minutes, half the suite's budget: ``make test`` checks the
families users fine-tune most and those with their own paths (MoE, latent attention, recurrent layers, soft-capped
attention); ``TRAINFORGE_FAMILY_MATRIX=all`` checks every row, as anyone changing the model paths should run."""

from __future__ import annotations

import os

import pytest

from trainforge.tools.family_matrix import DOC, Outcome, families, parse_table, run_family

ROWS = parse_table(DOC.read_text())
EVERY_BUILD = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "gpt2", "gpt_neox",
               "granite", "starcoder2", "smollm3", "olmo2", "cohere2", "glm4", "phi",
               "qwen2_moe", "qwen3_moe", "olmoe", "mixtral", "deepseek_v3", "gpt_oss",
               "mamba", "falcon_mamba", "qwen3_5", "falcon", "llama4_text"]
CHECKED = families() if os.environ.get("TRAINFORGE_FAMILY_MATRIX") == "all" else EVERY_BUILD


def test_the_table_has_one_row_per_family_of_this_transformers():
    assert sorted(ROWS) == families(), "rewrite docs/models.md: python -m trainforge.tools.family_matrix"


def test_a_row_is_rendered_with_its_note_on_one_line():
    row = Outcome("llama", "ok", "refused", "true", "lora: a | b\nc").row()
    assert row == "| llama | ok | refused | true | lora: a / b c |"


def test_the_families_every_build_checks_are_rows_of_the_table():
    assert set(EVERY_BUILD) <= set(ROWS)


@pytest.mark.parametrize("family", CHECKED)
def test_family(family, tmp_path_factory):
    work = tmp_path_factory.getbasetemp() / "family-matrix" / family
    outcome = run_family(family, work)
    assert outcome.full in {"ok", "refused", "skipped", "fails"} and outcome.lora in {"ok", "refused", "skipped", "fails"}
    if "refused" in (outcome.full, outcome.lora):  # a refusal is exit 2 and says why
        assert outcome.note
    assert outcome.row() == ROWS.get(family), f"docs/models.md's row differs: python -m trainforge.tools.family_matrix {family}"


def test_options_print_the_usage_and_an_unknown_family_writes_no_row(capsys, monkeypatch):
    from trainforge.tools import family_matrix

    monkeypatch.setattr(family_matrix, "write_table", lambda rows: pytest.fail("the table was rewritten"))
    family_matrix.main(["--help"])
    assert "family matrix" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="not a causal-LM model type of this transformers: lama"):
        family_matrix.main(["lama"])
