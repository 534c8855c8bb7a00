"""What one `mima fit` run is built from, its config parsed and its classes made (FitSettings): the
module, the datamodule, the Trainer's arguments, mima's own run options and the run folder. Both
fronts make it through mima.services.fit.program; mima.services.fit.build builds the Trainer from it."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from mima.core.errors import MimaError

if TYPE_CHECKING:
    from mima.data.datamodule import TaskSuiteDataModule
    from mima.training.module import MimaModule

NAME_MAX_BYTES = 255  # the longest file or folder name Linux file systems take (NAME_MAX)


@dataclass(frozen=True)
class RunOptions:
    """`mima fit`'s own options, beside model:, data: and trainer: (declared in
    mima.services.fit.program, where their help says what each does)."""

    out: str | None
    ckpt_path: str | None
    overwrite: bool
    checkpoint_every: str | int
    keep_checkpoints: bool
    threads_per_process: int | None
    force: bool
    accept_data_change: bool
    collective_timeout: int

    @classmethod
    def of(cls, config: Mapping[str, Any]) -> RunOptions:
        """The options of a parsed config (jsonargparse's namespace, or a mapping)."""
        return cls(out=config.get("out"), ckpt_path=config.get("ckpt_path"), overwrite=bool(config.get("overwrite")),
                   checkpoint_every=config.get("checkpoint_every"), keep_checkpoints=bool(config.get("keep_checkpoints")),
                   threads_per_process=config.get("threads_per_process"), force=bool(config.get("force")),
                   accept_data_change=bool(config.get("accept_data_change")),
                   collective_timeout=config["collective_timeout"])


@dataclass(frozen=True)
class FitSettings:
    """One run, parsed and built as far as a config builds it; build_trainer makes the rest."""

    model: MimaModule
    datamodule: TaskSuiteDataModule
    trainer: Any  # the config's trainer: section as written (a mapping of plain values)
    trainer_arguments: Any  # the Trainer's arguments with the config's classes made (callbacks, loggers, ...)
    options: RunOptions
    run_dir: Path
    config: Any  # the whole parsed config (jsonargparse's namespace): what the trackers record
    config_text: str  # the config as the run folder's config.yaml holds it

    def stored_config(self) -> dict:
        """The config as config.yaml holds it, read back: what a resume and the plan compare."""
        return yaml.safe_load(self.config_text) or {}


def resolve_run_dir(out: str | None, fields: Mapping[str, object]) -> Path:
    """--out with its {config}, {iterations} and {seed} fields filled in from `fields` (default:
    runs/<time>)."""
    if not out:
        return Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    try:
        filled = Path(out.format(**fields))
    except (KeyError, IndexError, ValueError) as exc:
        raise MimaError(f"--out {out}: only {{config}}, {{iterations}} and {{seed}} can be filled in ({exc})") from None
    longest = max((len(os.fsencode(part)) for part in filled.parts), default=0)
    if longest > NAME_MAX_BYTES:  # the folder could not be made: say so now, naming what the user wrote
        raise MimaError(f"--out {out}: filled in, one folder name is {longest} bytes long; a file system takes at "
                        f"most {NAME_MAX_BYTES}")
    return filled


def run_dir_fields(config: Mapping[str, Any], config_name: str) -> dict[str, object]:
    """What --out may name: the config file's name (`config_name`), N and seed_everything."""
    return {"config": config_name, "iterations": config["model"]["iterations"], "seed": config.get("seed_everything")}
