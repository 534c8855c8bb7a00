"""The merge service: what `mima merge` (mima/commands/merge/, which parses its command line) and
`mima.merge` (mima/api.py) run, one program for both.

    mima merge --method ties --base theta0.safetensors --models a.safetensors b.safetensors --output m.safetensors
    mima merge --method cart --models runs/x --output m.safetensors --select-on val
    mima merge --method adamerging --models runs/x --output m.safetensors

`--models` takes safetensors state dicts or one `mima fit` run folder (its final task models in task
order, its pretrained.safetensors as --base, its config.yaml as --config: `resolve_inputs`). With a
config (the tasks' model and data) the merge is also evaluated on each task's test split and a
results table is written next to the output (OUTPUT.results.json and .md); `--select-on val` chooses
the hyperparameters on the validation splits first (mima.merging.selection.choose). Data-free merges
without selection stream tensor by tensor; the others hold the models in memory. `--cache` says
whether that task pool reads the decoded-image cache (mima.evaluation.cache_use; auto: off, the pool
evaluating on the CPU).

`--device` (auto, cpu, cuda, cuda:N; auto: the first GPU where torch sees one, else the CPU) is where
the arithmetic runs: each key's tensors go to the device and the merged tensor comes back to be
written; `--device cpu` gives the file the CPU merge has always written, bit for bit, and a GPU the
same within float32 rounding. Data-dependent strategies compute where their task pool is. A device
the machine lacks is refused before any input is opened.

An input tensor holding NaN or Inf is refused, naming the file and the tensor, and so is a merged
tensor that overflows (a huge --lam); `--allow-non-finite` merges such weights as they are (the
strategies that decompose matrices still cannot, which is one line too). The output is never one of
the inputs (under any name), a folder, or left half written, and never lands on a run folder's own
files or inside the run folder of an input (mima.core.run_outputs); with results, the model and its
results files are placed as one set (mima.core.publish.publish_folder).

`--format open-clip` writes a folder instead: the full CLIP (the run's text tower, the merged image
tower) that open_clip.create_model_and_transforms("local-dir:DIR") loads, its model card, and the
merged encoder with its results (`merge_to_open_clip`, writing through mima.convert.open_clip_export).

Every refusal is written once, here, in the words the command prints after `error:`; the API raises
it as a MimaError. A request the command's parser made has passed `check_request` already (argparse
said the same); one from the API is checked by it.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from mima.config.source import check_config_source
from mima.core.errors import MimaError
from mima.core.files import (refuse_input_as_output, refuse_overwrite, remove_stale_temporaries, write_error,
                             write_json_atomic, write_text_atomic)
from mima.core.publish import atomic_folder, publish_folder, remove_folders, stage_folder
from mima.core.run_outputs import refuse_output_on_runs
from mima.core.safetensors_io import load_state_dict
from mima.core.spelling import check_device_spelling, suggest_option
from mima.evaluation.cache_use import CACHE_MODES, cache_use
from mima.merging import get_method
from mima.merging.catalogue import HYPERPARAMETERS, check_method_name
from mima.merging.engine import expand_models, merge_device, merge_to_file, open_inputs, write_state_dict
from mima.merging.registry import DataFreeMerge, MergeMethod, PerTaskMerge
from mima.merging.selection import Selection, choose
from mima.services.arguments import checked_state_dicts
from mima.services.merge_request import SELECT_ON, MergeRequest

if TYPE_CHECKING:
    from mima.pools import TaskPool

StateDict = dict[str, torch.Tensor]
StateDictOrFile = Mapping[str, torch.Tensor] | str | os.PathLike
Say = Callable[[str], None]  # where the command's lines go (print; a list's append to hold them)
# The task pool a merge is judged on evaluates where mima.pools.task_pool leaves its encoder: the CPU
# (data-dependent strategies compute there too, whatever --device says), so --cache auto is off.
POOL_DEVICE_TYPE = "cpu"


# ------------------------------------------------------------------------------ the checks
def flag(name: str) -> str:
    """The `mima merge` flag of a hyperparameter's name (of any name: as argparse would spell it)."""
    return HYPERPARAMETERS[name].flag if name in HYPERPARAMETERS else "--" + name.replace("_", "-")


def parser_line(message: str) -> MimaError:
    """A mistake in the words `mima merge`'s parser uses (mima.commands.common.OneLineParser)."""
    return MimaError(f"{message} (see mima merge --help)")


def invalid_choice(option: str, value: object, choices: Sequence[str]) -> MimaError:
    """argparse's line for a value outside an option's choices."""
    listed = ", ".join(repr(choice) for choice in choices)
    return parser_line(f"argument {option}: invalid choice: {value!r} (choose from {listed})")


def check_hyperparameter_names(given: Mapping[str, object]) -> None:
    """A name that is no hyperparameter at all, refused as `mima merge` refuses its flag (with the
    nearest known one); a known one the method does not take is check_hyperparameter_flags' line."""
    flags = [spec.flag for spec in HYPERPARAMETERS.values()]
    for name in given:
        if name not in HYPERPARAMETERS:
            suggestion = suggest_option(flag(name), flags)
            hint = f"; did you mean {suggestion}?" if suggestion else ""
            raise parser_line(f"unrecognized option {flag(name)}{hint}")


def check_request(request: MergeRequest) -> None:
    """What `mima merge` checks before it opens anything, in its order: what its parser checks (a
    request the parser made passes these), then that a --config given exists and is a config."""
    check_method_name(request.method)
    check_hyperparameter_names(request.hyperparameters)
    try:
        check_device_spelling(request.device)
    except ValueError as mistake:
        raise parser_line(f"argument --device: {mistake}") from None
    if request.select_on is not None and request.select_on not in SELECT_ON:
        raise invalid_choice("--select-on", request.select_on, SELECT_ON)
    if request.cache not in CACHE_MODES:
        raise invalid_choice("--cache", request.cache, CACHE_MODES)
    if request.config is not None:
        check_config_source(request.config)


def check_hyperparameter_flags(method: MergeMethod, given: Mapping[str, object]) -> None:
    """Refuse, naming the flag, a hyperparameter given that the method does not take, a bad value, or one
    the chosen mode does not use."""
    for name in given:
        if name not in method.defaults:
            raise MimaError(f"{flag(name)} does not apply to merge method '{method.name}'")
    method.hyperparameters(given, spell=flag)


def refuse_without_config(method: MergeMethod, select_on: str | None, config: Path | None) -> None:
    """A merge that needs the tasks' data (to compute, or to choose on) refused without a config."""
    if (method.needs_data or select_on) and config is None:
        raise MimaError(f"merge method '{method.name}' with these options needs --config (the tasks' model and data)")


# ------------------------------------------------------------------------------ the inputs
@dataclass(frozen=True)
class MergeInputs:
    """--models and --base as files, and the config that judges the merge."""

    models: list[Path]  # the task models' files, in task order
    base: Path | None  # theta_0's file
    config: Path | None  # the tasks' model and data: --config, else the run folder's
    run: Path | None  # the `mima fit` run folder given as --models, if one was

    @property
    def files(self) -> list[Path]:
        return [*self.models, *([self.base] if self.base is not None else [])]


def resolve_inputs(request: MergeRequest) -> MergeInputs:
    """The request's inputs; a run folder supplies its final task models, its theta_0 as the base (unless
    --base is given) and itself as the config (unless --config is given)."""
    model_paths, run_tasks, run_base = expand_models(request.models)
    run = request.models[0] if run_tasks is not None else None
    base = request.base if request.base is not None else run_base
    return MergeInputs(model_paths, base, request.config or run, run)


def judging_pool(config: Path, models: int, cache: str) -> TaskPool:
    """The task pool of `config` that judges (and feeds) the merge, refused in one line unless it has
    one task per model."""
    from mima.pools import task_pool  # the model and data stack only when a merge is judged on tasks

    pool = task_pool(config, cache_use(cache, POOL_DEVICE_TYPE))
    if models != len(pool.tasks):
        raise MimaError(f"{models} models given but the config has {len(pool.tasks)} tasks ({', '.join(pool.tasks)})")
    return pool



# ------------------------------------------------------------------------------ in memory
def merged_state(request: MergeRequest, models: Sequence[StateDictOrFile] | None = None,
                 base: StateDictOrFile | None = None) -> StateDict:
    """The state dict `mima merge` would write for `request`, not written (mima.merge without an
    output): of request.models and request.base (files, or a run folder), or of `models` and `base`
    when given (state dicts, or files read whole; request.models then unread)."""
    check_request(request)
    method = get_method(request.method)
    given, allow = request.hyperparameters, request.allow_non_finite
    check_hyperparameter_flags(method, given)
    device = merge_device(request.device, "--device")  # an absent GPU is refused before any input is read
    config = request.config
    if models is None:
        inputs = resolve_inputs(request)
        config = inputs.config
        with open_inputs(inputs.models, inputs.base) as opened:
            # as `mima merge` reads them: through the checked views, so that a NaN or Inf is named by its file
            checked = method.check(opened.models, opened.base, allow, **given)
            models = [dict(view.items()) for view in checked.models]
            base = dict(checked.base.items()) if checked.base is not None else None
    else:
        models, base = [state_dict_of(model) for model in models], state_dict_of(base) if base is not None else None
        checked_state_dicts(models, base)  # as open_inputs checks files: keys, shapes, dtypes, weights
    refuse_without_config(method, request.select_on, config)
    pool = judging_pool(config, len(models), request.cache) if config is not None else None
    return dict(choose(method.on(device), models, base, pool, given, request.select_on, allow).merged)


def state_dict_of(item: StateDictOrFile) -> StateDict:
    return dict(item) if isinstance(item, Mapping) else load_state_dict(Path(item))


# ------------------------------------------------------------------------------ to a file
def run_merge(request: MergeRequest, say: Say = print) -> None:
    """`mima merge`: the merge written to request.output (a file, or with format "open-clip" a
    folder), with its results beside it when a config judges it; the command's lines go to `say`."""
    check_request(request)
    # before anything is read: a run folder given (or one a given file lies in) is never written into
    refuse_output_on_runs("--output", request.output, [*request.models, request.base, request.config])
    if request.format == "open-clip":
        merge_to_open_clip(request, say)
    else:
        merge_into_file(request, request.output, say)


def merge_into_file(request: MergeRequest, shown_as: Path, say: Say) -> None:
    """The merge written to request.output (the lines naming it `shown_as`: where it will be seen)."""
    method = get_method(request.method)
    given, output = request.hyperparameters, request.output
    check_hyperparameter_flags(method, given)
    device = merge_device(request.device, "--device")  # an absent GPU is refused before any file is opened
    if output.is_dir():  # before any work: no --overwrite replaces a folder by a file
        raise MimaError(f"{output}: is a folder; give a file name to write")
    if not request.overwrite:
        refuse_overwrite([output, *results_paths(output)])
    inputs = resolve_inputs(request)
    refuse_input_as_output(output, inputs.files)
    with open_inputs(inputs.models, inputs.base) as opened:  # the method's rules, from the headers, before anything else
        method.check(opened.models, opened.base, request.allow_non_finite, **given)
    if request.log_to_tracker and inputs.run is None:
        raise MimaError("--log-to-tracker: needs --models RUN_FOLDER (the run whose tracker runs take the results)")
    refuse_without_config(method, request.select_on, inputs.config)
    if inputs.config is None:
        if request.overwrite:  # an earlier merge's results would describe the model this one replaces
            for stale in results_paths(output):
                stale.unlink(missing_ok=True)
        selection, summary = merge_into(output, request, method, inputs, None, device), []
    else:
        selection, summary = judged_merge(request, method, inputs, device, shown_as)
    where = "" if device.type == "cpu" or method.needs_data else f" on {device}"
    hparams = ", ".join(f"{k}={v}" for k, v in printable(selection.hparams).items()) or "defaults"
    say(f"mima merge: {method.name} ({hparams}){where} -> {shown_as}")
    for line in summary:
        say(f"mima merge: {line}")
    if request.log_to_tracker:
        log_results_to_trackers(inputs.run, method.name, results_paths(output)[0], say)


def judged_merge(request: MergeRequest, method: MergeMethod, inputs: MergeInputs, device: torch.device,
                 shown_as: Path) -> tuple[Selection, list[str]]:
    """The merge and its results, judged on the config's tasks and placed as one set: written into a
    staging folder beside the output, then placed together (an interrupted merge leaves the earlier
    set, never a new model beside the results of the one it replaced). The selection, and the lines
    that say the results."""
    output = request.output
    pool = judging_pool(inputs.config, len(inputs.models), request.cache)
    remove_stale_temporaries(output)  # a staged set a killed merge left beside the output
    staging, created = stage_folder(output)
    staged = staging / output.name
    try:
        selection = merge_into(staged, request, method, inputs, pool, device)
        summary = report_results(staged, method, selection, pool, shown_as=shown_as)
        publish_folder(staging, output.parent, request.overwrite)
    except BaseException as exc:
        shutil.rmtree(staging, ignore_errors=True)
        remove_folders(created)
        if isinstance(exc, Exception):
            raise write_error(exc, output.parent, staging) from None
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return selection, summary


def merge_into(path: Path, request: MergeRequest, method: MergeMethod, inputs: MergeInputs, pool: TaskPool | None,
               device: torch.device) -> Selection:
    """Merge the inputs into the file `path` (the output, or its staged copy); the selection made."""
    given, allow = request.hyperparameters, request.allow_non_finite
    with open_inputs(inputs.models, inputs.base) as opened:
        # the method's own rules (theta_0, task count, --min-tasks, --matrix-keys), from the headers,
        # before any merge; the merge below runs the same check again on its inputs
        checked = method.check(opened.models, opened.base, allow, **given)
        metadata = {"method": method.name, "models": [str(p) for p in inputs.models],
                    "base": str(inputs.base) if method.needs_base else None}
        if isinstance(method, DataFreeMerge) and not request.select_on:  # streams, tensor by tensor
            merge_to_file(method, opened, path, given, {**metadata, "hparams": printable(checked.values)},
                          request.overwrite, allow_non_finite=allow, device=device)
            return Selection(method.name, checked.values, None)
        # read through the checked views, so that a NaN or Inf is named by its file
        models = [dict(view.items()) for view in checked.models]
        base = dict(checked.base.items()) if checked.base is not None else None
        # the method bound to the device, so that selection's merges and sweeps compute there too
        selection = choose(method.on(device), models, base, pool, given, request.select_on, allow)
        per_task = isinstance(method, PerTaskMerge)
        order = list(selection.merged) if per_task else list((base or models[0]).keys())
        meta = {**metadata, "hparams": printable(selection.hparams)}
        if per_task:
            meta.update(kind="per_task", tasks=pool.tasks if pool else len(models))
        write_state_dict(path, selection.merged, order, meta, request.overwrite, allow_non_finite=allow)
        return selection


# ------------------------------------------------------------------------------ as an open_clip folder
def merge_to_open_clip(request: MergeRequest, say: Say) -> None:
    """`mima merge --format open-clip`: the merged encoder and its results written into the staging
    folder of request.output, then the full CLIP and its card beside them (mima.convert.open_clip_export);
    the folder appears whole or not at all."""
    # open_clip and the model stack only for this format (a merge of files loads neither)
    from mima.convert.open_clip_export import MERGED_ENCODER, done_line, write_merged_open_clip
    from mima.convert.open_clip_writer import OPEN_CLIP_FILES, refuse_existing_folder

    output = request.output
    if isinstance(get_method(request.method), PerTaskMerge):
        raise MimaError(f"--format open-clip: merge method '{request.method}' writes one model per task (an index), "
                        "not one image encoder; merge to a .safetensors file")
    inputs = resolve_inputs(request)
    if inputs.config is None:
        raise MimaError("--format open-clip: needs --config or a run folder in --models (the run whose CLIP gives the "
                        "text tower)")
    refuse_existing_folder(output, request.overwrite)
    for name in (*OPEN_CLIP_FILES, MERGED_ENCODER):
        refuse_input_as_output(output / name, inputs.files)
    said: list[str] = []  # the merge's lines, said once the folder is in place
    with atomic_folder(output, overwrite=request.overwrite) as staging:
        encoder = replace(request, output=staging / MERGED_ENCODER, format="safetensors", overwrite=False)
        merge_into_file(encoder, output / MERGED_ENCODER, said.append)
        export = write_merged_open_clip(staging, inputs.config, merge_command(request), output)
    for line in said:
        say(line)
    say(done_line("merge", export, output))


def merge_command(request: MergeRequest) -> list[str]:
    """The `mima merge` command line of `request`, for the model card's recipe."""
    command = ["mima", "merge", "--method", request.method]
    command += ["--base", str(request.base)] if request.base is not None else []
    command += ["--models", *map(str, request.models)]
    command += ["--config", str(request.config)] if request.config is not None else []
    command += ["--select-on", request.select_on] if request.select_on else []
    for name, value in request.hyperparameters.items():
        values = value if isinstance(value, (list, tuple)) else [value]
        command += [flag(name), *map(str, values)]
    return command + ["--format", "open-clip", "--output", str(request.output)]


# ------------------------------------------------------------------------------ the results
def results_paths(output: Path) -> tuple[Path, Path]:
    return output.with_name(output.name + ".results.json"), output.with_name(output.name + ".results.md")


def printable(hparams: dict) -> dict:
    return {k: v for k, v in hparams.items() if k != "matrix_keys"}


def report_results(output: Path, method: MergeMethod, selection: Selection, pool: TaskPool,
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
    write_text_atomic(md_path, results_markdown(output.name, report, selection.trials), overwrite=overwrite)
    chosen = "" if selection.score is None else f"; validation {100 * selection.score:.1f} (the best of {len(selection.trials)} grid points)"
    tasks = ", ".join(f"{task} {100 * value:.1f}" for task, value in accuracy.items())
    shown_json, shown_md = results_paths(shown_as or output)
    return [f"test accuracy (%): {tasks}; mean {100 * mean:.1f}{chosen}", f"wrote {shown_json} and {shown_md}"]


def results_markdown(name: str, report: Mapping, trials: Sequence[Mapping]) -> str:
    """OUTPUT.results.md: the hyperparameters, each task's test accuracy and the validation grid."""
    accuracy = dict(report["test_accuracy"])
    mean = accuracy.pop("mean")
    lines = [f"# {report['method']}: {name}", "", f"Hyperparameters: {json.dumps(report['hparams'])}", "",
             "| task | test accuracy (%) |", "|---|---|"]
    lines += [f"| {task} | {100 * value:.1f} |" for task, value in accuracy.items()] + [f"| mean | {100 * mean:.1f} |"]
    if trials:
        keys = [k for k in trials[0] if k != "score"]
        lines += ["", "Validation grid:", "", "| " + " | ".join(keys) + " | val accuracy (%) |", "|" + "---|" * (len(keys) + 1)]
        lines += ["| " + " | ".join(str(t[k]) for k in keys) + f" | {100 * t['score']:.1f} |" for t in trials]
    return "\n".join(lines) + "\n"


def log_results_to_trackers(run_dir: Path, method: str, results_file: Path, say: Say) -> None:
    """The merge's test accuracies as merge/<method>/<task> (and .../mean) to the run's tracker runs."""
    from mima.config.run_config import load_run_config
    from mima.core.bounded_json import read_json
    from mima.training.trackers import log_to_run_trackers

    accuracy = read_json(results_file)["test_accuracy"]
    logger_setting = (load_run_config(run_dir).other.get("trainer") or {}).get("logger")
    metrics = {f"merge/{method}/{task}": float(value) for task, value in accuracy.items()}
    for line in log_to_run_trackers(run_dir, logger_setting, metrics, "mima merge"):
        say(line)
