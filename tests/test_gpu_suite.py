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
    # the per-tensor loop: torch's AdamW on CPU parameters when neither fused nor foreach is asked for
    assert result["adamw"] == {"kernel": "for-loop", "fused": None, "foreach": None}
    large = result["large"]
    for name in ("no_checkpointing", "checkpointing"):
        step = large["step"][name]
        assert step["step_s"] > 0 and step["plan_bytes"] > 0 and step["peak_bytes"] is None  # no device allocator
    # recomputing activations keeps fewer of them: the plan's memory of the checkpointed step is smaller
    assert large["step"]["checkpointing"]["plan_bytes"] < large["step"]["no_checkpointing"]["plan_bytes"]
    assert large["sync"]["sync_s"] > 0 and large["sync"]["tasks"] == 2
    for method in ("cart", "tsv"):
        merge = large["merges"][method]
        # CPU against CPU in the smoke mode: the same code on the same inputs, the same bytes
        assert merge["device"] == "cpu" and merge["max_relative_difference"] == 0.0
        assert merge["cpu_s"] > 0 and merge["device_s"] > 0
    table = done.stdout[done.stdout.index("cpu-smoke on cpu"):]
    for row in ("fit, resident inputs", "fit, data.cache", "evaluation (images/s)", "one sync (s)", "checkpoint stall share",
                "AdamW kernel", "step, no checkpointing (s)", "step, checkpointing, peak memory vs plan",
                "cart, 2 tasks: cpu vs cpu (s)", "tsv: largest relative difference"):
        assert row in table
