"""`mima fit`: one MIMA run from a config, with LightningCLI conventions.

    mima fit --config configs/demo.yaml --out runs/demo                        # one process
    mima fit --config configs/demo.yaml --trainer.devices 2 --out runs/demo2   # two processes
    mima fit --config configs/demo.yaml --out runs/demo2 --ckpt_path last      # resume

The config has `model:` (MimaModule), `data:` (TaskSuiteDataModule), `trainer:` (lightning Trainer)
and `seed_everything:` sections; any key can be overridden on the command line (`--model.iterations 8`).
The run length is fixed by model.steps and model.iterations, so trainer.max_steps / max_epochs are
set here; the strategy is always MimaStrategy (task-parallel DDP, also for one process).

This module holds the command line (MimaCLI) and what it settles before the Trainer exists;
mima.commands.fit.run runs it. The run folder's files are listed in mima.core.run_folder (RunFolder
writes and reads them). Every check that can fail on user input runs before any process is launched,
so a mistake is reported once, on one line.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import yaml
from jsonargparse import ArgumentError, Namespace
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from typing_extensions import override

from mima.commands.common import suggest_option
from mima.config.config_changes import ConfigChanges, compare_configs, refuse_changes
from mima.config.defaults import AUTO, CHECKPOINT_EVERY_DEFAULT, COLLECTIVE_TIMEOUT_S, DEVICES_DEFAULT, NUM_NODES_DEFAULT
from mima.config.run_config import config_error_text
from mima.config.source import check_run_values, check_trainer_options
from mima.core.environment import global_rank
from mima.core.errors import MimaError
from mima.core.run_folder import JOINT, RunFolder
from mima.core.run_lock import RunLock
from mima.data.datamodule import TaskSuiteDataModule
from mima.data.listing import listing_changes
from mima.training.background_writer import BackgroundWriter
from mima.training.checkpoint_callback import MimaCheckpoint, SaveSchedule
from mima.training.determinism import prepare_deterministic
from mima.training.joint import JointFinalCallback
from mima.training.module import MimaModule
from mima.training.phase_state import PhaseState
from mima.training.plan_choices import choose_checkpoint_every
from mima.training.preemption import StopAgreement
from mima.training.progress import MimaLogLines
from mima.training.rank_logger import rank_loggers
from mima.training.trackers import TrackerForwarding, TrackerRelay, build_trackers, tracker_entries
from mima.training.resource_plan import trains_on_gpu
from mima.training.resume import ResumeCut, RunStart, resolve_resume, run_identity
from mima.training.sync import MimaSyncCallback
from mima.training.sync_merge import SyncMerge
from mima.training.trainer import (Launch, budget_summary, build_strategy, check_layout, configured_world_size,
                                   run_finished, same_layout)

TRAINER_DEFAULTS: dict[str, Any] = {
    "accelerator": "auto",
    "devices": DEVICES_DEFAULT,
    "num_sanity_val_steps": 0,
    "log_every_n_steps": 10,
    # Lightning's table of the module's parameters and FLOPs (0 for MIMA's encoder): `mima plan`, printed
    # at start, says what the run holds
    "enable_model_summary": False,
    "use_distributed_sampler": False,  # the PhaseBatchSampler decides every batch
}


class MimaCLI(LightningCLI):
    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument(
            "--out", type=str | None, default=None,
            help="run folder (default: runs/<time>); {config}, {iterations} and {seed} are replaced by the config "
            "file's name, N and seed_everything, so a resubmitted job finds its run (slurm/launch.sh uses "
            "$MIMA_RUNS/{config}-N{iterations}-seed{seed})",
        )
        parser.add_argument(
            "--ckpt_path", type=str | None, default=None,
            help="resume: 'last' (the run folder's newest consistent checkpoint; a fresh start if there is none)",
        )
        parser.add_argument("--overwrite", type=bool, default=False, help="replace the outputs of an earlier run")
        parser.add_argument(
            "--checkpoint_every", type=str | int, default=CHECKPOINT_EVERY_DEFAULT,
            help="when each process saves its state: 'auto' (default: 30min on a GPU, segment on the CPU; `mima plan` "
            "says which), 'segment' (every task segment end: at most K steps lost), "
            "'phase' or 'K phases' (at every K-th sync: fewer files, up to K phases lost), a number n of process "
            "steps (also at syncs; saves inside a segment hold the encoder and its moments), a time such as 90s, "
            "30min or 2h (at the first sync after it has passed), or 0 (never); a stop request always saves",
        )
        parser.add_argument(
            "--keep_checkpoints", type=bool, default=False,
            help="keep RUN/checkpoints after the run has finished (default: removed; final/ holds the result)",
        )
        parser.add_argument(
            "--threads_per_process", type=int | None, default=None,
            help="CPU threads of each process (default: Lightning's share of the cores). Results on the CPU "
            "depend on it, so fix it to compare runs with different numbers of processes",
        )
        parser.add_argument(
            "--force", type=bool, default=False,
            help="start even when the plan printed at start (`mima plan`) shows the run does not fit the device's memory",
        )
        parser.add_argument(
            "--accept_data_change", type=bool, default=False,
            help="resume although a task folder's listing changed since the run started (files added, removed or "
            "renamed): the splits are then cut from the new listing, which can move images between train and test; "
            "without it such a resume is refused",
        )
        parser.add_argument(
            "--collective_timeout", type=int, default=COLLECTIVE_TIMEOUT_S,
            help="seconds a collective may wait for other processes before the run fails (a dead process cannot hang it)",
        )

    @override
    def parse_arguments(self, parser: LightningArgumentParser, args: list[str] | dict[str, Any] | Namespace | None) -> None:
        # mima always passes the arguments explicitly (sys.argv also holds `mima fit`).
        try:
            self.config = parser.parse_object(args) if isinstance(args, dict) else parser.parse_args(args)
        except ArgumentError as exc:
            raise MimaError(f"config: {config_error_text(exc)}{typo_hint(str(exc), parser)}") from None
        # the numbers outside model: and data: (those the settings dataclasses check when they are built),
        # command-line overrides included, before anything is built
        check_run_values(self.config.as_dict())

    @override
    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        config = self.config
        trainer_config = config.get("trainer", {})
        check_trainer_options(trainer_config)  # also in parse_arguments' check_run_values; kept for dict configs
        set_threads(config.get("threads_per_process"))
        # before any CUDA work of this process (the processes Lightning starts come through here too)
        note = prepare_deterministic(trainer_config.get("deterministic"), trains_on_gpu(trainer_config))
        if note and global_rank() == 0:
            print(f"mima fit: {note}", flush=True)
        self.run_dir = resolve_run_dir(config.get("out"), config)
        # One job per run folder: process 0 of the job holds the lock from here to the end of run_fit (the
        # job's other processes are its own); every check below reads the folder under it.
        self.lock: RunLock | None = RunLock(self.run_dir, "mima fit").acquire() if global_rank() == 0 else None
        try:
            return self.instantiate_locked(config, trainer_config, kwargs)
        except BaseException:
            self.release_lock()
            raise

    def release_lock(self) -> None:
        if self.lock is not None:
            self.lock.release()

    def instantiate_locked(self, config, trainer_config, kwargs: dict[str, Any]):
        self.plan_checkpointing = False  # model.grad_checkpointing "auto" as the plan settles it
        if global_rank() == 0:  # before the Trainer exists, so a refusal is the only thing printed
            RunFolder(self.run_dir).check_target(resuming=config.get("ckpt_path") is not None, overwrite=bool(config.get("overwrite")))
        self.launch: Launch | None = None
        self.data_changes = self.check_data_listing()  # a changed task folder: refused before anything is built
        self.checkpoint_every = choose_checkpoint_every(config.get("checkpoint_every"), trains_on_gpu(trainer_config))
        # each task's phase lengths: a map of budgets that does not name exactly the run's tasks is refused here
        self.task_lengths = self.model.settings.task_lengths(self.datamodule.task_names)
        world_size = configured_world_size(trainer_config)
        if world_size is not None:  # "auto", lists: known once the Trainer exists (then run_fit prepares it)
            # the layout and the checkpoint to resume, checked before the Trainer prints anything
            self.launch = self.prepare_launch(world_size)
            if self.model.hparams.mode != JOINT:
                self.check_plan(world_size, trainer_config)
        if self.model.hparams.grad_checkpointing == AUTO and not self.plan_checkpointing:
            self.plan_checkpointing = self.choose_grad_checkpointing(world_size or 1, trainer_config)
        if self.plan_checkpointing:
            self.model.use_grad_checkpointing()
        kwargs.update(default_root_dir=str(self.run_dir), max_epochs=1, max_steps=-1)
        every = SaveSchedule.parse(self.checkpoint_every.value)
        saving = every.saves and trainer_config.get("enable_checkpointing") is not False
        stop = StopAgreement(self.run_dir, enabled=saving, timeout_s=config["collective_timeout"])
        # where this attempt starts: known here or once the Trainer exists (run_fit settles it)
        self.run_start = RunStart()
        kwargs["strategy"] = build_strategy(self.config_init["trainer"].get("strategy"), self.num_tasks(), self.task_work(),
                                       config["collective_timeout"], stop, self.run_start)
        logger_setting = trainer_config.get("logger")
        trackers, relay = self.trackers(logger_setting), TrackerRelay()
        if logger_setting in (None, True) or trackers:  # the per-process files always; trackers through the relay
            kwargs["logger"] = rank_loggers(RunFolder(self.run_dir).rank_logs_dir(global_rank())) + ([relay] if trackers else [])
        # One PhaseState per process, owned here: the sync callback changes it, the checkpoints store it.
        phases = PhaseState()
        # one background writer for the checkpoints and the final task models, in one order: a state
        # that refers to a final file is never on disk before it (the checkpoint callback closes it)
        writer = BackgroundWriter() if saving else None
        self.checkpoint: MimaCheckpoint | None = None
        if saving:
            self.checkpoint = MimaCheckpoint(phases, stop, self.run_start, every, keep=bool(config.get("keep_checkpoints")),
                                             writer=writer)
        else:
            kwargs["enable_checkpointing"] = False
        if self.model.hparams.mode == JOINT:
            mima_callbacks = [JointFinalCallback()]
        else:
            hparams = self.model.hparams
            sync_merge = SyncMerge(hparams.sync_merge, hparams.sync_merge_args, len(self.datamodule.task_names))
            mima_callbacks = [MimaSyncCallback(phases, stop, sync_merge=sync_merge, writer=writer)]
        user_callbacks = list(self.config_init["trainer"].get("callbacks") or [])
        # after the sync callback, so that a segment's line shows the loss it has just read
        log_lines = [MimaLogLines(None if self.model.hparams.mode == JOINT else phases)] if wants_log_lines(
            trainer_config, user_callbacks) else []
        # after the sync callback: it sends a phase's rows once the sync has taken place
        forwarding = [TrackerForwarding(trackers, relay, None if self.model.hparams.mode == JOINT else phases, self.run_dir,
                                        self.config.as_dict())] if trackers else []
        kwargs["callbacks"] = (user_callbacks + mima_callbacks + forwarding + log_lines
                               + ([self.checkpoint] if self.checkpoint else []))
        return super().instantiate_trainer(**kwargs)

    def trackers(self, logger_setting: Any) -> list:
        """The experiment trackers `trainer.logger` names (mima.training.trackers), built to continue
        the tracker runs of the run being resumed."""
        if isinstance(logger_setting, list):
            logger_setting = [entry.as_dict() if isinstance(entry, Namespace) else entry for entry in logger_setting]
        elif isinstance(logger_setting, Namespace):
            logger_setting = logger_setting.as_dict()
        entries = tracker_entries(logger_setting)
        record = RunFolder(self.run_dir).tracker_record() if entries and self.config.get("ckpt_path") is not None else {}
        return build_trackers(entries, self.run_dir, record)

    def check_data_listing(self) -> list[str]:
        """Compare the listings of the tasks read from folders with those the run recorded when it
        started (mima.data.listing): a resume on a changed folder is refused in one line naming the task
        and the change, unless --accept_data_change (then the changes are returned, to be said and
        recorded)."""
        recorded = RunFolder(self.run_dir).data_listing() if self.config.get("ckpt_path") is not None else None
        changes = listing_changes(recorded or {}, self.datamodule.data_listing())
        if changes and not self.config.get("accept_data_change"):
            raise MimaError(f"{self.run_dir}: {'; '.join(changes)} since the run started; resuming would cut the splits "
                            "from another listing (images could move between train and test): restore the folder, or "
                            "pass --accept_data_change true")
        return changes

    def num_tasks(self) -> int:
        """Tasks for the process layout: the joint baseline trains one model on all tasks (plain DDP)."""
        return 1 if self.model.hparams.mode == JOINT else len(self.datamodule.task_names)

    def task_work(self) -> tuple[int, ...]:
        """What the tasks are dealt to processes by (TaskLayout.work): each task's budget S_t."""
        return () if self.model.hparams.mode == JOINT else tuple(map(sum, self.task_lengths))

    def prepare_launch(self, world_size: int) -> Launch:
        """The layout of the run on `world_size` processes, its identity and the cut to resume from:
        computed once per `mima fit`, before any process writes."""
        layout = check_layout(self.num_tasks(), world_size, self.datamodule.hparams.batch_size, self.task_work())
        hparams = self.model.hparams
        joint = hparams.mode == JOINT
        # the longest task's lengths; with per-task budgets `steps` (the map) tells the tasks apart
        lengths = None if joint else max(self.task_lengths, key=sum)
        identity = run_identity(self.datamodule.task_names, hparams.steps, 1 if joint else hparams.iterations,
                                world_size, hparams.mode, lengths)
        if global_rank() == 0 and not joint and len(set(self.task_lengths)) > 1:
            print(budget_summary(self.datamodule.task_names, self.task_lengths, layout))
        resume_states, notes = resolve_resume(self.config.get("ckpt_path"), self.run_dir, layout, identity)
        changes = self.check_resumed_config(resume_states)
        return Launch(layout, identity, resume_states, notes, changes)

    def check_plan(self, world_size: int, trainer_config: Mapping[str, Any]) -> None:
        """Print the run's plan (mima.training.resource_plan, as `mima plan`) and refuse, in one line, a
        run whose memory the plan shows the device cannot hold, unless --force."""
        from mima.config.run_config import parse_run_config
        from mima.training.resource_plan import check_fits, format_plan, plan_for_config

        raw = yaml.safe_load(self.parser.dump(self.config, skip_none=False)) or {}
        nodes = int(str(trainer_config.get("num_nodes", NUM_NODES_DEFAULT)))
        plan, footprint, inputs = plan_for_config(parse_run_config(raw, "config"), world_size, nodes,
                                                  self.checkpoint_every.value, tasks=self.datamodule.task_names)
        self.plan_checkpointing = inputs.grad_checkpointing
        # model.batch_tasks "auto" as the plan settled it (on a GPU only: the CPU's plan leaves it off)
        self.model.planned_batch_tasks = bool(plan.choices.get("batch_tasks", {}).get("value", False))
        if global_rank() == 0:
            print(format_plan(plan, footprint, inputs), flush=True)
        problem = check_fits(plan, force=bool(self.config.get("force")))
        if problem is not None and not self.config.get("force"):
            raise MimaError(problem)
        if problem is not None and global_rank() == 0:
            print(f"mima fit: {problem}", flush=True)

    def choose_grad_checkpointing(self, world_size: int, trainer_config: Mapping[str, Any]) -> bool:
        """model.grad_checkpointing "auto" where no plan was printed (the joint baseline, a number of
        processes Lightning resolves): the plan's choice for `world_size` processes, said in one line."""
        if not trains_on_gpu(trainer_config):
            return False  # the plan's choice on the CPU, without tracing the model
        from mima.config.run_config import parse_run_config
        from mima.training.resource_plan import plan_for_config

        raw = yaml.safe_load(self.parser.dump(self.config, skip_none=False)) or {}
        configured_nodes = str(trainer_config.get("num_nodes", NUM_NODES_DEFAULT))
        nodes = int(configured_nodes) if configured_nodes.isdigit() else NUM_NODES_DEFAULT
        plan, _, inputs = plan_for_config(parse_run_config(raw, "config"), world_size, nodes, self.checkpoint_every.value,
                                          tasks=self.datamodule.task_names)
        choice = plan.choices["grad_checkpointing"]
        if global_rank() == 0:
            print(f"mima fit: model.grad_checkpointing auto: {'on' if choice['value'] else 'off'} ({choice['reason']})",
                  flush=True)
        return inputs.grad_checkpointing

    def check_resumed_config(self, resume_states: ResumeCut | None) -> ConfigChanges | None:
        """A resume goes on with the config its run was trained with: compare the stored config.yaml
        with this command's config and refuse, in one line, any change that would alter the weights
        (mima.config.config_changes). Read before anything is written, by every process alike (only
        changes that are accepted can differ between what two processes read). None: nothing to check
        (not a resume, or a resume that starts afresh: no state of the earlier attempt is used)."""
        run = RunFolder(self.run_dir)
        hparams = self.model.hparams
        if self.config.get("ckpt_path") is None or not run.config_file.is_file():
            return None
        if resume_states is None and not run_finished(run, self.datamodule.task_names, hparams.mode):
            return None
        stored = run.config_dict()
        new = yaml.safe_load(self.parser.dump(self.config, skip_none=False)) or {}
        changes = compare_configs(stored, new, lambda before, after: same_layout(before, after, self.num_tasks()))
        refuse_changes(changes, str(run.config_file))
        return changes


def typo_hint(message: str, parser: LightningArgumentParser) -> str:
    """"; did you mean --model.iterations?" for the first unrecognized option of a parser error that
    has a close match among the options (every key of the config: the parser's defaults), else ""."""
    unknown = re.search(r"unrecognized arguments: (--[^\s=]+)", message)
    if unknown is None:
        return ""
    known = [f"--{key}" for key in parser.get_defaults().keys()]
    match = suggest_option(unknown.group(1), known)
    return f"; did you mean {match}?" if match else ""


def wants_log_lines(trainer_config: Mapping[str, Any], user_callbacks: list) -> bool:
    """Plain progress lines instead of a redrawn bar: when the output is not a terminal (a SLURM log,
    a pipe), unless the bar is switched off or the config brings its own."""
    if trainer_config.get("enable_progress_bar") is False or any(isinstance(c, ProgressBar) for c in user_callbacks):
        return False
    return not sys.stdout.isatty()


def set_threads(threads: int | None) -> None:
    if threads is None:
        return
    # its range (1 .. 4 x the cores) is checked when the options are parsed (mima.config.source.check_run_values)
    os.environ["OMP_NUM_THREADS"] = str(threads)  # also keeps Lightning from choosing its own
    torch.set_num_threads(threads)


def resolve_run_dir(out: str | None, config: Mapping[str, Any]) -> Path:
    """--out with its {config}, {iterations} and {seed} fields filled in (default: runs/<time>)."""
    if not out:
        return Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    files = config.get("config") or []
    fields = {
        "config": Path(str(files[-1])).stem if files else "cli",
        "iterations": config["model"]["iterations"],
        "seed": config.get("seed_everything"),
    }
    try:
        filled = Path(out.format(**fields))
    except (KeyError, IndexError, ValueError) as exc:
        raise MimaError(f"--out {out}: only {{config}}, {{iterations}} and {{seed}} can be filled in ({exc})") from None
    longest = max((len(os.fsencode(part)) for part in filled.parts), default=0)
    if longest > NAME_MAX_BYTES:  # the folder could not be made: say so now, naming what the user wrote
        raise MimaError(f"--out {out}: filled in, one folder name is {longest} bytes long; a file system takes at "
                        f"most {NAME_MAX_BYTES}")
    return filled


NAME_MAX_BYTES = 255  # the longest file or folder name Linux file systems take (NAME_MAX)


def build_cli(args: list[str] | dict | None, cli_class: type[MimaCLI] | None = None) -> MimaCLI:
    """Parse a `mima fit` command line (or a config dict) and instantiate module, data and trainer
    (`cli_class` ParsedOnly: parse and check the options only)."""
    # Lightning 2.6 still calls jsonargparse APIs deprecated in 4.49; the warnings are not the user's concern.
    os.environ.setdefault("JSONARGPARSE_DEPRECATION_WARNINGS", "off")
    _quiet_lightning_notes()
    try:
        return (cli_class or MimaCLI)(
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
        raise MimaError(f"config: {config_error_text(exc)}") from None
    except ValueError as exc:  # jsonargparse wraps errors raised while instantiating classes
        cause = exc.__cause__ or exc.__context__
        if isinstance(cause, MimaError):
            raise cause from None
        raise MimaError(f"config: {config_error_text(exc)}") from None


class ParsedOnly(MimaCLI):
    """A `mima fit` command line parsed and its types checked against the module's, the data's and the
    Trainer's signatures, with nothing built (no run folder, no model, no Trainer)."""

    @override
    def instantiate_classes(self) -> None:
        pass


def parse_fit(args: list[str]):
    """The parsed options of a `mima fit` command line, without running it (mima.cli.parse)."""
    return build_cli(args, ParsedOnly).config


def _quiet_lightning_notes() -> None:
    # Lightning's notes at INFO level ("GPU available: ...", "Seed set to N", "Initializing distributed",
    # its logger advertisement, "`Trainer.fit` stopped: `max_epochs=1` reached") describe its own
    # machinery, not the run: mima prints the plan, the layout and the run's end in its own words.
    # Its warnings (and errors) still show.
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    rank_zero_logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if not any(isinstance(f, _DropExpectedNotes) for f in rank_zero_logger.filters):
        rank_zero_logger.addFilter(_DropExpectedNotes())
    # Lightning 2.6's own use of a torch pytree API that torch 2.14 deprecates.
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")
    # The PhaseBatchSampler starts a resumed epoch where it stopped, which Lightning cannot know.
    warnings.filterwarnings("ignore", message=r".*dataloader is not resumable.*")
    warnings.filterwarnings("ignore", message=r".*resuming from a checkpoint that ended before the epoch ended.*")
    # BatchNorm layers kept in eval mode on purpose (model.batchnorm: frozen).
    warnings.filterwarnings("ignore", message=r".*module\(s\) in eval mode at the start of training.*")
    # A run started by hand on a machine that has SLURM installed is not a SLURM job; nothing to fix.
    warnings.filterwarnings("ignore", message=r".*`srun` command is available on your system but is not used.*")


class _DropExpectedNotes(logging.Filter):
    """Lightning notes that describe what mima does on purpose."""

    EXPECTED = ("returned in `LightningModule.configure_callbacks` will override",)

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(note in record.getMessage() for note in self.EXPECTED)
