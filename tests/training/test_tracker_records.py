"""The parts of mima.training.trackers that need no training run: how rows from several processes
are merged, the outbox a kill can cut short, and logging a finished run's results to its trackers
(tests/training/test_trackers.py runs the whole path on real jobs)."""

from __future__ import annotations

import pytest

from mima.core.run_folder import RunFolder
from mima.training.trackers import append_outbox, log_to_run_trackers, merge_rows, read_outbox


def test_rows_of_several_processes_merge_by_step_with_replicas_averaged_and_process_metrics_by_rank():
    gathered = [
        [(3, 0, {"train/loss/a": 0.5, "sync/wait_s": 1.0, "mima/mean_cos_tau": 0.25}), (1, 0, {"train/loss/a": 0.75})],
        [(3, 1, {"train/loss/a": 0.25, "sync/wait_s": 2.0, "mima/mean_cos_tau": 0.25}), (3, 1, {"train/loss/b": 0.125})],
    ]
    merged = merge_rows(gathered)
    assert list(merged) == [1, 3]  # in step order
    assert merged[1] == {"train/loss/a": 0.75}
    assert merged[3] == {
        "mima/mean_cos_tau": 0.25,  # the same value from every process: kept as it is
        "sync/wait_s/rank-0": 1.0, "sync/wait_s/rank-1": 2.0,  # each process's own
        "train/loss/a": (0.5 + 0.25) / 2,  # two replicas of task a: their mean
        "train/loss/b": 0.125,
    }


def test_the_outbox_reads_back_what_was_appended_and_leaves_out_a_line_cut_by_a_kill(tmp_path):
    outbox = tmp_path / "tracker_outbox.jsonl"
    append_outbox(outbox, {0: {"train/loss/a": 0.5}, 1: {"train/loss/a": 0.25, "train/lr/a": 1e-3}})
    with outbox.open("a") as handle:
        handle.write('{"step": 2, "metrics": {"train/loss/a": 0.1')  # a write cut short
    assert read_outbox(outbox) == [(0, {"train/loss/a": 0.5}), (1, {"train/loss/a": 0.25, "train/lr/a": 1e-3})]
    assert read_outbox(tmp_path / "none.jsonl") == []


def test_results_go_to_no_tracker_without_a_record_and_a_failing_tracker_is_one_warning(tmp_path, monkeypatch):
    mlflow = {"class_path": "lightning.pytorch.loggers.MLFlowLogger", "init_args": {"tracking_uri": "http://127.0.0.1:9"}}
    lines = log_to_run_trackers(tmp_path, [mlflow], {"evaluate/uniform/a": 0.5}, "mima evaluate")
    assert lines == [f"mima evaluate: {tmp_path} logged to no experiment tracker (trainer.logger, tracker.json); nothing sent"]
    RunFolder(tmp_path).write_tracker_record({"MLFlowLogger": {"run_id": "0123abcd", "logged_through": {"train/loss/a": 7}}})
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    line, = log_to_run_trackers(tmp_path, [mlflow], {"evaluate/uniform/a": 0.5}, "mima evaluate")
    assert line.startswith("mima evaluate: warning: the MLFlowLogger tracker failed to take the results (")
    assert len(line) < 400


@pytest.mark.parametrize("setting, expected", [
    (None, []), (True, []), (False, []),
    ("lightning.pytorch.loggers.CSVLogger", [{"class_path": "lightning.pytorch.loggers.CSVLogger"}]),
])
def test_logger_settings_read_as_written(setting, expected):
    from mima.training.trackers import tracker_entries

    assert tracker_entries(setting) == expected
