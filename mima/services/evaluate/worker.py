"""One process's share of the work: each unit's cells evaluated and recorded the moment each is known,
the cells already recorded skipped (a model is loaded or merged only if one of its cells is missing).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mima.services.evaluate.dealing import Unit
from mima.services.evaluate.evaluation import NO_POINT, Evaluation
from mima.services.evaluate.grid_search import full_point, grid_merges, merge_at, validation_score
from mima.core.errors import MimaError
from mima.core.names import FINE_TUNED, JOINT, ZERO_SHOT
from mima.core.state_dicts import mean_off_diagonal, task_vector_cosines
from mima.evaluation.accuracy import EvalSettings
from mima.evaluation.cells import GEOMETRY, Cell, CellStore, ImageRecord, point_key
from mima.merging import get_method
from mima.merging.selection import BestPoint
from mima.pools import TaskPool, task_pool


class Worker:
    """Evaluates units in one process, recording each cell as it finishes; `should_stop` is asked
    before every batch (mima.evaluation.accuracy.EvaluationStopped ends the unit there)."""

    def __init__(self, evaluation: Evaluation, store: CellStore, should_stop: Callable[[], bool], settings: EvalSettings,
                 device: torch.device, merge_device: torch.device | None = None) -> None:
        self.evaluation, self.store, self.should_stop, self.settings, self.device = (
            evaluation, store, should_stop, settings, device)
        self.merge_device = merge_device if merge_device is not None else device  # where merges compute
        self.pool: TaskPool | None = None
        self.loaded: tuple[int, dict, list] | None = None  # (run index, theta_0, task models)

    def _pool(self) -> TaskPool:
        if self.pool is None:
            self.pool = task_pool(self.evaluation.configs[0], self.settings.cache)
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
            self.loaded = (index, finite(run.pretrained(), run.pretrained_file),
                           [finite(run.final(task), run.final_file(task)) for task in self.evaluation.tasks])
        return self.loaded[1], self.loaded[2]

    def _evaluate(self, run_id: str, model: str, point: str, split: str, tasks: list[str], weights) -> None:
        """Record the cells of `tasks` that are missing; `weights` is called only if one is."""
        self._evaluate_points(run_id, model, [(point, weights)], split, tasks)

    def _evaluate_points(self, run_id: str, model: str, points: list[tuple[str, object]], split: str,
                         tasks: list[str]) -> None:
        """Record the missing cells of several points of one model (each with its weights, or a callable
        computing them, called only if one of its cells is missing): per task, one pass over the split
        evaluates every point that lacks the task's cell on each batch read."""
        missing = {task: [index for index, (point, _) in enumerate(points)
                          if Cell(run_id, model, point, split, task) not in self.store] for task in tasks}
        if not any(missing.values()):
            return
        pool = self._pool()
        evaluator = pool.evaluator(split, self.settings, self.evaluation.val_examples if split == "val" else None)
        computed: dict[int, dict] = {}

        def weights_of(index: int) -> dict:
            if index not in computed:
                weights = points[index][1]
                computed[index] = weights() if callable(weights) else weights
            return computed[index]

        for task in tasks:
            if not missing[task]:
                continue
            indices = missing[task]
            # each cell with its per-image record (which images were right): the results' intervals and paired tests
            evaluator.records_of_models(
                [weights_of(index) for index in indices], [task],
                on_record=lambda position, name, correct, indices=indices: self.store.record(
                    Cell(run_id, model, points[indices[position]][0], split, name), ImageRecord(correct)),
                should_stop=self.should_stop)

    def run(self, unit: Unit) -> None:
        evaluation = self.evaluation
        tasks = evaluation.tasks
        if unit.kind == JOINT:
            joint = evaluation.joint
            self._evaluate(evaluation.run_id(joint), JOINT, NO_POINT, "test", tasks,
                           lambda: finite(joint.joint(), joint.final_file(JOINT)))
            return
        run = evaluation.runs[unit.run]
        run_id = evaluation.run_id(run)
        if unit.kind == ZERO_SHOT:
            self._evaluate(run_id, ZERO_SHOT, NO_POINT, "test", tasks, lambda: finite(run.pretrained(), run.pretrained_file))
        elif unit.kind == FINE_TUNED:
            for position, task in enumerate(tasks):
                self._evaluate(run_id, FINE_TUNED, NO_POINT, "test", [task], lambda p=position: self._models(unit.run)[1][p])
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
        """The merge's test cells at its best grid point; each grid point's validation cells first,
        the merged weights of the best point so far kept for the test pass."""
        evaluation, tasks = self.evaluation, self.evaluation.tasks
        method = get_method(unit.method).on(self.merge_device)  # every merge below computes there
        grid = evaluation.grid(method)
        models = lambda: self._models(unit.run)  # noqa: E731 - loaded only if a cell is missing
        if not grid:
            point = point_key(full_point(method, {}, None))
            self._evaluate(run_id, method.name, point, "test", tasks,
                           lambda: method.merge(models()[1], models()[0], self.pool).state)
            return

        def scored(point: str) -> bool:
            return all(Cell(run_id, method.name, point, "val", task) in self.store for task in tasks)

        kept: dict[str, dict | None] = {}  # this session's merged weights of the best point so far
        best: BestPoint[str] = BestPoint()
        group: list[tuple[str, Callable[[], dict] | None]] = []  # grid points in order, not yet offered

        def settle() -> None:
            """The group's missing validation cells (its models evaluated together on each batch read),
            then each of its points offered in grid order."""
            nonlocal kept
            needed = [(point, merged) for point, merged in group if merged is not None]
            if needed:
                self._evaluate_points(run_id, method.name, needed, "val", tasks)
            for point, merged in group:
                if best.offer(validation_score(self.store, run_id, method.name, point, tasks), point):
                    kept = {point: merged() if merged is not None else None}
            group.clear()

        per_pass = self.settings.cache.models_per_pass
        for setting, lam, merged in grid_merges(method, grid, scored, models, lambda: self.pool):
            group.append((point_key(full_point(method, setting, lam)), merged))
            if sum(merged is not None for _, merged in group) >= per_pass:
                settle()
        settle()
        chosen = best.point
        weights = kept.get(chosen) or (lambda: merge_at(method, chosen, models, lambda: self.pool))
        self._evaluate(run_id, method.name, chosen, "test", tasks, weights)


def finite(weights: dict, path) -> dict:
    """`weights` read from `path`, refused in one line if a tensor holds NaN or Inf: `mima fit` never
    writes such weights (mima.training.divergence), so the file was damaged or edited, and its accuracy
    or any merge of it would be meaningless."""
    for key, tensor in weights.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise MimaError(f"{path}: tensor '{key}' holds NaN or Inf values, which mima fit never writes (the file was "
                            "damaged or edited); restore it or train the run again")
    return weights

