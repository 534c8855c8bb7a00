"""`mima prefetch --config FILE`: fetch what a run needs from the network, ahead of the run.

Run it on a machine with internet (a cluster's login node); the compute nodes then find everything
on disk. It fetches
  - the open_clip weights of `model.clip` + `model.pretrained` (a tag) into open_clip's own cache
    (huggingface_hub's, under $HF_HOME; or ~/.cache/clip for URL-only tags), without building the
    model: `mima fit` loads them from there by the same tag;
  - the tasks of the `data:` section that torchvision can download, into `data.root`.
With `--weights-dir DIR` the weights are also copied to DIR/<architecture>-<tag>.<ext>, with a record
of their architecture, tag and activation beside them (WEIGHTS.open_clip.json): a config can then
name that file as `model.pretrained` on a node that has no cache, and `model.quick_gelu: auto` reads
the activation from the record. A config that names a weight file is checked for the same thing.
Everything else is local (embedded models are built on first use into $MIMA_CACHE_DIR, local-dir
folders, checkpoint files, bundled suites, custom task folders) and is reported as such. What is
still missing at the end (say, tasks that need a manual download) is named on one line, exit status 2.
With HF_HUB_OFFLINE=1 or MIMA_OFFLINE=1 nothing is downloaded: it only checks, so a compute node can
run it to see whether its caches are complete.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from mima.core.errors import MimaError
from mima.core.files import atomic_path
from mima.data.check import STATUS_FOUND, check_task
from mima.data.clip_tasks import REAL_TASKS, TASKS, require_files
from mima.data.datamodule import resolve_run_tasks
from mima.data.settings import benchmark_tasks
from mima.data.image_folder import as_folder_task
from mima.data.tasks import TaskSpec
from mima.core.cache_dir import default_cache_dir
from mima.models.clip import (
    EMBEDDED_PREFIX,
    LOCAL_DIR_PREFIX,
    RANDOM_WEIGHTS,
    check_pretrained_tag,
    fetch_pretrained,
    offline,
    resolve_quick_gelu,
    weights_record_file,
    write_weights_record,
)
from mima.config.run_config import RunConfig, load_run_config


def prefetch(config: RunConfig | str | os.PathLike, say: Callable[[str], None] = print,
             weights_dir: Path | None = None) -> list[str]:
    """Fetch the model weights and datasets a run configuration (or config file, or run folder) needs;
    one line per item (also passed to `say` as it goes: downloads take a while). What could not be
    fetched ends it with one MimaError line, after every other item was tried. `weights_dir`: also
    copy the weights there, with the record of their activation beside them."""
    if not isinstance(config, RunConfig):
        config = load_run_config(config)
    lines: list[str] = []
    failures: list[str] = []

    def report(line: str) -> None:
        lines.append(line)
        say(line)

    try:
        report(_fetch_model(config.model.clip, config.model.pretrained, config.model.quick_gelu, weights_dir))
    except MimaError as exc:
        failures.append(str(exc))
    data_failure = _fetch_data(config.data_args(), report)
    if data_failure:
        failures.append(data_failure)
    if failures:
        raise MimaError(" | ".join(failures))
    return lines


def _fetch_model(clip: str, pretrained: str | None, quick_gelu, weights_dir: Path | None = None) -> str:
    if clip.startswith(EMBEDDED_PREFIX):
        return f"model {clip}: built on first use into {default_cache_dir()} (no download)"
    if clip.startswith(LOCAL_DIR_PREFIX):
        return f"model {clip}: a local folder (no download)"
    if not pretrained or pretrained.lower() in RANDOM_WEIGHTS:
        return f"model {clip}: random weights (no download)"
    if Path(pretrained).is_file():  # refused here, on the login node, when nothing says its activation
        activation = _activation_name(resolve_quick_gelu(clip, pretrained, quick_gelu))
        return f"model {clip}: the local file {pretrained} (no download; {activation})"
    check_pretrained_tag(clip, pretrained)
    activation = resolve_quick_gelu(clip, pretrained, quick_gelu)
    path, cached = fetch_pretrained(clip, pretrained)
    line = f"model {clip} ({pretrained}): {'already in the cache' if cached else 'downloaded'}: {path}"
    if weights_dir is not None:
        copy = copy_weights(Path(path), Path(weights_dir), clip, pretrained, bool(activation))
        line += f"; copied to {copy} ({_activation_name(activation)}, recorded in {weights_record_file(copy).name})"
    return line


def _activation_name(quick_gelu: bool | None) -> str:
    return "QuickGELU" if quick_gelu else "GELU"


def copy_weights(source: Path, weights_dir: Path, clip: str, tag: str, quick_gelu: bool) -> Path:
    """Copy a tag's cached weight file to WEIGHTS_DIR/<clip>-<tag><suffix> (atomically) and record its
    activation beside it. An existing copy of the same size is kept; a different file is refused."""
    target = weights_dir.expanduser() / f"{clip}-{tag}{source.suffix}"
    if target.exists() and target.stat().st_size != source.stat().st_size:
        raise MimaError(f"--weights-dir: {target} exists and is not a copy of {source}; remove it or choose another folder")
    if not target.exists():
        with atomic_path(target, overwrite=False) as temporary:
            shutil.copyfile(source, temporary)
    write_weights_record(target, clip, tag, quick_gelu)
    return target


def _fetch_data(data: dict, report: Callable[[str], None]) -> str | None:
    """Download the run's clip-suite tasks that torchvision can fetch and that are not complete
    under data.root; what is still missing afterwards, on one line (None: nothing)."""
    try:
        custom = [as_folder_task(task, i) for i, task in enumerate(data.get("custom_tasks") or [])]
        tasks = benchmark_tasks(data.get("suite"), data.get("tasks"), data.get("benchmark"))
        specs = resolve_run_tasks(data.get("suite"), tasks, custom)
    except MimaError as exc:
        return str(exc)
    custom_names = {task.name for task in custom}
    missing: dict[str, str] = {}  # task -> its one-line message (alone, `mima fit`'s where it has one)
    why: dict[str, str] = {}  # task -> why it is still missing, for the summary of several
    for spec in specs:
        if not _is_benchmark_task(spec):
            where = "a local folder" if spec.name in custom_names else "bundled or generated locally"
            report(f"data {spec.name}: {where} (no download)")
            continue
        if not data.get("root"):
            return (f"data.root: task {spec.name} is read from disk; set data.root (or --data.root DIR) "
                    "to the folder that holds or is to hold its files")
        task, root = REAL_TASKS[spec.name], Path(data["root"]).expanduser()
        if check_task(task, root).status == STATUS_FOUND:
            report(f"data {spec.name}: already under {root}")
            continue
        if task.downloadable and offline():
            missing[spec.name] = (f"data.root: task {spec.name} is not under {root} and this machine is offline; "
                                  "run `mima prefetch --config <your config>` on a machine with internet")
            why[spec.name] = "offline"
            continue
        if task.downloadable:
            report(f"data {spec.name}: downloading with torchvision into {root} ...")
            try:
                task.download(root)
            except Exception as exc:  # network errors, bad archives, torchvision's RuntimeErrors: report and go on
                reason = " ".join(str(exc).split())[:200] or type(exc).__name__
                missing[spec.name] = f"data.root: download of {spec.name} into {root} failed ({reason})"
                why[spec.name] = f"download failed: {reason}"
                continue
        try:
            require_files(task, str(root), download=False)  # still missing: the message `mima fit` gives
            report(f"data {spec.name}: downloaded into {root}")
        except MimaError as exc:
            missing[spec.name] = str(exc)
            why[spec.name] = "incomplete after the download" if task.downloadable else "manual download"
    if len(missing) <= 1:
        return next(iter(missing.values()), None)
    root = Path(data["root"]).expanduser()
    listed = ", ".join(f"{name} ({why[name]})" for name in missing)
    return (f"data.root: {len(missing)} tasks are missing under {root}: {listed}; "
            f"`mima data check --root {root}` lists what each needs and where to get it")


def _is_benchmark_task(spec: TaskSpec) -> bool:
    # The same test as check_specs: a custom task may share a benchmark task's name.
    return TASKS.get(spec.name) is spec
