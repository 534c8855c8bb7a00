"""The results of an evaluation, built from its recorded cells once every process is done:
ModelResult rows (zero_shot, fine_tuned, [joint], one per merge at its chosen point; per run), with
the 95 % intervals and paired comparisons of their per-image records (mima.evaluation.significance),
written as results.json/.csv/.md and selection.json with the plots, all at once (a failure leaves
the earlier set), so that they equal those of an uninterrupted evaluation.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from mima.services.evaluate.evaluation import NO_POINT, Evaluation
from mima.services.evaluate.grid_search import full_point, recorded_best
from mima.core.errors import MimaError
from mima.core.files import write_error
from mima.core.names import FINE_TUNED, JOINT, ZERO_SHOT
from mima.core.publish import publish_folder, remove_folders, stage_folder
from mima.core.run_folder import RunFolder, SweepFolder
from mima.config.run_config import load_run_config
from mima.evaluation.accuracy import accuracy_of
from mima.evaluation.cells import GEOMETRY, Cell, CellStore, point_key
from mima.evaluation.plots import plot_accuracy_vs_n, plot_cosine_vs_n
from mima.evaluation.results import ModelResult, training_setup
from mima.evaluation.results_files import write_results
from mima.evaluation.significance import TaskRecord, add_statistics
from mima.evaluation.tables import markdown_text

Pairwise = dict[int, list[float]]  # each N's task-vector cosines, over its runs


def build_results(evaluation: Evaluation, store: CellStore) -> tuple[list[ModelResult], Pairwise]:
    """The results rows (zero_shot, fine_tuned, [joint], one per merge; per run) from the cells."""
    tasks = evaluation.tasks
    cells: dict[tuple, tuple[str, str, str]] = {}  # (N, seed, model) of a row -> the (run, model, point) of its cells

    def accuracies(run_id: str, model: str, point: str) -> dict[str, float]:
        return {task: accuracy_of(*store.get(Cell(run_id, model, point, "test", task))) for task in tasks}

    def measured(result: ModelResult, run_id: str, point: str) -> ModelResult:
        cells[(result.N, result.seed, result.model)] = (run_id, result.model, point)
        return result

    several_seeds = len({(int(c.model.iterations), c.seed) for c in evaluation.configs}) > \
        len({int(c.model.iterations) for c in evaluation.configs})
    # theta_0 (evaluated with the first run) and the joint model (trained once) are one measurement each,
    # repeated beside every run: with several seeds their rows say which seed's run measured them
    zero_shot_seed = evaluation.configs[0].seed if several_seeds else None
    joint_seed = load_run_config(evaluation.joint).seed if several_seeds and evaluation.joint else None
    zero_shot_run = evaluation.run_id(evaluation.runs[0])
    zero_shot = accuracies(zero_shot_run, ZERO_SHOT, NO_POINT)
    joint_run = evaluation.run_id(evaluation.joint) if evaluation.joint else None
    joint = accuracies(joint_run, JOINT, NO_POINT) if joint_run else None
    results, pairwise = [], {}
    for run, config in zip(evaluation.runs, evaluation.configs):
        run_id, n, seed = evaluation.run_id(run), int(config.model.iterations), config.seed
        geometry = store.get(Cell(run_id, GEOMETRY, NO_POINT, "-", "-"))
        own = [measured(ModelResult(n, ZERO_SHOT, dict(zero_shot), seed=seed, measured_at=zero_shot_seed), zero_shot_run,
                        NO_POINT),
               measured(ModelResult(n, FINE_TUNED, accuracies(run_id, FINE_TUNED, NO_POINT),
                                    mean_cos_tau=geometry["mean"], seed=seed), run_id, NO_POINT)]
        if joint is not None:  # one model for every run, like zero_shot; placed after fine_tuned
            own.append(measured(ModelResult(n, JOINT, dict(joint), seed=seed, measured_at=joint_seed), joint_run, NO_POINT))
        for method in evaluation.methods:
            grid = evaluation.grid(method)
            if not grid:
                hparams = full_point(method, {}, None)
                point = point_key(hparams)
                own.append(measured(ModelResult(n, method.name, accuracies(run_id, method.name, point),
                                                hparams=hparams, seed=seed), run_id, point))
                continue
            best = recorded_best(store, run_id, method, grid, tasks)
            point = point_key(best.point)
            own.append(measured(ModelResult(n, method.name, accuracies(run_id, method.name, point),
                                            hparams=best.point, validation_accuracy=best.score, seed=seed), run_id, point))
        label = f"N={n}, seed {seed}" if several_seeds else f"N={n}"
        summary = ", ".join(f"{r.model} {100 * r.mean:.1f}%" for r in own if r.model != ZERO_SHOT)
        print(f"{label}: cos(tau) {geometry['mean']:.3f}; {summary}")
        results += own
        pairwise.setdefault(n, []).extend(geometry["pairs"])
    add_statistics(results, {key: records_on_test(store, *where, tasks) for key, where in cells.items()})
    return results, pairwise


def recorded_test_records(folder: Path, run: Path, model: str) -> dict[str, TaskRecord]:
    """Per task, the test counts and per-image record of `model` on `run` in the finished evaluation
    in `folder` (`mima evaluate --out`), read from its cells, each checked as the results were: the
    record of the hyperparameters it chose (only those are evaluated on test). For pairing models
    of two evaluations on the same test images (benchmarks/study.py); nothing is written."""
    store = CellStore(folder, session="reader", rank=0)
    if store.read_manifest() is None:
        raise MimaError(f"{folder}: not an evaluation folder (no {CellStore.MANIFEST})")
    store.load()
    run_id = str(Path(run).resolve())
    cells = [cell for cell in store.values if (cell.run, cell.model, cell.split) == (run_id, model, "test")]
    if not cells:
        raise MimaError(f"{folder}: no test cells of {model} on {run}")
    points = {cell.point for cell in cells}
    if len(points) > 1:
        raise MimaError(f"{folder}: {model} on {run} has test cells at several hyperparameter points")
    tested = {cell.task for cell in cells}
    order = [task for task in RunFolder(run).task_order() if task in tested]  # the bootstraps draw in task order
    records = records_on_test(store, run_id, model, points.pop(), order)
    if any(correct is None for _, correct in records.values()):
        raise MimaError(f"{folder}: {model} on {run} has no per-image records (cells of an earlier mima); "
                        "evaluate it again into a new folder")
    return records


def records_on_test(store: CellStore, run_id: str, model: str, point: str, tasks: list[str]) -> dict[str, TaskRecord]:
    """Per task, the test cell's counts and per-image record (None where its line has none)."""
    found = {}
    for task in tasks:
        cell = Cell(run_id, model, point, "test", task)
        found[task] = (tuple(store.get(cell)), store.correct_images(cell))
    return found


def selection_extra(evaluation: Evaluation, extra: dict | None) -> dict:
    """What selection.json records beside the chosen points: how the table was made (the time taken
    is added when the results are written)."""
    config = evaluation.configs[0]
    info = {
        "heads": config.model.heads,
        "select_on": "val" if evaluation.select_on_val else "defaults",
        "runs": [str(r.path) for r in evaluation.runs],
        # the schedule (lr_schedule, schedule_scope, warm-up), precision and clipping that produced the table
        "training": training_setup((c.model, c.other.get("trainer") or {}) for c in evaluation.configs),
        "precision": evaluation.precision,
    }
    if evaluation.val_examples is not None:
        info["val_examples"] = evaluation.val_examples
    info.update(steps=config.model.steps, **(extra or {}))
    return info


def publish_results(evaluation: Evaluation, results: list[ModelResult], pairwise: Pairwise, out_dir: Path,
                    info: dict, title: str) -> None:
    """Write the results files and plots into `out_dir`: the whole set aside first, moved into place
    at the end, so that a failure leaves the earlier set."""
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
