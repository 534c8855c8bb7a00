"""The LightningDataModule: a task suite's splits and the MIMA training schedule."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import lightning as L
import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch.utils.data import DataLoader

from mima.core.layout import TaskLayout
from mima.core.plan import PhasePlan, phase_lengths, plan_for_budgets
from mima.core.settings import takes_settings
from mima.core.names import JOINT  # model.mode of the joint baseline, and its final model's name
from mima.data.cache_augment import BatchPreparer, CachedTrainingSet, crop_settings, whole_batch
from mima.core.cache_dir import default_data_cache_dir
from mima.data.cache_store import SPLITS, CachedTask, eval_geometry, load_cached_task
from mima.data.clip_tasks import check_specs
from mima.data.image_folder import FolderTask, as_folder_task, folder_task_spec
from mima.data.settings import DataSettings
from mima.data.splits import SPLIT_RULE
from mima.data.registry import DEFAULT_TASKS, resolve_tasks, task_names
from mima.data.sampler import JointBatchSampler, MultiTaskDataset, PhaseBatchSampler
from mima.data.tasks import LoadOptions, TaskData, TaskSpec
from mima.core.errors import MimaError


# `data.suite` values that mean "no built-in tasks": the run consists of `data.custom_tasks` only.
NO_SUITE = (None, "custom")


@dataclass(frozen=True)
class TrainingSetup:
    """What the data needs from the model and the process: the model's image transforms (evaluation,
    and training: None trains on the evaluation transform), the run's budget (S, N, or each task's
    phase lengths) and which tasks this process trains."""

    image_size: int
    preprocess: Callable | None
    steps: int | dict[str, int]  # model.steps (the joint baseline's S; MIMA runs read task_lengths)
    iterations: int
    layout: TaskLayout | None  # None: one process trains every task
    rank: int
    mode: str = "mima"  # "joint": one model trained on every task's batch at every step
    preprocess_train: Callable | None = None  # for the training splits of suites of PIL images
    accumulate: int = 1  # trainer.accumulate_grad_batches: micro-batches of data.batch_size per optimiser step
    # the run's task names -> each task's K_1 .. K_N (ModelSettings.task_lengths); None: S / N for every task
    task_lengths: Callable[[Sequence[str]], tuple[tuple[int, ...], ...]] | None = None
    batch_tasks: bool = False  # model.batch_tasks as resolved: every step holds a batch of every local task


@dataclass(frozen=True)
class ProcessTasks:
    """What the model gets back: this process's phase plan, its share of each task batch, and the
    specs, data key, seed and settings of the run's tasks."""

    plan: PhasePlan
    layout: TaskLayout
    shard: tuple[int, int]  # (replica index, replicas per task)
    specs: list[TaskSpec]  # the run's tasks, in run order
    data_key: str
    seed: int
    settings: dict  # the data section's values, for the run's metadata
    # task name -> its training split through the EVALUATION transform (linear probes are fitted on clean images)
    train_set: Callable[[str], object]
    mode: str = "mima"
    head_tasks: tuple[int, ...] = ()  # the tasks whose heads this process uses: its own (MIMA) or all (joint)
    # with data.cache: turns a cached batch, on the device, into (images, labels, slots) (mima.data.cache_augment)
    prepare_batch: Callable | None = None

    @property
    def local_specs(self) -> list[TaskSpec]:
        """The specs of the tasks whose heads this process uses, in slot order."""
        return [self.specs[index] for index in self.head_tasks]

    @property
    def task_names(self) -> list[str]:
        return [spec.name for spec in self.specs]


@takes_settings(DataSettings)
class TaskSuiteDataModule(L.LightningDataModule):
    """Tasks of one suite. Training batches follow the LightningModule's PhasePlan (one task per batch).

    Options: mima.data.settings.DataSettings (its documentation is appended below).
    """

    def __init__(self, **options) -> None:
        super().__init__()
        settings = DataSettings(**options)
        suite, tasks, root, download = settings.suite, settings.task_list(), settings.root, settings.download
        custom_tasks, cache_dir = settings.custom_tasks, settings.cache_dir
        folder_tasks = [as_folder_task(task, i) for i, task in enumerate(custom_tasks or [])]
        # cache_dir is kept out of hparams: Lightning merges the module's and the datamodule's hparams
        # for loggers and refuses a key both hold with different values (model.cache_dir)
        self.hparams.update({key: value for key, value in asdict(settings).items() if key not in ("custom_tasks", "cache_dir")})
        self.cache_dir = cache_dir
        # Plain dicts, not dataclasses: hyperparameters go into checkpoints and logs as plain data.
        self.hparams["custom_tasks"] = [asdict(task) for task in folder_tasks] or None
        self.task_specs: list[TaskSpec] = resolve_run_tasks(suite, tasks, folder_tasks)
        check_specs(self.task_specs, root, download)  # missing benchmark files: one line, before any training
        self._loaded: dict[tuple[str, bool], TaskData] = {}  # (task, with a training transform)
        self._cached: dict[tuple[str, tuple[str, ...]], CachedTask] = {}  # (task, splits) -> its cached splits
        self.cache_progress = True  # the cache build's tqdm bar
        self._setup: TrainingSetup | None = None
        self._process: ProcessTasks | None = None
        self._copy_streams: dict[torch.device, torch.cuda.Stream] = {}  # per GPU, made at its first batch

    def data_listing(self) -> dict[str, dict]:
        """{task: {split: fingerprint}} of the run's tasks read from folders (mima.data.listing)."""
        return {spec.name: spec.listing for spec in self.task_specs if spec.listing is not None}

    def connect(self, setup: TrainingSetup) -> ProcessTasks:
        """The one exchange with the LightningModule (called from its `setup`): the data learns the
        model's transform and the process's place in the run; the model gets its plan and tasks."""
        joint = setup.mode == JOINT
        # The joint baseline is one "task" (all tasks at once) over the processes: plain data parallelism.
        layout = setup.layout or TaskLayout(1 if joint else len(self.task_specs), 1)
        if joint:
            plan = PhasePlan(tasks=(JOINT,), local_tasks=(0,), total_steps=setup.steps, iterations=1)
            head_tasks = tuple(range(len(self.task_specs)))
        else:
            if setup.task_lengths is not None:
                task_lengths = setup.task_lengths(self.task_names)
            else:
                task_lengths = (phase_lengths(setup.steps, setup.iterations),) * len(self.task_specs)
            # tasks are dealt by their budgets (mima.core.layout.deal_tasks), whoever made the layout
            layout = TaskLayout(layout.num_tasks, layout.world_size, tuple(map(sum, task_lengths)))
            plan = plan_for_budgets(self.task_names, layout.local_tasks(setup.rank), task_lengths, setup.iterations,
                                    batched=setup.batch_tasks)
            head_tasks = plan.local_tasks
        self._setup = setup
        self._process = ProcessTasks(
            plan=plan,
            layout=layout,
            shard=(layout.replica_index(setup.rank), layout.replicas),
            specs=list(self.task_specs),
            data_key=self.data_key,
            seed=int(self.hparams.seed),
            settings=dict(self.hparams),
            train_set=lambda name: self.task_data(name, setup.image_size, setup.preprocess).train,
            mode=setup.mode,
            head_tasks=head_tasks,
            prepare_batch=self._batch_preparer(setup) if self.hparams.cache else None,
        )
        return self._process

    def transfer_batch_to_device(self, batch, device: torch.device, dataloader_idx: int):
        """Lightning's copy of a batch to the device; on a GPU, issued on a stream of its own, so that
        the copy of step g's (pinned) batch runs beside step g-1's kernels instead of queueing behind
        them; the compute stream waits for the copy only where its next kernel reads the batch."""
        if device.type != "cuda":
            return super().transfer_batch_to_device(batch, device, dataloader_idx)
        if device not in self._copy_streams:
            self._copy_streams[device] = torch.cuda.Stream(device)
        compute, copy = torch.cuda.current_stream(device), self._copy_streams[device]
        with torch.cuda.stream(copy):
            moved = super().transfer_batch_to_device(batch, device, dataloader_idx)
        compute.wait_stream(copy)
        # the copies' memory belongs to the copy stream: the caching allocator must not hand it out
        # again before the compute stream is done with the batch
        apply_to_collection(moved, torch.Tensor, lambda tensor: tensor.record_stream(compute) if tensor.is_cuda else None)
        return moved

    def _batch_preparer(self, setup: TrainingSetup) -> BatchPreparer:
        """The device-side half of the cached path (checks the model's transforms now, before training)."""
        if setup.preprocess is None:
            raise MimaError("data.cache: needs the model's image transform")
        geometry = eval_geometry(setup.preprocess, setup.image_size)
        return BatchPreparer(geometry.mean, geometry.std, setup.image_size, crop_settings(setup.preprocess_train))

    @property
    def cache_folder(self) -> Path:
        return Path(self.cache_dir).expanduser() if self.cache_dir else default_data_cache_dir()

    def cached_task(self, name: str, image_size: int, preprocess: Callable,
                    splits: tuple[str, ...] = SPLITS) -> CachedTask:
        """Task `name`'s cached `splits` (default: all three), built (in parallel, with a progress bar)
        where missing or stale."""
        key = (name, tuple(splits))
        if key not in self._cached:
            spec = next(spec for spec in self.task_specs if spec.name == name)
            custom = {task["name"]: task["path"] for task in self.hparams.get("custom_tasks") or []}
            identity = {"suite": self.hparams.suite, "root": self.hparams.root, "path": custom.get(name)}
            options = LoadOptions(root=self.hparams.root, image_size=image_size, split_seed=self.hparams.split_seed,
                                  download=self.hparams.download)
            workers = self.hparams.num_workers or min(4, os.cpu_count() or 1)
            self._cached[key] = load_cached_task(spec, options, preprocess, self.cache_folder, identity, workers,
                                                 self.cache_progress, splits)
        return self._cached[key]

    def build_cache(self, image_size: int, preprocess: Callable) -> list[CachedTask]:
        """`mima data cache`: every task's cached splits, built where missing or stale."""
        return [self.cached_task(name, image_size, preprocess) for name in self.task_names]

    @property
    def data_key(self) -> str:
        """What identifies the training data of this module's tasks (a cache key for linear probes)."""
        key = f"{self.hparams.suite}|{self.hparams.root}|{self.hparams.split_seed}|{SPLIT_RULE}"
        custom = self.hparams.get("custom_tasks") or []
        return key + "".join(f"|{task['name']}={task['path']}" for task in custom)

    @property
    def task_names(self) -> list[str]:
        return [spec.name for spec in self.task_specs]

    def task_data(
        self, name: str, image_size: int, preprocess: Callable | None = None, preprocess_train: Callable | None = None
    ) -> TaskData:
        """The splits of task `name`, loaded once (once more with a training transform). `preprocess`
        is the model's evaluation transform, `preprocess_train` its training transform for the train
        split (None: the evaluation one); suites of PIL images use them (see LoadOptions), tensor
        datasets are sized by `image_size`."""
        if self.hparams.get("cache") and preprocess is not None:
            # every split from the cache, through the evaluation transform (training reads the same
            # files in train_dataloader, and augments on the device)
            return self.cached_task(name, image_size, preprocess).task_data()
        key = (name, preprocess_train is not None)
        if key not in self._loaded:
            spec = next(spec for spec in self.task_specs if spec.name == name)
            options = LoadOptions(
                root=self.hparams.root,
                image_size=image_size,
                split_seed=self.hparams.split_seed,
                preprocess=preprocess,
                download=self.hparams.download,
                preprocess_train=preprocess_train,
            )
            self._loaded[key] = spec.load(options)
        return self._loaded[key]

    def train_dataloader(self) -> DataLoader:
        if self._process is None:
            raise RuntimeError("TaskSuiteDataModule.connect must run (MimaModule.setup calls it) before training")
        process, setup = self._process, self._setup
        names = [spec.name for spec in process.local_specs]
        cached = bool(self.hparams.get("cache"))
        if cached:
            tasks = [self.cached_task(name, setup.image_size, setup.preprocess) for name in names]
            local = [task.splits["train"] for task in tasks]
        else:
            local = [self.task_data(name, setup.image_size, setup.preprocess, setup.preprocess_train).train for name in names]
        sizes = [len(dataset) for dataset in local]
        start = self.trainer.global_step  # restored before this is called: resume where it stopped
        seed, batch_size = self.hparams.seed, self.hparams.batch_size
        # Every example carries its draw seed (data seed, task, per-task step, position in the step's
        # batch): its random crop comes from it, on the device (cached) or in the loader (per image),
        # never from a worker's global RNG, so batches are the same at any W, any worker count and
        # after a resume.
        if process.mode == JOINT or process.plan.batched:
            # batched (model.batch_tasks): process step g is every local task's step g, and task t's part of it
            # is the batch it gets at its own step g one after another: the joint baseline's batches
            sampler = JointBatchSampler(names, sizes, process.plan.local_steps, batch_size, seed, start, process.shard,
                                        setup.accumulate, draws=True)
        else:
            sampler = PhaseBatchSampler(process.plan, sizes, batch_size, seed, start, process.shard, setup.accumulate,
                                        draws=True)
        # batches pinned on a CUDA run, for non-blocking copies (Lightning copies with non_blocking=True)
        pin = self.trainer.strategy.root_device.type == "cuda"
        if not cached:
            return DataLoader(
                MultiTaskDataset(local),
                batch_sampler=sampler,
                num_workers=self.hparams.num_workers,
                persistent_workers=self.hparams.num_workers > 0,
                # pinned batches: Lightning's non_blocking copies to a GPU then do not wait for the host
                pin_memory=pin,
            )
        # whole uint8 batches
        dataset = CachedTrainingSet(local, [task.augment for task in tasks], crop_settings(setup.preprocess_train),
                                    setup.image_size)
        return DataLoader(
            dataset,
            batch_sampler=sampler,
            collate_fn=whole_batch,
            num_workers=self.hparams.num_workers,
            persistent_workers=self.hparams.num_workers > 0,
            pin_memory=pin,
        )


def resolve_run_tasks(suite: str | None, names: Sequence[str] | None, custom: Sequence[FolderTask]) -> list[TaskSpec]:
    """The TaskSpecs of a run: `names` looked up among the suite's tasks and the custom tasks (None:
    the suite's default list, then every custom task), in the given order."""
    if not custom and suite not in NO_SUITE:
        return resolve_tasks(suite, names)  # the suite alone: its own checks and messages
    built_in = {} if suite in NO_SUITE else {spec.name: spec for spec in resolve_tasks(suite, task_names(suite))}
    folders: dict[str, FolderTask] = {}
    for task in custom:
        if task.name in folders:
            raise MimaError(f"data.custom_tasks: the name '{task.name}' is used by two custom tasks")
        if task.name in built_in:
            raise MimaError(f"data.custom_tasks: '{task.name}' is already a task of suite '{suite}'; give the custom task another name")
        folders[task.name] = task
    defaults = [] if suite in NO_SUITE else list(DEFAULT_TASKS[suite])
    chosen = defaults + list(folders) if names is None else list(names)
    known = [*built_in, *folders]
    if not chosen:
        raise MimaError("data.tasks: the task list is empty; name tasks of data.suite or add data.custom_tasks")
    duplicates = sorted({name for name in chosen if chosen.count(name) > 1})
    if duplicates:
        raise MimaError(f"data.tasks: task '{duplicates[0]}' is listed more than once")
    unknown = [name for name in chosen if name not in built_in and name not in folders]
    if unknown:
        where = "the custom tasks" if suite in NO_SUITE else f"suite '{suite}' or the custom tasks"
        raise MimaError(f"data.tasks: unknown task '{unknown[0]}' in {where} (known: {', '.join(known) or 'none'})")
    return [built_in[name] if name in built_in else folder_task_spec(folders[name]) for name in chosen]
