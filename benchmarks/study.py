"""The study of issue 38 (item 5): MIMA beside the federated phase-end operators, the joint model and
theta_0, over N, T, per-task budgets and seeds, each run with its measured cost beside `mima plan`'s.

One command, resumable (docs/results.md, "The study (issue 38)"):

    python benchmarks/study.py --out runs/study                   # the full grid
    python benchmarks/study.py --grid reduced --out runs/study    # 45 fits, ~4 hours on 2 cores
    python benchmarks/study.py --dry-run                          # list the runs, train nothing
    python benchmarks/study.py --grid reduced --only T12/equal/uniform   # a second process: one cell
    python benchmarks/study.py --grid reduced --tables            # the tables of the cells done so far
    python benchmarks/study.py --grid gap --out runs/study-gap --reuse runs/study   # issue 50: the joint gap

The gap grid (issue 50) asks how many syncs, and which operator at the sync, bring one merged model
level with the joint model at T = 8 and 12: N from 8 to S = 200 for the uniform sync and for outer
Nesterov (its outer lr and momentum chosen first on the validation splits, OuterChoice), ATM at two N,
four final merges each. Runs that an earlier study (--reuse) trained with the same settings are
copied from it instead of trained again (their cost.json says `reused_from`). Its report is
OUT/gap.md, gap.json and joint_gap_vs_syncs.png (benchmarks/study_gap.py).

The grid is a list of cells (T, budget mode, phase-end operator); each cell is one sweep
(mima.commands.sweep.run_sweep over N and the seeds) in OUT/T<T>/<budget>/<operator>/, whose runs
are OUT/T<T>/<budget>/<operator>/runs/N<n>-seed<s>/. Every run is fitted here first, one at a time,
with its CPU seconds measured, and its cost written beside it (cost.json); a run that has a cost.json
is finished and skipped, so the same command resumes the study run by run, and a finished study run
again trains nothing. The sweep then only evaluates (its evaluation cells resume too). At the end,
OUT/study.md and OUT/study.json: mean +- std over the seeds of each (cell, N, model) with the 95 %
intervals `mima evaluate` writes; OUT/claims.md and claims.json: recipes paired across cells on the
same test images (benchmarks/study_claims.py), and the table of MIMA's gain and the joint gap by T;
OUT/costs.md: each run's measured cost beside the plan's.

What "cost" holds (cost.json):
  cpu_s            user + system CPU seconds of the fit: this process's threads
                   (time.process_time) plus any child processes that ended during it (loader
                   workers; resource.getrusage RUSAGE_CHILDREN); measured
  wall_s           wall-clock seconds of the fit; measured
  sync_bytes       bytes sent plus received at the syncs by the run's processes: 0 by construction,
                   not a measurement: the study's runs are single-process (W = 1), where the phase
                   average is taken in memory and nothing crosses a process boundary
  plan_sync_bytes  `mima plan`'s prediction for the run as trained (W = 1): 0
  plan_sync_bytes_federated  `mima plan`'s prediction at W = T (one process per task, the
                   federated view: each process sends its task's state and receives the others'
                   at each of the N - 1 syncs), summed over the syncs, per process; computed, not
                   measured
  plan_cpu_s       `mima plan` has no CPU time model (its timing is a GPU estimate): null
A cell's evaluation (every final merge of every run, hyperparameters chosen on validation) is timed
apart, once, in OUT/T<T>/<budget>/<operator>/evaluation_cost.json (CPU and wall seconds).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import resource
import shutil
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from offline_suite import suite_config  # noqa: E402
from study_claims import Claim, Side, claims_markdown, diverged_sides, evaluate_claim, mean_std  # noqa: E402
from study_gap import write_gap_report  # noqa: E402

from mima.commands.fit.run import run_fit  # noqa: E402
from mima.commands.sweep import run_settings, run_sweep  # noqa: E402
from mima.config.run_config import load_run_config  # noqa: E402
from mima.core.errors import MimaError, RunDiverged  # noqa: E402
from mima.core.bounded_json import read_json  # noqa: E402
from mima.core.names import JOINT  # noqa: E402
from mima.core.run_folder import SweepFolder  # noqa: E402

COST_FILE = "cost.json"  # beside a run's config.yaml: the run is finished and measured
# When a study run saves its state: at the first sync after 10 minutes, not at every task segment end
# (mima's CPU default): at N = 200 and T = 8 a run has 1600 segment ends, each a 27 MB state (about
# 40 GB written per run). The weights do not depend on it; a stopped run loses at most 10 minutes.
CHECKPOINT_EVERY = "10min"
EVALUATION_COST_FILE = "evaluation_cost.json"  # in a cell's folder: its first evaluation (every merge, every run)

# The phase-end operators: the model settings each sets (mima.config.model.ModelSettings). ATM is
# task arithmetic at the paper's lam 0.3; outer_nesterov takes DiLoCo's defaults (outer lr 0.7,
# momentum 0.9); FedProx adds mu/2 ||theta - theta_s||^2 to each task's loss at a mu from the middle
# of FedProx's grid {0.001, 0.01, 0.1, 1}, with the uniform average at the syncs.
OPERATORS: dict[str, dict] = {
    "uniform": {"sync_merge": "uniform"},
    "atm": {"sync_merge": "task_arithmetic", "sync_merge_args": {"lam": 0.3}},
    "ties": {"sync_merge": "ties"},
    "outer_nesterov": {"sync_merge": "outer_nesterov"},
    "fedprox": {"sync_merge": "uniform", "proximal_mu": 0.01},
}
# The operators whose run at N = 1 is MIMA's own (they act only at a sync, and N = 1 has none): their
# N = 1 is not trained again but shared with uniform's. FedProx pulls towards theta_0 even at N = 1.
ACTS_ONLY_AT_SYNCS = frozenset({"atm", "ties", "outer_nesterov"})
BUDGET_MODES = ("equal", "proportional")


@dataclass(frozen=True)
class Cell:
    """One sweep of the study: T tasks of the offline family, a budget mode and a phase-end operator."""

    tasks: int
    budget: str  # "equal" (S per task) or "proportional" (S_t by training-set size, the same total)
    operator: str
    iterations: tuple[int, ...]
    merges: tuple[str, ...]  # the final merges
    joint: bool  # also the joint baseline (equal budgets only)

    def folder(self, out: Path) -> Path:
        return out / f"T{self.tasks}" / self.budget / self.operator


@dataclass(frozen=True)
class OuterChoice:
    """Outer Nesterov's outer lr and momentum, chosen once on the validation splits and then fixed for
    every outer_nesterov cell of the grid: each candidate is fitted at one T, N and seed, and the
    candidate whose uniform merge scores best on the validation splits is taken (the first on ties,
    mima.merging.selection.BestPoint, as every selection of mima)."""

    tasks: int
    iterations: int
    seed: int
    candidates: tuple[tuple[float, float], ...]  # (outer_lr, outer_momentum)

    def folder(self, out: Path) -> Path:
        return out / f"T{self.tasks}" / "equal" / "outer_nesterov-choice"

    def run_path(self, out: Path, lr: float, momentum: float) -> Path:
        return self.folder(out) / "runs" / f"lr{lr:g}-momentum{momentum:g}"


@dataclass(frozen=True)
class Grid:
    name: str
    seeds: tuple[int, ...]
    cells: tuple[Cell, ...]
    steps: int | None = None  # S per task; None: the config's (configs/offline.yaml: 200)
    notes: tuple[str, ...] = field(default=())
    family: tuple[str, ...] | None = None  # the tasks T counts from; None: the offline family (FAMILY)
    select_on_val: bool = True  # merges' hyperparameters chosen on the validation split
    outer_choice: OuterChoice | None = None  # outer Nesterov's lr and momentum chosen on validation first
    joint_gap: bool = False  # also the joint-gap report (OUT/gap.md, benchmarks/study_gap.py)


ALL_MERGES = ("uniform", "task_arithmetic", "ties", "tsv", "adamerging")
# Merges that learn from task data: `mima evaluate` (the sweep's table) takes data-free merges only, so
# these run per run through `mima merge --models RUN` (its OUTPUT.results.json: test accuracy per task)
DATA_MERGES = frozenset({"adamerging"})
DATA_MERGE_FOLDER = "data_merges"  # in a cell's folder: <run>-<method>.safetensors and its results
FEW_MERGES = ("uniform", "task_arithmetic")  # at T = 8 and 12 in the full grid: the compute stays inside the machine
# The reduced grid's cheaper final merges. Choosing a merge's hyperparameters on validation is most of
# a cell's evaluation (the T = 4 uniform cell: 1752 of its 1862 cells, 27 lam / k candidates per task
# and run), so the reduced grid keeps every merge at T = 4 for MIMA's own operator only.
OPERATOR_MERGES = ("uniform", "task_arithmetic")  # the other phase-end operators at T = 4
GAIN_MERGES = ("uniform",)  # T = 8 and 12: MIMA's gain (the uniform merge at N = 8 minus N = 1), the joint gap


def full_grid(seeds: Sequence[int] = (0, 1, 2)) -> Grid:
    """Issue 38's grid: at T = 4 every operator x both budget modes x N in 1 2 4 8 x every final merge;
    at T = 8 and 12 MIMA (uniform) and the joint model, equal budgets, two final merges."""
    iterations = (1, 2, 4, 8)
    cells = [Cell(4, budget, operator, iterations, ALL_MERGES, joint=budget == "equal" and operator == "uniform")
             for budget in BUDGET_MODES for operator in OPERATORS]
    cells += [Cell(t, "equal", "uniform", iterations, FEW_MERGES, joint=True) for t in (8, 12)]
    return Grid("full", tuple(seeds), tuple(cells))


def reduced_grid(seeds: Sequence[int] = (0, 1, 2)) -> Grid:
    """Equal budgets at S = 200, N in 1 8, 3 seeds, in the order its findings are needed: MIMA at T = 4
    with every final merge and the joint model; ATM at T = 4 (the README's ATM-above-joint claim); MIMA
    at T = 8 and 12 with the uniform merge and the joint model (the gain table); then the other
    operators at T = 4; last MIMA at T = 4 with budgets proportional to the training sets. The cells
    other than MIMA's first take the uniform and task arithmetic merges. 45 fits."""
    iterations = (1, 8)
    cells = [Cell(4, "equal", "uniform", iterations, ALL_MERGES, joint=True),
             Cell(4, "equal", "atm", iterations, OPERATOR_MERGES, joint=False)]
    cells += [Cell(t, "equal", "uniform", iterations, GAIN_MERGES, joint=True) for t in (8, 12)]
    cells += [Cell(4, "equal", operator, iterations, OPERATOR_MERGES, joint=False)
              for operator in ("fedprox", "ties", "outer_nesterov")]
    cells.append(Cell(4, "proportional", "uniform", iterations, OPERATOR_MERGES, joint=False))
    return Grid("reduced", tuple(seeds), tuple(cells),
                notes=("N = 2 and 4 left out; proportional budgets for MIMA only; fewer final merges beside MIMA at T = 4",))


# Issue 50's N: S = 200 must be a multiple of N (every phase K = S / N whole steps), so the doubling
# 8, 16, 32, 64 the issue names becomes the divisors 8, 20, 40, 100 (about as evenly spaced on a log
# scale), then N = S (an average after every step of each task).
GAP_ITERATIONS = (8, 20, 40, 100, 200)
GAP_ATM_ITERATIONS = (8, 40)
GAP_MERGES = ("uniform", "task_arithmetic", "ties", "tsv")
# DiLoCo's (0.7, 0.9) and its neighbours; chosen at T = 8, N = 40 (the middle of the N), seed 0
OUTER_CANDIDATES = ((0.5, 0.5), (0.5, 0.9), (0.7, 0.5), (0.7, 0.9), (1.0, 0.5), (1.0, 0.9))


def gap_grid(seeds: Sequence[int] = (0, 1, 2)) -> Grid:
    """Issue 50: at T = 8, then 12, equal budgets S = 200: the uniform sync (MIMA) with the joint model,
    outer Nesterov at the same N, ATM at N = 8 and 40; each run merged by uniform, task arithmetic,
    TIES and TSV. 78 runs and the 6 of the outer choice, one of which is also the outer cell's T = 8,
    N = 40, seed 0 run (copied, 83 fits); the earlier study's N = 8 and joint runs reused where present."""
    cells = []
    for tasks in (8, 12):
        cells += [Cell(tasks, "equal", "uniform", GAP_ITERATIONS, GAP_MERGES, joint=True),
                  Cell(tasks, "equal", "outer_nesterov", GAP_ITERATIONS, GAP_MERGES, joint=False),
                  Cell(tasks, "equal", "atm", GAP_ATM_ITERATIONS, GAP_MERGES, joint=False)]
    choice = OuterChoice(8, 40, seeds[0], OUTER_CANDIDATES)
    return Grid("gap", tuple(seeds), tuple(cells), outer_choice=choice, joint_gap=True,
                notes=("N = 16, 32, 64 do not divide S = 200: N in 8 20 40 100 200",))


GRIDS = {"full": full_grid, "reduced": reduced_grid, "gap": gap_grid}
DEFAULT_OUT = {"full": Path("runs/study"), "reduced": Path("runs/study"), "gap": Path("runs/study-gap")}


# ------------------------------------------------------------------------------ budgets
def training_set_sizes(tasks: Sequence[str]) -> dict[str, int]:
    """Each offline-family task's training-set size (the official train split less the validation
    split mima.data.offline.suite_split_indices takes; a rotation has its source's size)."""
    from mima.data import offline

    source_of = {offline.rotated_name(source, degrees): source for source in offline.SOURCES for degrees in offline.ROTATIONS}
    sizes = {}
    for task in tasks:
        if task not in source_of:
            raise MimaError(f"study: task {task} is not in the offline task family (mima.data.offline.FAMILY)")
        official = len(offline.SOURCES[source_of[task]][2](None)["train"][1])
        sizes[task] = len(offline.suite_split_indices(official, 1, split_seed=0)["train"])
    return sizes


def proportional_budgets(steps: int, sizes: Mapping[str, int], multiple: int) -> dict[str, int]:
    """S_t proportional to each task's training-set size, the total as close to T x `steps` as
    whole multiples of `multiple` (every N of the cell divides S_t) allow, each at least `multiple`."""
    total, images = steps * len(sizes), sum(sizes.values())
    return {task: max(multiple, multiple * round(total * size / images / multiple)) for task, size in sizes.items()}


def cell_config(base: Mapping, cell: Cell, steps: int | None, family: Sequence[str] | None = None,
                operator_args: Mapping | None = None) -> dict:
    """The `mima fit` config of a cell: the family's first T tasks, its operator, its budgets;
    `operator_args` replace the operator's own sync_merge_args (outer Nesterov's chosen ones)."""
    from mima.data.offline import family_tasks

    config = copy.deepcopy(dict(base))
    if family is None:
        tasks = family_tasks(cell.tasks)
    elif cell.tasks <= len(family):
        tasks = list(family[:cell.tasks])
    else:
        raise MimaError(f"study: T = {cell.tasks}, but the task family has only {len(family)} tasks")
    config["data"] = {**config["data"], "tasks": tasks}
    s = int(steps if steps is not None else config["model"]["steps"])
    model = {**config["model"], "sync_merge_args": None, "proximal_mu": 0.0, **OPERATORS[cell.operator], "steps": s}
    if operator_args is not None:
        model["sync_merge_args"] = dict(operator_args)
    if cell.budget == "proportional":
        model["steps"] = proportional_budgets(s, training_set_sizes(config["data"]["tasks"]), math.lcm(*cell.iterations))
    elif cell.budget != "equal":
        raise MimaError(f"study: budget mode {cell.budget}; expected one of {', '.join(BUDGET_MODES)}")
    config["model"] = model
    return config


def cell_iterations(cell: Cell) -> list[int]:
    """The N this cell trains: an operator acting only at syncs shares uniform's N = 1."""
    return [n for n in cell.iterations if not (n == 1 and cell.operator in ACTS_ONLY_AT_SYNCS)]


# ------------------------------------------------------------------------------ one run, measured
def fit_run_config(config: Mapping, model_settings: Mapping, seed: int | None, run_path: Path, progress: bool) -> dict:
    """The config run_sweep gives `run_fit` for one run (mima.commands.sweep.run_sweep's loop;
    run_sweep refuses a run whose saved config differs, so a mismatch here cannot pass unseen)."""
    run_config = copy.deepcopy(dict(config))
    run_config["model"] = {**run_config.get("model", {}), **model_settings}
    if seed is not None:
        run_config["seed_everything"] = seed
        run_config["data"] = {**(run_config.get("data") or {}), "seed": seed}
    run_config["trainer"] = {**(run_config.get("trainer") or {}), "enable_progress_bar": progress,
                             "enable_model_summary": False}
    run_config.update(out=str(run_path), overwrite=False, checkpoint_every=CHECKPOINT_EVERY)
    return run_config


def planned_syncs(run_config: Mapping, world_size: int) -> tuple[int, int]:
    """`mima plan`'s syncs of the run and its bytes sent and received per process over them at `world_size`."""
    from mima.training.plan_from_config import plan_for_config

    plain = {key: value for key, value in run_config.items() if key not in ("out", "overwrite", "ckpt_path")}
    plan, _, _ = plan_for_config(load_run_config(plain), world_size=world_size)
    return plan.syncs, plan.sync_bytes_per_process * plan.syncs


def planned_sync_bytes(run_config: Mapping, world_size: int) -> int:
    """`mima plan`'s bytes sent and received per process over the run's syncs at `world_size`."""
    return planned_syncs(run_config, world_size)[1]


# Options that cannot change a run's weights: a reused run may differ in them
DISPLAY_OPTIONS = frozenset({"out", "overwrite", "ckpt_path", "checkpoint_every", "keep_checkpoints",
                             "trainer.enable_progress_bar", "trainer.enable_model_summary", "trainer.logger"})


def same_training(earlier: Path, run_config: Mapping) -> bool:
    """The earlier run folder's config trains what `run_config` would: the same model and data
    settings (defaults filled in) and seed, and every other option `run_config` sets (the trainer's,
    threads_per_process, ...) the same in the saved config.yaml, display options and the folder aside."""
    from mima.config.config_changes import flatten
    from mima.core.run_folder import RunFolder

    try:
        saved = load_run_config(earlier)
        stored = flatten(RunFolder(earlier).config_dict())
    except MimaError:
        return False
    plain = {key: value for key, value in run_config.items() if key not in ("out", "overwrite", "ckpt_path")}
    wanted = load_run_config(plain)
    if (saved.model_args(), saved.data_args(), saved.seed) != (wanted.model_args(), wanted.data_args(), wanted.seed):
        return False
    others = {key: value for key, value in flatten({k: v for k, v in plain.items() if k not in ("model", "data")}).items()
              if key not in DISPLAY_OPTIONS and key != "seed_everything"}
    return all(stored.get(key) == value for key, value in others.items())


def reuse_earlier_run(sources: Sequence[Path], run_path: Path, run_config: Mapping) -> bool:
    """Copy into `run_path` the first finished run of `sources` that trained exactly what this one
    would (an earlier study's run at the same place, e.g. runs/study's T8/equal/uniform/runs/N8-seed0,
    or outer Nesterov's chosen candidate); its cost.json then records where it came from. False
    (nothing done) where none did: the run is trained here."""
    if run_path.exists():
        return False
    for source in sources:
        if not (source / COST_FILE).is_file():
            continue
        if not same_training(source, run_config):
            print(f"study: not reusing {source}: it was trained with other settings than {run_path} needs")
            continue
        staging = run_path.with_name(f".{run_path.name}.copying")  # a copy cut short is never taken for a run
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(source, staging, symlinks=True)
        cost = read_json(staging / COST_FILE)
        (staging / COST_FILE).write_text(json.dumps({**cost, "reused_from": str(source)}, indent=2) + "\n")
        staging.rename(run_path)
        print(f"study: reusing {source} (trained with the same settings)")
        return True
    return False


PARTIAL_COST_FILE = "cost.partial.json"  # the CPU and wall seconds of a run's earlier, stopped attempts


def fit_measured(run_config: dict, tasks: int, joint: bool, grid: str = "") -> dict:
    """Fit one run and return its cost record (the module docstring says what each value is). A run
    stopped by a signal adds its attempt's seconds to cost.partial.json, which the attempt that
    finishes adds in; `cpu_complete` is false where an earlier attempt ended without saying (killed),
    so its seconds are missing."""
    run_path = Path(run_config["out"])
    resumed = (run_path / "config.yaml").is_file()
    partial_file = run_path / PARTIAL_COST_FILE
    earlier = read_json(partial_file) if partial_file.is_file() else {"cpu_s": 0.0, "wall_s": 0.0, "attempts": 0}
    if resumed:
        run_config = {**run_config, "ckpt_path": "last"}
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu, wall = time.process_time(), time.perf_counter()
    diverged = None
    try:
        result = run_fit(run_config)
    except RunDiverged as exc:  # a result too: recorded in cost.json, the run left out of the tables
        result, diverged = None, exc.report
        print(f"study: {run_config['out']} diverged ({exc.report}); recorded, the study goes on")
    wall = time.perf_counter() - wall
    cpu = time.process_time() - cpu
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu += (after.ru_utime - children.ru_utime) + (after.ru_stime - children.ru_stime)
    cpu, wall = cpu + earlier["cpu_s"], wall + earlier["wall_s"]
    if result is not None and result.preempted_by is not None:
        partial_file.write_text(json.dumps({"cpu_s": cpu, "wall_s": wall, "attempts": earlier["attempts"] + 1}) + "\n")
        print(f"study: {run_config['out']} stopped (state saved); run the same command to go on")
        raise SystemExit(128 + result.preempted_by if result.preempted_by else 0)
    syncs, _ = planned_syncs(run_config, 1)
    return {
        "cpu_s": round(cpu, 2), "wall_s": round(wall, 2), "resumed": resumed, "grid": grid, "plan_syncs": syncs,
        "cpu_complete": not resumed or earlier["attempts"] > 0,
        "sync_bytes": 0,  # W = 1: the average is taken in memory, nothing is sent
        "plan_sync_bytes": planned_sync_bytes(run_config, 1),
        "plan_sync_bytes_federated": None if joint else planned_sync_bytes(run_config, tasks),
        "plan_cpu_s": None,
        **({"diverged": diverged} if diverged else {}),
    }


def fit_or_reuse(run_config: dict, tasks: int, joint: bool, label: str, grid: Grid, out: Path,
                 earlier: Path | None, what: str, twins: Sequence[Path] = ()) -> None:
    """One run of the study (`what` says which, for the log), measured into its cost.json; copied
    instead from an earlier study (`earlier`) or from one of `twins` (runs of this study) that trained
    the same run."""
    run_path = Path(run_config["out"])
    sources = [Path(earlier) / run_path.relative_to(out)] if earlier is not None else []
    if reuse_earlier_run([*sources, *twins], run_path, run_config):
        return
    print(f"study: {what}: fitting {label}")
    cost = fit_measured(run_config, tasks, joint, grid.name)
    (run_path / COST_FILE).write_text(json.dumps({"label": label, **cost}, indent=2) + "\n")
    (run_path / PARTIAL_COST_FILE).unlink(missing_ok=True)


def chosen_twin(grid: Grid, cell: Cell, iterations: int | None, seed: int, out: Path,
                operator_args: Mapping | None) -> tuple[Path, ...]:
    """The outer choice's run of the chosen lr and momentum, where this outer_nesterov run has its T, N
    and seed: the same training, so it is copied rather than fitted twice."""
    choice = grid.outer_choice
    if (choice is None or not operator_args or not takes_outer_choice(cell, grid)
            or (cell.tasks, iterations, seed) != (choice.tasks, choice.iterations, choice.seed)):
        return ()
    return (choice.run_path(out, operator_args["outer_lr"], operator_args["outer_momentum"]),)


def run_cell(base: Mapping, cell: Cell, grid: Grid, out: Path, progress: bool, dry_run: bool,
             operator_args: Mapping | None = None, earlier: Path | None = None) -> list:
    """Fit the cell's unfinished runs (measured, or reused from `earlier`), then its sweep (evaluation
    only); its results."""
    config = cell_config(base, cell, grid.steps, grid.family, operator_args)
    folder = cell.folder(out)
    sweep = SweepFolder(folder)
    iterations = cell_iterations(cell)
    settings = run_settings(sweep, iterations, list(grid.seeds), cell.joint)
    for model_settings, seed, run_folder, label in settings:
        if (run_folder.path / COST_FILE).is_file():
            continue
        if dry_run:
            print(f"would fit {run_folder.path} ({label})")
            continue
        run_config = fit_run_config(config, model_settings, seed, run_folder.path, progress)
        fit_or_reuse(run_config, cell.tasks, "mode" in model_settings, label, grid, out, earlier,
                     f"T={cell.tasks} {cell.budget} {cell.operator}",
                     chosen_twin(grid, cell, model_settings.get("iterations"), seed, out, operator_args))
    if dry_run:
        for seed in (grid.seeds[1:] if cell.joint else ()):
            if not (folder / "runs" / f"{JOINT}-seed{seed}" / COST_FILE).is_file():
                print(f"would fit {folder / 'runs' / f'{JOINT}-seed{seed}'} ({JOINT}, seed {seed})")
        return []
    cpu, wall = time.process_time(), time.perf_counter()
    free = [merge for merge in cell.merges if merge not in DATA_MERGES]
    results = run_sweep(config, folder, iterations=iterations, merges=free, progress=progress,
                        select_on_val=grid.select_on_val,
                        title=f"study T={cell.tasks} {cell.budget} {cell.operator}",
                        extra={"study": grid.name, "operator": cell.operator, "budget": cell.budget},
                        joint=cell.joint, seeds=list(grid.seeds))
    evaluation = folder / EVALUATION_COST_FILE
    if not evaluation.is_file():  # the first evaluation's; a later call resumes its cells (seconds)
        evaluation.write_text(json.dumps({"cpu_s": round(time.process_time() - cpu, 2),
                                          "wall_s": round(time.perf_counter() - wall, 2)}, indent=2) + "\n")
    for method in (merge for merge in cell.merges if merge in DATA_MERGES):
        results += [data_merge_result(folder, run_folder, seed, method)
                    for model_settings, seed, run_folder, _ in settings if "mode" not in model_settings]
    if cell.joint and len(grid.seeds) > 1:
        # the sweep's table repeats its one joint model (the first seed's) in every seed's rows: those
        # rows give way to the joint model trained at that seed
        results = [r for r in results if not (r.model == JOINT and r.seed != grid.seeds[0])]
        results += later_seed_joints(config, cell, grid, out, progress, earlier)
    return results


def later_seed_joints(config: Mapping, cell: Cell, grid: Grid, out: Path, progress: bool, earlier: Path | None) -> list:
    """The joint model at the grid's other seeds (the sweep trains it at the first seed only), each
    fitted into FOLDER/runs/joint-seed<s> (measured, like every run) and evaluated beside that seed's
    N = 1 run in FOLDER/joint-seed<s>/ (`mima evaluate`: per-image records, intervals); its row is
    repeated at each N of the cell, as the sweep's joint row is."""
    from mima.services.evaluate.runs import evaluate_runs
    from mima.core.run_folder import RunFolder

    folder = cell.folder(out)
    sweep = SweepFolder(folder)
    rows = []
    for seed in grid.seeds[1:]:
        run_path = sweep.path / "runs" / f"{JOINT}-seed{seed}"
        if not (run_path / COST_FILE).is_file():
            run_config = fit_run_config(config, {"mode": JOINT, "iterations": 1}, seed, run_path, progress)
            fit_or_reuse(run_config, cell.tasks, True, f"{JOINT}, seed {seed}", grid, out, earlier,
                         f"T={cell.tasks} {cell.budget} {cell.operator}")
        partner = sweep.run(min(cell.iterations), seed).path
        evaluated = evaluate_runs([partner, RunFolder(run_path).path], folder / f"{JOINT}-seed{seed}", [],
                                  select_on_val=grid.select_on_val, title=f"study T={cell.tasks} {JOINT}, seed {seed}")
        joint, = [r for r in evaluated if r.model == JOINT]
        rows += [dataclasses.replace(joint, N=n, seed=seed) for n in cell_iterations(cell) or cell.iterations]
    return rows


def data_merge_result(folder: Path, run_folder, seed: int | None, method: str):
    """A data-dependent merge of one run's final models (`mima merge --models RUN --method METHOD`,
    its defaults), as a row of the cell's table: its test accuracy per task. Written once into
    FOLDER/data_merges/ and read back by later calls. No per-image records: no interval."""
    from mima.api import merge
    from mima.evaluation.results import ModelResult

    output = folder / DATA_MERGE_FOLDER / f"{run_folder.path.name}-{method}.safetensors"
    results_file = output.with_name(output.name + ".results.json")
    if not results_file.is_file():
        print(f"study: {folder.name}: {method} of {run_folder.path.name}")
        output.parent.mkdir(parents=True, exist_ok=True)
        merge(run_folder.path, method, output=output, overwrite=True)
    accuracy = dict(read_json(results_file)["test_accuracy"])
    accuracy.pop("mean", None)
    iterations = int(load_run_config(run_folder).model.iterations)
    return ModelResult(iterations, method, {task: float(value) for task, value in accuracy.items()}, seed=seed)


# ------------------------------------------------------------------------------ outer Nesterov's choice
CHOICE_FILE = "choice.json"  # in the OuterChoice folder: every candidate's score and the chosen one
SCORE_FILE = "validation_score.json"  # in a candidate's run folder: its uniform merge on the validation splits


def validation_score(run_path: Path) -> float:
    """Mean validation accuracy over the run's tasks of the uniform merge of its task models (the same
    merge and validation splits `mima merge --models RUN --method uniform` and --select-on use); kept in
    the run folder so that a resumed choice does not evaluate it again."""
    from mima.api import merge
    from mima.core.run_folder import RunFolder
    from mima.pools import task_pool

    score_file = run_path / SCORE_FILE
    if score_file.is_file():
        return float(read_json(score_file)["uniform_validation_accuracy"])
    score = task_pool(RunFolder(run_path)).evaluator("val").mean_accuracy(merge(run_path, "uniform"))
    score_file.write_text(json.dumps({"uniform_validation_accuracy": score}, indent=2) + "\n")
    return score


def choose_outer(base: Mapping, grid: Grid, out: Path, progress: bool, dry_run: bool,
                 earlier: Path | None = None) -> dict | None:
    """Outer Nesterov's {outer_lr, outer_momentum} for the grid's outer_nesterov cells (grid.outer_choice):
    every candidate fitted (measured, resumable) and scored on validation, the best one kept in
    OUT/.../choice.json. None on a dry run that still has candidates to fit."""
    from mima.merging.selection import BestPoint

    choice = grid.outer_choice
    chosen_file = choice.folder(out) / CHOICE_FILE
    settings = {"tasks": choice.tasks, "N": choice.iterations, "seed": choice.seed, "steps": grid.steps,
                "candidates": [list(candidate) for candidate in choice.candidates]}
    if chosen_file.is_file():
        record = read_json(chosen_file)
        if {key: record.get(key) for key in settings} != settings:
            raise MimaError(f"{chosen_file}: made for other settings ({ {key: record.get(key) for key in settings} }) than "
                            f"this grid's ({settings}); remove it (and its runs) to choose again")
        return dict(record["chosen"])
    cell = Cell(choice.tasks, "equal", "outer_nesterov", (choice.iterations,), (), joint=False)
    best: BestPoint[tuple[float, float]] = BestPoint()
    rows = []
    for lr, momentum in choice.candidates:
        args = {"outer_lr": lr, "outer_momentum": momentum}
        run_path = choice.run_path(out, lr, momentum)
        label = f"outer lr {lr:g}, momentum {momentum:g}"
        if not (run_path / COST_FILE).is_file():
            if dry_run:
                print(f"would fit {run_path} ({label})")
                continue
            config = cell_config(base, cell, grid.steps, grid.family, args)
            run_config = fit_run_config(config, {"iterations": choice.iterations}, choice.seed, run_path, progress)
            fit_or_reuse(run_config, choice.tasks, False, label, grid, out, earlier,
                         f"T={choice.tasks} outer Nesterov's choice at N={choice.iterations}")
        if read_json(run_path / COST_FILE).get("diverged"):  # no final models: not a candidate
            rows.append({**args, "diverged": read_json(run_path / COST_FILE)["diverged"]})
            continue
        score = validation_score(run_path)
        best.offer(score, (lr, momentum))
        rows.append({**args, "uniform_validation_accuracy": score, "cpu_s": read_json(run_path / COST_FILE)["cpu_s"]})
    if dry_run and len(rows) < len(choice.candidates):
        return None
    if best.point is None:
        raise MimaError(f"every outer Nesterov candidate diverged ({', '.join(r['diverged'] for r in rows)}); "
                        "no choice to make: give the grid other candidates")
    lr, momentum = best.point
    record = {**settings, "scores": rows, "chosen": {"outer_lr": lr, "outer_momentum": momentum}}
    chosen_file.write_text(json.dumps(record, indent=2) + "\n")
    print(f"study: outer Nesterov: outer lr {lr:g}, momentum {momentum:g} chosen on validation ({chosen_file})")
    return dict(record["chosen"])


# ------------------------------------------------------------------------------ the tables
def summary_rows(cell: Cell, results: Sequence) -> list[dict]:
    """Per (N, model) of a cell: mean and sample std over the seeds of the mean test accuracy, and
    each seed's 95 % interval (bootstrap over the images, as `mima evaluate` writes it), in %."""
    by_key: dict[tuple[int, str], list] = {}
    for result in results:
        by_key.setdefault((result.N, result.model), []).append(result)
    rows = []
    for (n, model), group in sorted(by_key.items()):
        measured = {r.measured_at for r in group}
        if len(measured) == 1 and None not in measured:  # theta_0: evaluated once, repeated beside every seed
            group = [r for r in group if r.seed == group[0].measured_at] or group[:1]
        means = [100 * r.mean for r in group]
        intervals = [[100 * v for v in r.intervals["mean"]] if "mean" in r.intervals else None for r in group]
        rows.append({"T": cell.tasks, "budget": cell.budget, "operator": cell.operator, "N": n, "model": model,
                     "seeds": [r.seed for r in group], "accuracy": statistics.fmean(means),
                     "accuracy_std": statistics.stdev(means) if len(means) > 1 else None,
                     "per_seed": means, "ci95_per_seed": intervals})
    return rows


def cost_rows(out: Path) -> list[dict]:
    """Every measured run of the study (its cost.json), in folder order."""
    rows = []
    for path in sorted(out.glob(f"T*/*/*/runs/*/{COST_FILE}")):
        run = path.parent
        tasks, budget, operator = run.parts[-5][1:], run.parts[-4], run.parts[-3]
        rows.append({"T": int(tasks), "budget": budget, "operator": operator, "run": run.name, **read_json(path)})
    return rows


def _half_width(intervals: list) -> str:
    widths = [(high - low) / 2 for low, high in (i for i in intervals if i)]
    return f"{statistics.fmean(widths):.1f}" if widths else "-"


def write_tables(out: Path, rows: list[dict], costs: list[dict], grid: Grid) -> None:
    """OUT/study.md and .json (accuracies), OUT/costs.md (each run's cost beside the plan's)."""
    lines = [f"# The study, grid {grid.name}, seeds {list(grid.seeds)}", "",
             "Mean test accuracy (%) over the tasks, mean +- sample std over the seeds; 'ci95 +-': the mean "
             "half-width of the seeds' 95 % intervals (bootstrap over the test images, `mima evaluate`).", "",
             "| T | budget | operator | N | model | accuracy | ci95 +- | seeds |",
             "| ---: | --- | --- | ---: | --- | ---: | ---: | --- |"]
    for row in rows:
        lines.append(f"| {row['T']} | {row['budget']} | {row['operator']} | {row['N']} | {row['model']} | "
                     f"{mean_std(row['accuracy'], row['accuracy_std'])} | {_half_width(row['ci95_per_seed'])} | "
                     f"{' '.join(map(str, row['seeds']))} |")
    shown = {(row["T"], row["budget"], row["operator"]) for row in rows}
    missing = [str(cell.folder(Path())) for cell in grid.cells if (cell.tasks, cell.budget, cell.operator) not in shown]
    if missing:
        lines += ["", f"Cells of the grid not done yet: {', '.join(missing)}."]
    out.mkdir(parents=True, exist_ok=True)
    (out / "study.md").write_text("\n".join(lines) + "\n")
    evaluations = {str(path.parent.relative_to(out)): read_json(path)
                   for path in sorted(out.glob(f"T*/*/*/{EVALUATION_COST_FILE}"))}
    (out / "study.json").write_text(json.dumps({"grid": grid.name, "seeds": list(grid.seeds), "rows": rows,
                                                "costs": costs, "evaluation_costs": evaluations}, indent=2) + "\n")
    cost_lines = ["| T | budget | operator | run | CPU s (measured) | wall s | sync bytes (W = 1: none cross processes) | "
                  "plan: sync bytes W = 1 | plan: sync bytes per process, W = T |",
                  "| ---: | --- | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for cost in costs:
        federated = cost["plan_sync_bytes_federated"]
        cost_lines.append(f"| {cost['T']} | {cost['budget']} | {cost['operator']} | {cost['run']} | {cost['cpu_s']:.0f} | "
                          f"{cost['wall_s']:.0f} | {cost['sync_bytes']} | {cost['plan_sync_bytes']} | "
                          f"{'-' if federated is None else federated} |")
    (out / "costs.md").write_text("\n".join(cost_lines) + "\n")


def grid_claims(grid: Grid) -> list[Claim]:
    """The comparisons the study answers (OUT/claims.md), from the cells it has: per T, MIMA's gain
    (the uniform merge at the largest N against N = 1) and the joint gap; at T = 4, each other
    operator's uniform merge at the largest N against MIMA's and against the joint model, and the
    final merges on MIMA's aligned task vectors against the uniform merge; MIMA under other budgets
    against equal budgets, at each N both have."""
    claims = []
    uniform = {cell.tasks: cell for cell in grid.cells if cell.operator == "uniform" and cell.budget == "equal"}
    for tasks, cell in uniform.items():
        name, top = f"T{tasks}/equal/uniform", max(cell.iterations)
        if min(cell.iterations) < top:
            claims.append(Claim(Side(name, "uniform", top), Side(name, "uniform", min(cell.iterations)), "MIMA's gain"))
        if cell.joint:
            claims.append(Claim(Side(name, JOINT), Side(name, "uniform", top), "the joint gap"))
        claims += [Claim(Side(name, merge, top), Side(name, "uniform", top), "a final merge on MIMA's task vectors")
                   for merge in cell.merges if merge not in ("uniform", *DATA_MERGES)]
    for cell in grid.cells:
        base = uniform.get(cell.tasks)
        if cell.budget != "equal" and base is not None and cell.operator == "uniform":
            name = str(cell.folder(Path()))
            claims += [Claim(Side(name, "uniform", n), Side(f"T{cell.tasks}/equal/uniform", "uniform", n),
                             f"{cell.budget} budgets against equal") for n in sorted(set(cell.iterations) & set(base.iterations))]
        if cell.operator == "uniform" or cell.budget != "equal" or base is None:
            continue
        name, mima, top = str(cell.folder(Path())), f"T{cell.tasks}/equal/uniform", max(cell.iterations)
        claims.append(Claim(Side(name, "uniform", top), Side(mima, "uniform", top), "the phase-end operator"))
        if base.joint:
            claims.append(Claim(Side(name, "uniform", top), Side(mima, JOINT), "the README's ATM-above-joint"
                                if cell.operator == "atm" else "the phase-end operator against joint training"))
        if cell.operator == "atm" and "tsv" in base.merges:
            claims.append(Claim(Side(name, "uniform", top), Side(mima, "tsv", top), "docs/results.md: +0.6 over MIMA + TSV"))
    return claims


def write_claims(out: Path, grid: Grid, rows: Sequence[dict]) -> None:
    """OUT/claims.md and claims.json: the comparisons whose cells are evaluated (the others listed),
    and the table of MIMA's gain and the joint gap by T (from them and the summary `rows`)."""
    found, pending, diverged = [], [], []
    for claim in grid_claims(grid):
        lost = diverged_sides(claim, out, list(grid.seeds))
        row = None if lost else evaluate_claim(claim, out, list(grid.seeds))
        if lost:
            diverged.append((claim, lost))
        elif row is None:
            pending.append(claim)
        else:
            found.append(row)
    text = claims_markdown(found, pending, grid.seeds, diverged) + "\n" + gain_markdown(rows, found)
    (out / "claims.md").write_text(text)
    (out / "claims.json").write_text(json.dumps(found, indent=2) + "\n")


def gain_markdown(rows: Sequence[dict], claims: Sequence[dict]) -> str:
    """MIMA's gain (the uniform merge at the largest N minus the smallest, N = 1) and the joint gap (the joint model
    minus that merge) at each T of the study, mean ± std over the seeds, with their intervals."""
    def accuracy(tasks: int, n: int | None, model: str) -> str:
        found = [r for r in rows if (r["T"], r["budget"], r["operator"], r["model"]) == (tasks, "equal", "uniform", model)
                 and (n is None or r["N"] == n)]
        if not found:
            return "-"
        return mean_std(found[0]["accuracy"], found[0]["accuracy_std"])

    def difference(first: str, second: str) -> str:
        found = [c for c in claims if (c["first"], c["second"]) == (first, second)]
        if not found:
            return "-"
        c = found[0]
        over = " [{:+.1f}, {:+.1f}]".format(*c["ci95_over_seeds"]) if c["ci95_over_seeds"] else ""
        return mean_std(c["difference"], c["difference_std"], signed=True) + over

    lines = ["## MIMA's gain and the joint gap by T", "",
             "Mean test accuracy (%) over the tasks, mean ± std over the seeds; the differences in points "
             "with the Student t 95 % interval over the seeds (the per-seed intervals are in the table above).", "",
             "| T | N | uniform merge at the smallest N | at the largest N | gain | joint | joint gap (joint - largest N's uniform) |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    mima = [r for r in rows if (r["operator"], r["budget"], r["model"]) == ("uniform", "equal", "uniform")]
    for tasks in sorted({r["T"] for r in mima}):
        low, top = min(r["N"] for r in mima if r["T"] == tasks), max(r["N"] for r in mima if r["T"] == tasks)
        lines.append(f"| {tasks} | {low} -> {top} | {accuracy(tasks, low, 'uniform')} | {accuracy(tasks, top, 'uniform')} | "
                     f"{difference(f'T{tasks} MIMA N={top} + uniform', f'T{tasks} MIMA N={low} + uniform')} | "
                     f"{accuracy(tasks, None, JOINT)} | {difference(f'T{tasks} joint', f'T{tasks} MIMA N={top} + uniform')} |")
    return "\n".join(lines) + "\n"


def cell_is_done(cell: Cell, grid: Grid, out: Path) -> bool:
    """Every run of the cell is fitted (its cost.json, the later seeds' joint models too), its sweep
    has written its results and its data-dependent merges theirs."""
    folder = cell.folder(out)
    settings = run_settings(SweepFolder(folder), cell_iterations(cell), list(grid.seeds), cell.joint)
    joints = [folder / "runs" / f"{JOINT}-seed{seed}" for seed in (grid.seeds[1:] if cell.joint else ())]
    data_merges = [folder / DATA_MERGE_FOLDER / f"{run.path.name}-{method}.safetensors.results.json"
                   for method in cell.merges if method in DATA_MERGES
                   for model_settings, _, run, _ in settings if "mode" not in model_settings]
    return (folder / "results.json").is_file() and all(path.is_file() for path in data_merges) and all(
        (path / COST_FILE).is_file() for path in [run.path for _, _, run, _ in settings] + joints)


def takes_outer_choice(cell: Cell, grid: Grid) -> bool:
    return cell.operator == "outer_nesterov" and grid.outer_choice is not None


def write_reports(out: Path, grid: Grid, rows: list[dict]) -> None:
    write_tables(out, rows, cost_rows(out), grid)
    write_claims(out, grid, rows)
    if grid.joint_gap:
        write_gap_report(out, grid, rows, cost_rows(out), cell_iterations, DATA_MERGES)


def run_study(base: Mapping, grid: Grid, out: Path, progress: bool = False, dry_run: bool = False,
              only: Sequence[str] = (), tables: bool = False, earlier: Path | None = None) -> list[dict]:
    """Every cell of `grid` in order (resumable run by run), then the tables; the summary rows.
    `only`: the folders (e.g. "T12/equal/uniform") of the cells to run, the others left alone, and no
    tables written (a second process can so take a cell while the first runs the others). `tables`:
    fit nothing; the tables from the cells that are done (`cell_is_done`), the others left out.
    `earlier`: an earlier study's output folder whose runs this one reuses where they match."""
    known = {str(cell.folder(Path())) for cell in grid.cells}
    if set(only) - known:
        raise MimaError(f"--only {' '.join(sorted(set(only) - known))}: not a cell of grid {grid.name} "
                        f"(its cells: {', '.join(sorted(known))})")
    if earlier is not None and Path(earlier).resolve() == Path(out).resolve():
        raise MimaError(f"--reuse {earlier}: that is --out itself; name the earlier study's folder")
    rows = []
    chosen: Mapping | None = None  # outer Nesterov's chosen sync_merge_args, made before its first cell
    for cell in grid.cells:
        if (only and str(cell.folder(Path())) not in only) or (tables and not cell_is_done(cell, grid, out)):
            continue
        if takes_outer_choice(cell, grid) and chosen is None:
            chosen_file = grid.outer_choice.folder(out) / CHOICE_FILE
            if tables:  # fit nothing: a cell done has its choice on disk
                chosen = dict(read_json(chosen_file)["chosen"])
            else:
                chosen = choose_outer(base, grid, out, progress, dry_run, earlier)
            if chosen is None:  # a dry run before the choice: the cell's runs listed with DiLoCo's values
                chosen = {}
        operator_args = (chosen or None) if takes_outer_choice(cell, grid) else None
        try:
            rows += summary_rows(cell, run_cell(base, cell, grid, out, progress, dry_run, operator_args, earlier))
        except MimaError as exc:
            if "in use by another job" not in str(exc):
                raise
            # a second process (--only) is on this cell: go on with the others; the same command later takes it
            print(f"study: passing over {cell.folder(out)} for now: {exc}")
            continue
        if not dry_run and not only and not tables:  # after every cell: a study stopped part way shows what it has
            write_reports(out, grid, rows)
    if tables:
        write_reports(out, grid, rows)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, nargs="+", default=[ROOT / "configs" / "offline.yaml"],
                        help="the base `mima fit` config (several: later files override earlier ones); "
                        "the study sets the task list, operator and budgets")
    parser.add_argument("--out", type=Path, default=None,
                        help="output folder (default: runs/study; runs/study-gap for --grid gap)")
    parser.add_argument("--reuse", type=Path, default=None, metavar="EARLIER_OUT",
                        help="an earlier study's output folder: its finished runs that match one of this grid's "
                        "(same cell and run name, same settings) are copied, not trained again "
                        "(default for --grid gap: runs/study, if it exists)")
    parser.add_argument("--grid", choices=sorted(GRIDS), default="full", help="which grid (docs/results.md)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds (at least 3 for the study)")
    parser.add_argument("--steps", type=int, default=None, help="S per task (default: the config's)")
    parser.add_argument("--dry-run", action="store_true", help="list the runs still to fit; fit nothing")
    parser.add_argument("--only", nargs="+", default=(), metavar="CELL",
                        help="run only these cells (their folders under --out, e.g. T12/equal/uniform), "
                        "for a second process beside the first; writes no tables")
    parser.add_argument("--tables", action="store_true",
                        help="fit nothing: write the tables from the cells that are done (study.md names the grid's others)")
    parser.add_argument("--progress", action="store_true", help="show progress bars")
    options = parser.parse_args(argv)
    grid = GRIDS[options.grid](options.seeds)
    if options.steps is not None:
        grid = dataclasses.replace(grid, steps=options.steps)
    out = options.out if options.out is not None else DEFAULT_OUT[options.grid]
    earlier = options.reuse
    if earlier is None and options.grid == "gap" and DEFAULT_OUT["reduced"].is_dir():
        earlier = DEFAULT_OUT["reduced"]
    try:
        if earlier is not None and not Path(earlier).is_dir():
            raise MimaError(f"--reuse {earlier}: no such folder (an earlier study's --out)")
        run_study(suite_config(options.config), grid, out, options.progress, options.dry_run, options.only,
                  options.tables, earlier)
    except MimaError as exc:
        print(f"study: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
