"""`mima evaluate`: the Table-1 results of finished runs, as cells that survive any stop.

What is evaluated, per run (one per N, or one per N and seed; at most one joint run beside them):
theta_0 with the frozen heads (once: the same for every run of one model), each task model on its
own task, the task vectors' pairwise cosines, and every merge in `merges`, its hyperparameters
chosen on the validation splits (the first best grid point, as mima.merging.selection) and its
test accuracy at that point.

How it survives a preemptible cluster:
  * Every result is a cell (mima.evaluation.cells) recorded the moment it is known; running the
    same command again skips the finished cells and says how many. The results files are built
    from the cells at the end, so they equal those of an uninterrupted evaluation.
  * SIGTERM or SIGUSR1 stops after the running batch; SIGUSR1 (SLURM's warning before the time
    limit) also requeues the job, as `mima fit` does.
  * `--devices N` deals the work over N processes, one device each (started here, or one per task
    under `srun`); each records its own cells, process 0 writes the results once all are done.
    Counts are integers, so the results equal one process's exactly. Each process makes its GPU
    (from its local rank, mima.evaluation.device) the current device before any CUDA call.
  * Each process has at most `--num-workers` loader workers alive, whatever the number of tasks and
    splits: one set serves every pass (mima.evaluation.loader_pool).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mima.config.run_config import load_run_config
from mima.core.errors import MimaError
from mima.core.files import publish_folder, remove_folders, stage_folder, write_error
from mima.core.run_folder import JOINT, RunFolder, SweepFolder
from mima.core.run_lock import RunLock
from mima.core.state_dicts import mean_off_diagonal, task_vector_cosines
from mima.evaluation.accuracy import EvalSettings, EvaluationStopped, accuracy_of, default_precision
from mima.evaluation.cells import Cell, CellStore, point_key
from mima.evaluation.device import claim_device, local_rank
from mima.evaluation.plots import plot_accuracy_vs_n, plot_cosine_vs_n
from mima.evaluation.results import ModelResult, training_setup
from mima.evaluation.results_files import write_results
from mima.evaluation.tables import markdown_text
from mima.merging import get_method
from mima.merging.engine import merge_device as resolve_merge_device
from mima.merging.registry import MergeMethod, combine
from mima.pools import TaskPool, task_pool

NO_POINT = point_key({})
GEOMETRY = "pairwise_cos_tau"  # the cell holding a run's task-vector cosines


# ----------------------------------------------------------------------------- processes
@dataclass
class Team:
    """The processes of one evaluation: this one's rank, how many, the session that names their
    cell files, and (process 0 started by `mima evaluate --devices N`) the command for the others."""

    rank: int = 0
    world: int = 1
    session: str = ""
    local_rank: int = 0
    argv: list[str] | None = None  # process 0 starts ranks 1..world-1 with it
    children: list[subprocess.Popen] = field(default_factory=list)

    RANK_ENV, WORLD_ENV, SESSION_ENV = "MIMA_EVALUATE_RANK", "MIMA_EVALUATE_WORLD", "MIMA_EVALUATE_SESSION"

    def start_children(self) -> None:
        for rank in range(1, self.world if self.argv is not None else 1):
            environment = {**os.environ, self.RANK_ENV: str(rank), self.WORLD_ENV: str(self.world),
                           self.SESSION_ENV: self.session}
            self.children.append(subprocess.Popen([sys.executable, "-m", "mima", "evaluate", *self.argv], env=environment))

    def signal_children(self, signum: int) -> None:
        for child in self.children:
            if child.poll() is None:
                child.send_signal(signum)


def team_for(devices: int | None, argv: Sequence[str] | None = None) -> Team:
    """This process's place: a child started by process 0, a task of an `srun` step, or process 0
    of `--devices` processes (default 1). Too many devices is one line, before any work."""
    environment = os.environ
    if Team.RANK_ENV in environment:
        world = int(environment[Team.WORLD_ENV])
        rank = int(environment[Team.RANK_ENV])
        return Team(rank, world, environment[Team.SESSION_ENV], local_rank=rank)
    # inside an srun step (not the batch script itself, which has SLURM_NTASKS but no step size)
    tasks = int(environment.get("SLURM_STEP_NUM_TASKS", "1") or 1)
    if tasks > 1 and "SLURM_PROCID" in environment and "SLURM_STEP_ID" in environment:
        if devices not in (None, tasks):
            raise MimaError(f"--devices {devices}: this srun step has {tasks} tasks (one process each); omit --devices")
        session = f"slurm{environment.get('SLURM_JOB_ID', '')}.{environment['SLURM_STEP_ID']}" \
                  f".r{environment.get('SLURM_RESTART_COUNT', '0')}"
        return Team(int(environment["SLURM_PROCID"]), tasks, session, local_rank=local_rank(environment))
    world = 1 if devices is None else devices
    if world < 1:
        raise MimaError(f"--devices {world}: expected at least 1")
    available = torch.cuda.device_count() if torch.cuda.is_available() else (os.cpu_count() or 1)
    if world > available:
        kind = "GPUs" if torch.cuda.is_available() else "CPU cores"
        raise MimaError(f"--devices {world}: this machine has {available} {kind}")
    session = f"{socket.gethostname()}-{os.getpid()}-{time.time_ns()}"
    # the processes started here take GPUs 0..world-1; one process alone takes its launcher's choice
    return Team(0, world, session, local_rank=local_rank(environment) if world == 1 else 0,
                argv=list(argv) if argv is not None and world > 1 else None)


class StopRequests:
    """SIGTERM/SIGUSR1 while evaluating: finish the running batch, keep every finished cell, stop."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self, team: Team) -> None:
        self.team = team
        self.signal: int | None = None
        self.previous: dict[int, object] = {}

    def __enter__(self) -> StopRequests:
        for signum in self.SIGNALS:
            self.previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum, frame) -> None:
        self.signal = signum
        self.team.signal_children(signum)

    def requested(self) -> bool:
        return self.signal is not None


# ----------------------------------------------------------------------------- the work
@dataclass
class Evaluation:
    """What one evaluation computes; the same in every process."""

    runs: list[RunFolder]
    joint: RunFolder | None
    configs: list
    tasks: list[str]
    methods: list[MergeMethod]
    select_on_val: bool
    val_examples: int | None
    precision: str

    def run_id(self, run: RunFolder) -> str:
        return str(run.path.resolve())

    def manifest(self) -> dict:
        """What the cells are results of (mima.evaluation.cells: another manifest is another evaluation)."""
        def files(run: RunFolder) -> dict:
            paths = [run.config_file, run.pretrained_file, *run.final_files()]
            return {str(path.relative_to(run.path)): [path.stat().st_size, path.stat().st_mtime_ns] for path in paths}

        return {
            "runs": {self.run_id(run): files(run) for run in [*self.runs, *([self.joint] if self.joint else [])]},
            "merges": [method.name for method in self.methods],
            "select_on": "val" if self.select_on_val else "defaults",
            "val_examples": self.val_examples,
            "precision": self.precision,
        }

    def grid(self, method: MergeMethod) -> list[tuple[dict, float | None]]:
        """The method's validation grid in selection order: (structural setting, lam or None)."""
        if not (self.select_on_val and method.grid):
            return []
        if method.scaled_fn is not None:
            structural = {name: values for name, values in method.grid.items() if name != "lam"}
            settings = [dict(zip(structural, values)) for values in itertools.product(*structural.values())]
            lams = method.grid.get("lam", (method.defaults["lam"],))
            return [(setting, lam) for setting in settings for lam in lams]
        return [(dict(zip(method.grid, values)), None) for values in itertools.product(*method.grid.values())]


def full_point(method: MergeMethod, setting: Mapping, lam: float | None) -> dict:
    hparams = dict(setting) if lam is None else {**setting, "lam": lam}
    return {key: value for key, value in method.hyperparameters(hparams).items() if key != "matrix_keys"}


@dataclass(frozen=True)
class Unit:
    """One piece of work dealt to one process: everything of one (run, model)."""

    kind: str  # zero_shot, joint, fine_tuned, geometry, merge
    run: int  # index into Evaluation.runs (zero_shot: the first run's theta_0; joint: ignored)
    method: str | None = None
    cost: int = 1  # forward passes over a task's split, for dealing


def plan_units(evaluation: Evaluation) -> list[Unit]:
    count = len(evaluation.tasks)
    units = [Unit("zero_shot", 0, cost=count)]
    if evaluation.joint is not None:
        units.append(Unit("joint", 0, cost=count))
    for index, _ in enumerate(evaluation.runs):
        units += [Unit("fine_tuned", index, cost=count), Unit("geometry", index, cost=1)]
        units += [Unit("merge", index, method.name, cost=count * (len(evaluation.grid(method)) + 1))
                  for method in evaluation.methods]
    return units


def deal(units: Sequence[Unit], world: int) -> list[list[Unit]]:
    """Largest first to the least loaded process (ties: the lower rank); each process then takes its
    units in plan order, so that consecutive units share a run's loaded models."""
    order = sorted(range(len(units)), key=lambda i: (-units[i].cost, i))
    loads, dealt = [0] * world, [[] for _ in range(world)]
    for index in order:
        rank = min(range(world), key=lambda r: (loads[r], r))
        loads[rank] += units[index].cost
        dealt[rank].append(index)
    return [[units[i] for i in sorted(indices)] for indices in dealt]


class Worker:
    """Evaluates units in one process, recording each cell as it finishes."""

    def __init__(self, evaluation: Evaluation, store: CellStore, stop: StopRequests, settings: EvalSettings,
                 device: torch.device, merge_device: torch.device | None = None) -> None:
        self.evaluation, self.store, self.stop, self.settings, self.device = evaluation, store, stop, settings, device
        self.merge_device = merge_device if merge_device is not None else device  # where merges compute
        self.pool: TaskPool | None = None
        self.loaded: tuple[int, dict, list] | None = None  # (run index, theta_0, task models)

    def _pool(self) -> TaskPool:
        if self.pool is None:
            self.pool = task_pool(self.evaluation.configs[0])
            self.pool.encoder.to(self.device)
        return self.pool

    def close(self) -> None:
        """End the loader workers (the evaluators' one set, mima.evaluation.loader_pool)."""
        if self.pool is not None:
            self.pool.loaders.close()

    def _models(self, index: int) -> tuple[dict, list]:
        if self.loaded is None or self.loaded[0] != index:
            self.loaded = None  # free the previous run's models first
            run = self.evaluation.runs[index]
            self.loaded = (index, run.pretrained(), [run.final(task) for task in self.evaluation.tasks])
        return self.loaded[1], self.loaded[2]

    def _evaluate(self, run_id: str, model: str, point: str, split: str, tasks: list[str], weights) -> None:
        """Record the cells of `tasks` that are missing; `weights` is called only if one is."""
        missing = [task for task in tasks if Cell(run_id, model, point, split, task) not in self.store]
        if not missing:
            return
        pool = self._pool()
        evaluator = pool.evaluator(split, self.settings, self.evaluation.val_examples if split == "val" else None)
        evaluator.counts(weights() if callable(weights) else weights, missing,
                         on_task=lambda task, counts: self.store.record(Cell(run_id, model, point, split, task), list(counts)),
                         should_stop=self.stop.requested)

    def run(self, unit: Unit) -> None:
        evaluation = self.evaluation
        tasks = evaluation.tasks
        if unit.kind == "joint":
            joint = evaluation.joint
            self._evaluate(evaluation.run_id(joint), JOINT, NO_POINT, "test", tasks, joint.joint)
            return
        run = evaluation.runs[unit.run]
        run_id = evaluation.run_id(run)
        if unit.kind == "zero_shot":
            self._evaluate(run_id, "zero_shot", NO_POINT, "test", tasks, run.pretrained)
        elif unit.kind == "fine_tuned":
            for position, task in enumerate(tasks):
                self._evaluate(run_id, "fine_tuned", NO_POINT, "test", [task], lambda p=position: self._models(unit.run)[1][p])
        elif unit.kind == "geometry":
            cell = Cell(run_id, GEOMETRY, NO_POINT, "-", "-")
            if cell not in self.store:
                base, models = self._models(unit.run)
                cos = task_vector_cosines(base, models)
                pairs = [float(cos[i, j]) for i in range(len(tasks)) for j in range(i + 1, len(tasks))]
                self.store.record(cell, {"pairs": pairs, "mean": mean_off_diagonal(cos)})
        else:
            self._merge(unit, run_id)

    def _merge(self, unit: Unit, run_id: str) -> None:
        evaluation, tasks = self.evaluation, self.evaluation.tasks
        method = get_method(unit.method).on(self.merge_device)  # every merge below computes there
        grid = evaluation.grid(method)
        models = lambda: self._models(unit.run)  # noqa: E731 - loaded only if a cell is missing
        if not grid:
            point = point_key(full_point(method, {}, None))
            self._evaluate(run_id, method.name, point, "test", tasks,
                           lambda: method.merge(models()[1], models()[0], self.pool).state)
            return
        kept: dict[str, dict] = {}  # this session's merged weights of the best point so far
        best: tuple[float, str] | None = None
        for setting, lam, merged in self._grid_merges(method, grid, run_id, models):
            point = point_key(full_point(method, setting, lam))
            if merged is not None:
                self._evaluate(run_id, method.name, point, "val", tasks, merged)
            score = validation_score(self.store, run_id, method.name, point, tasks)
            if best is None or score > best[0]:
                best = (score, point)
                kept = {point: merged() if merged is not None else None}
        chosen = best[1]
        hparams = json.loads(chosen)
        weights = kept.get(chosen) or (lambda: self._merge_at(method, hparams, models))
        self._evaluate(run_id, method.name, chosen, "test", tasks, weights)

    def _grid_merges(self, method: MergeMethod, grid, run_id: str, models) -> Iterator:
        """(setting, lam, weights or None) in selection order; weights (a callable) only for points
        with a missing validation cell. A scaled method computes each needed setting's direction once,
        all settings in one sweep (CART: one SVD per task and matrix for every rank ratio)."""
        def done(setting, lam) -> bool:
            point = point_key(full_point(method, setting, lam))
            return all(Cell(run_id, method.name, point, "val", task) in self.store for task in self.evaluation.tasks)

        if method.scaled_fn is None:
            for setting, lam in grid:
                yield setting, lam, None if done(setting, lam) else _cached(
                    lambda s=setting: method.merge(models()[1], models()[0], self.pool, **s).state)
            return
        needed = [setting for setting, _ in _unique_settings(grid) if not all(done(s, lam) for s, lam in grid if s == setting)]
        directions: dict[str, tuple[dict, dict]] = {}
        if needed:
            names = list(needed[0])
            settings = {name: tuple(dict.fromkeys(s[name] for s in needed)) for name in names}
            for setting, anchor, direction in method.sweep(models()[1], models()[0], settings):
                if setting in needed:
                    directions[point_key(setting)] = (anchor, direction)
        for setting, lam in grid:
            pair = directions.get(point_key(setting))
            yield setting, lam, None if pair is None or done(setting, lam) else _cached(
                lambda a=pair[0], d=pair[1], value=lam: combine(a, d, value))

    def _merge_at(self, method: MergeMethod, hparams: dict, models) -> dict:
        """The merged weights at a chosen point, computed as the grid computed them."""
        if method.scaled_fn is None:
            grid_names = set(method.grid)
            return method.merge(models()[1], models()[0], self.pool, **{k: v for k, v in hparams.items() if k in grid_names}).state
        structural = {name: (hparams[name],) for name in method.grid if name != "lam"}
        for _, anchor, direction in method.sweep(models()[1], models()[0], structural):
            return combine(anchor, direction, hparams["lam"])
        raise MimaError(f"{method.name}: no merge at {hparams}")


def _unique_settings(grid) -> list[tuple[dict, None]]:
    seen, unique = set(), []
    for setting, _ in grid:
        if point_key(setting) not in seen:
            seen.add(point_key(setting))
            unique.append((setting, None))
    return unique


def _cached(compute):
    """A callable computing its value once (the weights of one grid point)."""
    value = []

    def get():
        if not value:
            value.append(compute())
        return value[0]
    return get


def validation_score(store: CellStore, run_id: str, model: str, point: str, tasks: Sequence[str]) -> float:
    """Mean validation accuracy over the tasks (the selection's score), from the counts."""
    scores = [accuracy_of(*store.get(Cell(run_id, model, point, "val", task))) for task in tasks]
    return sum(scores) / len(scores)


# ----------------------------------------------------------------------------- the results
def build_results(evaluation: Evaluation, store: CellStore) -> tuple[list[ModelResult], dict[int, list[float]]]:
    """The results rows (zero_shot, fine_tuned, [joint], one per merge; per run) from the cells."""
    tasks = evaluation.tasks

    def accuracies(run_id: str, model: str, point: str) -> dict[str, float]:
        return {task: accuracy_of(*store.get(Cell(run_id, model, point, "test", task))) for task in tasks}

    several_seeds = len({(int(c.model.iterations), c.seed) for c in evaluation.configs}) > \
        len({int(c.model.iterations) for c in evaluation.configs})
    zero_shot = accuracies(evaluation.run_id(evaluation.runs[0]), "zero_shot", NO_POINT)
    joint = accuracies(evaluation.run_id(evaluation.joint), JOINT, NO_POINT) if evaluation.joint else None
    results, pairwise = [], {}
    for run, config in zip(evaluation.runs, evaluation.configs):
        run_id, n, seed = evaluation.run_id(run), int(config.model.iterations), config.seed
        geometry = store.get(Cell(run_id, GEOMETRY, NO_POINT, "-", "-"))
        own = [ModelResult(n, "zero_shot", dict(zero_shot), seed=seed),
               ModelResult(n, "fine_tuned", accuracies(run_id, "fine_tuned", NO_POINT), mean_cos_tau=geometry["mean"], seed=seed)]
        if joint is not None:  # one model for every run, like zero_shot; placed after fine_tuned
            own.append(ModelResult(n, JOINT, dict(joint), seed=seed))
        for method in evaluation.methods:
            grid = evaluation.grid(method)
            if not grid:
                hparams = full_point(method, {}, None)
                own.append(ModelResult(n, method.name, accuracies(run_id, method.name, point_key(hparams)),
                                       hparams=hparams, seed=seed))
                continue
            best = None
            for setting, lam in grid:
                hparams = full_point(method, setting, lam)
                score = validation_score(store, run_id, method.name, point_key(hparams), tasks)
                if best is None or score > best[0]:
                    best = (score, hparams)
            own.append(ModelResult(n, method.name, accuracies(run_id, method.name, point_key(best[1])), hparams=best[1],
                                   validation_accuracy=best[0], seed=seed))
        label = f"N={n}, seed {seed}" if several_seeds else f"N={n}"
        summary = ", ".join(f"{r.model} {100 * r.mean:.1f}%" for r in own if r.model != "zero_shot")
        print(f"{label}: cos(tau) {geometry['mean']:.3f}; {summary}")
        results += own
        pairwise.setdefault(n, []).extend(geometry["pairs"])
    return results, pairwise


# ----------------------------------------------------------------------------- the command
def evaluate_runs(
    run_dirs: Sequence[Path],
    out_dir: Path,
    merges: Sequence[str],
    select_on_val: bool = True,
    overwrite: bool = False,
    title: str = "mima evaluate",
    extra: dict | None = None,
    started: float | None = None,
    precision: str | None = None,
    val_examples: int | None = None,
    team: Team | None = None,
    skip_unfinished: bool = False,
    num_workers: int | None = None,
    merge_device: str | None = None,
) -> list[ModelResult] | None:
    """Evaluate finished runs of the same tasks and model into `out_dir` (results.json/.csv/.md,
    selection.json, plots; the cells in cells/). Returns the results in process 0, None elsewhere.

    Runs at the same N must differ only in the seed (seed_everything, and data.seed, which the
    SLURM seed sweep sets to the same value); the table then adds the mean and sample standard
    deviation over the seeds (format: mima.evaluation.results_files). `num_workers` loader workers per
    process (None: the first run's data.num_workers). `merge_device` (`--merge-device`): where the
    merges' arithmetic runs (None or "auto": each process's evaluation device)."""
    started = started or time.time()
    team = team or Team(session=f"{socket.gethostname()}-{os.getpid()}-{time.time_ns()}")
    if val_examples is not None and val_examples <= 0:
        raise MimaError(f"--val-examples {val_examples}: expected a positive number of examples per task")
    if num_workers is not None and num_workers < 0:
        raise MimaError(f"--num-workers {num_workers}: expected 0 or more loader worker processes")
    device = claim_device(team.local_rank)  # first: nothing below may open a CUDA context on another GPU
    merges_on = device if merge_device in (None, "auto") else resolve_merge_device(merge_device, "--merge-device")
    evaluation = describe_evaluation(run_dirs, merges, select_on_val, val_examples,
                                     precision or default_precision(device), skip_unfinished)
    workers = int(evaluation.configs[0].data.num_workers) if num_workers is None else num_workers
    settings = EvalSettings(precision=evaluation.precision, num_workers=workers, pin_memory=device.type == "cuda")
    # one evaluation per folder at a time (process 0 holds the lock; the others are its own)
    with RunLock(out_dir, "mima evaluate") if team.rank == 0 else contextlib.nullcontext():
        return _evaluate(evaluation, Path(out_dir), merges, select_on_val, overwrite, title, extra, started,
                         val_examples, team, device, settings, merges_on)


def _evaluate(evaluation: Evaluation, out_dir: Path, merges: Sequence[str], select_on_val: bool, overwrite: bool,
              title: str, extra: dict | None, started: float, val_examples: int | None,
              team: Team, device: torch.device, settings: EvalSettings,
              merge_device: torch.device | None = None) -> list[ModelResult] | None:
    store = CellStore(out_dir, team.session, team.rank)
    sweep = SweepFolder(out_dir)
    if team.rank == 0:
        if store.read_manifest() is None and not overwrite:
            sweep.prepare(False)  # results of an evaluation without cells: refused as before
        store.prepare({**evaluation.manifest(), "session": team.session}, overwrite)
        team.start_children()
    else:
        _wait_for_session(store, team.session)
    done = store.load()
    units = plan_units(evaluation)
    mine = deal(units, team.world)[team.rank]
    if team.rank == 0:
        print(f"{title}: {len(evaluation.tasks)} tasks ({', '.join(evaluation.tasks)}); merges: {', '.join(merges)}; "
              f"{evaluation.precision}, {team.world} process(es)")
        if done:
            print(f"{title}: {done} cells already done in {store.cells_dir}; evaluating the rest")
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True  # evaluation tolerates TF32's 10-bit mantissa matmuls
        torch.backends.cudnn.allow_tf32 = True
    with StopRequests(team) as stop:
        try:
            worker = Worker(evaluation, store, stop, settings, device, merge_device or device)
            try:
                for unit in mine:
                    if stop.requested():
                        raise EvaluationStopped()
                    worker.run(unit)
            finally:
                worker.close()  # its loader workers end before this process waits for the others
            _finish_rank(store, team, stop)
        except EvaluationStopped:
            _stopped(store, team, stop.signal, title)
    if team.rank != 0:
        return None
    store.load()
    results, pairwise = build_results(evaluation, store)
    config = evaluation.configs[0]
    info = {
        "heads": config.model.heads,
        "select_on": "val" if select_on_val else "defaults",
        "runs": [str(r.path) for r in evaluation.runs],
        # the schedule (lr_schedule, schedule_scope, warm-up), precision and clipping that produced the table
        "training": training_setup((c.model, c.other.get("trainer") or {}) for c in evaluation.configs),
        "precision": evaluation.precision,
    }
    if val_examples is not None:
        info["val_examples"] = val_examples
    info.update(steps=config.model.steps, **(extra or {}))
    seconds = round(time.time() - started, 1)
    info["seconds_total"] = seconds
    # the whole set is written aside and moved into place at the end: a failure leaves the earlier set
    staging, created = stage_folder(out_dir)
    try:
        staged = SweepFolder(staging)
        write_results(staged, results, extra=info, title=title)
        plot_accuracy_vs_n(results, staged.plot_file(SweepFolder.ACCURACY_PLOT))
        phases: dict[int, list[dict]] = {}
        for run, run_config in zip(evaluation.runs, evaluation.configs):
            phases.setdefault(int(run_config.model.iterations), run.phase_records())  # the first run of each N
        plot_cosine_vs_n(pairwise, phases, staged.plot_file(SweepFolder.COSINE_PLOT))
        publish_folder(staging, out_dir, overwrite=True)
    except BaseException as exc:
        remove_folders(created)
        if isinstance(exc, Exception):  # a refused write names the output folder, not the staging one
            raise write_error(exc, out_dir, staging) from None
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    print()
    print(markdown_text(results, title=title))
    print(f"Wrote {out_dir}/results.{{json,csv,md}}, selection.json and plots in {seconds:.0f} s.")
    return results


def _wait_for_session(store: CellStore, session: str, timeout_s: float = 600.0) -> None:
    """A process other than 0 starts once process 0 has prepared the folder for this session."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        manifest = store.read_manifest()
        if manifest and manifest.get("session") == session:
            return
        time.sleep(0.5)
    raise MimaError(f"{store.manifest_file}: process 0 did not prepare the evaluation folder within {timeout_s:.0f} s")


def _marker(store: CellStore, team: Team, rank: int, state: str) -> Path:
    return store.cells_dir / f"{team.session}-p{rank}.{state}"


def _finish_rank(store: CellStore, team: Team, stop: StopRequests) -> None:
    """Say this process is done; process 0 waits until every process is (or one stopped)."""
    _marker(store, team, team.rank, "done").touch()
    if team.rank != 0:
        return
    while True:
        states = []
        for rank in range(1, team.world):
            states.append("done" if _marker(store, team, rank, "done").exists()
                          else "stopped" if _marker(store, team, rank, "stopped").exists() else None)
        if all(state == "done" for state in states):
            break
        if "stopped" in states or stop.requested():
            raise EvaluationStopped()
        failed = [child for child in team.children if child.poll() not in (None, 0)]
        if failed:
            raise MimaError(f"mima evaluate: process {team.children.index(failed[0]) + 1} failed (exit code "
                            f"{failed[0].returncode}); its finished cells are kept, run the same command again")
        time.sleep(0.2)
    for child in team.children:
        child.wait()


def _stopped(store: CellStore, team: Team, signum: int | None, title: str) -> None:
    _marker(store, team, team.rank, "stopped").touch()
    for child in team.children:
        if child.poll() is None:
            child.send_signal(signum or signal.SIGTERM)
        child.wait()
    if team.rank == 0:
        kept = store.load()
        print(f"{title}: stopped by signal {signum}; {kept} finished cells kept in {store.cells_dir}; "
              "run the same command to go on", flush=True)  # before a requeue ends the job step
        if signum == signal.SIGUSR1:
            from mima.training.trainer import requeue_slurm_job  # only under SLURM, and only here

            requeue_slurm_job("mima evaluate")
    raise SystemExit(128 + (signum or signal.SIGTERM))


def describe_evaluation(run_dirs: Sequence[Path], merges: Sequence[str], select_on_val: bool,
                        val_examples: int | None, precision: str, skip_unfinished: bool = False) -> Evaluation:
    """The runs and merges checked (one line for each mistake), before anything is written. With
    `skip_unfinished`, runs that are missing or have not finished (a cancelled or failed job of a
    sweep) are left out, named in one line, and the others evaluated."""
    methods = data_free_per_model(merges)
    every_run, missing = [], []
    for run_dir in run_dirs:
        try:
            every_run.append(finished_run(Path(run_dir)))
        except MimaError as error:
            if not skip_unfinished:
                raise
            missing.append(str(error).split(" (")[0])
    if missing:
        print(f"mima evaluate: left out {len(missing)} run(s) that have not finished: {'; '.join(missing)}")
        if not every_run:
            raise MimaError("no run given has finished; nothing to evaluate")
    joint_runs = [run for run in every_run if run.is_joint()]
    runs = [run for run in every_run if not run.is_joint()]
    if len(joint_runs) > 1 or not runs:
        raise MimaError("mima evaluate takes MIMA runs (one per N and seed) and at most one joint run (model.mode: joint)")
    configs = [load_run_config(run) for run in runs]
    tasks = runs[0].task_order()
    for run in runs[1:] + joint_runs:
        if run.task_order() != tasks:
            raise MimaError(f"{run.path}: tasks {run.task_order()} differ from {runs[0].path}'s {tasks}")
    check_one_run_per_seed(runs, configs)
    EvalSettings(precision=precision)  # an unknown precision is one line here
    return Evaluation(runs, joint_runs[0] if joint_runs else None, configs, tasks, methods, select_on_val,
                      val_examples, precision)


def check_one_run_per_seed(runs: Sequence[RunFolder], configs: Sequence) -> None:
    """Runs at one N must have different seeds (their rows would be indistinguishable) and must not
    differ in anything else (their mean over seeds would mix two settings)."""
    seen: dict[tuple[int, int], RunFolder] = {}
    first_at_n: dict[int, tuple[RunFolder, object]] = {}
    for run, config in zip(runs, configs):
        n = int(config.model.iterations)
        if (n, config.seed) in seen:
            raise MimaError(f"{run.path} and {seen[(n, config.seed)].path}: both N={n} with seed_everything "
                            f"{config.seed}; give one run per N and seed")
        seen[(n, config.seed)] = run
        if n not in first_at_n:
            first_at_n[n] = (run, config)
            continue
        other_run, other_config = first_at_n[n]
        difference = _config_difference(other_config, config)
        if difference:
            raise MimaError(f"{run.path} and {other_run.path}: both N={n} but they differ in {difference}, not only "
                            "in the seed (a mean over seeds needs runs of one config)")


def _config_difference(first, second) -> str | None:
    """The first model or data option in which two run configs differ, data.seed aside (a seed
    sweep varies it with seed_everything), or None."""
    for section, left, right in (("model", first.model_args(), second.model_args()),
                                 ("data", first.data_args(), second.data_args())):
        for key in sorted(set(left) | set(right)):
            if (section, key) != ("data", "seed") and left.get(key) != right.get(key):
                return f"{section}.{key} ({left.get(key)!r} vs {right.get(key)!r})"
    return None


def finished_run(path: Path) -> RunFolder:
    """`path` as the folder of a finished `mima fit` run, or a one-line error saying what it is instead."""
    if not path.exists():
        raise MimaError(f"{path}: no such run folder (give folders written by `mima fit --out`)")
    if not path.is_dir():
        raise MimaError(f"{path}: a file, not a run folder (give folders written by `mima fit --out`)")
    run = RunFolder(path)
    if not run.is_finished():
        raise MimaError(f"{path}: not a finished run (no final/ task models; resume it with `mima fit ... --ckpt_path last`)")
    run.iterations()  # reads the final models' metadata: a damaged file is named before anything is written
    return run


def data_free_per_model(merges: Sequence[str]) -> list[MergeMethod]:
    methods = [get_method(name) for name in merges]
    per_task = [method.name for method in methods if method.per_task]
    if per_task:
        raise MimaError(f"--merges: '{per_task[0]}' keeps one model per task; use `mima merge` for it")
    needs_data = [method.name for method in methods if method.needs_data]
    if needs_data:  # they train on each N's validation data for minutes; the table compares data-free merges
        raise MimaError(f"--merges: '{needs_data[0]}' learns from task data; the table takes data-free merges, "
                        f"use `mima merge --method {needs_data[0]}` for it")
    return methods
