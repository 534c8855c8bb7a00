"""`mima fit`'s options besides `model:` and `data:`, each declared once with its facts (default, range,
what a resume may do with it: mima.core.settings.option): fit's own options (`FitOptions`, which the
command line offers as `--NAME`) and the options of Lightning that mima sets a default for, checks or
lets a resume change (`LIGHTNING_OPTIONS`). Imports nothing heavy: `mima fit` checks its command line
against these ranges before Lightning is imported (mima.config.source).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any

from mima.config.defaults import CHECKPOINT_EVERY_DEFAULT, COLLECTIVE_TIMEOUT_S, DEVICES_DEFAULT
from mima.core.settings import (BATCH_MAX, COLLECTIVE_TIMEOUT_MAX_S, FACTS, LIGHTNING_SEED_MAX, THREADS_PER_CORE_MAX,
                                OptionFacts, PerCore, ResumeRule, ValueRange, declared_options, option)


@dataclass(frozen=True)
class FitOptions:
    """The options of `mima fit` itself (each `--NAME` on its command line, a top-level key of its config)."""

    out: str | None = option(
        None, resume="not compared",
        help="run folder (default: runs/<time>); {config}, {iterations} and {seed} are replaced by the config "
        "file's name, N and seed_everything, so a resubmitted job finds its run (slurm/launch.sh uses "
        "$MIMA_RUNS/{config}-N{iterations}-seed{seed})",
    )
    ckpt_path: str | None = option(
        None, resume="not compared",
        help="resume: 'last' (the run folder's newest consistent checkpoint; a fresh start if there is none)",
    )
    overwrite: bool = option(False, resume="not compared", help="replace the outputs of an earlier run")
    checkpoint_every: str | int = option(
        CHECKPOINT_EVERY_DEFAULT, resume="may change",  # when states are saved
        help="when each process saves its state: 'auto' (default: 30min on a GPU, segment on the CPU; `mima plan` "
        "says which), 'segment' (every task segment end: at most K steps lost), "
        "'phase' or 'K phases' (at every K-th sync: fewer files, up to K phases lost), a number n of process "
        "steps (also at syncs; saves inside a segment hold the encoder and its moments), a time such as 90s, "
        "30min or 2h (at the first sync after it has passed), or 0 (never); a stop request always saves",
    )
    keep_checkpoints: bool = option(
        False, resume="may change",
        help="keep RUN/checkpoints after the run has finished (default: removed; final/ holds the result)",
    )
    threads_per_process: int | None = option(
        None, bounds=ValueRange(int, 1, PerCore(THREADS_PER_CORE_MAX)),  # CPU results depend on it: fixed
        help="CPU threads of each process (default: Lightning's share of the cores). Results on the CPU "
        "depend on it, so fix it to compare runs with different numbers of processes",
    )
    force: bool = option(
        False,
        help="start even when the plan printed at start (`mima plan`) shows the run does not fit the device's memory",
    )
    accept_data_change: bool = option(
        False, resume="not compared",
        help="resume although a task folder's listing changed since the run started (files added, removed or "
        "renamed): the splits are then cut from the new listing, which can move images between train and test; "
        "without it such a resume is refused",
    )
    collective_timeout: int = option(
        COLLECTIVE_TIMEOUT_S, bounds=ValueRange(int, 1, COLLECTIVE_TIMEOUT_MAX_S), resume="may change",  # how long to wait
        help="seconds a collective may wait for other processes before the run fails (a dead process cannot hang it)",
    )


@dataclass(frozen=True)
class Argument:
    """One of fit's own options as its command line offers it (`--NAME`)."""

    name: str
    kind: Any  # the type jsonargparse parses it as (a union such as str | None included)
    default: object
    help: str


def fit_arguments() -> list[Argument]:
    """Every field of FitOptions as a command-line argument, in declaration order."""
    kinds = typing.get_type_hints(FitOptions)
    return [Argument(field.name, kinds[field.name], field.default, field.metadata[FACTS].help)
            for field in dataclasses.fields(FitOptions)]


class LightningsDefault:
    """The default of a Lightning option that mima leaves to Lightning."""

    def __str__(self) -> str:
        return "Lightning's"


LIGHTNINGS = LightningsDefault()


@dataclass(frozen=True)
class LightningOption:
    """An option of Lightning's (LightningCLI's --config, seed_everything, a trainer: key) that mima sets
    a default for, checks or lets a resume change: the default (LIGHTNINGS: Lightning's own) and its facts."""

    default: object
    facts: OptionFacts


def lightning_option(default: object = LIGHTNINGS, *, bounds: ValueRange | None = None,
                     resume: ResumeRule = "fixed") -> LightningOption:
    return LightningOption(default, OptionFacts(bounds=bounds, resume=resume))


PROCESS_COUNT = ValueRange(int, 1, 2**16)

# Keys as a config gives them; a key names a whole section where the option is one (trainer.logger:
# class_path, init_args, ...), and its facts cover every key under it.
LIGHTNING_OPTIONS: dict[str, LightningOption] = {
    "config": lightning_option(resume="not compared"),  # the files the config was read from
    "seed_everything": lightning_option(bounds=ValueRange(int, 0, LIGHTNING_SEED_MAX)),
    "trainer.accelerator": lightning_option("auto"),
    # one process where a config gives none (Lightning's own default being "auto")
    "trainer.devices": lightning_option(DEVICES_DEFAULT, bounds=PROCESS_COUNT, resume="same processes"),
    "trainer.num_nodes": lightning_option(bounds=PROCESS_COUNT, resume="same processes"),
    "trainer.accumulate_grad_batches": lightning_option(bounds=ValueRange(int, 1, BATCH_MAX)),
    "trainer.num_sanity_val_steps": lightning_option(0),
    "trainer.log_every_n_steps": lightning_option(10, resume="may change"),
    # Lightning's table of the module's parameters and FLOPs (0 for MIMA's encoder): `mima plan`, printed
    # at start, says what the run holds
    "trainer.enable_model_summary": lightning_option(False, resume="may change"),
    "trainer.use_distributed_sampler": lightning_option(False),  # the PhaseBatchSampler decides every batch
    # what the run shows and logs, and where: none of it changes the weights
    "trainer.enable_progress_bar": lightning_option(resume="may change"),
    "trainer.logger": lightning_option(resume="may change"),
    "trainer.enable_checkpointing": lightning_option(resume="may change"),
    "trainer.default_root_dir": lightning_option(resume="may change"),
    "trainer.profiler": lightning_option(resume="may change"),
    "trainer.callbacks": lightning_option(resume="may change"),
}
# the trainer defaults `mima fit` gives LightningCLI
TRAINER_DEFAULTS: dict[str, Any] = {key.removeprefix("trainer."): declared.default
                                    for key, declared in LIGHTNING_OPTIONS.items()
                                    if key.startswith("trainer.") and declared.default is not LIGHTNINGS}
# the facts of every option of fit's config outside model: and data:, by key
RUN_OPTIONS: dict[str, OptionFacts] = {**declared_options(FitOptions),
                                       **{key: declared.facts for key, declared in LIGHTNING_OPTIONS.items()}}
