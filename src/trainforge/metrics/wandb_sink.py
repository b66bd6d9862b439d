"""Weights & Biases tracker: offline into the run directory unless the user is logged in.

Mode: ``WANDB_MODE`` when set; otherwise ``online`` when an API key is at hand
(``WANDB_API_KEY``, or ``wandb login``'s entry in ~/.netrc), else ``offline``: the run is
written under ``RUN_DIR/wandb/offline-run-*`` and uploaded later with ``wandb sync``.
Our own ``step`` is W&B's x-axis (``define_metric``), so a resumed run (same id, stored in
the checkpoint) continues on the same axis whatever W&B's internal step counter says.
"""

from __future__ import annotations

import netrc
import os
import secrets
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from .sink import scalars


def logged_in() -> bool:
    """An API key is available: ``WANDB_API_KEY`` or a ~/.netrc entry for the W&B host."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or "api.wandb.ai"
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def wandb_mode() -> str:
    return os.environ.get("WANDB_MODE") or ("online" if logged_in() else "offline")


class WandbSink:
    name = "wandb"

    def __init__(self, out: Path, run_name: str, project: str, config: dict[str, Any], resume: dict[str, Any] | None):
        import wandb

        mode = wandb_mode()
        run_id = (resume or {}).get("id") or secrets.token_hex(6)  # W&B ids: letters and digits
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or project,
            name=run_name,
            id=run_id,
            resume="allow",  # the same id continues the run (a resume); a new id starts one
            dir=str(out),
            mode=mode,
            config=config,
            # console off: our console output stays ours; silent: we print where the run went ourselves
            settings=wandb.Settings(console="off", silent=True),
        )
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        self.out = out
        if mode == "offline":
            local = Path(self.run.dir).parent
            self.where = f"W&B offline run {run_id} in {local} (upload it with: wandb sync {local})"
        else:
            self.where = f"W&B run {run_id} ({mode}): {getattr(self.run, 'url', None) or project}"

    def write(self, record: dict[str, Any]) -> None:
        group, values = scalars(record)
        self.run.log({"step": record.get("step", 0), **{f"{group}/{k}": v for k, v in values.items()}})

    def summary(self, summary: dict[str, Any]) -> None:
        """summary.json's fields as the run's summary, and the file itself."""
        flat: dict[str, Any] = {}

        def add(key: str, value: Any) -> None:
            if isinstance(value, dict):
                for k, v in value.items():
                    add(f"{key}/{k}", v)
            elif isinstance(value, (int, float, str, bool)) or value is None:
                flat[key] = value

        for k, v in summary.items():
            add(k, v)
        self.run.summary.update(flat)
        self.artifact(self.out / "summary.json")

    def artifact(self, path: Path) -> None:
        if path.exists():
            self.run.save(str(path), base_path=str(path.parent), policy="now")

    def state(self) -> dict[str, Any]:
        return {"id": self.run.id}

    def close(self, ok: bool = True) -> None:
        self.run.finish(exit_code=0 if ok else 1)
