"""The one base of every error a user can act on, and the exit codes they map to (a leaf: imports nothing of ours).

Every user-facing error derives from ``TrainforgeError`` and carries its ``exit_code``; the CLI
catches that one type. ``EXIT_CODES`` is the one list of codes: the CLI's help, the launcher
and the README table are checked against it.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_UNEXPECTED = 1  # a bug or an unforeseen failure: the traceback is printed
EXIT_BAD_INPUT = 2
EXIT_NONFINITE = 3
EXIT_OUT_OF_MEMORY = 4
EXIT_PLAN_ERROR = 5  # `trainforge plan`: a finding is an error (the run as planned would fail)
EXIT_INTERRUPTED = 75  # sysexits.h EX_TEMPFAIL: a temporary failure, retrying (resuming) is expected to work

EXIT_CODES: dict[int, str] = {
    EXIT_OK: "done",
    EXIT_UNEXPECTED: "unexpected error (a traceback is printed)",
    EXIT_BAD_INPUT: "bad input (config, data, model directory, output directory, a checkpoint that does not fit), "
    "an output directory another live run holds (it is named), or a run directory that cannot be written "
    "mid-run (disk full: the path is named)",
    EXIT_NONFINITE: "stopped after train.max_skipped_steps non-finite steps in a row",
    EXIT_OUT_OF_MEMORY: "out of memory even at micro-batch 1, refused before loading the model (its estimated "
    "memory exceeds the device's twice over), or a tokenizer worker killed (lower data.num_workers)",
    EXIT_PLAN_ERROR: "plan: a finding is an error (the run as planned would fail; each finding names its fix)",
    EXIT_INTERRUPTED: "stopped by SIGTERM/SIGINT: a run saves a checkpoint first (none before its first step), and the "
    "same command with the same --output resumes it, or starts it again from step 0 where it saved none (the message "
    "names the directory; a second signal stops at once, without saving); selftest, bench, plan --measure and "
    "prepare save nothing: run them again",
}
"""Exit code -> what it means, for every code trainforge exits with on purpose."""


class TrainforgeError(Exception):
    """An error the user can act on: the message says what and where, ``exit_code`` how the process ends."""

    exit_code: int = EXIT_BAD_INPUT
    label: str = "error"  # the word the CLI prints before the message


def exit_codes_text() -> str:
    """``0 done; 1 unexpected error ...``: the codes in one line, for ``--help``."""
    return "; ".join(f"{code} {meaning}" for code, meaning in EXIT_CODES.items()) + "."
