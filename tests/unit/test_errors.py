"""One error base, one list of exit codes: every user-facing error derives from TrainforgeError
and names a listed code; the README's table is that list."""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

import trainforge
from trainforge.errors import EXIT_CODES, TrainforgeError

README = Path(__file__).resolve().parents[2] / "README.md"


def all_error_classes() -> list[type[TrainforgeError]]:
    for mod in pkgutil.walk_packages(trainforge.__path__, "trainforge."):
        if not mod.name.endswith("__main__"):  # importing it runs the CLI
            importlib.import_module(mod.name)
    seen, todo = [], [TrainforgeError]
    while todo:
        cls = todo.pop()
        seen.append(cls)
        todo.extend(cls.__subclasses__())
    return seen


def test_every_error_names_a_listed_exit_code():
    classes = all_error_classes()
    names = {c.__name__ for c in classes}
    # the errors of config, data, resume, run directory, non-finite, out of memory and signals share the base
    assert {"ConfigError", "DataError", "ResumeError", "OutputDirError", "RunDirBusy", "NonFiniteError",
            "OutOfMemory", "Interrupted", "ModelSourceError", "DistError", "ReportError"} <= names
    for cls in classes:
        assert cls.exit_code in EXIT_CODES, cls


def test_readme_exit_code_table_is_the_list():
    rows = dict(re.findall(r"^\| (\d+) \| (.+) \|$", README.read_text(), re.M))
    assert {int(k): v for k, v in rows.items()} == EXIT_CODES


def test_model_settings_that_fail_at_build_time_are_user_errors(tiny_tokenizer_dir):
    """model.init.vocab_size below the tokenizer's size (and the model checks beside it in model/load.py) raised
    a bare ValueError: a traceback and exit 1 for a config value the message itself names."""
    import pytest

    from trainforge.errors import EXIT_BAD_INPUT
    from trainforge.model.load import init_config
    from trainforge.model.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_tokenizer_dir)
    with pytest.raises(TrainforgeError, match=r"model.init.vocab_size=50 is smaller than the tokenizer's \d+ tokens; raise it") as e:
        init_config({"architecture": "llama", "vocab_size": 50}, tok)
    assert e.value.exit_code == EXIT_BAD_INPUT
    source = (Path(trainforge.__file__).parent / "model" / "load.py").read_text()
    assert "raise ValueError(" not in source  # every refusal there is a ConfigError the CLI prints
