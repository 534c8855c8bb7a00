"""`mima data check`: which benchmark tasks are ready under a data root, and what is missing.

It looks at names on disk only (files, folders, class folders), never opens a dataset, so it is
quick even for the full 20 tasks. The table lists, for every task, each file or folder the task
needs (relative to the root) and whether it is there:

    task      status   piece       expected under /data (relative)
    --------  -------  ----------  ----------------------------------------------
    DTD       partial  ok          dtd/train/<class>/ (47 class folders: banded, blotchy, braided, ...)
                       missing     dtd/val/<class>/ (47 class folders: banded, blotchy, braided, ...)
    MNIST     found    ok          MNIST/raw/train-images-idx3-ubyte (training split)
    ...

status: found (every piece there), missing (none), partial (some). The exit status is 0 when every
task is found and 1 otherwise. `--download` first lets torchvision fetch the tasks it can download
(GTSRB, MNIST, SVHN and most of the 14/20-task additions); the others need a manual download,
whose source the summary names.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from mima.data.clip_tasks import BENCHMARKS, REAL_TASKS, RealTask
from mima.core.errors import MimaError

STATUS_FOUND, STATUS_MISSING, STATUS_PARTIAL = "found", "missing", "partial"


@dataclass
class TaskReport:
    task: RealTask
    rows: list[tuple[str, str, str]]  # (state, described piece, detail)

    @property
    def status(self) -> str:
        states = {state for state, _, _ in self.rows}
        if states == {"ok"}:
            return STATUS_FOUND
        return STATUS_MISSING if states == {"missing"} else STATUS_PARTIAL


def select_tasks(names: Sequence[str] | None, benchmark: str | None) -> list[str]:
    """Task names to check: `--tasks`, or a benchmark's list, or every task of the clip suite."""
    if names:
        unknown = [name for name in names if name not in REAL_TASKS]
        if unknown:
            raise MimaError(f"--tasks: unknown task '{unknown[0]}' (clip suite tasks: {', '.join(REAL_TASKS)})")
        return list(dict.fromkeys(names))
    if benchmark is not None:
        return list(BENCHMARKS[benchmark])
    return list(REAL_TASKS)


def check_task(task: RealTask, root: Path) -> TaskReport:
    return TaskReport(task, [(state, piece.describe(), detail) for piece, state, detail in task.states(root)])


def format_table(root: Path, reports: Sequence[TaskReport]) -> str:
    header = ("task", "status", "piece", f"expected under {root} (relative)")
    lines: list[tuple[str, str, str, str]] = []
    for report in reports:
        for position, (state, described, detail) in enumerate(report.rows):
            first = position == 0
            text = f"{described}  [{detail}]" if detail else described
            lines.append((report.task.name if first else "", report.status if first else "", state, text))
    widths = [max(len(row[i]) for row in [header, *lines]) for i in range(3)]
    rule = tuple("-" * width for width in (*widths, len(header[3])))

    def render(row) -> str:
        return "  ".join(cell.ljust(width) for cell, width in zip(row[:3], widths)) + "  " + row[3]

    return "\n".join(render(row).rstrip() for row in [header, rule, *lines])


def summary(root: Path, reports: Sequence[TaskReport], failures: dict[str, str]) -> str:
    found = [r.task.name for r in reports if r.status == STATUS_FOUND]
    lacking = [r for r in reports if r.status != STATUS_FOUND]
    lines = [f"{len(found)} of {len(reports)} tasks found under {root}."]
    if lacking:
        lines.append(f"missing or partial: {', '.join(r.task.name for r in lacking)}")
        fetchable = [r.task.name for r in lacking if r.task.downloadable and r.task.name not in failures]
        if fetchable:
            lines.append(f"torchvision can download {', '.join(fetchable)}: "
                         f"mima data check --root {root} --tasks {' '.join(fetchable)} --download")
        for name, message in failures.items():
            lines.append(f"download of {name} failed: {message}")
        manual = [r.task for r in lacking if not r.task.downloadable]
        if manual:
            lines.append("to be downloaded by hand (README, section 'Real tasks'), then laid out by "
                         f"mima data prepare --root {root} --tasks {' '.join(task.name for task in manual)}:")
            lines += [f"  {task.name}: {task.source}" for task in manual]
    return "\n".join(lines)


def download_missing(root: Path, names: Sequence[str], say: Callable[[str], None]) -> dict[str, str]:
    """Let torchvision fetch every selected task that is not complete and that it can download.
    Returns the tasks whose download failed, with the reason."""
    failures: dict[str, str] = {}
    for name in names:
        task = REAL_TASKS[name]
        if not task.downloadable or check_task(task, root).status == STATUS_FOUND:
            continue
        say(f"mima data check: downloading {name} with torchvision into {root} ...")
        try:
            task.download(root)
        except Exception as exc:  # network errors, bad archives, torchvision's RuntimeErrors: report and go on
            text = " ".join(str(exc).split())  # one line: torchvision's messages span several
            failures[name] = text[:300] or type(exc).__name__
    return failures


def run_check(root: Path, names: Sequence[str], download: bool = False, say: Callable[[str], None] = print) -> int:
    """Print the table and summary for `names` under `root`; 0 when every task is found, else 1."""
    root = Path(root).expanduser()
    failures = download_missing(root, names, say) if download else {}
    reports = [check_task(REAL_TASKS[name], root) for name in names]
    say(format_table(root, reports))
    say("")
    say(summary(root, reports, failures))
    return 0 if all(report.status == STATUS_FOUND for report in reports) else 1
