"""`mima plan`: what a `mima fit` run will cost, before it starts (mima.training.plan_from_config)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from mima.commands.common import OneLineParser, frozen_options
from mima.config.defaults import AUTO, DEVICES_DEFAULT, NUM_NODES_DEFAULT
from mima.config.fit_options import PROCESS_COUNT
from mima.config.source import check_config_source
from mima.core.errors import MimaError


COUNT_FLAGS = {"devices": "--trainer.devices", "num_nodes": "--trainer.num_nodes", "batch_size": "--data.batch_size",
               "iterations": "--model.iterations"}
PROCESS_FLAGS = {"devices": ("--trainer.devices", "processes per node"), "num_nodes": ("--trainer.num_nodes", "nodes")}
DEVICE_MEMORY_MAX_GIB = 2**30  # a GiB count beyond any device (an exbibyte): the plan's byte counts stay integers


@dataclass(frozen=True)
class PlanOptions:
    """Each None: the config's value."""

    config: Path
    devices: int | None  # processes per node
    num_nodes: int | None
    benchmark: str | None  # "8", "14" or "20": a clip-suite benchmark's tasks instead of the config's
    batch_size: int | None
    iterations: int | None  # N
    checkpoint_every: str | None
    device_memory: float | None  # GiB; None: the device present
    json: bool  # print one JSON object


def parse(argv: Sequence[str]) -> PlanOptions:
    parser = OneLineParser(
        prog="mima plan",
        description="Print what `mima fit` with this config would cost, before anything runs: each process's tasks and "
        "the share of time spent waiting at syncs (with the W values that waste less), device memory per process "
        "(weights, gradients, AdamW moments, the phase average, activations traced from the model on the meta "
        "device), host memory per process and per node, the size of each checkpoint file, the bytes written over the "
        "run, the peak on disk and the sync volume; and the defaults it chooses for the run (model.grad_checkpointing, "
        "--checkpoint_every, a loader warning, the SLURM --signal lead), from a step time estimated on a GPU. No "
        "weights or data are read. `mima fit` prints the same at start.",
    )
    parser.add_argument("--config", type=Path, required=True, help="the `mima fit` config file (or a run folder)")
    parser.add_argument("--trainer.devices", dest="devices", type=int, default=None,
                        help="processes per node (default: the config's trainer.devices)")
    parser.add_argument("--trainer.num_nodes", dest="num_nodes", type=int, default=None,
                        help="nodes (default: the config's trainer.num_nodes or 1)")
    parser.add_argument("--data.benchmark", dest="benchmark", choices=("8", "14", "20"), default=None,
                        help="plan for a clip-suite benchmark's task list instead of the config's")
    parser.add_argument("--data.batch_size", dest="batch_size", type=int, default=None, help="instead of the config's")
    parser.add_argument("--model.iterations", dest="iterations", type=int, default=None, help="N, instead of the config's")
    parser.add_argument("--checkpoint_every", default=None,
                        help="as `mima fit --checkpoint_every` (default: the config's, else auto: by time on a GPU, "
                        "every segment on the CPU)")
    parser.add_argument("--device-memory", dest="device_memory", type=float, default=None, metavar="GIB",
                        help="the memory of one device in GiB (default: the GPU present, or this machine's for the CPU); "
                        "the plan says whether the run fits it")
    parser.add_argument("--json", action="store_true", help="print the plan as one JSON object (bytes as integers)")
    options = parser.parse_args(argv)
    for name, flag in COUNT_FLAGS.items():
        value = getattr(options, name)
        if value is not None and value < 1:
            parser.error(f"{flag} {value}: expected a positive number")
    for name, (flag, what) in PROCESS_FLAGS.items():  # as `mima fit` bounds them (mima.config.fit_options)
        value = getattr(options, name)
        if value is not None and value > PROCESS_COUNT.upper():
            parser.error(f"{flag} {value}: expected at most {PROCESS_COUNT.upper()} {what}")
    memory = options.device_memory
    if memory is not None and not 0 < memory <= DEVICE_MEMORY_MAX_GIB:  # NaN and inf fail too
        parser.error(f"--device-memory {memory}: expected a positive number of GiB, at most {DEVICE_MEMORY_MAX_GIB}")
    return frozen_options(PlanOptions, options)


def main(argv: Sequence[str]) -> None:
    options = parse(argv)
    check_config_source(options.config)
    import json

    import mima.commands.fit.run  # noqa: F401  (the fit stack: its import is part of a process's host memory)
    from mima.config.run_config import load_run_config
    from mima.training.plan_format import format_plan
    from mima.training.plan_from_config import plan_for_config
    from mima.training.save_schedule import SaveSchedule

    config = load_run_config(options.config)
    checkpoint_every = options.checkpoint_every if options.checkpoint_every is not None else config.other.get("checkpoint_every")
    if checkpoint_every is not None and str(checkpoint_every).strip().lower() != AUTO:
        SaveSchedule.parse(checkpoint_every)
    if options.benchmark is not None:
        config.data.benchmark, config.data.tasks = options.benchmark, None
    if options.batch_size is not None:
        config.data.batch_size = options.batch_size
    if options.iterations is not None:
        config.model.iterations = options.iterations
    trainer = dict(config.other.get("trainer") or {})
    devices = options.devices if options.devices is not None else trainer.get("devices", DEVICES_DEFAULT)
    nodes = options.num_nodes if options.num_nodes is not None else trainer.get("num_nodes", NUM_NODES_DEFAULT)
    if not str(devices).isdigit() or not str(nodes).isdigit():
        raise MimaError(f"trainer.devices={devices!r}, trainer.num_nodes={nodes!r}: give numbers "
                        "(--trainer.devices W --trainer.num_nodes M) to plan for")
    memory = int(options.device_memory * 2**30) if options.device_memory is not None else None
    plan, footprint, inputs = plan_for_config(config, int(devices) * int(nodes), int(nodes), checkpoint_every, memory)
    if options.json:
        print(json.dumps(plan.as_json(), indent=1))
    else:
        print(format_plan(plan, footprint, inputs))
