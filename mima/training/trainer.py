"""`mima fit`: one MIMA run from a config, with LightningCLI conventions.

    mima fit --config configs/demo.yaml --out runs/demo --trainer.accelerator cpu

The config has `model:` (MimaModule), `data:` (TaskSuiteDataModule), `trainer:` (lightning Trainer)
and `seed_everything:` sections; any key can be overridden on the command line (`--model.iterations 8`).
The run length is fixed by model.steps and model.iterations, so trainer.max_steps / max_epochs are
set here. A run folder holds config.yaml, pretrained.safetensors, final/<task>.safetensors (+ .json),
metrics.jsonl (one object per phase) and logs/ (Lightning's CSV logger).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

from jsonargparse import ArgumentError
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import CSVLogger

from mima.data.datamodule import TaskSuiteDataModule
from mima.errors import MimaError
from mima.safetensors_io import write_text_atomic
from mima.training.module import MimaModule

RUN_OUTPUTS = ("config.yaml", "pretrained.safetensors", "metrics.jsonl", "final", "logs")
TRAINER_DEFAULTS: dict[str, Any] = {
    "accelerator": "auto",
    "devices": 1,
    "enable_checkpointing": False,
    "num_sanity_val_steps": 0,
    "log_every_n_steps": 10,
    "use_distributed_sampler": False,  # the PhaseBatchSampler decides every batch
}


class MimaCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.add_argument("--out", type=str | None, default=None, help="run folder (default: runs/<time>)")
        parser.add_argument("--ckpt_path", type=str | None, default=None, help="checkpoint to resume from")
        parser.add_argument("--overwrite", type=bool, default=False, help="replace the outputs of an earlier run")

    def parse_arguments(self, parser, args) -> None:
        # mima always passes the arguments explicitly (sys.argv also holds `mima fit`).
        self.config = parser.parse_object(args) if isinstance(args, dict) else parser.parse_args(args)

    def instantiate_trainer(self, **kwargs: Any):
        trainer_config = self.config.get("trainer", {})
        for key, neutral in (("max_steps", -1), ("max_epochs", None), ("max_time", None), ("min_steps", None)):
            if trainer_config.get(key) not in (neutral, None):
                raise MimaError(f"trainer.{key}: the run length is set by model.steps and model.iterations; leave it unset")
        self.run_dir = resolve_run_dir(self.config.get("out"))
        # Before the Trainer exists, so a refusal is the only thing printed.
        prepare_run_dir(self.run_dir, resuming=self.config.get("ckpt_path") is not None, overwrite=bool(self.config.get("overwrite")))
        kwargs.update(default_root_dir=str(self.run_dir), max_epochs=1, max_steps=-1)
        if trainer_config.get("logger") in (None, True):
            kwargs["logger"] = CSVLogger(save_dir=str(self.run_dir), name="logs", version="")
        return super().instantiate_trainer(**kwargs)


class _DropProgressBarOverrideNote(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "returned in `LightningModule.configure_callbacks` will override" not in record.getMessage()


def resolve_run_dir(out: str | None) -> Path:
    return Path(out) if out else Path("runs") / time.strftime("%Y%m%d-%H%M%S")


def build_cli(args: list[str] | dict | None) -> MimaCLI:
    """Parse a `mima fit` command line (or a config dict) and instantiate module, data and trainer."""
    # Lightning 2.6 still calls jsonargparse APIs deprecated in 4.49; the warnings are not the user's concern.
    os.environ.setdefault("JSONARGPARSE_DEPRECATION_WARNINGS", "off")
    # "Seed set to N" would precede a one-line config error; the seed is in config.yaml anyway.
    logging.getLogger("lightning.fabric.utilities.seed").setLevel(logging.WARNING)
    # "...configure_callbacks will override existing callbacks": the MIMA progress bar, by design.
    rank_zero_logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if not any(isinstance(f, _DropProgressBarOverrideNote) for f in rank_zero_logger.filters):
        rank_zero_logger.addFilter(_DropProgressBarOverrideNote())
    # Lightning 2.6's own use of a torch pytree API that torch 2.14 deprecates.
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")
    try:
        return MimaCLI(
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
    except ArgumentError as exc:
        raise MimaError(f"config: {_first_line(exc)}") from None
    except ValueError as exc:  # jsonargparse wraps errors raised while instantiating classes
        cause = exc.__cause__ or exc.__context__
        if isinstance(cause, MimaError):
            raise cause from None
        raise MimaError(f"config: {_first_line(exc)}") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def prepare_run_dir(run_dir: Path, resuming: bool, overwrite: bool) -> None:
    """Refuse to clobber an earlier run unless resuming it or asked to overwrite it."""
    earlier = [name for name in RUN_OUTPUTS if (run_dir / name).exists()]
    if earlier and not resuming:
        if not overwrite:
            raise MimaError(
                f"--out {run_dir}: already holds a run ({', '.join(earlier)}); "
                "resume it with --ckpt_path, pick another --out, or pass --overwrite"
            )
        for name in earlier:
            path = run_dir / name
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    run_dir.mkdir(parents=True, exist_ok=True)


def run_fit(args: list[str] | dict | None = None) -> Path:
    """Run `mima fit` and return the run folder."""
    cli = build_cli(args)
    run_dir: Path = cli.run_dir
    ckpt_path = cli.config.get("ckpt_path")
    if cli.trainer.is_global_zero:
        write_text_atomic(run_dir / "config.yaml", cli.parser.dump(cli.config, skip_none=False))
    cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=ckpt_path)
    return run_dir
