"""Defaults and mode names that several modules use are written once and imported where used (issue 37):
each place that states one gives the value of its one definition. Each option of a run is declared once
with its facts (issue 48): the resume rule and the documentation's table of options follow the declarations."""

from __future__ import annotations

import inspect
import statistics
import typing
from pathlib import Path

import pytest

from mima.config.config_changes import compare_configs
from mima.config.defaults import CHECKPOINT_EVERY_ON_CPU, COLLECTIVE_TIMEOUT_S, DEVICES_DEFAULT, NUM_NODES_DEFAULT
from mima.config.model import TrainingMode
from mima.config.options import OPTIONS, options_table
from mima.core.names import EVAL_BATCH_SIZE, JOINT, Z95
from mima.evaluation.accuracy import EvalSettings, TaskEvaluator
from mima.evaluation.statistics import wilson_interval
from mima.training.checkpoint_callback import MimaCheckpoint
from mima.training.save_schedule import SaveSchedule
from mima.training.preemption import StopAgreement
from mima.training.strategy import MimaStrategy
from mima.services.fit.program import TRAINER_DEFAULTS
from mima.training.trainer import configured_world_size


def _default(function, name: str):
    return inspect.signature(function).parameters[name].default


def test_the_collective_timeout_has_one_default():
    assert COLLECTIVE_TIMEOUT_S == 1800  # 30 min, as Lightning's DDP
    assert _default(MimaStrategy, "timeout_s") == COLLECTIVE_TIMEOUT_S
    assert _default(StopAgreement, "timeout_s") == COLLECTIVE_TIMEOUT_S


def test_the_save_schedule_default_is_the_cpus():
    assert CHECKPOINT_EVERY_ON_CPU == "segment"
    assert _default(MimaCheckpoint, "every") == CHECKPOINT_EVERY_ON_CPU
    assert SaveSchedule.parse(None) == SaveSchedule.parse(CHECKPOINT_EVERY_ON_CPU) == SaveSchedule("segment")


def test_the_joint_mode_is_the_name_of_its_final_model():
    assert JOINT == "joint" and JOINT in typing.get_args(TrainingMode)


def test_one_process_on_one_node_where_the_config_says_nothing():
    assert (DEVICES_DEFAULT, NUM_NODES_DEFAULT) == (1, 1)
    assert TRAINER_DEFAULTS["devices"] == DEVICES_DEFAULT
    assert configured_world_size({}) == DEVICES_DEFAULT * NUM_NODES_DEFAULT
    assert configured_world_size({"devices": 3}) == 3 and configured_world_size({"devices": 2, "num_nodes": 4}) == 8
    assert configured_world_size({"devices": "auto"}) is None


def test_every_95_percent_interval_takes_the_normals_quantile():
    assert Z95 == pytest.approx(statistics.NormalDist().inv_cdf(0.975), rel=1e-15)
    assert _default(wilson_interval, "z") == Z95


def test_the_evaluation_batch_size_has_one_default():
    assert EvalSettings().batch_size == _default(TaskEvaluator, "batch_size") == EVAL_BATCH_SIZE == 512


# ------------------------------------------------------------------ options: each declared once, with its facts
def _nested(key: str, value: object) -> dict:
    """{"a": {"b": value}} for the key "a.b": a config that sets one option."""
    for part in reversed(key.split(".")):
        value = {part: value}
    return value  # type: ignore[return-value]


def test_the_docs_table_of_options_is_the_declarations():
    """docs/configuration.md holds options_table() between its markers (regenerate the table with
    `python -c "from mima.config.options import options_table; print(options_table())"`)."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    begin = page.index("-->\n", page.index("<!-- generated from the option declarations")) + len("-->\n")
    end = page.index("<!-- end of the generated table -->")
    assert page[begin:end] == options_table()
    assert all(f"| `{key}` |" in page for key in OPTIONS)


def test_a_resume_treats_each_changed_option_as_its_declaration_says():
    for key, facts in OPTIONS.items():
        for layout_allowed in (True, False):
            changes = compare_configs(_nested(key, "before"), _nested(key, "after"), lambda a, b: layout_allowed)
            accepted = facts.resume == "may change" or (facts.resume == "same processes" and layout_allowed)
            compared = facts.resume != "not compared"
            assert (key in changes.harmless, key in changes.refused) == (accepted and compared, compared and not accepted), key
    # the keys a resume may change: those of before the declarations moved onto the options (issue 48)
    assert {key for key, facts in OPTIONS.items() if facts.resume == "may change"} == {
        "checkpoint_every", "keep_checkpoints", "collective_timeout", "trainer.enable_progress_bar",
        "trainer.enable_model_summary", "trainer.logger", "trainer.log_every_n_steps", "trainer.enable_checkpointing",
        "trainer.default_root_dir", "trainer.profiler", "trainer.callbacks", "data.num_workers", "data.eval_batch_size",
        "data.download", "data.cache_dir", "model.cache_dir", "model.grad_checkpointing"}
    # an entry of a section-valued option follows its option
    nested = compare_configs(_nested("trainer.logger.init_args.name", "a"), _nested("trainer.logger.init_args.name", "b"),
                             lambda a, b: False)
    assert set(nested.harmless) == {"trainer.logger.init_args.name"}


def test_a_run_written_before_an_option_reads_as_its_older_runs_value():
    older = {key: facts.older_runs for key, facts in OPTIONS.items() if facts.older_runs is not None}
    assert older == {"model.quick_gelu": "auto", "model.proximal_mu": 0.0, "model.compile": "auto", "model.batch_tasks": "auto"}
    for key, value in older.items():
        assert not compare_configs({}, _nested(key, value), lambda a, b: True).refused
        assert set(compare_configs({}, _nested(key, "other"), lambda a, b: True).refused) == {key}

