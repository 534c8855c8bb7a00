"""`mima prefetch --config FILE`: fetch what a run needs from the network, ahead of the run.

Run it on a machine with internet (a cluster's login node); the compute nodes then find everything
on disk. It fetches
  - the open_clip weights of `model.clip` + `model.pretrained` (a tag) into open_clip's own cache
    (huggingface_hub's, under $HF_HOME; or ~/.cache/clip for URL-only tags), without building the
    model: `mima fit` loads them from there by the same tag;
  - the tasks of the `data:` section that torchvision can download, into `data.root`.
Everything else is local (embedded models are built on first use into $MIMA_CACHE_DIR, local-dir
folders, checkpoint files, bundled suites, custom task folders) and is reported as such. Tasks that
need a manual download end it with the same one-line message `mima fit` would give.
With HF_HUB_OFFLINE=1 or MIMA_OFFLINE=1 nothing is downloaded: it only checks, so a compute node can
run it to see whether its caches are complete.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from mima.core.errors import MimaError
from mima.data import clip_tasks
from mima.data.check import STATUS_FOUND, check_task
from mima.data.clip_tasks import REAL_TASKS, require_files
from mima.data.datamodule import resolve_run_tasks
from mima.data.image_folder import as_folder_task
from mima.data.tasks import TaskSpec
from mima.models.clip import (
    EMBEDDED_PREFIX,
    LOCAL_DIR_PREFIX,
    RANDOM_WEIGHTS,
    check_pretrained_tag,
    default_cache_dir,
    fetch_pretrained,
    offline,
)
from mima.training.run_config import RunConfig


def prefetch(config: RunConfig, say: Callable[[str], None] = print) -> list[str]:
    """Fetch the model weights and datasets `config` needs; one line per item (also passed to `say`
    as it goes: downloads take a while). A failure is a MimaError, after the other items were tried."""
    lines: list[str] = []
    failures: list[str] = []

    def report(line: str) -> None:
        lines.append(line)
        say(line)

    try:
        report(_fetch_model(config.model.clip, config.model.pretrained))
    except MimaError as exc:
        failures.append(str(exc))
    failures += _fetch_data(config.data_args(), report)
    if failures:
        raise MimaError(failures[0] if len(failures) == 1 else f"{len(failures)} items missing: " + " | ".join(failures))
    return lines


def _fetch_model(clip: str, pretrained: str | None) -> str:
    if clip.startswith(EMBEDDED_PREFIX):
        return f"model {clip}: built on first use into {default_cache_dir()} (no download)"
    if clip.startswith(LOCAL_DIR_PREFIX):
        return f"model {clip}: a local folder (no download)"
    if not pretrained or pretrained.lower() in RANDOM_WEIGHTS:
        return f"model {clip}: random weights (no download)"
    if Path(pretrained).is_file():
        return f"model {clip}: the local file {pretrained} (no download)"
    check_pretrained_tag(clip, pretrained)
    path, cached = fetch_pretrained(clip, pretrained)
    return f"model {clip} ({pretrained}): {'already in the cache' if cached else 'downloaded'}: {path}"


def _fetch_data(data: dict, report: Callable[[str], None]) -> list[str]:
    """Download the run's clip-suite tasks that torchvision can fetch and are not complete under
    data.root; returns what is still missing, one line per task."""
    custom = [as_folder_task(task, i) for i, task in enumerate(data.get("custom_tasks") or [])]
    try:
        specs = resolve_run_tasks(data.get("suite"), data.get("tasks"), custom)
    except MimaError as exc:
        return [str(exc)]
    custom_names = {task.name for task in custom}
    failures: list[str] = []
    for spec in specs:
        if not _is_benchmark_task(spec):
            where = "a local folder" if spec.name in custom_names else "bundled or generated locally"
            report(f"data {spec.name}: {where} (no download)")
            continue
        task = REAL_TASKS[spec.name]
        if not data.get("root"):
            return [*failures, f"data.root: task {spec.name} is read from disk; set data.root (or --data.root DIR) "
                               "to the folder that holds or is to hold its files"]
        root = Path(data["root"]).expanduser()
        if check_task(task, root).status == STATUS_FOUND:
            report(f"data {spec.name}: already under {root}")
            continue
        if task.downloadable and offline():
            failures.append(f"data.root: task {spec.name} is not under {root} and this machine is offline; "
                            "run `mima prefetch --config <your config>` on a machine with internet")
            continue
        if task.downloadable:
            report(f"data {spec.name}: downloading with torchvision into {root} ...")
            try:
                task.download(root)
            except Exception as exc:  # network errors, bad archives, torchvision's RuntimeErrors: report and go on
                failures.append(f"data.root: download of {spec.name} failed ({' '.join(str(exc).split())[:200]})")
                continue
        try:
            require_files(task, str(root), download=False)  # still missing: the message `mima fit` would give
            report(f"data {spec.name}: downloaded into {root}")
        except MimaError as exc:
            failures.append(str(exc))
    return failures


def _is_benchmark_task(spec: TaskSpec) -> bool:
    # The same test as check_specs: a custom task may share a benchmark task's name.
    return clip_tasks.TASKS.get(spec.name) is spec
