"""The Trainer of one `mima fit` run, built from its FitSettings by the command and by mima.fit alike
(build_trainer): the process made ready (CPU threads, determinism), every check that can fail on the
user's input before anything is built (the run folder, a changed task folder, the process layout and
the checkpoint to resume, the plan printed at start), then the strategy, the loggers and mima's
callbacks, in the order they must run: the sync callback, which owns the phase state, before those
that read it through its view (mima.training.phase_view; each of them checks that order in its
`setup`). mima.services.fit.run fits it."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

import torch
from jsonargparse import Namespace
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback, ProgressBar

from mima.config.config_changes import ConfigChanges, compare_configs, refuse_changes
from mima.config.defaults import AUTO, NUM_NODES_DEFAULT
from mima.config.source import check_trainer_options
from mima.core.environment import global_rank
from mima.core.errors import MimaError
from mima.core.run_folder import JOINT, RunFolder
from mima.data.listing import listing_changes
from mima.services.fit.program import config_errors
from mima.services.fit.settings import FitSettings
from mima.training.background_writer import BackgroundWriter
from mima.training.checkpoint_callback import MimaCheckpoint
from mima.training.determinism import prepare_deterministic
from mima.training.joint import JointFinalCallback
from mima.training.phase_view import PhaseView
from mima.training.plan_choices import Choice, choose_checkpoint_every
from mima.training.preemption import StopAgreement
from mima.training.progress import MimaLogLines
from mima.training.rank_logger import rank_loggers
from mima.training.trackers import TrackerForwarding, TrackerRelay, build_trackers, tracker_entries
from mima.training.plan_probes import trains_on_gpu
from mima.training.save_schedule import SaveSchedule
from mima.training.resume import ResumeCut, RunStart, resolve_resume, run_identity
from mima.training.sync import MimaSyncCallback
from mima.training.sync_merge import SyncMerge
from mima.training.trainer import (Launch, budget_summary, build_strategy, check_layout, configured_world_size,
                                   run_finished, same_layout)


def build_trainer(settings: FitSettings) -> FitRun:
    """The run with its Trainer (FitRun.trainer), every input checked first; what it settles (the
    launch, the checkpoint callback, a data change accepted) is kept on the FitRun for the fit."""
    with config_errors():  # as when the config's classes were made: one line
        trainer_config = settings.trainer
        check_trainer_options(trainer_config)  # also when the config is parsed; kept for settings made otherwise
        set_threads(settings.options.threads_per_process)
        # before any CUDA work of this process (the processes Lightning starts come through here too)
        note = prepare_deterministic(trainer_config.get("deterministic"), trains_on_gpu(trainer_config))
        if note and global_rank() == 0:
            print(f"mima fit: {note}", flush=True)
        run = FitRun(settings)
        run.check_inputs()
        # the config's Trainer arguments, then mima's (as LightningCLI's own instantiate_trainer merges them)
        run.trainer = Trainer(**{**settings.trainer_arguments, **run.trainer_arguments()})
    return run


class FitRun:
    """One run while it is built and fitted: its settings; what the checks settle before the Trainer
    exists (the launch, a data change accepted, the checkpoint schedule, the plan's choices); the
    Trainer and mima's checkpoint callback."""

    def __init__(self, settings: FitSettings) -> None:
        self.settings, self.options = settings, settings.options
        self.model, self.datamodule, self.run_dir = settings.model, settings.datamodule, settings.run_dir
        self.plan_checkpointing = False  # model.grad_checkpointing "auto" as the plan settles it
        self.launch: Launch | None = None  # known here, or once the Trainer exists (the fit prepares it then)
        self.data_changes: list[str] = []
        self.checkpoint_every: Choice | None = None  # the checkpoint schedule chosen, set by check_inputs
        self.task_lengths: list = []  # each task's phase lengths, set by check_inputs
        self.run_start = RunStart()  # where this attempt starts: filled once before trainer.fit
        self.checkpoint: MimaCheckpoint | None = None
        self.tracker_loggers: list = []  # the trackers trainer.logger names, made by check_inputs
        self.trainer: Trainer | None = None

    def check_inputs(self) -> None:
        """Everything that can refuse the run, before the Trainer prints anything."""
        trainer_config = self.settings.trainer
        if global_rank() == 0:  # before the Trainer exists, so a refusal is the only thing printed
            RunFolder(self.run_dir).check_target(resuming=self.options.ckpt_path is not None, overwrite=self.options.overwrite)
        self.data_changes = self.check_data_listing()  # a changed task folder: refused before anything is built
        # a tracker that refuses its arguments: one line, before the plan is printed (a later refusal may
        # leave behind the store a tracker made, e.g. MLflow's RUN/mlruns; the run's own files are not yet written)
        self.tracker_loggers = self.trackers(trainer_config.get("logger"))
        self.checkpoint_every = choose_checkpoint_every(self.options.checkpoint_every, trains_on_gpu(trainer_config))
        # each task's phase lengths: a map of budgets that does not name exactly the run's tasks is refused here
        self.task_lengths = self.model.settings.task_lengths(self.datamodule.task_names)
        world_size = configured_world_size(trainer_config)
        if world_size is not None:  # "auto", lists: known once the Trainer exists (then the fit prepares it)
            # the layout and the checkpoint to resume, checked before the Trainer prints anything
            self.launch = self.prepare_launch(world_size)
            if self.model.hparams.mode != JOINT:
                self.check_plan(world_size, trainer_config)
        if self.model.hparams.grad_checkpointing == AUTO and not self.plan_checkpointing:
            self.plan_checkpointing = self.choose_grad_checkpointing(world_size or 1, trainer_config)
        if self.plan_checkpointing:
            self.model.use_grad_checkpointing()

    def trainer_arguments(self) -> dict[str, Any]:
        """What mima gives the Trainer: the run length, the strategy, the loggers and the callbacks."""
        trainer_config = self.settings.trainer
        arguments: dict[str, Any] = dict(default_root_dir=str(self.run_dir), max_epochs=1, max_steps=-1)
        every = SaveSchedule.parse(self.checkpoint_every.value)
        saving = every.saves and trainer_config.get("enable_checkpointing") is not False
        stop = StopAgreement(self.run_dir, enabled=saving, timeout_s=self.options.collective_timeout)
        arguments["strategy"] = build_strategy(self.settings.trainer_arguments.get("strategy"), self.num_tasks(),
                                               self.task_work(), self.options.collective_timeout, stop, self.run_start)
        logger_setting = trainer_config.get("logger")
        trackers, relay = self.tracker_loggers, TrackerRelay()
        if logger_setting in (None, True) or trackers:  # the per-process files always; trackers through the relay
            own_logs = rank_loggers(RunFolder(self.run_dir).rank_logs_dir(global_rank()))
            arguments["logger"] = own_logs + ([relay] if trackers else [])
        # one background writer for the checkpoints and the final task models, in one order: a state
        # that refers to a final file is never on disk before it (the checkpoint callback closes it)
        writer = BackgroundWriter() if saving else None
        phase_callback = self.phase_callback(stop, writer)
        phases = phase_callback.phase_view() if isinstance(phase_callback, MimaSyncCallback) else None
        if saving:
            self.checkpoint = MimaCheckpoint(phases or PhaseView.without_phases(), stop, self.run_start, every,
                                             keep=self.options.keep_checkpoints, writer=writer)
        else:
            arguments["enable_checkpointing"] = False
        arguments["callbacks"] = self.callbacks(phase_callback, phases, trackers, relay)
        return arguments

    def phase_callback(self, stop: StopAgreement, writer: BackgroundWriter | None) -> Callback:
        """The callback that ends segments and phases and owns the phase state (MimaSyncCallback); the
        joint baseline's, which has no phases (JointFinalCallback)."""
        if self.model.hparams.mode == JOINT:
            return JointFinalCallback()
        hparams = self.model.hparams
        sync_merge = SyncMerge(hparams.sync_merge, hparams.sync_merge_args, len(self.datamodule.task_names))
        return MimaSyncCallback(stop, sync_merge=sync_merge, writer=writer)

    def callbacks(self, phase_callback: Callback, phases: PhaseView | None, trackers: list,
                  relay: TrackerRelay) -> list:
        """The config's callbacks, then mima's, in the order they must run: the phase callback first,
        then what reads its phase state (`phases`: its view, None without phases), each of which
        refuses another order in its `setup`. The checkpoint callback comes last (Lightning moves
        every Checkpoint there anyway)."""
        user_callbacks = list(self.settings.trainer_arguments.get("callbacks") or [])
        # a segment's line shows the loss the sync callback has just read
        log_lines = [MimaLogLines(phases)] if wants_log_lines(self.settings.trainer, user_callbacks) else []
        # a phase's rows go once the sync has taken place
        forwarding = [TrackerForwarding(trackers, relay, phases, self.run_dir,
                                        self.settings.config.as_dict())] if trackers else []
        checkpoint = [self.checkpoint] if self.checkpoint else []
        return user_callbacks + [phase_callback] + forwarding + log_lines + checkpoint

    def trackers(self, logger_setting: Any) -> list:
        """The experiment trackers `trainer.logger` names (mima.training.trackers), built to continue
        the tracker runs of the run being resumed."""
        if isinstance(logger_setting, list):
            logger_setting = [entry.as_dict() if isinstance(entry, Namespace) else entry for entry in logger_setting]
        elif isinstance(logger_setting, Namespace):
            logger_setting = logger_setting.as_dict()
        entries = tracker_entries(logger_setting)
        record = RunFolder(self.run_dir).tracker_record() if entries and self.options.ckpt_path is not None else {}
        return build_trackers(entries, self.run_dir, record)

    def check_data_listing(self) -> list[str]:
        """Compare the listings of the tasks read from folders with those the run recorded when it
        started (mima.data.listing): a resume on a changed folder is refused in one line naming the task
        and the change, unless --accept_data_change (then the changes are returned, to be said and
        recorded)."""
        recorded = RunFolder(self.run_dir).data_listing() if self.options.ckpt_path is not None else None
        changes = listing_changes(recorded or {}, self.datamodule.data_listing())
        if changes and not self.options.accept_data_change:
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
        resume_states, notes = resolve_resume(self.options.ckpt_path, self.run_dir, layout, identity)
        changes = self.check_resumed_config(resume_states)
        return Launch(layout, identity, resume_states, notes, changes)

    def check_plan(self, world_size: int, trainer_config: Mapping[str, Any]) -> None:
        """Print the run's plan (mima.training.plan_from_config, as `mima plan`) and refuse, in one line, a
        run whose memory the plan shows the device cannot hold, unless --force."""
        from mima.config.run_config import parse_run_config
        from mima.training.plan_format import check_fits, format_plan
        from mima.training.plan_from_config import plan_for_config

        raw = self.settings.stored_config()
        nodes = int(str(trainer_config.get("num_nodes", NUM_NODES_DEFAULT)))
        plan, footprint, inputs = plan_for_config(parse_run_config(raw, "config"), world_size, nodes,
                                                  self.checkpoint_every.value, tasks=self.datamodule.task_names)
        self.plan_checkpointing = inputs.grad_checkpointing
        # model.batch_tasks "auto" as the plan settled it (on a GPU only: the CPU's plan leaves it off)
        self.model.planned_batch_tasks = bool(plan.choices.get("batch_tasks", {}).get("value", False))
        if global_rank() == 0:
            print(format_plan(plan, footprint, inputs), flush=True)
        problem = check_fits(plan, force=self.options.force)
        if problem is not None and not self.options.force:
            raise MimaError(problem)
        if problem is not None and global_rank() == 0:
            print(f"mima fit: {problem}", flush=True)

    def choose_grad_checkpointing(self, world_size: int, trainer_config: Mapping[str, Any]) -> bool:
        """model.grad_checkpointing "auto" where no plan was printed (the joint baseline, a number of
        processes Lightning resolves): the plan's choice for `world_size` processes, said in one line."""
        if not trains_on_gpu(trainer_config):
            return False  # the plan's choice on the CPU, without tracing the model
        from mima.config.run_config import parse_run_config
        from mima.training.plan_from_config import plan_for_config

        raw = self.settings.stored_config()
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
        if self.options.ckpt_path is None or not run.config_file.is_file():
            return None
        if resume_states is None and not run_finished(run, self.datamodule.task_names, hparams.mode):
            return None
        stored = run.config_dict()
        new = self.settings.stored_config()
        changes = compare_configs(stored, new, lambda before, after: same_layout(before, after, self.num_tasks()))
        refuse_changes(changes, str(run.config_file))
        return changes


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
