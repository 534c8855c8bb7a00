"""benchmarks/gpu_suite.py in its reduced CPU mode (issue 23 item 6, issue 47 item 6): every row of the
suite, one table, one JSON; each recorded ratio the quotient of the rates recorded beside it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SUITE = ROOT / "benchmarks" / "gpu_suite.py"


def _run(tmp_path: Path, private_cache: Path, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MIMA_CACHE_DIR": str(private_cache)}
    return subprocess.run([sys.executable, str(SUITE), *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _rate_consistent(row: dict, batch: int) -> None:
    assert row["timed_steps"] > 0 and row["seconds"] > 0
    assert row["steps_per_s"] == pytest.approx(row["timed_steps"] / row["seconds"])
    assert row["images_per_s"] == pytest.approx(row["steps_per_s"] * batch)
    assert row["mfu"] is None  # no bf16 peak is known for a CPU


# five small `mima fit` runs (one compiled by TorchInductor), bare loops, the L/14 rows' code on a small
# tower: 20-90 s on 2 cores (TorchInductor's cache warm or cold)
@pytest.mark.slow
def test_gpu_suite_cpu_smoke_runs_every_row_and_writes_its_json(tmp_path, private_cache):
    output = tmp_path / "suite.json"
    done = _run(tmp_path, private_cache, "--cpu-smoke", "--json", str(output))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(output.read_text())
    assert result["mode"] == "cpu-smoke" and result["device"] == "cpu" and result["complete"] is True
    size = result["size"]
    batch, large_batch = result["batch"], result["large_batch"]
    assert result["flops_per_step"] > 0 and result["peak_bf16_tflops"] is None

    # bare anchors: eager and compiled at both batches, the compile (first step) timed apart
    anchors = result["bare_anchor"]
    assert set(anchors) == {f"{kind}_{b}" for kind in ("eager", "compiled") for b in (batch, large_batch)}
    for key, row in anchors.items():
        _rate_consistent(row, row["batch"])
        assert row["timed_steps"] == size["anchor_steps"] and row["first_step_s"] > 0
        assert row["compiled"] == key.startswith("compiled")
        assert row["backend"] == ("aot_eager" if row["compiled"] else None)

    # mima fit: eager, compiled, compiled without checkpoints, from the cache; the first step apart
    fits = result["fit"]
    assert set(fits) == {"eager", "compiled", "compiled_no_checkpoints", "cached"}
    steps = size["steps"] * result["tasks"]  # S per task, every task of the run
    for key, row in fits.items():
        _rate_consistent(row, batch)
        assert row["timed_steps"] == steps - size["fit_warmup"] and row["first_step_s"] > 0
        # the per-tensor loop: torch's AdamW on CPU parameters when neither fused nor foreach is asked for
        assert row["adamw"] == {"kernel": "for-loop", "fused": None, "foreach": None}
    assert fits["compiled"]["compiled"] and fits["compiled_no_checkpoints"]["compiled"]
    assert not fits["eager"]["compiled"] and not fits["cached"]["compiled"]  # model.compile: auto is off on the CPU
    assert fits["compiled"]["stall_s"] >= 0 and fits["compiled_no_checkpoints"]["stall_s"] in (None, 0.0)

    # batch_tasks: one batch of each of the row's tasks per step
    stacked = result["batch_tasks"]
    assert stacked["tasks"] == size["batch_tasks"] and stacked["images_per_step"] == batch * size["batch_tasks"]
    assert stacked["images_per_s"] == pytest.approx(stacked["steps_per_s"] * batch * size["batch_tasks"])
    assert stacked["timed_steps"] == size["steps"] - size["fit_warmup"] and not stacked["compiled"]  # S process steps

    stall = result["checkpoint_stall"]
    assert stall["share_of_fit"] == pytest.approx(stall["stall_s"] / stall["timed_s"])
    assert stall["timed_s"] == fits["compiled"]["seconds"]
    assert stall["share_by_rates"] == pytest.approx(
        max(0.0, 1 - fits["compiled"]["steps_per_s"] / fits["compiled_no_checkpoints"]["steps_per_s"]))

    # evaluation from PNGs and from the cache (equal counts on the CPU: the same float32 operations on
    # the same pixels), and the bare compiled loop on the same images resident on the device
    evaluation = result["evaluation"]
    assert set(evaluation) == {"png", "cache", "bare_resident"}
    for row in evaluation.values():
        assert row["images"] == size["eval_images"] * result["tasks"]
        assert row["images_per_s"] == pytest.approx(row["images"] / row["seconds"])
        assert set(row["correct"]) == {"noise_a", "noise_b"}
        assert all(0 <= count <= size["eval_images"] for count in row["correct"].values())
    assert evaluation["png"]["correct"] == evaluation["cache"]["correct"]
    assert evaluation["png"]["cache"] == "off" and evaluation["cache"]["cache"] == "every task"
    assert evaluation["bare_resident"]["compiled"] and evaluation["bare_resident"]["compile_s"] > 0

    assert result["sync"]["sync_s"] > 0 and result["sync"]["tasks"] == 2

    ratios = result["ratios"]
    assert ratios["fit_compiled_over_bare_compiled"] == pytest.approx(
        fits["compiled"]["images_per_s"] / anchors[f"compiled_{batch}"]["images_per_s"])
    assert ratios["fit_eager_over_bare_eager"] == pytest.approx(
        fits["eager"]["images_per_s"] / anchors[f"eager_{batch}"]["images_per_s"])
    assert ratios["fit_cached_over_bare"] == pytest.approx(
        fits["cached"]["images_per_s"] / anchors[f"eager_{batch}"]["images_per_s"])  # eager: auto on the CPU
    for b in (batch, large_batch):
        assert ratios["bare_compiled_over_eager"][str(b)] == pytest.approx(
            anchors[f"compiled_{b}"]["images_per_s"] / anchors[f"eager_{b}"]["images_per_s"])
    assert ratios["eval_cache_over_bare_resident"] == pytest.approx(
        evaluation["cache"]["images_per_s"] / evaluation["bare_resident"]["images_per_s"])
    assert ratios["eval_cache_over_png"] == pytest.approx(
        evaluation["cache"]["images_per_s"] / evaluation["png"]["images_per_s"])
    assert ratios["large_peak_over_plan"] == {"no_checkpointing": None, "checkpointing": None}  # no device allocator

    large = result["large"]
    assert result["allocated_before_large_bytes"] == 0
    for name in ("no_checkpointing", "checkpointing"):
        step = large["step"][name]
        assert step["step_s"] > 0 and step["peak_bytes"] is None and step["baseline_bytes"] is None
        parts = step["plan_parts"]
        assert step["plan_bytes"] == parts["total"] == sum(value for key, value in parts.items() if key != "total")
        assert parts["gradients"] == parts["weights"] and parts["adamw_moments"] == 2 * parts["weights"]
    # recomputing activations keeps fewer of them: the plan's memory of the checkpointed step is smaller
    assert large["step"]["checkpointing"]["plan_bytes"] < large["step"]["no_checkpointing"]["plan_bytes"]
    assert large["sync"]["sync_s"] > 0 and large["sync"]["tasks"] == 2
    for method in ("cart", "tsv"):
        merge = large["merges"][method]
        # CPU against CPU in the smoke mode: the same code on the same inputs, the same bytes
        assert merge["device"] == "cpu" and merge["max_relative_difference"] == 0.0
        assert merge["cpu_s"] > 0 and merge["device_s"] > 0 and merge["full_device_s"] > 0
        assert 0 < merge["subset_share"] < 1 and merge["subset_keys"] > 0  # one of the tower's two blocks
        assert merge["cpu_s_scaled_to_every_tensor"] == pytest.approx(merge["cpu_s"] / merge["subset_share"])

    table = done.stdout[done.stdout.index("cpu-smoke on cpu"):]
    for row in (f"bare loop, eager, batch {batch}", f"bare loop, compiled, batch {large_batch}", "mima fit, eager",
                "mima fit, compiled", "mima fit, cached", "mima fit, batch_tasks", "evaluation from PNGs",
                "evaluation from the cache", "bare compiled inference, resident inputs", "one sync, 2 tasks (s)",
                "checkpoint stall, share of the compiled fit", "goal: mima fit compiled / bare compiled",
                "goal: evaluation from the cache / bare resident inference", "goal: L/14 peak / plan, checkpointing",
                "step, no checkpointing (s)", "step, checkpointing, peak memory above baseline vs plan",
                "cart, 2 tasks, every tensor, on cpu (s)", "tsv: largest relative difference"):
        assert row in table, row


def test_gpu_suite_refuses_to_overwrite_a_results_file(tmp_path, private_cache):
    output = tmp_path / "suite.json"
    output.write_text("{}")
    done = _run(tmp_path, private_cache, "--cpu-smoke", "--json", str(output), timeout=300)
    assert done.returncode == 2 and "--overwrite" in done.stderr
    assert output.read_text() == "{}"
