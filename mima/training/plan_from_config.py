"""The plan of a run config: `mima plan`'s and `mima fit`'s entry to it.

Reads what the plan needs from the run config (mima.config.run_config.RunConfig) and its `trainer:`
section into plain values (mima.training.resource_plan.PlanInputs), with the machine's
(mima.training.plan_probes), settles the "auto" defaults that depend on the plan
(mima.training.plan_choices: gradient checkpointing from the memory without it, model.compile,
the checkpoint schedule, model.batch_tasks from the stacked layout's memory), and computes the plan
(mima.training.resource_plan.make_plan) once more with them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from mima.config.model import ModelSettings
from mima.core.run_folder import JOINT
from mima.models.footprint import ModelFootprint, measure_footprint
from mima.training.plan_choices import (as_json, choose_batch_tasks, choose_checkpoint_every, choose_compile,
                                        choose_grad_checkpointing)
from mima.training.plan_format import batched_layout_line
from mima.training.plan_probes import (file_measures, present_device_memory, present_device_name, resident_bytes,
                                       tensorboard_installed, trains_on_gpu)
from mima.training.resource_plan import PlanInputs, RunPlan, batched_layout, make_plan
from mima.training.sync_merge import OUTER_DEFAULTS, OUTER_NESTEROV


def plan_for_config(config, world_size: int, num_nodes: int = 1, checkpoint_every: str | int | None = None,
                    device_memory: int | None = None, trainer: dict | None = None,
                    tasks: list[str] | None = None) -> tuple[RunPlan, ModelFootprint, PlanInputs]:
    """The plan of a run config (mima.config.run_config.RunConfig) on `world_size` processes (its
    `tasks` when known, else read from the config), with the defaults it chooses for the "auto"
    values of model.grad_checkpointing and `checkpoint_every` (None: auto). The interpreter's share
    of host memory is this process's RSS: call it with the fit stack imported."""
    trainer = dict(config.other.get("trainer") or {}) | dict(trainer or {})
    settings = ModelSettings(**config.model_args())
    tasks = list(tasks) if tasks is not None else plan_tasks(config)
    inputs = plan_inputs(config, settings, trainer, tasks, world_size, num_nodes, checkpoint_every, device_memory)
    footprint = measure_footprint(settings.clip, inputs.precision, inputs.grad_checkpointing)
    plan = make_plan(inputs, footprint, file_measures(footprint))
    checkpointing = choose_grad_checkpointing(settings.grad_checkpointing, inputs.on_gpu, plan.device_memory_per_process,
                                              inputs.device_memory_bytes)
    if checkpointing.value and not inputs.grad_checkpointing:
        footprint = measure_footprint(settings.clip, inputs.precision, True)
    inputs = replace(inputs, grad_checkpointing=bool(checkpointing.value),
                     choices=(("grad_checkpointing", checkpointing), *inputs.choices))
    plan = make_plan(inputs, footprint, file_measures(footprint))
    plan.notes += settings.schedule_notes(tasks)  # printed by `mima plan` and at `mima fit` start alike
    if settings.mode != JOINT and inputs.on_gpu:
        choose_batched_layout(plan, settings, inputs, tasks)
    return plan, footprint, inputs


def plan_inputs(config, settings: ModelSettings, trainer: dict, tasks: list[str], world_size: int, num_nodes: int,
                checkpoint_every: str | int | None, device_memory: int | None) -> PlanInputs:
    """The plan's inputs from the config (`settings`: its model section read), the machine and this
    process, with the compile and checkpoint schedule defaults settled (gradient checkpointing as given:
    "auto" needs a first plan)."""
    joint = settings.mode == JOINT
    lengths = ((settings.steps,) * 1,) if joint else settings.task_lengths(tasks)
    precision = str(trainer.get("precision") or "32-true")
    on_gpu = trains_on_gpu(trainer)
    schedule = choose_checkpoint_every(checkpoint_every, on_gpu)
    compiling = choose_compile(settings.compile, on_gpu, trainer.get("deterministic") is True)
    return PlanInputs(
        tasks=(JOINT,) if joint else tuple(tasks), task_lengths=tuple(lengths), world_size=world_size,
        num_nodes=num_nodes, batch_size=int(config.data.batch_size), num_workers=int(config.data.num_workers),
        precision=precision, accelerator="gpu" if on_gpu else "cpu", optimizer_state=settings.optimizer_state,
        checkpoint_every=schedule.value, log_every_n_steps=int(trainer.get("log_every_n_steps") or 10),
        tensorboard=tensorboard_installed(), base_rss_bytes=resident_bytes(),
        device_memory_bytes=device_memory if device_memory is not None else present_device_memory("gpu" if on_gpu else "cpu"),
        device_name=present_device_name() if on_gpu else None,
        accumulate=int(trainer.get("accumulate_grad_batches") or 1),
        reads_images=reads_image_files(config), data_cache=bool(config.data.cache),
        grad_checkpointing=settings.grad_checkpointing is True, compiled=bool(compiling.value),
        outer_momentum=keeps_outer_momentum(settings.sync_merge, settings.sync_merge_args),
        choices=(("compile", compiling), ("checkpoint_every", schedule)),
    )


def choose_batched_layout(plan: RunPlan, settings: ModelSettings, inputs: PlanInputs, tasks: list[str]) -> None:
    """model.batch_tasks on a GPU: both layouts' memory and step time as a note of `plan`, and what
    "auto" takes among its choices."""
    stacked = batched_layout(plan, len(tasks), inputs.compiled)
    conflict = settings.batch_tasks_conflict(tasks)
    choice = choose_batch_tasks(settings.batch_tasks, inputs.on_gpu, conflict, stacked.device_memory_per_process,
                                inputs.device_memory_bytes)
    plan.choices["batch_tasks"] = as_json(choice=choice)["choice"]
    plan.notes.append(batched_layout_line(plan, stacked))


def plan_tasks(config) -> list[str]:
    """The run's task names, without opening the data: a clip-suite benchmark is a list of names."""
    from mima.data.benchmarks import BENCHMARKS

    data = config.data
    if data.tasks:
        return list(data.tasks)
    if data.suite == "clip" and data.benchmark is not None and not data.custom_tasks:
        return list(BENCHMARKS[str(data.benchmark)])
    return config.datamodule().task_names


def reads_image_files(config) -> bool:
    """Whether the run's training data are image files decoded per example (the loader's work)."""
    return config.data.suite == "clip" or bool(config.data.custom_tasks)


def keeps_outer_momentum(sync_merge: str, args: Mapping[str, object] | None) -> bool:
    """Whether the phase-end operator keeps a momentum buffer (outer_nesterov with momentum > 0)."""
    return sync_merge == OUTER_NESTEROV and float({**OUTER_DEFAULTS, **(args or {})}["outer_momentum"]) > 0
