"""The phase state has one owner, MimaSyncCallback: the callbacks that read it (checkpoints, progress
bars and lines, tracker forwarding) are given its view when they are made, and each refuses, in its
`setup`, to run before it (mima.training.phase_view)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel

from mima.core.errors import MimaError
from mima.training.checkpoint_callback import MimaCheckpoint
from mima.training.phase_view import PhaseView
from mima.training.preemption import StopAgreement
from mima.training.progress import MimaLogLines, MimaProgressBar, MimaRichProgressBar
from mima.training.resume import RunStart
from mima.training.sync import MimaSyncCallback
from mima.training.trackers import TrackerForwarding, TrackerRelay
from tests.helpers import fit_config

READERS = {
    "MimaCheckpoint": lambda view, folder: MimaCheckpoint(view, StopAgreement(folder), RunStart()),
    "MimaLogLines": lambda view, folder: MimaLogLines(view),
    "MimaProgressBar": lambda view, folder: MimaProgressBar(view),
    "MimaRichProgressBar": lambda view, folder: MimaRichProgressBar(view),
    "TrackerForwarding": lambda view, folder: TrackerForwarding([], TrackerRelay(), view, folder, {}),
}


def _set_up(callback, callbacks: list) -> None:
    """The callback's `setup` as a Trainer with these callbacks (in this order) calls it."""
    callback.setup(SimpleNamespace(callbacks=callbacks, is_global_zero=True), None, "fit")


@pytest.mark.parametrize("reader", sorted(READERS))
def test_a_reader_before_the_sync_callback_is_refused_in_one_line_naming_both(tmp_path, reader):
    sync = MimaSyncCallback()
    callback = READERS[reader](sync.phase_view(), tmp_path)
    with pytest.raises(MimaError) as refused:
        _set_up(callback, [callback, sync])
    line = str(refused.value)
    assert "\n" not in line
    assert line == (f"trainer.callbacks: {reader} comes before MimaSyncCallback, whose phase state it reads in the "
                    "same hooks; it must come after MimaSyncCallback")
    _set_up(callback, [sync, callback])  # the order it must run in


@pytest.mark.parametrize("reader", sorted(READERS))
def test_a_reader_whose_sync_callback_is_not_in_the_trainer_is_refused(tmp_path, reader):
    callback = READERS[reader](MimaSyncCallback().phase_view(), tmp_path)
    other = MimaSyncCallback()  # another sync callback's state is not the one this reader was given
    with pytest.raises(MimaError, match=rf"^trainer.callbacks: {reader} reads the phase state of a MimaSyncCallback "
                                        "that is not among them; add that MimaSyncCallback before it$"):
        _set_up(callback, [other, callback])


def test_a_run_without_phases_has_no_order_to_keep(tmp_path):
    callback = READERS["MimaCheckpoint"](PhaseView.without_phases(), tmp_path)
    _set_up(callback, [callback])  # the joint baseline: nothing changes its (empty) state


def test_a_trainer_refuses_the_wrong_order_before_it_trains(tmp_path):
    sync = MimaSyncCallback()
    lines = MimaLogLines(sync.phase_view())
    trainer = Trainer(default_root_dir=tmp_path, callbacks=[lines, sync], max_steps=1, logger=False,
                      enable_model_summary=False, accelerator="cpu", devices=1)
    model = BoringModel()
    before = {name: value.clone() for name, value in model.state_dict().items()}
    with pytest.raises(MimaError, match=r"^trainer.callbacks: MimaLogLines comes before MimaSyncCallback"):
        trainer.fit(model)
    assert trainer.global_step == 0
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())


def test_the_order_build_trainer_makes_passes_and_every_reader_has_the_sync_callbacks_view(tmp_path, small_clip,
                                                                                           monkeypatch):
    from mima.commands.fit.parser import build_cli
    from mima.services.fit.build import build_trainer
    from mima.services.fit.program import fit_settings

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store behind this switch
    config = fit_config(tmp_path / "run", small_clip, ["rot90", "mirror"], steps=4, iterations=2)
    config["trainer"].update(enable_progress_bar=True, logger={
        "class_path": "lightning.pytorch.loggers.MLFlowLogger",
        "init_args": {"tracking_uri": f"file:{tmp_path / 'mlruns'}", "experiment_name": "mima-test"}})
    trainer = build_trainer(fit_settings(build_cli(config), "cli")).trainer
    sync, = [callback for callback in trainer.callbacks if isinstance(callback, MimaSyncCallback)]
    readers = [callback for callback in trainer.callbacks
               if isinstance(callback, (MimaCheckpoint, MimaLogLines, TrackerForwarding))]
    assert [type(reader) for reader in readers] == [TrackerForwarding, MimaLogLines, MimaCheckpoint]
    for reader in readers:
        assert reader.phases is sync.phase_view()
        reader.setup(trainer, trainer.lightning_module, "fit")
