"""Per-task budgets (`model.steps` as a map task -> S_t), the largest-first dealing of tasks to
processes, and the sync timeout that grows with the work the other processes still have.

The runs use the demo's four digit tasks with the small CLIP of tests/conftest.py, as the other
distributed tests do (tests/distributed/test_distributed.py); jobs are real `mima fit` processes over gloo.
"""

from __future__ import annotations

import itertools
import json
import signal
from pathlib import Path

import pytest
import torch
import yaml

from mima.cli import main
from mima.config.config_changes import compare_configs
from mima.core.errors import MimaError
from mima.core.layout import TaskLayout, deal_tasks
from mima.core.plan import PhasePlan, plan_for_budgets, task_budgets, task_phase_lengths
from mima.core.safetensors_io import load_state_dict
from mima.data.sampler import PhaseBatchSampler
from mima.training.lr_schedule import lr_factor, warmup_cosine
from mima.training.sync_deadline import StepClock, lag_steps, sync_allowance_s
from tests.helpers import assert_identical, finals, logged_losses, run_job, write_config

FOUR = ["rot90", "rot180", "rot270", "mirror"]  # configs/demo.yaml's tasks
BUDGETS = {"rot90": 64, "rot180": 32, "rot270": 32, "mirror": 16}
N = 4
BUDGET_MODEL = {"steps": BUDGETS, "iterations": N}


# ------------------------------------------------------------------------------------ dealing
def makespan(work, owned) -> int:
    return max(sum(work[task] for task in tasks) for tasks in owned)


def best_makespan(work, world_size: int) -> int:
    """The optimum over every assignment of tasks to processes (brute force)."""
    best = None
    for ranks in itertools.product(range(world_size), repeat=len(work)):
        loads = [0] * world_size
        for task, rank in enumerate(ranks):
            loads[rank] += work[task]
        best = max(loads) if best is None else min(best, max(loads))
    return best


def test_equal_budgets_are_dealt_round_robin_as_before():
    for tasks in range(1, 9):
        for world in range(1, tasks + 1):
            owned = deal_tasks([5] * tasks, world)
            assert owned == tuple(tuple(range(rank, tasks, world)) for rank in range(world)), (tasks, world)
            layout = TaskLayout(tasks, world, (7,) * tasks)
            assert [layout.owner(t) for t in range(tasks)] == [(t % world, t // world) for t in range(tasks)]


def test_largest_first_is_within_grahams_bound_of_the_optimum_and_owns_every_task_once():
    """LPT's makespan is at most (4/3 - 1/(3W)) of the optimum (Graham 1969); checked against a brute
    force optimum on every budget vector in {1..4}^T, T <= 5, W = 2, 3."""
    optimal = 0
    cases = 0
    for world in (2, 3):
        for tasks in range(world, 6):
            for work in itertools.product(range(1, 5), repeat=tasks):
                owned = deal_tasks(work, world)
                assert sorted(t for ts in owned for t in ts) == list(range(tasks))
                got, best = makespan(work, owned), best_makespan(work, world)
                assert best <= got <= (4 / 3 - 1 / (3 * world)) * best + 1e-9, (work, world, owned)
                optimal += got == best
                cases += 1
    assert optimal / cases > 0.9  # mostly optimal on small cases


def test_largest_first_on_the_acceptance_budgets_and_a_case_where_greedy_is_not_optimal():
    work = [BUDGETS[t] for t in FOUR]
    assert deal_tasks(work, 2) == ((0, 3), (1, 2))  # rot90 + mirror = 80, rot180 + rot270 = 64
    assert makespan(work, deal_tasks(work, 2)) == best_makespan(work, 2) == 80
    assert makespan(work, deal_tasks(work, 4)) == 64
    # round-robin would give 64 + 32 = 96 on one process
    assert makespan(work, [(0, 2), (1, 3)]) == 96
    # greedy, not exact: 3, 3, 2, 2, 2 on two processes is 7 (3+2+2) against the optimum 6 (3+3 | 2+2+2)
    assert makespan([3, 3, 2, 2, 2], deal_tasks([3, 3, 2, 2, 2], 2)) == 7 and best_makespan([3, 3, 2, 2, 2], 2) == 6


# ---------------------------------------------------------------------------------- the plan
def test_a_plan_with_budgets_walks_each_task_for_its_own_budget():
    lengths = task_phase_lengths(BUDGETS, FOUR, N)
    assert lengths == ((16,) * 4, (8,) * 4, (8,) * 4, (4,) * 4)
    plan = plan_for_budgets(FOUR, (0, 3), lengths, N)  # rot90 and mirror
    assert plan.local_steps == 64 + 16 and [plan.process_phase_steps(p) for p in range(N)] == [20] * 4
    walked = [plan.position(step) for step in range(plan.local_steps)]
    for slot, task in enumerate(plan.local_tasks):
        mine = [p for p in walked if p.slot == slot]
        assert [p.task_step for p in mine] == list(range(BUDGETS[FOUR[task]]))  # 0 .. S_t - 1, in order
        assert {p.task_budget for p in mine} == {BUDGETS[FOUR[task]]}
    # phase 2 (index 1): rot90's 16 steps, then mirror's 4, then phase 3 starts
    assert [(p.phase, p.slot, p.step_in_phase) for p in walked[20:21] + walked[35:37] + walked[39:41]] == [
        (1, 0, 0), (1, 0, 15), (1, 1, 0), (1, 1, 3), (2, 0, 0)]
    assert [step for step in range(plan.local_steps) if plan.ends_phase(step)] == [19, 39, 59, 79]
    assert plan.ends_segment(15) and plan.ends_segment(19) and not plan.ends_segment(16)


def test_one_budget_for_every_task_gives_todays_plan():
    plan = plan_for_budgets(FOUR, (0, 2), task_phase_lengths(24, FOUR, 3), 3)
    today = PhasePlan(tasks=tuple(FOUR), local_tasks=(0, 2), total_steps=24, iterations=3)
    assert plan == today and plan.uniform
    assert [plan.position(s) for s in range(48)] == [today.position(s) for s in range(48)]


def test_learning_rate_and_batches_of_a_task_depend_on_its_own_budget_only():
    """Task mirror (S = 16) in the mixed plan gets the learning rates and batches of a run in which every
    task has S = 16: both are keyed on the task's own step and budget."""
    mixed = plan_for_budgets(FOUR, (0, 3), task_phase_lengths(BUDGETS, FOUR, N), N)
    alone = PhasePlan(tasks=tuple(FOUR), local_tasks=(3,), total_steps=16, iterations=N)
    mixed_steps = [s for s in range(mixed.local_steps) if mixed.position(s).task_index == 3]
    assert len(mixed_steps) == 16
    mixed_lr = [lr_factor(mixed, s, "cosine", "run", 5) for s in mixed_steps]
    alone_lr = [lr_factor(alone, s, "cosine", "run", 5) for s in range(16)]
    assert mixed_lr == alone_lr == [warmup_cosine(s, 16, 5) for s in range(16)]
    mixed_batches = list(PhaseBatchSampler(mixed, [50, 50], batch_size=4, seed=1))
    alone_batches = list(PhaseBatchSampler(alone, [50], batch_size=4, seed=1))
    assert [[e for _, e in mixed_batches[s]] for s in mixed_steps] == [[e for _, e in b] for b in alone_batches]


def test_bad_budget_maps_are_one_line_naming_the_task():
    with pytest.raises(MimaError, match=r"model.steps names 'cars', not a task of the run"):
        task_budgets({**BUDGETS, "cars": 8}, FOUR)
    with pytest.raises(MimaError, match=r"no budget for task 'mirror'"):
        task_budgets({t: BUDGETS[t] for t in FOUR[:3]}, FOUR)
    with pytest.raises(MimaError, match=r"model.iterations=4 does not divide model.steps.rot180=30"):
        task_phase_lengths({**BUDGETS, "rot180": 30}, FOUR, N)


# ------------------------------------------------------------------------------- sync timeout
def test_the_sync_allowance_covers_the_plan_s_difference_in_work():
    lengths = task_phase_lengths(8, ["a", "b", "c"], 2)  # K = 4
    layout = TaskLayout(3, 2)  # process 0: a, c (8 steps a phase); process 1: b (4)
    assert layout.phase_steps(lengths, 0) == [8, 4]
    assert lag_steps(layout, lengths, 0, resumed_in_phase=False) == 4
    assert lag_steps(layout, lengths, 0, resumed_in_phase=True) == 8
    clock = StepClock()
    for now in (0.0, 1.0, 2.5, 3.5, 10.0):  # intervals 1.0, 1.5, 1.0, 6.5: median 1.25
        clock.step_ended(now)
    assert clock.median() == 1.25
    assert sync_allowance_s(4, clock.median()) == 4 * 1.25 * 2.0
    assert sync_allowance_s(4, None) == 0.0
    clock.restart(20.0)
    clock.step_ended(21.0)  # the interval after a segment end starts at the restart
    assert clock.median() == 1.0


# ------------------------------------------------------------------------------------ runs
def budget_config(path: Path, clip: str, devices: int, callbacks=(), logger: bool = False, model=None) -> Path:
    write_config(path, clip, FOUR, devices, callbacks, model={**BUDGET_MODEL, **(model or {})})
    if logger:
        config = yaml.safe_load(path.read_text())
        config["trainer"].update(logger=True, log_every_n_steps=1)
        path.write_text(yaml.safe_dump(config))
    return path


def test_bad_budget_input_is_one_line_before_launch(tmp_path, small_clip, capsys):
    cases = [
        ({"steps": {**BUDGETS, "cars": 16}}, "model.steps names 'cars'"),
        ({"steps": {t: BUDGETS[t] for t in FOUR[:3]}}, "no budget for task 'mirror'"),
        ({"steps": {**BUDGETS, "mirror": 18}}, "model.iterations=4 does not divide model.steps.mirror=18"),
        ({"steps": BUDGETS, "mode": "joint"}, "the joint baseline trains one model"),
    ]
    for model, fragment in cases:
        config = budget_config(tmp_path / "bad.yaml", small_clip, 2, model=model)
        out = tmp_path / "out"
        code = main(["fit", "--config", str(config), "--out", str(out)])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and fragment in err[0], (model, err)
        assert not (out / "final").exists()


@pytest.mark.slow
def test_budgets_run_at_w1_and_at_w2_after_a_sigkill_end_the_same(tmp_path, small_clip):
    one = tmp_path / "w1"
    result = run_job(budget_config(tmp_path / "w1.yaml", small_clip, 1, logger=True), one)
    assert result.returncode == 0, result.stderr[-3000:]
    expected = finals(one, FOUR)
    pretrained = load_state_dict(one / "pretrained.safetensors")
    for task in FOUR:
        meta = json.loads((one / "final" / f"{task}.json").read_text())
        assert (meta["S"], meta["K"], meta["N"]) == (BUDGETS[task], BUDGETS[task] // N, N)
        assert meta["budgets"] == BUDGETS
        assert any(not torch.equal(expected[task][k], pretrained[k]) for k in pretrained)  # training moved it
    # each task took exactly S_t steps (its logged losses, one row per step)
    logged = logged_losses(one / "logs" / "metrics.csv")
    assert {task: sum(1 for _, t, _ in logged if t == task) for task in FOUR} == BUDGETS
    records = [json.loads(line) for line in (one / "metrics.jsonl").read_text().splitlines()]
    assert [r["phase"] for r in records] == [1, 2, 3, 4]
    assert all(r["budgets"] == BUDGETS for r in records)
    assert [r["task_steps"]["mirror"] for r in records] == [4, 8, 12, 16]
    assert [r["step"] for r in records] == [16, 32, 48, 64] and {r["K"] for r in records} == {16}

    # W = 2, killed mid-run and resumed, ends with the one-process run's task models
    killed = tmp_path / "killed"
    # step 30: process 0 is inside rot90's second segment, process 1 inside rot270's
    run = run_job(budget_config(tmp_path / "kill.yaml", small_clip, 2, [("KillAtStep", {"step": 30})]), killed)
    assert run.returncode == -signal.SIGKILL, run.stderr[-2000:]
    resumed = run_job(budget_config(tmp_path / "w2.yaml", small_clip, 2), killed, "--ckpt_path", "last")
    assert resumed.returncode == 0 and "resuming from" in resumed.stdout, resumed.stderr[-3000:]
    # dealt largest first: rot90 + mirror on process 0, rot180 + rot270 on process 1
    assert "process 0: rot90, mirror (20 steps); process 1: rot180, rot270 (16 steps)" in resumed.stdout
    assert_identical(finals(killed, FOUR), expected)


@pytest.mark.slow
def test_unequal_budgets_with_replicas_w4_on_two_tasks_match_one_process(tmp_path, small_clip):
    """W > T: two processes share each task; the task groups take different numbers of steps per phase
    (the smaller one waits at the sync). DDP averages the replicas' gradients, whose float sums round
    differently from one process's (W > T is not bit-identical at equal budgets either), so the task
    models agree with one process's up to rounding: far closer than training moved them."""
    model = {"steps": {"rot90": 24, "mirror": 12}, "iterations": 3}
    results = {}
    for devices in (1, 4):
        out = tmp_path / f"w{devices}"
        config = write_config(tmp_path / f"w{devices}.yaml", small_clip, ["rot90", "mirror"], devices, model=model)
        raw = yaml.safe_load(config.read_text())
        raw["collective_timeout"] = 300  # four processes take long to meet on a small, busy machine
        config.write_text(yaml.safe_dump(raw))
        result = run_job(config, out, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        results[devices] = finals(out, ["rot90", "mirror"])
        assert json.loads((out / "final" / "mirror.json").read_text())["S"] == 12
    pretrained = load_state_dict(tmp_path / "w1" / "pretrained.safetensors")
    for task in ("rot90", "mirror"):
        keys = [k for k in pretrained if pretrained[k].is_floating_point()]
        flat = {w: torch.cat([results[w][task][k].double().reshape(-1) for k in keys]) for w in (1, 4)}
        moved = (flat[1] - torch.cat([pretrained[k].double().reshape(-1) for k in keys])).norm()
        assert (flat[4] - flat[1]).norm() < 1e-2 * moved, task


def test_a_budget_change_is_refused_on_resume(tmp_path, small_clip, capsys):
    out = tmp_path / "run"
    stopped = run_job(budget_config(tmp_path / "stop.yaml", small_clip, 1, [("TouchStopAtStep", {"step": 10})]), out)
    assert stopped.returncode == 0 and "stopped by" in stopped.stdout, stopped.stderr[-3000:]
    changed = budget_config(tmp_path / "changed.yaml", small_clip, 1, model={"steps": {**BUDGETS, "mirror": 32}})
    code = main(["fit", "--config", str(changed), "--out", str(out), "--ckpt_path", "last"])
    err = capsys.readouterr().err.strip().splitlines()
    # refused by the saved states' run identity (mima.training.resume), before any config comparison
    assert code == 2 and len(err) == 1 and "'mirror': 16" in err[0] and "'mirror': 32" in err[0], err
    # and by the config comparison itself (mima.config.config_changes), key by key
    stored = yaml.safe_load((out / "config.yaml").read_text())
    new = {**stored, "model": {**stored["model"], "steps": {**BUDGETS, "mirror": 32}}}
    changes = compare_configs(stored, new, lambda a, b: True)
    assert changes.refused == {"model.steps.mirror": (16, 32)} and not changes.harmless


@pytest.mark.slow
def test_a_process_with_less_work_waits_out_a_slow_step_at_its_sync(tmp_path, small_clip):
    """Two processes, three tasks, N = 1 (the whole difference falls on the one sync): process 0 owns two
    tasks, process 1 one. Every step sleeps 1 s, so process 1 waits about 8 x 1 = 8 s at the sync, longer
    than the syncs' base timeout of 3 s (which before this aborted the run after its training): the wait
    allowed is 3 s + 8 steps x its median step time x 2. (The base is set by the test callback once the
    processes have met: --collective_timeout is also the rendezvous timeout, too short at 3 s here.)"""
    out = tmp_path / "run"
    sleep = ("SleepEachStep", {"seconds": 1.0, "sync_timeout": 3.0})
    config = write_config(tmp_path / "slow.yaml", small_clip, FOUR[:3], 2, [sleep], model={"steps": 8, "iterations": 1})
    result = run_job(config, out, timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["phase"] for r in records] == [1]
    assert records[0]["wait_s"][1] > 3 + 2, records  # process 1 did wait well past the base timeout


def test_the_vit_l14_config_lets_the_plan_decide_gradient_checkpointing():
    """configs/clip/ViT-L-14.yaml leaves gradient checkpointing to the plan at the paper's batch 128
    (tests/plan/test_plan_choices.py: off on an 80 GiB GPU, on on a 40 GiB one)."""
    from mima.config.run_config import load_run_config

    config = load_run_config(Path(__file__).resolve().parents[2] / "configs" / "clip" / "ViT-L-14.yaml")
    assert config.model.grad_checkpointing == "auto" and config.data.batch_size == 128
    assert config.other["trainer"]["precision"] == "bf16-mixed"
