"""The family matrix (``trainforge/tools/family_matrix.py``): every causal-LM family of transformers trains full and
LoRA through trainforge, exports and reloads with the same logits, or is refused / skipped with its reason. Each
family is one test (xdist spreads them), and each checks its row of ``docs/models.md`` equals a fresh run, so the
table cannot drift from the code; regenerate it with ``python -m trainforge.tools.family_matrix [FAMILY ...]``."""

from __future__ import annotations

import pytest

from trainforge.tools.family_matrix import DOC, Outcome, families, parse_table, run_family

ROWS = parse_table(DOC.read_text())


def test_the_table_has_one_row_per_family_of_this_transformers():
    assert sorted(ROWS) == families(), "rewrite docs/models.md: python -m trainforge.tools.family_matrix"


def test_a_row_is_rendered_with_its_note_on_one_line():
    row = Outcome("llama", "ok", "refused", "true", "lora: a | b\nc").row()
    assert row == "| llama | ok | refused | true | lora: a / b c |"


@pytest.mark.parametrize("family", families())
def test_family(family, tmp_path_factory):
    work = tmp_path_factory.getbasetemp() / "family-matrix" / family
    outcome = run_family(family, work)
    assert outcome.full in {"ok", "refused", "skipped", "fails"} and outcome.lora in {"ok", "refused", "skipped", "fails"}
    if "refused" in (outcome.full, outcome.lora):  # a refusal is exit 2 and says why
        assert outcome.note
    assert outcome.row() == ROWS.get(family), f"docs/models.md's row differs: python -m trainforge.tools.family_matrix {family}"
