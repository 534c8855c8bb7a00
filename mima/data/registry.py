"""The one place that lists task suites and their tasks."""

from __future__ import annotations

from collections.abc import Sequence

from mima.data import clip_tasks, digits, offline, synthetic
from mima.data.tasks import TaskSpec
from mima.core.errors import MimaError

SUITES: dict[str, dict[str, TaskSpec]] = {
    "clip": clip_tasks.TASKS,
    "digits": digits.TASKS,
    "offline": offline.TASKS,
    "synthetic": synthetic.TASKS,
}
DEFAULT_TASKS: dict[str, tuple[str, ...]] = {
    "clip": clip_tasks.DEFAULT_TASKS,
    "digits": digits.DEFAULT_TASKS,
    "offline": offline.DEFAULT_TASKS,
    "synthetic": synthetic.DEFAULT_TASKS,
}


def suite_names() -> list[str]:
    return sorted(SUITES)


def task_names(suite: str) -> list[str]:
    return list(_suite(suite))


def _suite(suite: str) -> dict[str, TaskSpec]:
    if suite not in SUITES:
        raise MimaError(f"data.suite: unknown suite '{suite}' (known: {', '.join(suite_names())})")
    return SUITES[suite]


def resolve_tasks(suite: str, names: Sequence[str] | None) -> list[TaskSpec]:
    """The TaskSpecs for `names` (None means the suite's default list), in the given order."""
    tasks = _suite(suite)
    chosen = list(DEFAULT_TASKS[suite]) if names is None else list(names)
    if not chosen:
        raise MimaError(f"data.tasks: the task list is empty; name at least one of {', '.join(tasks)}")
    duplicates = sorted({name for name in chosen if chosen.count(name) > 1})
    if duplicates:
        raise MimaError(f"data.tasks: task '{duplicates[0]}' is listed more than once")
    unknown = [name for name in chosen if name not in tasks]
    if unknown:
        raise MimaError(f"data.tasks: unknown task '{unknown[0]}' in suite '{suite}' (known: {', '.join(tasks)})")
    return [tasks[name] for name in chosen]
