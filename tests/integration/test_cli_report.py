"""`trainforge report` and the report.html every run writes: through the real CLI, and in a real
browser (headless Chromium) when one is installed."""

from __future__ import annotations

import base64
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from integration_helpers import root_conftest, run_cli, show

write_config = root_conftest().write_config
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
PANEL_COUNT = 8


def inlined_pngs(page: str) -> list[bytes]:
    return [base64.b64decode(d) for d in re.findall(r'src="data:image/png;base64,([^"]+)"', page)]


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory, tiny_model_dir, toy_data_dir) -> tuple[Path, Path]:
    """Two short runs that differ in the learning rate, each through `trainforge train` (shared by the tests here)."""
    tmp_path = tmp_path_factory.mktemp("two-runs")
    runs = []
    for name, lr in (("lr-1e-3", 1.0e-3), ("lr-3e-3", 3.0e-3)):
        cfg = {
            "model": {"path": str(tiny_model_dir), "method": "full"},
            "data": {"train": str(toy_data_dir / "pc_train.jsonl"), "eval": str(toy_data_dir / "pc_eval.jsonl"), "max_length": 64},
            "train": {"max_steps": 4, "micro_batch_size": 4, "grad_accum": 2, "precision": "fp32", "device": "cpu"},
            "optim": {"lr": lr, "warmup_steps": 2},
            "checkpoint": {"every_steps": 2},
            "log": {"every_steps": 1},
        }
        config = write_config(tmp_path / f"{name}.yaml", cfg)
        proc = run_cli(["train", config, "--output", tmp_path / name], tmp_path)
        assert proc.returncode == 0, show(proc)
        assert f"report: {tmp_path / name / 'report.html'}" in proc.stdout, show(proc)
        runs.append(tmp_path / name)
    return runs[0], runs[1]


def test_every_run_writes_its_report_and_report_compares_runs(tmp_path, two_runs):
    a, b = two_runs
    page = (a / "report.html").read_text()
    assert len(inlined_pngs(page)) == PANEL_COUNT
    assert "<td>finished</td>" in page and "<td>checkpoint</td>" in page  # checkpoints at steps 2 and 4

    proc = run_cli(["report", a, b, "--out", tmp_path / "compare.html"], tmp_path)
    assert proc.returncode == 0, show(proc)
    assert f"wrote {tmp_path / 'compare.html'}" in proc.stdout
    page = (tmp_path / "compare.html").read_text()
    assert len(inlined_pngs(page)) == PANEL_COUNT
    assert '<tr class="diff"><th>optim.lr</th><td>0.001</td><td>0.003</td></tr>' in page

    proc = run_cli(["report", tmp_path / "nothing-here"], tmp_path)
    assert proc.returncode == 2, show(proc)
    assert "nothing-here" in proc.stderr and "Traceback" not in proc.stderr, show(proc)


def test_a_run_stopped_by_a_signal_writes_its_report_and_the_resume_is_marked(tmp_path, finetune_config):
    cfg = {**finetune_config, "checkpoint": {"every_steps": 100}, "log": {"every_steps": 1}}
    cfg["train"] = {**cfg["train"], "max_steps": 5}
    config = write_config(tmp_path / "run.yaml", cfg)
    run = tmp_path / "run"

    proc = run_cli(["train", config, "--output", run], tmp_path, faults={"signal_in_step": [3, "SIGTERM"]})
    assert proc.returncode == 75, show(proc)
    page = (run / "report.html").read_text()
    assert "<td>stopped by SIGTERM at step 3</td>" in page
    assert "<td>3</td><td>stopped by a signal</td><td>SIGTERM, checkpoint saved</td>" in page

    proc = run_cli(["train", config, "--output", run], tmp_path)
    assert proc.returncode == 0, show(proc)
    page = (run / "report.html").read_text()
    assert "<td>finished</td>" in page
    assert "<td>3</td><td>resume</td><td>from step-00000003</td>" in page
    assert "<th>resumed at steps</th><td>3</td>" in page


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium on this machine (apt-get install chromium)")
def test_report_renders_in_a_real_browser(tmp_path, two_runs):
    """Headless Chromium draws the comparison page from the file alone (no network needed)."""
    from matplotlib.image import imread

    out = tmp_path / "compare.html"
    proc = run_cli(["report", *two_runs, "--out", out], tmp_path)
    assert proc.returncode == 0, show(proc)
    shot = tmp_path / "report.png"
    browser = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={tmp_path / 'chromium-profile'}", f"--screenshot={shot}", "--window-size=1400,2000",
         out.resolve().as_uri()],
        capture_output=True, text=True, timeout=120,
    )
    assert shot.is_file(), browser.stderr
    pixels = imread(shot)
    assert pixels.shape[:2] == (2000, 1400)
    ink = (pixels[..., :3].mean(axis=-1) < 0.9).mean()  # share of non-white pixels: text, axes, curves
    assert ink > 0.02, f"the page looks blank ({ink:.3%} ink)"
    # the plots themselves were drawn: the curves' blue and red are on screen
    rgb = (pixels[..., :3] * 255).astype(int)
    blue = ((abs(rgb[..., 0] - 0x1F) < 30) & (abs(rgb[..., 1] - 0x77) < 30) & (abs(rgb[..., 2] - 0xB4) < 30)).sum()
    red = ((abs(rgb[..., 0] - 0xD6) < 30) & (abs(rgb[..., 1] - 0x27) < 30) & (abs(rgb[..., 2] - 0x28) < 30)).sum()
    assert blue > 200 and red > 200, (blue, red)
