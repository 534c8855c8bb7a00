"""What `mima fit` hands MimaStrategy and MimaCheckpoint when it builds them: the run's tasks, stop
protocol and a RunStart that it fills once it knows where the run starts; nothing is set on them later."""

from __future__ import annotations

import pytest

from mima.core.errors import MimaError
from mima.training.preemption import StopAgreement
from mima.training.resume import ResumeCut, RunStart
from mima.training.strategy import MimaStrategy
from mima.training.trainer import build_strategy


def test_a_configured_mima_strategy_keeps_its_options_and_gets_the_runs_parts(tmp_path):
    stop, start = StopAgreement(tmp_path), RunStart()
    configured = MimaStrategy(timeout_s=60, find_unused_parameters=True)
    strategy = build_strategy(configured, 3, (5, 4, 3), 1800, stop, start)
    assert isinstance(strategy, MimaStrategy) and strategy is not configured
    assert (strategy.num_tasks, strategy.task_work, strategy.timeout_s) == (3, (5, 4, 3), 60)
    assert strategy.ddp_options == {"find_unused_parameters": True}
    assert strategy.stop is stop and strategy.run_start is start
    assert (configured.num_tasks, configured.task_work, configured.stop) == (1, (), None)  # left as it was


@pytest.mark.parametrize("configured", [None, "auto", "ddp", "mima"])
def test_the_default_strategies_become_mima_s_own(tmp_path, configured):
    strategy = build_strategy(configured, 2, (4, 4), 90, StopAgreement(tmp_path), RunStart())
    assert (strategy.num_tasks, strategy.task_work, strategy.timeout_s, strategy.ddp_options) == (2, (4, 4), 90, {})


def test_another_strategy_is_refused_in_one_line(tmp_path):
    with pytest.raises(MimaError, match=r"^trainer.strategy: 'fsdp' would mix tasks"):
        build_strategy("fsdp", 2, (), 90, StopAgreement(tmp_path), RunStart())


def test_the_run_start_is_read_where_it_is_filled_in(tmp_path):
    start = RunStart()
    strategy = MimaStrategy(num_tasks=2, run_start=start)
    assert strategy.run_start.cut is None and start.state_of(0) is None
    cut = ResumeCut({0: tmp_path / "a.ckpt", 1: tmp_path / "b.ckpt"}, world_size=2)
    start.settle({"world_size": 2}, cut)  # after the strategy was built, as run_fit does
    assert strategy.run_start.cut is cut and strategy.run_start.identity == {"world_size": 2}
    assert start.state_of(1) == tmp_path / "b.ckpt" and start.state_of(2) is None
