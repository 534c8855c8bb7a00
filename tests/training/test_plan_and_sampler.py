"""The phase plan, the learning-rate schedule and the batch schedule."""

import math

import pytest
import torch

from mima.data.sampler import PhaseBatchSampler, TaskStream
from mima.core.errors import MimaError
from mima.training.lr_schedule import lr_factor
from mima.core.plan import PhasePlan, check_budget, phase_lengths


def test_positions_walk_phases_then_tasks():
    plan = PhasePlan(tasks=("a", "b", "c"), local_tasks=(0, 1, 2), total_steps=6, iterations=2)  # K = 3
    walk = [(p.phase, plan.tasks[p.task_index], p.step_in_phase, p.task_step) for p in map(plan.position, range(18))]
    assert walk[:4] == [(0, "a", 0, 0), (0, "a", 1, 1), (0, "a", 2, 2), (0, "b", 0, 0)]
    assert walk[9] == (1, "a", 0, 3)
    assert walk[17] == (1, "c", 2, 5)
    assert [s for s in range(18) if plan.ends_segment(s)] == [2, 5, 8, 11, 14, 17]
    assert [s for s in range(18) if plan.ends_phase(s)] == [8, 17]
    with pytest.raises(IndexError):
        plan.position(18)


def test_budget_rejects_n_not_dividing_s():
    assert check_budget(320, 8) == 40
    with pytest.raises(MimaError, match="model.iterations=3 does not divide model.steps=320"):
        check_budget(320, 3)
    with pytest.raises(MimaError, match="at least 1"):
        check_budget(320, 0)


def _task_vectors_cosine_lr(base_lr: float, warmup: int, steps: int, step: int) -> float:
    """The schedule of task_vectors' `cosine_lr`, written out again from its definition."""
    if step < warmup:
        return base_lr * (step + 1) / warmup
    e, es = step - warmup, steps - warmup
    return 0.5 * (1 + math.cos(math.pi * e / es)) * base_lr


@pytest.mark.parametrize("scope", ["run", "phase"])
def test_cosine_schedule_is_keyed_on_the_task_step(scope):
    plan = PhasePlan(tasks=("a", "b"), local_tasks=(0, 1), total_steps=40, iterations=4)  # K = 10
    for step in range(plan.local_steps):
        position = plan.position(step)
        if scope == "run":
            expected = _task_vectors_cosine_lr(1.0, 4, 40, position.task_step)
        else:
            expected = _task_vectors_cosine_lr(1.0, 4, 10, position.step_in_phase)
        assert lr_factor(plan, step, "cosine", scope, warmup=4) == pytest.approx(expected)


def test_constant_schedule_warms_up_then_stays_flat():
    plan = PhasePlan(tasks=("a",), local_tasks=(0,), total_steps=20, iterations=2)
    factors = [lr_factor(plan, s, "constant", "run", warmup=4) for s in range(20)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0] and set(factors[4:]) == {1.0}


def test_task_stream_epochs_are_permutations():
    stream = TaskStream("rot90", size=10, seed=0)
    seen = [i for step in range(5) for i in stream.batch(step, 4)]  # 20 draws = two epochs
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:]) == list(range(10))
    assert seen[:10] != seen[10:]


def test_batches_depend_only_on_seed_task_and_task_step():
    together = PhasePlan(tasks=("a", "b"), local_tasks=(0, 1), total_steps=12, iterations=3)
    alone = PhasePlan(tasks=("a", "b"), local_tasks=(1,), total_steps=12, iterations=3)
    batches_together = list(PhaseBatchSampler(together, [50, 30], batch_size=8, seed=1))
    batches_alone = list(PhaseBatchSampler(alone, [30], batch_size=8, seed=1))
    b_in_together = [[i for _, i in batch] for batch in batches_together if batch[0][0] == 1]
    assert b_in_together == [[i for _, i in batch] for batch in batches_alone]
    resumed = PhaseBatchSampler(together, [50, 30], batch_size=8, seed=1, start_step=7)
    assert list(resumed) == batches_together[7:] and len(resumed) == len(batches_together)
    halves = [list(PhaseBatchSampler(together, [50, 30], batch_size=8, seed=1, shard=(i, 2))) for i in (0, 1)]
    assert [a + b for a, b in zip(*halves)] == batches_together
    other_seed = list(PhaseBatchSampler(together, [50, 30], batch_size=8, seed=2))
    assert other_seed != batches_together
    assert len(batches_together) == together.local_steps == 24


def test_sampler_batches_come_from_one_task():
    plan = PhasePlan(tasks=("a", "b"), local_tasks=(0, 1), total_steps=4, iterations=2)
    for step, batch in enumerate(PhaseBatchSampler(plan, [9, 9], batch_size=4, seed=0)):
        assert {slot for slot, _ in batch} == {plan.position(step).slot}
        assert all(0 <= i < 9 for _, i in batch)


def test_segment_warmup_ramps_every_segment_on_top_of_the_run_schedule():
    """K = 5, two local tasks, constant schedule with 2 run warm-up steps and 3 segment warm-up steps:
    written out by hand, segment by segment."""
    plan = PhasePlan(tasks=("a", "b"), local_tasks=(0, 1), total_steps=10, iterations=2)
    factors = [lr_factor(plan, s, "constant", "run", warmup=2, segment_warmup=3) for s in range(plan.local_steps)]
    ramp = [1 / 3, 2 / 3, 1.0, 1.0, 1.0]
    first_phase = [0.5 * ramp[0], 1.0 * ramp[1], *ramp[2:]]  # the run's warm-up: task steps 0 and 1
    assert factors == pytest.approx(first_phase * 2 + ramp * 2)  # a, b in phase 1; a, b in phase 2
    assert [lr_factor(plan, s, "constant", "run", warmup=2) for s in range(5)] == pytest.approx([0.5, 1, 1, 1, 1])


@pytest.mark.parametrize("lengths, local", [((5, 5, 5), (0, 1)), ((1, 2, 4, 8), (0, 2, 3)), ((7, 3), (1,))])
def test_a_plan_with_phase_lengths_walks_every_segment_in_order(lengths, local):
    """Every process step against a hand-written walk: phase by phase, each local task K_phase steps."""
    plan = PhasePlan(("a", "b", "c", "d"), local, sum(lengths), len(lengths), lengths)
    expected, start = [], 0
    for phase, k in enumerate(lengths):
        for slot in range(len(local)):
            expected += [(phase, slot, i, start + i, i == k - 1, i == k - 1 and slot == len(local) - 1) for i in range(k)]
        start += k
    walked = [(p.phase, p.slot, p.step_in_phase, p.task_step, plan.ends_segment(step), plan.ends_phase(step))
              for step in range(plan.local_steps) for p in [plan.position(step)]]
    assert walked == expected


def test_geometric_phase_lengths_sum_to_s_and_grow_by_the_ratio():
    for total, n, ratio in [(320, 4, 2.0), (2000, 20, 1.1), (2000, 8, 0.5), (100, 3, 1.0)]:
        lengths = phase_lengths(total, n, "geometric", ratio)
        assert sum(lengths) == total and len(lengths) == n and min(lengths) >= 1
        ideal = [total * ratio ** i / sum(ratio ** j for j in range(n)) for i in range(n)]
        assert all(abs(k - x) < 1 for k, x in zip(lengths, ideal))  # rounding moves no phase by a whole step
    assert phase_lengths(320, 4) == (80, 80, 80, 80)
    with pytest.raises(MimaError, match="the shortest phase gets no step"):
        phase_lengths(10, 8, "geometric", 3.0)


class _RandomDraw(torch.utils.data.Dataset):
    """An example whose "augmentation" is one draw from torch's global generator."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int):
        return torch.rand(()), index


def test_a_draw_seeds_an_augmenting_dataset_and_skips_one_that_only_indexes_tensors():
    """Behind a Subset too: the augmenting dataset gives the same example for the same draw whatever the
    global generator's state, and a different one for another draw; a TensorDataset's example is its
    stored value, and reading it leaves the global generator exactly where it was."""
    from torch.utils.data import Subset, TensorDataset

    from mima.data.sampler import MultiTaskDataset

    tensors = TensorDataset(torch.arange(10.0), torch.arange(10))
    dataset = MultiTaskDataset([Subset(_RandomDraw(), [0, 1, 2]), Subset(Subset(tensors, range(2, 9)), [0, 3])])
    torch.manual_seed(1)
    first = dataset[(0, 1, 123)][0]
    torch.manual_seed(2)
    assert dataset[(0, 1, 123)][0] == first and dataset[(0, 1, 124)][0] != first
    state = torch.get_rng_state()
    assert dataset[(1, 1, 123)][:2] == (torch.tensor(5.0), torch.tensor(5))  # tensors[2 + 3]
    assert torch.equal(torch.get_rng_state(), state)
