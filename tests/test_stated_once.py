"""Defaults and mode names that several modules use are written once and imported where used (issue 37):
each place that states one gives the value of its one definition."""

from __future__ import annotations

import inspect
import typing

from mima.config.defaults import CHECKPOINT_EVERY_ON_CPU, COLLECTIVE_TIMEOUT_S, DEVICES_DEFAULT, NUM_NODES_DEFAULT
from mima.config.model import TrainingMode
from mima.core.run_folder import JOINT
from mima.training.checkpoint_callback import MimaCheckpoint, SaveSchedule
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
