"""What `mima fit` (mima.services.fit) builds a run from, once its options are parsed: the process
layout of the run's tasks and its check, the run's strategy (MimaStrategy, given the run's tasks,
stop protocol and RunStart when it is made), what a resume may change about the number of processes,
and whether a run has finished. Nothing here reads a command line.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lightning.pytorch.plugins.environments import SLURMEnvironment

from mima.config.config_changes import ConfigChanges
from mima.config.defaults import DEVICES_DEFAULT, NUM_NODES_DEFAULT
from mima.core.errors import MimaError
from mima.core.layout import TaskLayout
from mima.core.names import JOINT
from mima.core.run_folder import RunFolder
from mima.training.elastic import check_world_size
from mima.training.preemption import StopAgreement
from mima.training.resume import ResumeCut, RunStart
from mima.training.strategy import MimaStrategy


@dataclass(frozen=True)
class Launch:
    """What `mima fit` settles once it knows the number of processes."""

    layout: TaskLayout
    identity: dict  # what a saved state must agree on to be resumed (mima.training.resume)
    resume_states: ResumeCut | None  # rank -> state file of the cut to resume; None: a fresh start
    notes: list[str]  # files the resume passed over, and why
    config_changes: ConfigChanges | None = None  # a resume's accepted changes to config.yaml (recorded in the run)


def same_layout(stored: Mapping[str, Any], new: Mapping[str, Any], num_tasks: int) -> bool:
    """Whether a resume may change trainer.devices / num_nodes: when both give a plain number of
    processes and each task keeps its number of processes (elastic resume, mima.training.elastic)."""
    before = configured_world_size(stored.get("trainer") or {})
    after = configured_world_size(new.get("trainer") or {})
    if before is None or after is None:
        return False
    try:
        return check_world_size(num_tasks, before, after, raise_error=False) is None
    except MimaError:  # a W that does not fit the tasks at all: refused by the layout check
        return False


def configured_world_size(trainer_config: Mapping[str, Any]) -> int | None:
    """devices x num_nodes when both are plain numbers; None when Lightning must resolve them."""
    devices = str(trainer_config.get("devices", DEVICES_DEFAULT))
    nodes = str(trainer_config.get("num_nodes", NUM_NODES_DEFAULT))
    if devices.isdigit() and int(devices) > 0 and nodes.isdigit():
        return int(devices) * int(nodes)
    return None


def budget_summary(tasks: list[str], task_lengths, layout: TaskLayout) -> str:
    """Each task's budget and each process's tasks and steps per phase (the first phase's), for the log."""
    budgets = ", ".join(f"{task} S={sum(lengths)} (K={lengths[0]})" for task, lengths in zip(tasks, task_lengths))
    steps = layout.phase_steps(task_lengths, 0)
    processes = "; ".join(f"process {rank}: {', '.join(tasks[t] for t in layout.local_tasks(rank))} ({steps[rank]} steps)"
                          for rank in range(layout.world_size))
    return f"mima fit: per-task budgets {budgets}; per phase {processes}"


def check_layout(num_tasks: int, world_size: int, batch_size: int, work: tuple[int, ...] = ()) -> TaskLayout:
    """The process layout of T tasks on W processes, refused (one line) where it cannot work."""
    layout = TaskLayout(num_tasks, world_size, work)
    layout.check_batch(batch_size)
    return layout


def build_strategy(configured, num_tasks: int, task_work: tuple[int, ...], timeout_s: int, stop: StopAgreement,
              run_start: RunStart) -> MimaStrategy:
    """The run's MimaStrategy: a new one, or (trainer.strategy: a MimaStrategy of the config) one with the
    configured one's timeout and DDP options, given the run's tasks, stop protocol and start."""
    if configured in (None, "auto", "ddp", "mima"):
        timeout, ddp_options, environment = timeout_s, {}, None
    elif isinstance(configured, MimaStrategy):
        timeout, ddp_options, environment = configured.timeout_s, configured.ddp_options, configured.cluster_environment
    else:
        raise MimaError(
            f"trainer.strategy: {configured!r} would mix tasks; mima runs its own task-parallel DDP (leave it unset)"
        )
    if SLURMEnvironment.detect():
        # Requeueing is done by mima at a step boundary, not inside Lightning's signal handler.
        environment = SLURMEnvironment(auto_requeue=False)
    return MimaStrategy(num_tasks=num_tasks, timeout_s=timeout, stop=stop, task_work=task_work, run_start=run_start,
                        cluster_environment=environment, **ddp_options)


def run_finished(run: RunFolder, tasks: list[str], mode: str) -> bool:
    """Whether every final model of the run (each task's, or the joint baseline's one) is in final/."""
    return not missing_finals(run, tasks, mode)


def missing_finals(run: RunFolder, tasks: list[str], mode: str) -> list[str]:
    """The names of the final models (each task's, or the joint baseline's one) that final/ lacks (a final
    model is there once its metadata file is: it is written after the weights)."""
    names = [JOINT] if mode == JOINT else tasks
    return [name for name in names if not run.final_metadata_file(name).is_file()]
