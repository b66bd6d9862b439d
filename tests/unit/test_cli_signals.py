"""A signal before a command's own stop handling (imports, config, probes: the first seconds) exits 75 with a line."""

from __future__ import annotations

import os
import signal

import pytest


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_before_a_commands_own_handling_exits_75(monkeypatch, capfd, signum):
    """It exited 143 (SIGTERM's default) or with a KeyboardInterrupt traceback in the seconds before `train` installed
    its handler: exit 75 says "stopped, nothing saved, run it again", as the exit-code table promises."""
    import trainforge.cli as cli
    import trainforge.config.run as config

    def signalled(*args, **kwargs):
        os.kill(os.getpid(), signum)  # arrives while the command is at work
        raise AssertionError("the signal did not stop the command")

    monkeypatch.setattr(config, "load_config", signalled)
    monkeypatch.setattr("sys.argv", ["trainforge", "config"])
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}

    def unhandled(*args):  # stands in for the default (which would end this test process) until main installs its own
        raise AssertionError("main installed no handler")

    signal.signal(signum, unhandled)
    try:
        with pytest.raises(SystemExit) as e:
            cli.main()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    assert e.value.code == 75
    said = capfd.readouterr().err
    assert f"stopped: {signal.Signals(signum).name}; nothing more was saved (what was saved before stays); run the same " in said
