"""The silent progress reporter selftest's training runs report to."""

from __future__ import annotations


def quiet():
    """A ``ConsoleReporter`` that prints nothing."""
    from rich.console import Console

    from ...metrics.console import ConsoleReporter

    return ConsoleReporter(Console(quiet=True))
