"""model.batch_tasks: a process's tasks stepped together as one stacked model (mima.models.stacked).

What is checked, on the CPU, on the demo's config (configs/demo.yaml: embedded:tiny-digits, its four
tasks, batch 64) shortened to S = 8, N = 2 (K = 4):
  - the batched plan (every process step advances every local task; segment end = phase end);
  - batch_tasks true and false give the same final task models at W = 1 and W = 2. The measure is
    ||theta_batched - theta_sequential|| / ||tau_sequential|| per task (tau = theta - theta_0):
      * in float64 (`--trainer.precision 64-true`), which leaves only rounding between the two
        schedules: measured 5e-11 at W = 1 (W = 2 passes the same bound); tolerance 1e-8
        (BATCHED_TOLERANCE_FLOAT64);
      * in float32, the demo's precision: measured 1.2 % .. 2.3 % at W = 1 (0.1 % on the small ViT). Not rounding of the
        weights themselves: vmap's batched matrix products sum in another order, and AdamW divides
        each gradient element by its own running RMS, so an element whose gradient is near zero
        turns a rounding difference into a step of up to lr; over 8 steps these reach a couple per
        cent of tau. Tolerance BATCHED_TOLERANCE_FLOAT32 = 8 % (a wide margin; a wrong batch, learning
        rate or moment is tens of per cent, and float64 pins the schedule itself down);
  - a batched run killed after its first checkpoint and resumed with --ckpt_path last ends with the
    uninterrupted batched run's task models, bit for bit (killed in the second phase, resumed from
    the phase-end state; and from a mid-phase state, --checkpoint_every 2);
  - the refusals (one line each, naming model.batch_tasks) and what "auto" chooses.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch
import yaml

from mima.config.model import ModelSettings
from mima.core.errors import MimaError
from mima.core.plan import PhasePlan
from mima.core.safetensors_io import load_state_dict
from mima.training.plan_choices import choose_batch_tasks
from tests.helpers import REPO, assert_identical, finals, run_job

DEMO_TASKS = ["rot90", "rot180", "rot270", "mirror"]
SHORT = {"steps": 8, "iterations": 2, "warmup_steps": 2}  # K = 4
BATCHED_TOLERANCE_FLOAT64 = 1e-8
BATCHED_TOLERANCE_FLOAT32 = 0.08


def demo_config(path: Path, devices: int = 1, callbacks=(), **model) -> Path:
    """configs/demo.yaml shortened (SHORT) with `model` options (a `clip` among them replaces the demo's
    embedded one, which a test session pretrains first: a minute), on `devices` CPU processes."""
    config = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    config["model"].update(SHORT, **model)
    config["trainer"].update({"devices": devices, "enable_progress_bar": False, "enable_model_summary": False,
                              "logger": False})
    if callbacks:
        config["trainer"]["callbacks"] = [{"class_path": f"tests.helpers.{name}", "init_args": args}
                                          for name, args in callbacks]
    path.write_text(yaml.safe_dump(config))
    return path


def fit(tmp_path: Path, name: str, *extra: str, devices: int = 1, callbacks=(), **model) -> Path:
    model = {key: value for key, value in model.items() if value is not None}  # clip=None: the demo's
    out = tmp_path / name
    result = run_job(demo_config(tmp_path / f"{name}.yaml", devices, callbacks, **model), out, *extra)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def relative_differences(a: Path, b: Path) -> dict[str, float]:
    """Per task: ||a - b|| / ||b - theta_0|| over the encoder's tensors (b's final models, a's)."""
    theta_0 = load_state_dict(b / "pretrained.safetensors")
    first, second = finals(a, DEMO_TASKS), finals(b, DEMO_TASKS)
    ratios = {}
    for task in DEMO_TASKS:
        assert first[task].keys() == second[task].keys()
        gap = sum(float((first[task][k].double() - second[task][k].double()).square().sum()) for k in first[task])
        tau = sum(float((second[task][k].double() - theta_0[k].double()).square().sum()) for k in first[task])
        ratios[task] = (gap / tau) ** 0.5
    return ratios


# ------------------------------------------------------------------------------------ the plan
def test_a_batched_plan_steps_every_local_task_at_once():
    plan = PhasePlan(tasks=("a", "b", "c"), local_tasks=(0, 2), total_steps=6, iterations=2, batched=True)
    assert plan.local_steps == 6  # K per phase, not K per task
    positions = plan.positions(4)
    assert [p.slot for p in positions] == [0, 1] and [p.task_index for p in positions] == [0, 2]
    assert {(p.phase, p.step_in_phase, p.task_step) for p in positions} == {(1, 1, 4)}
    assert [plan.ends_segment(step) for step in range(6)] == [False, False, True, False, False, True]
    assert [plan.ends_phase(step) for step in range(6)] == [False, False, True, False, False, True]
    assert plan.phase_of(3) == 1
    with pytest.raises(RuntimeError, match="positions"):
        plan.position(0)  # a batched step has no one task: every consumer asks for all of them


def test_a_batched_plan_refuses_tasks_with_different_phase_lengths():
    with pytest.raises(MimaError, match="model.batch_tasks") as error:
        PhasePlan(tasks=("a", "b"), local_tasks=(0, 1), total_steps=8, iterations=2, task_lengths=((4, 4), (2, 2)),
                  batched=True)
    assert "\n" not in str(error.value)


# ------------------------------------------------------------------------- refusals and auto
@pytest.mark.parametrize("options, named", [
    ({"mode": "joint"}, "model.mode"),
    ({"proximal_mu": 0.1}, "model.proximal_mu"),
    ({"batchnorm": "train"}, "model.batchnorm"),
    ({"grad_checkpointing": True}, "model.grad_checkpointing"),
    ({"compile": True}, "model.compile"),
    ({"steps": {"rot90": 8, "mirror": 4}, "iterations": 2}, "model.steps"),
])
def test_batch_tasks_true_refuses_what_it_cannot_stack_in_one_line(options, named):
    with pytest.raises(MimaError) as error:
        ModelSettings(**{"clip": "embedded:tiny-digits", "steps": 8, "iterations": 2, **options, "batch_tasks": True})
    message = str(error.value)
    assert "model.batch_tasks" in message and named in message and "\n" not in message


def test_auto_is_off_on_the_cpu_and_where_the_run_cannot_stack_and_on_where_the_plan_fits():
    assert choose_batch_tasks("auto", False, None, 1, 100).value is False
    assert choose_batch_tasks("auto", True, "model.mode=joint (...)", 1, 100).value is False
    assert choose_batch_tasks("auto", True, None, None, None).value is False
    assert choose_batch_tasks("auto", True, None, 50, 100).value is True
    assert choose_batch_tasks("auto", True, None, 90, 100).value is False
    assert choose_batch_tasks(True, False, None, None, None).value is True  # given: as given, also on the CPU


# ----------------------------------------------------------------- batched = one after another
# fast: the small random ViT of the test session (clip fixture small_clip); slow: the demo's own model
CLIPS = [pytest.param("small", id="small-vit"), pytest.param(None, id="demo", marks=pytest.mark.slow)]


def _clip(which, small_clip):
    return small_clip if which == "small" else None


@pytest.mark.parametrize("devices", [1, pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.parametrize("which", CLIPS)
def test_batched_tasks_end_as_the_one_after_another_schedule_in_float64(tmp_path, small_clip, which, devices):
    precision, clip = ("--trainer.precision", "64-true"), _clip(which, small_clip)
    sequential = fit(tmp_path, "sequential", *precision, devices=devices, batch_tasks=False, clip=clip)
    batched = fit(tmp_path, "batched", *precision, devices=devices, batch_tasks=True, clip=clip)
    ratios = relative_differences(batched, sequential)
    assert max(ratios.values()) < BATCHED_TOLERANCE_FLOAT64, ratios


@pytest.mark.parametrize("which", CLIPS)
def test_batched_tasks_end_near_the_one_after_another_schedule_in_float32(tmp_path, small_clip, which):
    clip = _clip(which, small_clip)
    sequential = fit(tmp_path, "sequential", batch_tasks=False, clip=clip)
    batched = fit(tmp_path, "batched", batch_tasks=True, clip=clip)
    ratios = relative_differences(batched, sequential)
    print("relative differences (float32):", ratios)
    assert max(ratios.values()) < BATCHED_TOLERANCE_FLOAT32, ratios
    assert max(ratios.values()) > 0  # rounding differs: the stacked forward did run


# ------------------------------------------------------------------------------ kill + resume
@pytest.mark.slow
@pytest.mark.parametrize("extra, kill_at", [((), 6), (("--checkpoint_every", "2"), 7)])
def test_a_batched_run_killed_and_resumed_ends_bit_for_bit_as_the_uninterrupted_one(tmp_path, extra, kill_at):
    whole = fit(tmp_path, "whole", *extra, batch_tasks=True)
    out = tmp_path / "killed"
    killed = run_job(demo_config(tmp_path / "kill.yaml", 1, [("KillAtStep", {"step": kill_at})], batch_tasks=True), out,
                     *extra)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    resumed = run_job(demo_config(tmp_path / "resume.yaml", 1, batch_tasks=True), out, *extra, "--ckpt_path", "last")
    assert resumed.returncode == 0 and "resuming from" in resumed.stdout, resumed.stderr[-3000:]
    assert_identical(finals(out, DEMO_TASKS), finals(whole, DEMO_TASKS))


@pytest.mark.slow
def test_a_resume_that_would_step_the_tasks_otherwise_is_refused_in_one_line(tmp_path):
    out = tmp_path / "killed"
    killed = run_job(demo_config(tmp_path / "kill.yaml", 1, [("KillAtStep", {"step": 6})], batch_tasks=True), out)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    resumed = run_job(demo_config(tmp_path / "resume.yaml", 1, batch_tasks=False), out, "--ckpt_path", "last")
    assert resumed.returncode != 0 and "model.batch_tasks" in resumed.stderr
    assert not (out / "final" / "rot90.safetensors").exists()


@pytest.mark.slow
def test_a_batched_run_resumed_on_another_number_of_processes_is_refused_in_one_line(tmp_path):
    """An elastic resume re-deals per-task files among the new processes; a batched state holds the
    stacked task models instead, so it resumes on its own number of processes only."""
    out = tmp_path / "killed"
    killed = run_job(demo_config(tmp_path / "kill.yaml", 1, [("KillAtStep", {"step": 6})], batch_tasks=True), out)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    resumed = run_job(demo_config(tmp_path / "resume.yaml", 2, batch_tasks=True), out, "--ckpt_path", "last")
    assert resumed.returncode != 0
    assert "resumes on its own number of processes only (1)" in resumed.stderr, resumed.stderr[-2000:]
    assert "Traceback" not in resumed.stderr, resumed.stderr[-2000:]
    assert not (out / "final" / "rot90.safetensors").exists()
