"""The plan's arithmetic (mima.training.resource_plan) on small made-up models and runs, against sums
worked out here by hand from the module's rules: memory parts, checkpoint file sizes and counts, bytes
written, the peak on disk, the sync volume and the layout's waiting; and that the arithmetic is pure
(no torch), so that `mima plan` loads no Lightning callback to compute it."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from mima.core.errors import MimaError
from mima.core.layout import TaskLayout
from mima.models.footprint import ModelFootprint
from mima.training.resource_plan import (
    CONFIG_BYTES,
    CSV_ROW_BYTES,
    CUDA_CONTEXT_BYTES,
    FINAL_METADATA_BYTES,
    FINAL_RECORD_BYTES,
    RUNTIME_WORKSPACE_BYTES,
    STATE_OVERHEAD_BYTES,
    FileMeasures,
    PlanInputs,
    batched_layout,
    better_world_sizes,
    checkpoint_counts,
    inline_saves,
    make_plan,
    metrics_bytes,
    utilisation,
)
from mima.training.plan_choices import STEP_OVERHEAD_S
from mima.training.save_schedule import SaveSchedule

# a toy model: 10 parameters (40 B in float32), a 48-byte state dict in a 200-byte file, 2 x 2 images
TOY = ModelFootprint(source="toy", parameters=10, parameter_shapes=((2, 5),), parameter_bytes=40, state_bytes=48,
                     file_bytes=200, model_bytes=100, activation_bytes_per_example=8, activation_fixed_bytes=16,
                     forward_flops_per_example=100, image_size=2, embed_dim=4)
MEASURED = FileMeasures(moments_file_bytes=300, rng_state_bytes=500)
IMAGE = 3 * 2 * 2 * 4  # one float32 RGB image of 2 x 2 pixels


def inputs(**changes) -> PlanInputs:
    """Two tasks of 3 steps per phase, N = 2, on one CPU process; moments kept, a save at every segment end."""
    values = dict(tasks=("a", "b"), task_lengths=((3, 3), (3, 3)), world_size=1, num_nodes=1, batch_size=4,
                  num_workers=0, precision="32-true", accelerator="cpu", optimizer_state="keep",
                  checkpoint_every="segment", base_rss_bytes=100)
    return PlanInputs(**(values | changes))


def test_one_cpu_process_with_two_tasks():
    plan = make_plan(inputs(), TOY, MEASURED)
    assert plan.tasks_per_process == [["a", "b"]] and plan.steps_per_phase == [6]
    assert plan.utilisation == 1.0 and plan.better_world_sizes == []
    # batch 4: activations 4 x 8 B; no mixed precision, so no fixed part; no CUDA context on the CPU
    device = {"weights": 40, "gradients": 40, "adamw_moments": 80, "activations": 32, "phase_average": 48}
    assert plan.device_memory_parts == device and plan.device_memory_per_process == 240
    # on the CPU the device's parts are host memory too; training (880 B) holds more than setup (100 + 48 B)
    training = {"theta_0": 48, "segment_end_weights": 1 * 48, "kept_adamw_moments": 2 * 2 * 40,
                "batches_in_flight": 1 * 2 * 4 * IMAGE} | {f"device_{name}": value for name, value in device.items()}
    assert plan.host_memory_parts == {"interpreter_and_libraries": 100, "runtime_workspace": RUNTIME_WORKSPACE_BYTES} | training
    assert plan.host_memory_per_process == plan.host_memory_per_node == 100 + RUNTIME_WORKSPACE_BYTES + 880
    state = 500 + STATE_OVERHEAD_BYTES + 40 * 2  # random states, Lightning's part, a reference per task
    assert plan.checkpoint_file_bytes == {"weights": 200, "moments": 300, "state": state, "inline_state": state + 500}
    # 2 tasks x 2 phases = 4 segment ends, the last not saved; the first task's end of phase 1 (the
    # second's is followed by the sync, whose average stands for it); one sync: an average, 2 tasks' moments
    assert plan.checkpoint_files == {"states": 3, "segments": 1, "averages": 1, "moments": 2}
    logs = 12 * (CSV_ROW_BYTES + 2)  # 12 steps, a row each with a column per task; no tensorboard here
    metrics = (150 + 40 * 2 + 2 * 20 * 2**2) * (1 + 2)  # records after phase 1, then after phases 1 and 2
    final = 2 * (200 + FINAL_METADATA_BYTES + FINAL_RECORD_BYTES)
    assert plan.bytes_written_parts == {
        "pretrained": 240, "config": CONFIG_BYTES, "final": final, "metrics_jsonl": metrics, "logs": logs,
        "checkpoints_states": 3 * state, "checkpoints_segments": 200, "checkpoints_averages": 200,
        "checkpoints_moments": 2 * 300}
    assert plan.bytes_written == sum(plan.bytes_written_parts.values())
    # two averages, two phases' segment ends (one a phase), a generation of moments (2) and the writer's
    # next one (1), two states
    checkpoints_at_once = 2 * 200 + 2 * 1 * 200 + (2 + 1) * 300 + 2 * state
    assert plan.peak_disk_bytes == 240 + CONFIG_BYTES + final + logs + checkpoints_at_once
    assert (plan.sync_bytes_per_process, plan.syncs, plan.timing, plan.notes) == (0, 1, None, [])
    # a stop saves the running task's state with its encoder and moments, the phase average, and the
    # other task's segment end and moments: a small save gets the minimum lead
    assert plan.choices["slurm_signal"]["save_bytes"] == (state + 500) + 200 + 1 * (200 + 300)
    assert plan.choices["slurm_signal_option"] == "--signal=USR1@90"


def test_setup_memory_counts_when_the_whole_clip_is_larger_than_training():
    big = replace(TOY, model_bytes=10_000)
    plan = make_plan(inputs(), big, MEASURED)
    assert plan.host_memory_parts == {"interpreter_and_libraries": 100, "runtime_workspace": RUNTIME_WORKSPACE_BYTES,
                                      "clip_loaded_at_setup": 10_000 + 48}


def test_two_gpu_processes_of_unequal_tasks_saving_every_three_steps():
    plan = make_plan(inputs(task_lengths=((2, 2, 2), (1, 1, 1)), world_size=2, accelerator="gpu",
                            precision="bf16-mixed", optimizer_state="reset", checkpoint_every="3", outer_momentum=True,
                            device_memory_bytes=2 * CUDA_CONTEXT_BYTES),
                     TOY, MEASURED)
    # one task a process: 6 and 3 steps, so one process waits half the time; one process wastes nothing
    assert sorted(map(len, plan.tasks_per_process)) == [1, 1]
    assert plan.utilisation == (6 + 3) / (2 * 6) and plan.better_world_sizes == [1]
    assert plan.device_memory_parts == {"weights": 40, "gradients": 40, "adamw_moments": 80,
                                        "activations": 4 * 8 + 16, "phase_average": 48, "outer_momentum": 48,
                                        "cuda_context_reserve": CUDA_CONTEXT_BYTES}
    assert plan.fits and plan.on_gpu and plan.timing is not None
    # on a GPU the host holds no device part, and with moments reset none are kept
    assert plan.host_memory_parts == {"interpreter_and_libraries": 100, "runtime_workspace": RUNTIME_WORKSPACE_BYTES,
                                      "theta_0": 48, "segment_end_weights": 0, "kept_adamw_moments": 0,
                                      "batches_in_flight": 2 * 4 * IMAGE}
    # every 3 process steps: the 6-step process's step 3 is inside phase 2 (its syncs are at 2 and 4);
    # the 3-step process's has no step 3 before its end; both save at the two syncs
    assert plan.checkpoint_files == {"states": 2 * 2, "segments": 0, "averages": 2, "moments": 0, "inline_states": 1}
    state = plan.checkpoint_file_bytes["state"]
    inline = plan.checkpoint_file_bytes["inline_state"]
    written = plan.bytes_written_parts
    assert written["checkpoints_states"] == 4 * state and written["checkpoints_inline_states"] == inline
    assert plan.peak_disk_bytes == (written["pretrained"] + written["config"] + written["final"] + written["logs"]
                                    + 2 * 200 + 2 * 2 * state + 2 * 2 * inline)
    assert (plan.sync_bytes_per_process, plan.syncs) == (2 * 1 * 48, 2)  # all-gather: W end weights of 48 B


def test_replicas_split_the_batch_and_write_no_segment_ends():
    plan = make_plan(inputs(world_size=4, batch_size=8), TOY, MEASURED)
    assert plan.tasks_per_process == [["a"], ["a"], ["b"], ["b"]]
    assert plan.device_memory_parts["activations"] == (8 // 2) * 8  # each of a task's 2 replicas: half the batch
    # each process: 2 segment ends, the last not saved; no segment file (each segment ends at a sync)
    assert plan.checkpoint_files == {"states": 4 * (1 * 2 - 1), "segments": 0, "averages": 1, "moments": 2}
    writers = 2  # one process per task group writes its moments
    state = plan.checkpoint_file_bytes["state"]
    written = plan.bytes_written_parts
    assert plan.peak_disk_bytes == (written["pretrained"] + written["config"] + written["final"] + written["logs"]
                                    + 2 * 200 + (2 + writers) * 300 + 2 * 4 * state)
    assert plan.sync_bytes_per_process == 4 * 1 * 48


def test_processes_that_do_not_spread_over_the_nodes_are_one_line():
    with pytest.raises(MimaError, match="3 processes do not spread evenly over 2 nodes"):
        make_plan(inputs(world_size=3, num_nodes=2, tasks=("a", "b", "c"), task_lengths=((1,), (1,), (1,))), TOY,
                  MEASURED)


@pytest.mark.parametrize("every, phases, world, expected", [
    ("0", 4, 2, {}),
    ("phase", 4, 2, {"states": 2 * 3, "segments": 0, "averages": 3, "moments": 2 * 3}),
    ("2 phases", 5, 2, {"states": 2 * 2, "segments": 0, "averages": 2, "moments": 2 * 2}),  # syncs 2 and 4 of 4
    ("30min", 4, 1, {"states": 3, "segments": 0, "averages": 3, "moments": 2 * 3}),  # no estimate: every sync
])
def test_checkpoint_counts_of_each_schedule(every, phases, world, expected):
    layout = TaskLayout(2, world, (phases, phases))
    counts = checkpoint_counts(layout, ((1,) * phases, (1,) * phases), SaveSchedule.parse(every), keep=True)
    assert counts == expected


def test_saves_every_n_steps_leave_out_the_syncs():
    assert inline_saves([4, 8, 12], 3) == 3  # steps 3, 6 and 9 (12 is the end)
    assert inline_saves([4, 8, 12], 4) == 0  # steps 4 and 8 are syncs


def test_metrics_are_rewritten_whole_after_every_phase():
    record = 150 + 40 * 3 + 2 * 20 * 3**2
    assert metrics_bytes(3, 4) == record * (1 + 2 + 3 + 4)


def test_better_world_sizes_waste_less():
    # budgets 4, 2, 2 on two processes: 4 | 2 + 2, nothing waits; on three: 4 | 2 | 2, two thirds of the
    # time stepping; one process wastes nothing either
    assert utilisation((4, 2, 2), 3) == 8 / (3 * 4)
    assert better_world_sizes((4, 2, 2), 3) == [1, 2]
    assert better_world_sizes((4, 2, 2), 2) == []


def test_the_stacked_layout_adds_a_step_per_further_task():
    plan = make_plan(inputs(tasks=("a", "b", "c"), task_lengths=((3, 3),) * 3, accelerator="gpu"), TOY, MEASURED)
    stacked = batched_layout(plan, 3, compiled=False)
    step = 40 + 40 + 80 + 4 * 8  # weights, gradients, moments and activations of one task
    assert stacked.copies == 3 and stacked.device_memory_per_process == plan.device_memory_per_process + 2 * step
    # one step's overhead for three tasks' work (eager, so the overhead in the one task's step is the eager one)
    one_task_work = plan.timing["step_s"] - STEP_OVERHEAD_S
    assert stacked.stacked_step_s == pytest.approx(STEP_OVERHEAD_S + 3 * one_task_work)


def modules_loaded_by(*imported: str) -> set[str]:
    """The modules a fresh interpreter holds after importing `imported`."""
    probe = f"import json, sys; import {', '.join(imported)}; print(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return set(json.loads(done.stdout))


def test_the_arithmetic_loads_no_torch_and_the_planner_no_lightning():
    arithmetic = modules_loaded_by("mima.training.resource_plan", "mima.training.plan_format")
    assert {name for name in arithmetic if name.split(".")[0] in ("torch", "lightning", "open_clip")} == set()
    planner = modules_loaded_by("mima.training.plan_from_config")
    assert "torch" in planner  # the probes measure with it
    assert {name for name in planner if name.split(".")[0] in ("lightning", "pytorch_lightning")
            or name == "mima.training.checkpoint_callback"} == set()
