"""The progress bar's items: phase, task and the newest logged loss, which the sync callback keeps in
the process's phase state, read through its view (handed to the bar when it is made), not on the module."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from mima.core.plan import PhasePlan
from mima.training.phase_state import PhaseState
from mima.training.phase_view import PhaseView
from mima.training.progress import MimaProgressBar, MimaRichProgressBar, mima_metrics
from mima.training.sync import MimaSyncCallback


class RecordingLogger:
    def __init__(self) -> None:
        self.rows: list[tuple[dict, int]] = []

    def log_metrics(self, metrics: dict, step: int) -> None:
        self.rows.append((metrics, step))


def _plan() -> PhasePlan:
    # two tasks on one process, S = 4 over N = 2 phases: each phase is 2 steps of "a", then 2 of "b"
    return PhasePlan(tasks=("a", "b"), local_tasks=(0, 1), total_steps=4, iterations=2)


def test_the_bar_shows_phase_task_and_the_phase_states_loss():
    phases = PhaseView(PhaseState(shown_loss=0.123456), owner=None)
    trainer = SimpleNamespace(global_step=6)  # phase 2 starts at process step 4; steps 6, 7 are "b"'s
    items = mima_metrics({"v_num": 3, "other": 1}, trainer, SimpleNamespace(plan=_plan()), phases)
    assert items == {"other": 1, "phase": "2/2", "task": "b", "loss": 0.1235}


def test_without_a_phase_state_or_a_loss_the_bar_shows_none():
    trainer = SimpleNamespace(global_step=0)
    assert mima_metrics({}, trainer, SimpleNamespace(plan=_plan()), None) == {"phase": "1/2", "task": "a"}
    assert mima_metrics({}, trainer, SimpleNamespace(plan=None), PhaseView.without_phases()) == {}
    assert MimaProgressBar().phases is None and MimaRichProgressBar(PhaseView.without_phases()).phases is not None


def test_the_sync_callback_keeps_the_logged_loss_in_the_phase_state_not_on_the_module():
    sync = MimaSyncCallback()
    phases = sync.phase_view()
    logger = RecordingLogger()
    trainer = SimpleNamespace(global_step=0, log_every_n_steps=1, loggers=[logger])
    module = SimpleNamespace(plan=_plan(), learning_rate=lambda step: 1e-3 * (step + 1))
    # one optimiser step of two micro-batches: the step's loss is their sum (each is already divided)
    for micro_batch, loss in enumerate((0.5, 0.25)):
        sync.on_train_batch_start(trainer, module, None, micro_batch)
        trainer.global_step = micro_batch  # Lightning counts the step once the optimiser has stepped
        sync.on_train_batch_end(trainer, module, {"loss": torch.tensor(loss)}, None, micro_batch)
    assert logger.rows == [({"train/loss/a": 0.75, "train/lr/a": 1e-3}, 0)]  # the step's learning rate beside it
    assert phases.shown_loss == 0.75
    assert not hasattr(module, "shown_loss")
    bar = MimaProgressBar(phases)
    assert mima_metrics({}, trainer, module, bar.phases)["loss"] == 0.75
