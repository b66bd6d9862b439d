"""A user's reward function in a real process: a call past rl.reward_timeout_s stops with the message, and the
function still running in its worker thread does not keep the process from exiting."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"


def test_a_hung_reward_function_does_not_hold_the_process(tmp_path: Path) -> None:
    (tmp_path / "slow_rewards.py").write_text("import time\n\ndef score(prompts, completions, **kw):\n"
                                              "    time.sleep(3600)\n")
    script = textwrap.dedent("""
        import sys
        from trainforge.config.rewards import RewardSettings
        from trainforge.rl.rewards import RewardError, RewardSet

        rewards = RewardSet.from_settings([RewardSettings(function="slow_rewards.py:score")], 0.5)
        try:
            rewards.score(["2+2?"], ["4"], [{"answer": "4"}], where=["prompts.jsonl line 1"])
        except RewardError as e:
            print(e)
            sys.exit(e.exit_code)
    """)
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    # the bound is only against a hang: the sleeping thread would hold a non-daemon process for an hour
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2, done.stderr
    assert ("the reward function score (slow_rewards.py) did not return within rl.reward_timeout_s=0.5s scoring 1 "
            "completion (first: prompts.jsonl line 1); it is still running") in done.stdout
