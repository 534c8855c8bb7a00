"""`mima merge`: merge checkpoints with any registered strategy.

    mima merge --method ties --base theta0.safetensors --models a.safetensors b.safetensors --output m.safetensors
    mima merge --method cart --models runs/x --output m.safetensors --select-on val
    mima merge --method adamerging --models runs/x --output m.safetensors

`--models` takes safetensors state dicts or one `mima fit` run folder (its final task models in task
order, its pretrained.safetensors as --base, its config.yaml as --config). With a config (the tasks'
model and data) the merge is also evaluated on each task's test split and a results table is
written next to the output (OUTPUT.results.json and .md); `--select-on val` chooses the
hyperparameters on the validation splits first. Data-free merges without selection stream tensor by
tensor; the others hold the models in memory.

`--device` (auto, cpu, cuda, cuda:N; auto: the first GPU where torch sees one, else the CPU) is where
the arithmetic runs: each key's tensors go to the device and the merged tensor comes back to be
written; `--device cpu` gives the file the CPU merge has always written, bit for bit, and a GPU the
same within float32 rounding. Data-dependent strategies compute where their task pool is. A device
the machine lacks is refused before any input is opened.

An input tensor holding NaN or Inf is refused, naming the file and the tensor, and so is a merged
tensor that overflows (a huge --lam); `--allow-non-finite` merges such weights as they are (the
strategies that decompose matrices still cannot, which is one line too). The output is never one of
the inputs (under any name), a folder, or left half written; with results, the model and its results
files are placed as one set (mima.core.files.publish_folder).

`--format open-clip` writes a folder instead: the full CLIP (the run's text tower, the merged image
tower) that open_clip.create_model_and_transforms("local-dir:DIR") loads, its model card, and the
merged encoder with its results (mima.commands.convert.open_clip_export).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from mima.commands.merge.options import MergeOptions
from mima.core.errors import MimaError
from mima.core.files import (publish_folder, refuse_input_as_output, refuse_overwrite, remove_folders,
                             remove_stale_temporaries, stage_folder, write_error, write_json_atomic, write_text_atomic)
from mima.core.safetensors_io import load_state_dict
from mima.merging import get_method
from mima.merging.engine import expand_models, merge_device, merge_to_file, open_inputs, write_state_dict
from mima.merging.registry import HYPERPARAMETERS, DataFreeMerge, MergeMethod, PerTaskMerge
from mima.merging.selection import BestPoint, Selection, merge_with_defaults, select_on_validation

if TYPE_CHECKING:
    from mima.pools import TaskPool


def flag(name: str) -> str:
    return HYPERPARAMETERS[name].flag if name in HYPERPARAMETERS else "--" + name.replace("_", "-")


def check_hyperparameter_flags(method: MergeMethod, given: Mapping[str, object]) -> None:
    """Refuse, naming the flag, a hyperparameter given that the method does not take, a bad value, or one
    the chosen mode does not use."""
    for name in given:
        if name not in method.defaults:
            raise MimaError(f"{flag(name)} does not apply to merge method '{method.name}'")
    method.hyperparameters(given, spell=flag)


def run_merge(options: MergeOptions) -> None:
    if options.format == "open-clip":  # this merge, written with the run's text tower as a full open_clip CLIP folder
        from mima.convert.open_clip_export import merge_to_open_clip

        merge_to_open_clip(options, run_merge)
        return
    method = get_method(options.method)
    given = options.hyperparameters
    check_hyperparameter_flags(method, given)
    device = merge_device(options.device, "--device")  # an absent GPU is refused before any file is opened
    if options.output.is_dir():  # before any work: no --overwrite replaces a folder by a file
        raise MimaError(f"{options.output}: is a folder; give a file name to write")
    if not options.overwrite:
        refuse_overwrite([options.output, *results_paths(options.output)])
    model_paths, run_tasks, run_base = expand_models(options.models)
    base_path = options.base if options.base is not None else run_base
    refuse_input_as_output(options.output, [*model_paths, *([base_path] if base_path is not None else [])])
    with open_inputs(model_paths, base_path) as inputs:  # the method's rules, from the headers, before anything else
        method.check(inputs.models, inputs.base, options.allow_non_finite, **given)
    config = options.config or (options.models[0] if run_tasks is not None else None)
    if options.log_to_tracker and run_tasks is None:
        raise MimaError("--log-to-tracker: needs --models RUN_FOLDER (the run whose tracker runs take the results)")
    if (method.needs_data or options.select_on) and config is None:
        raise MimaError(f"merge method '{method.name}' with these options needs --config (the tasks' model and data)")
    if config is None:
        if options.overwrite:  # an earlier merge's results would describe the model this one replaces
            for stale in results_paths(options.output):
                stale.unlink(missing_ok=True)
        selection, pool = merge_into(options.output, options, method, model_paths, base_path, None, device), None
        summary = []
    else:
        # the merged model and its results are one set: written into a staging folder beside the
        # output, then placed together (an interrupted merge leaves the earlier set, never a new model
        # beside the results of the one it replaced)
        from mima.pools import task_pool  # the model and data stack only when a merge is judged on tasks

        pool = task_pool(config)
        remove_stale_temporaries(options.output)  # a staged set a killed merge left beside the output
        staging, created = stage_folder(options.output)
        staged = staging / options.output.name
        try:
            selection = merge_into(staged, options, method, model_paths, base_path, pool, device)
            summary = report_results(staged, method, selection, pool, shown_as=options.output)
            publish_folder(staging, options.output.parent, options.overwrite)
        except BaseException as exc:
            shutil.rmtree(staging, ignore_errors=True)
            remove_folders(created)
            if isinstance(exc, Exception):
                raise write_error(exc, options.output.parent, staging) from None
            raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    where = "" if device.type == "cpu" or method.needs_data else f" on {device}"
    print(f"mima merge: {method.name} ({', '.join(f'{k}={v}' for k, v in printable(selection.hparams).items()) or 'defaults'})"
          f"{where} -> {options.output}")
    for line in summary:
        print(f"mima merge: {line}")
    if options.log_to_tracker and pool is not None:
        log_results_to_trackers(options.models[0], method.name, results_paths(options.output)[0])


def log_results_to_trackers(run_dir: Path, method: str, results_file: Path) -> None:
    """The merge's test accuracies as merge/<method>/<task> (and .../mean) to the run's tracker runs."""
    from mima.config.run_config import load_run_config
    from mima.core.files import read_json
    from mima.training.trackers import log_to_run_trackers

    accuracy = read_json(results_file)["test_accuracy"]
    logger_setting = (load_run_config(run_dir).other.get("trainer") or {}).get("logger")
    metrics = {f"merge/{method}/{task}": float(value) for task, value in accuracy.items()}
    for line in log_to_run_trackers(run_dir, logger_setting, metrics, "mima merge"):
        print(line)


def merge_into(path: Path, options: MergeOptions, method: MergeMethod, model_paths: list[Path], base_path: Path | None,
               pool: "TaskPool | None", device) -> Selection:
    """Merge the inputs into the file `path` (the output, or its staged copy); the selection made."""
    given, allow = options.hyperparameters, options.allow_non_finite
    with open_inputs(model_paths, base_path) as inputs:
        # the method's own rules (theta_0, task count, --min-tasks, --matrix-keys), from the headers,
        # before any merge; the merge below runs the same check again on its inputs
        checked = method.check(inputs.models, inputs.base, allow, **given)
        if pool is not None and len(inputs.models) != len(pool.tasks):
            raise MimaError(f"{len(inputs.models)} models given but the config has {len(pool.tasks)} tasks ({', '.join(pool.tasks)})")
        metadata = {"method": method.name, "models": [str(p) for p in model_paths],
                    "base": str(base_path) if method.needs_base else None}
        if isinstance(method, DataFreeMerge) and not options.select_on:  # streams, tensor by tensor
            merge_to_file(method, inputs, path, given, {**metadata, "hparams": printable(checked.values)},
                          options.overwrite, allow_non_finite=allow, device=device)
            return Selection(method.name, checked.values, None)
        # read through the checked views, so that a NaN or Inf is named by its file
        models = [dict(view.items()) for view in checked.models]
        base = dict(checked.base.items()) if checked.base is not None else None
        # the method bound to the device, so that selection's merges and sweeps compute there too
        selection = choose(method.on(device), models, base, pool, given, options.select_on, allow)
        per_task = isinstance(method, PerTaskMerge)
        order = list(selection.merged) if per_task else list((base or models[0]).keys())
        meta = {**metadata, "hparams": printable(selection.hparams)}
        if per_task:
            meta.update(kind="per_task", tasks=pool.tasks if pool else len(models))
        write_state_dict(path, selection.merged, order, meta, options.overwrite, allow_non_finite=allow)
        return selection


def choose(method: MergeMethod, models, base, pool: "TaskPool | None", given: Mapping[str, object], select_on: str | None,
           allow_non_finite: bool = False) -> Selection:
    if select_on is None:
        output = method.merge(models, base, pool, allow_non_finite, **given)
        return Selection(method.name, method.hyperparameters(given), None, [], output.state, output.notes)
    validation = pool.evaluator("val")
    if isinstance(method, PerTaskMerge):
        return select_per_task(method, models, base, pool, allow_non_finite)
    if given:
        raise MimaError("--select-on val chooses the hyperparameters itself; leave them out or drop --select-on")
    return select_on_validation(method, models, base, validation.mean_accuracy, pool=pool, allow_non_finite=allow_non_finite)


def select_per_task(method: PerTaskMerge, models, base, pool: "TaskPool", allow_non_finite: bool = False) -> Selection:
    """Per-task methods pick their grid value for each task on that task's own validation split (the
    best score, the first value on ties: BestPoint)."""
    if not method.grid:
        return merge_with_defaults(method, models, base, allow_non_finite=allow_non_finite)
    (name, values), = method.grid.items()
    validation = pool.evaluator("val")
    scores: dict[float, list[float]] = {}
    for value in values:
        index = method(models, base, allow_non_finite=allow_non_finite, **{name: value})
        scores[value] = [validation.accuracy(method.reconstruct(index, t), [task])[task] for t, task in enumerate(pool.tasks)]
    best = []
    for t in range(len(pool.tasks)):
        task_best: BestPoint[object] = BestPoint()
        for value in values:
            task_best.offer(scores[value][t], value)
        best.append(task_best.point)
    trials = [{name: value, "task": task, "score": scores[value][t]} for value in values for t, task in enumerate(pool.tasks)]
    chosen = method.hyperparameters({name: best})
    return Selection(method.name, chosen, None, trials, method(models, base, allow_non_finite=allow_non_finite, **{name: best}))


def results_paths(output: Path) -> tuple[Path, Path]:
    return output.with_name(output.name + ".results.json"), output.with_name(output.name + ".results.md")


def printable(hparams: dict) -> dict:
    return {k: v for k, v in hparams.items() if k != "matrix_keys"}


def report_results(output: Path, method: MergeMethod, selection: Selection, pool: "TaskPool",
                   overwrite: bool = True, shown_as: Path | None = None) -> list[str]:
    """Each task's test accuracy (per-task methods: of that task's own model), written beside the output;
    returns the lines that tell the user what it found and where it wrote it (`shown_as`: the path
    the output will have, when `output` is its staged copy)."""
    test = pool.evaluator("test")
    if isinstance(method, PerTaskMerge):
        accuracy = {task: test.accuracy(method.reconstruct(selection.merged, t), [task])[task] for t, task in enumerate(pool.tasks)}
    else:
        accuracy = test.accuracy(selection.merged or load_state_dict(output))
    mean = sum(accuracy.values()) / len(accuracy)
    report = {
        "method": method.name, "hparams": printable(selection.hparams), "selected_on": "val" if selection.trials else None,
        "validation_accuracy": selection.score, "test_accuracy": {**accuracy, "mean": mean},
        "trials": selection.trials, "notes": selection.notes or None,
    }
    json_path, md_path = results_paths(output)
    write_json_atomic(json_path, report, overwrite=overwrite)
    lines = [f"# {method.name}: {output.name}", "", f"Hyperparameters: {json.dumps(report['hparams'])}", "",
             "| task | test accuracy (%) |", "|---|---|"]
    lines += [f"| {task} | {100 * value:.1f} |" for task, value in accuracy.items()] + [f"| mean | {100 * mean:.1f} |"]
    if selection.trials:
        keys = [k for k in selection.trials[0] if k != "score"]
        lines += ["", "Validation grid:", "", "| " + " | ".join(keys) + " | val accuracy (%) |", "|" + "---|" * (len(keys) + 1)]
        lines += ["| " + " | ".join(str(t[k]) for k in keys) + f" | {100 * t['score']:.1f} |" for t in selection.trials]
    write_text_atomic(md_path, "\n".join(lines) + "\n", overwrite=overwrite)
    chosen = "" if selection.score is None else f"; validation {100 * selection.score:.1f} (the best of {len(selection.trials)} grid points)"
    tasks = ", ".join(f"{task} {100 * value:.1f}" for task, value in accuracy.items())
    shown_json, shown_md = results_paths(shown_as or output)
    return [f"test accuracy (%): {tasks}; mean {100 * mean:.1f}{chosen}", f"wrote {shown_json} and {shown_md}"]
