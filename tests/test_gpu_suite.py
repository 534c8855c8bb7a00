"""benchmarks/gpu_suite.py in its reduced CPU mode (issue 23, item 6): one command, one table, one JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # five small `mima fit` runs and a bare loop: ~30-60 s on 2 shared cores
def test_gpu_suite_cpu_smoke_prints_one_table_and_writes_its_json(tmp_path, private_cache):
    output = tmp_path / "suite.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MIMA_CACHE_DIR": str(private_cache)}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_suite.py"), "--cpu-smoke", "--json", str(output)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(output.read_text())
    assert result["mode"] == "cpu-smoke" and result["device"] == "cpu"
    median = result["median_steps_per_s"]
    for key in ("mima", "bare", "cached", "no_checkpoints"):
        assert len(result["steps_per_s"][key]) == result["repeats"] and median[key] > 0
    assert result["fit_over_bare_resident"] == pytest.approx(median["mima"] / median["bare"])
    assert result["cached_over_bare_resident"] == pytest.approx(median["cached"] / median["bare"])
    assert result["eval_over_bare"] == pytest.approx(result["eval_images_per_s"]["mima"] / result["eval_images_per_s"]["bare"])
    assert result["flops_per_step"] > 0 and result["sync_s"] > 0 and 0 <= result["checkpoint_stall_share"] < 1
    assert result["mfu"] is None  # no bf16 peak is known for a CPU
    table = done.stdout[done.stdout.index("cpu-smoke on cpu"):]
    for row in ("fit, resident inputs", "fit, data.cache", "evaluation (images/s)", "one sync (s)", "checkpoint stall share"):
        assert row in table
