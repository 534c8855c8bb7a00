"""Tasks, suites and the MIMA batch schedule."""

from mima.data.registry import resolve_tasks, suite_names, task_names
from mima.data.tasks import TaskData, TaskSpec

__all__ = ["TaskData", "TaskSpec", "resolve_tasks", "suite_names", "task_names"]
