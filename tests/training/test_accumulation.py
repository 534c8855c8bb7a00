"""Gradient accumulation (`trainer.accumulate_grad_batches`): a micro-batches of size b train the same
run as batches of size a*b, up to the order of float sums (issue 13, item 3)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import yaml

from mima.core.safetensors_io import load_state_dict
from mima.data.sampler import JointBatchSampler, PhaseBatchSampler
from mima.core.plan import PhasePlan
from mima.commands.fit.run import run_fit
from tests.helpers import run_job

REPO = Path(__file__).resolve().parents[2]
DEMO = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
DEMO_TASKS = DEMO["data"]["tasks"]


def _demo(batch_size: int, accumulate: int, devices: int = 1) -> dict:
    config = copy.deepcopy(DEMO)
    config["model"].update(steps=16, iterations=2, warmup_steps=2)
    config["data"]["batch_size"] = batch_size
    # In float64: some directions of a ViT change no output (attention's key bias; the key weights
    # along the input direction in which LayerNorm makes all tokens agree), so their true gradient is
    # exactly 0 and autograd returns float noise. In float32 that noise (~1e-10) is near AdamW's eps,
    # which turns it into steps of up to the learning rate, different for every order of the float
    # sums (measured: weights 3e-4 apart after 16 steps at N = 2, embeddings 3e-5); in float64 the
    # noise is 1e-19 and the two runs agree to 1e-11.
    config["trainer"].update(devices=devices, accumulate_grad_batches=accumulate, precision="64-true",
                             enable_progress_bar=False, enable_model_summary=False, logger=False)
    return config


def _finals(run: Path, tasks) -> dict[str, dict[str, torch.Tensor]]:
    return {task: load_state_dict(run / "final" / f"{task}.safetensors") for task in tasks}


def _max_difference(a: dict, b: dict) -> float:
    return max(float((a[t][k].double() - b[t][k].double()).abs().max()) for t in a for k in a[t])


def _moved(run: Path, finals: dict) -> float:
    theta_0 = load_state_dict(run / "pretrained.safetensors")
    return max(float((state[k] - theta_0[k]).abs().max()) for state in finals.values() for k in state)


def test_sampler_cuts_each_step_batch_into_equal_micro_batches():
    plan = PhasePlan(tasks=("a", "b"), local_tasks=(0, 1), total_steps=4, iterations=2)
    whole = list(PhaseBatchSampler(plan, [50, 70], batch_size=12, seed=1))
    micro = list(PhaseBatchSampler(plan, [50, 70], batch_size=4, seed=1, accumulate=3))
    assert len(micro) == 3 * len(whole) == 3 * plan.local_steps
    assert [sum(micro[3 * i : 3 * i + 3], []) for i in range(len(whole))] == whole
    # a replica's share (shard 1 of 2) of the accumulated step is that share of the whole step batch
    half = list(PhaseBatchSampler(plan, [50, 70], batch_size=4, seed=1, accumulate=3, shard=(1, 2)))
    assert [sum(half[3 * i : 3 * i + 3], []) for i in range(len(whole))] == [batch[6:] for batch in whole]
    # resuming at step 3 yields the micro-batches of steps 3.. only
    assert list(PhaseBatchSampler(plan, [50, 70], batch_size=4, seed=1, start_step=3, accumulate=3)) == micro[9:]
    joint_whole = list(JointBatchSampler(["a", "b"], [50, 70], 4, batch_size=6, seed=1))
    joint_micro = list(JointBatchSampler(["a", "b"], [50, 70], 4, batch_size=3, seed=1, accumulate=2))
    for step, batch in enumerate(joint_whole):
        first, second = joint_micro[2 * step], joint_micro[2 * step + 1]
        assert {slot for slot, _ in first} == {slot for slot, _ in second} == {0, 1}  # every task in every micro-batch
        assert sorted(first + second) == sorted(batch)


@pytest.mark.slow
def test_accumulated_micro_batches_train_the_same_run_as_one_large_batch(tmp_path):
    large = run_fit(_demo(64, 1) | {"out": str(tmp_path / "b64")}).run_dir
    accumulated = run_fit(_demo(32, 2) | {"out": str(tmp_path / "b32x2")}).run_dir
    a, b = _finals(large, DEMO_TASKS), _finals(accumulated, DEMO_TASKS)
    assert _moved(large, a) > 1e-3  # the models trained, so the comparison is not vacuous
    assert _max_difference(a, b) <= 1e-5
    # and batch 32 without accumulation is a different run
    small = run_fit(_demo(32, 1) | {"out": str(tmp_path / "b32")}).run_dir
    assert _max_difference(a, _finals(small, DEMO_TASKS)) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("tasks", [DEMO_TASKS, DEMO_TASKS[:1]], ids=["two-tasks-per-process", "two-replicas-of-one-task"])
def test_accumulation_on_two_processes_matches_one_large_batch(tmp_path, tasks):
    def job(name: str, batch_size: int, accumulate: int, devices: int) -> Path:
        config = _demo(batch_size, accumulate, devices)
        config["data"]["tasks"] = tasks
        file = tmp_path / f"{name}.yaml"
        file.write_text(yaml.safe_dump(config))
        result = run_job(file, tmp_path / name)
        assert result.returncode == 0, result.stderr[-3000:]
        return tmp_path / name

    reference = _finals(job("w1-b64", 64, 1, 1), tasks)
    accumulated = _finals(job("w2-b32x2", 32, 2, 2), tasks)
    assert _max_difference(reference, accumulated) <= 1e-5
