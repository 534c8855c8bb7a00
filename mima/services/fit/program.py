"""`mima fit`: one MIMA run from a config, with LightningCLI conventions.

    mima fit --config configs/demo.yaml --out runs/demo                        # one process
    mima fit --config configs/demo.yaml --trainer.devices 2 --out runs/demo2   # two processes
    mima fit --config configs/demo.yaml --out runs/demo2 --ckpt_path last      # resume

The config has `model:` (MimaModule), `data:` (TaskSuiteDataModule), `trainer:` (lightning Trainer)
and `seed_everything:` sections; any key can be overridden on the command line (`--model.iterations 8`).
The run length is fixed by model.steps and model.iterations, so trainer.max_steps / max_epochs are
set by mima; the strategy is always MimaStrategy (task-parallel DDP, also for one process).

This module holds the program as Lightning parses it (FitProgram: every option of a run, with the
trainer's defaults) given a config as mappings, and makes the classes a config names (the module, the
datamodule, the Trainer's arguments): FitSettings. The command line's parsing is the command's
(mima.commands.fit.parser, a FitProgram that also reads argv); the Trainer is built by
mima.services.fit.build and fitted by mima.services.fit.run. The run folder's files are listed in
mima.core.run_folder. Every check that can fail on user input runs before any process is launched,
so a mistake is reported once, on one line.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

from jsonargparse import ArgumentError, Namespace
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from typing_extensions import override

from mima.config.fit_options import TRAINER_DEFAULTS, fit_arguments
from mima.config.parse_errors import config_error_text, library_message
from mima.config.source import check_run_values
from mima.core.errors import MimaError
from mima.data.datamodule import TaskSuiteDataModule
from mima.services.fit.config import ConfigLayers
from mima.services.fit.construction import named_instantiators, without_trackers
from mima.services.fit.settings import FitSettings, RunOptions, resolve_run_dir, run_dir_fields
from mima.training.module import MimaModule
from mima.training.plan_probes import accelerator_refusal

class FitProgram(LightningCLI):
    """`mima fit`'s options and the classes its config names, from a config mapping (or ConfigLayers);
    nothing is trained, and no Trainer is made (mima.services.fit.build does)."""

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        for argument in fit_arguments():  # fit's own options, as mima.config.fit_options declares them
            parser.add_argument(f"--{argument.name}", type=argument.kind, default=argument.default, help=argument.help)

    @override
    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        self.config = self.parse_config(parser, args)
        # the numbers outside model: and data: (those the settings dataclasses check when they are built),
        # command-line overrides included, before anything is built
        check_run_values(self.config.as_dict())

    def parse_config(self, parser: LightningArgumentParser, args: Any) -> Namespace:
        """A config mapping (or ConfigLayers) parsed; a mistake is one line."""
        if not isinstance(args, (Mapping, ConfigLayers)):
            raise TypeError(f"{type(self).__name__} parses a config mapping, not {type(args).__name__} (a command "
                            "line: mima.commands.fit.parser)")
        try:
            return parse_layers(parser, args if isinstance(args, ConfigLayers) else ConfigLayers(None, (args,)))
        except ArgumentError as exc:
            raise MimaError(f"config: {config_error_text(exc)}") from None

    @override
    def instantiate_classes(self) -> None:
        """The module, the datamodule and the Trainer's arguments made from the config (the Trainer
        itself is build_trainer's, with what mima adds to it; its trackers are mima's to make): a class
        that refuses its arguments is one line naming its option (mima.services.fit.construction)."""
        # a device this machine lacks, before the model is loaded (Lightning would refuse it in a traceback)
        refusal = accelerator_refusal(self.config.get("trainer") or {})
        if refusal is not None:
            raise MimaError(refusal)
        self.config_init = self.parser.instantiate(without_trackers(self.config),
                                                   instantiators=named_instantiators(self.config))
        self.model = self.config_init["model"]
        self.datamodule = self.config_init["data"]


def parse_layers(parser: LightningArgumentParser, layers: ConfigLayers) -> Namespace:
    """The layers parsed in order, each over the ones before it, as successive --config files."""
    config = parser.parse_path(layers.file, defaults=True) if layers.file is not None else None
    for mapping in layers.mappings:
        config = parser.parse_object(dict(mapping), cfg_base=config, defaults=config is None)
    if config is None:
        config = parser.parse_object({})
    return config


def build_program(args: Any, program: type[FitProgram] = FitProgram) -> FitProgram:
    """A run's config (what `program` parses: for FitProgram a mapping or ConfigLayers) parsed, its
    options checked and its classes made."""
    # Lightning 2.6 still calls jsonargparse APIs deprecated in 4.49; the warnings are not the user's concern.
    os.environ.setdefault("JSONARGPARSE_DEPRECATION_WARNINGS", "off")
    quiet_lightning_notes()
    with config_errors():
        return program(
            MimaModule,
            TaskSuiteDataModule,
            run=False,
            args=args,
            save_config_callback=None,
            auto_configure_optimizers=False,
            seed_everything_default=0,
            trainer_defaults=TRAINER_DEFAULTS,
            parser_kwargs={"exit_on_error": False, "prog": "mima fit"},
        )


@contextlib.contextmanager
def config_errors() -> Iterator[None]:
    """jsonargparse's errors, and the ValueError it (or a class the config names) raises while the
    config's classes and the Trainer are made, as one line ("config: ..."); a MimaError it wraps, as
    itself; Lightning's refusal of the Trainer's arguments, as one line ("trainer: ...")."""
    try:
        yield
    except MisconfigurationException as exc:
        raise MimaError(f"trainer: {library_message(exc)}") from None
    except ArgumentError as exc:
        raise MimaError(f"config: {config_error_text(exc)}") from None
    except ValueError as exc:
        cause = exc.__cause__ or exc.__context__
        if isinstance(cause, MimaError):
            raise cause from None
        raise MimaError(f"config: {config_error_text(exc)}") from None


def fit_settings(program: FitProgram, config_name: str) -> FitSettings:
    """What build_trainer needs, from a program whose classes are made; `config_name` fills --out's
    {config} (the config file's name)."""
    config = program.config
    options = RunOptions.of(config)
    return FitSettings(model=program.model, datamodule=program.datamodule, trainer=config.get("trainer", {}),
                       trainer_arguments=program.config_init["trainer"], options=options,
                       run_dir=resolve_run_dir(options.out, run_dir_fields(config, config_name)), config=config,
                       config_text=program.parser.dump(config, skip_none=False))


def quiet_lightning_notes() -> None:
    # Lightning's notes at INFO level ("GPU available: ...", "Seed set to N", "Initializing distributed",
    # its logger advertisement, "`Trainer.fit` stopped: `max_epochs=1` reached") describe its own
    # machinery, not the run: mima prints the plan, the layout and the run's end in its own words.
    # Its warnings (and errors) still show.
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    rank_zero_logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if not any(isinstance(f, DropExpectedNotes) for f in rank_zero_logger.filters):
        rank_zero_logger.addFilter(DropExpectedNotes())
    # Lightning 2.6's own use of a torch pytree API that torch 2.14 deprecates.
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")
    # The PhaseBatchSampler starts a resumed epoch where it stopped, which Lightning cannot know.
    warnings.filterwarnings("ignore", message=r".*dataloader is not resumable.*")
    warnings.filterwarnings("ignore", message=r".*resuming from a checkpoint that ended before the epoch ended.*")
    # BatchNorm layers kept in eval mode on purpose (model.batchnorm: frozen).
    warnings.filterwarnings("ignore", message=r".*module\(s\) in eval mode at the start of training.*")
    # A run started by hand on a machine that has SLURM installed is not a SLURM job; nothing to fix.
    warnings.filterwarnings("ignore", message=r".*`srun` command is available on your system but is not used.*")


class DropExpectedNotes(logging.Filter):
    """Lightning notes that describe what mima does on purpose."""

    EXPECTED = ("returned in `LightningModule.configure_callbacks` will override",)

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(note in record.getMessage() for note in self.EXPECTED)
