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
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

from mima.errors import MimaError
from mima.merging import MERGE_METHODS, get_method
from mima.merging.engine import expand_models, merge_to_file, open_inputs, write_state_dict
from mima.merging.registry import HYPERPARAMETERS, MergeMethod
from mima.merging.selection import Selection, merge_with_defaults, select_on_validation
from mima.safetensors_io import load_state_dict, write_json_atomic, write_text_atomic

if TYPE_CHECKING:
    from mima.merging.context import TaskContext

# How each hyperparameter is given on the command line (the values are checked by the registry).
FLAG_TYPES: dict[str, dict] = {
    "lam": {"type": float}, "k": {"type": float}, "rank_ratio": {"type": float}, "drop": {"type": float},
    "density": {"type": float}, "gamma": {"type": float}, "seed": {"type": int}, "matrix_keys": {"type": str},
    "trim": {"choices": ("global", "per-tensor")}, "mask_lam": {"type": float, "nargs": "+"},
    "min_tasks": {"type": int}, "alpha": {"type": float}, "steps": {"type": int}, "lr": {"type": float},
    "granularity": {"choices": ("task", "layer")}, "iterations": {"type": int}, "mode": {"choices": ("hard", "soft")},
    "prior": {"type": float}, "examples": {"type": int}, "adapt_on": {"choices": ("test", "val", "train")},
    "start": {"choices": ("pretrained", "task_arithmetic", "adamerging")}, "step_size": {"type": float},
    "ada_steps": {"type": int},
}


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--method", required=True, help=f"one of: {', '.join(sorted(MERGE_METHODS))}")
    parser.add_argument("--base", type=Path, help="theta_0, the pretrained state dict (not needed by uniform, cart, ...)")
    parser.add_argument("--models", type=Path, nargs="+", required=True,
                        help="fine-tuned state dicts (.safetensors), or one `mima fit` run folder")
    parser.add_argument("--output", type=Path, required=True, help="where to write the merged .safetensors")
    parser.add_argument("--config", type=Path, help="a mima fit config or run folder: the tasks' model and data")
    parser.add_argument("--select-on", choices=("val",), help="choose hyperparameters on the validation splits")
    parser.add_argument("--overwrite", action="store_true", help="replace --output (and its results) if they exist")
    hyper = parser.add_argument_group("hyperparameters (each method takes some; see the method's docstring)")
    for name, spec in FLAG_TYPES.items():
        hyper.add_argument(flag(name), dest=name, default=None, help=HYPERPARAMETERS[name][1], **spec)


def given_hyperparameters(options, method: MergeMethod) -> dict[str, object]:
    given = {name: getattr(options, name) for name in FLAG_TYPES if getattr(options, name) is not None}
    if "mask_lam" in given and len(given["mask_lam"]) == 1:
        given["mask_lam"] = given["mask_lam"][0]
    for name in given:
        if name not in method.defaults:
            raise MimaError(f"{flag(name)} does not apply to merge method '{method.name}'")
    for name, value in given.items():
        check, meaning = HYPERPARAMETERS[name]
        if not check(value):
            raise MimaError(f"{flag(name)} must be {meaning}, got {value}")
    return given


def run_merge(options) -> None:
    method = get_method(options.method)
    given = given_hyperparameters(options, method)
    outputs = [options.output, *results_paths(options.output)]
    existing = [path for path in outputs if path.exists()]
    if existing and not options.overwrite:
        raise MimaError(f"{existing[0]}: already exists (pass --overwrite to replace it)")
    _, run_tasks, run_base = expand_models(options.models)
    base_path = options.base if options.base is not None else run_base
    if method.needs_base and base_path is None:
        raise MimaError(f"merge method '{method.name}' needs the pretrained model: pass --base")
    config = options.config or (options.models[0] if run_tasks is not None else None)
    if (method.needs_data or options.select_on) and config is None:
        raise MimaError(f"merge method '{method.name}' with these options needs --config (the tasks' model and data)")
    context = None
    if config is not None:  # the model and data stack is only imported when a merge is judged on tasks
        from mima.merging.context import context_from_config

        context = context_from_config(config)

    with open_inputs(options.models, base_path) as inputs:
        if context is not None and len(inputs.models) != len(context.tasks):
            raise MimaError(f"{len(inputs.models)} models given but the config has {len(context.tasks)} tasks ({', '.join(context.tasks)})")
        metadata = {"method": method.name, "models": [str(p) for p in inputs.paths[-len(inputs.models):]],
                    "base": str(base_path) if method.needs_base else None}
        streamable = not method.needs_data and not method.per_task and not options.select_on
        if streamable:
            hparams = method.hyperparameters(given)
            merge_to_file(method, inputs, options.output, given, {**metadata, "hparams": printable(hparams)}, options.overwrite)
            selection = Selection(method.name, hparams, None)
        else:
            models = [dict(view.items()) for view in inputs.models]
            base = dict(inputs.base.items()) if inputs.base is not None else None
            selection = choose(method, models, base, context, given, options.select_on)
            order = list(selection.merged) if method.per_task else list((base or models[0]).keys())
            meta = {**metadata, "hparams": printable(selection.hparams)}
            if method.per_task:
                meta.update(kind="per_task", tasks=context.tasks if context else len(models))
            write_state_dict(options.output, selection.merged, order, meta, options.overwrite)
    if context is not None:
        report_results(options.output, method, selection, context)
    print(f"mima merge: {method.name} ({', '.join(f'{k}={v}' for k, v in printable(selection.hparams).items()) or 'defaults'}) -> {options.output}")


def choose(method: MergeMethod, models, base, context: "TaskContext | None", given: dict, select_on: str | None) -> Selection:
    if select_on is None:
        merged = method(models, base, context=context, **given)
        return Selection(method.name, method.hyperparameters(given), None, [], merged)
    validation = context.evaluator("val")
    if method.per_task:
        return select_per_task(method, models, base, context)
    if given:
        raise MimaError("--select-on val chooses the hyperparameters itself; leave them out or drop --select-on")
    return select_on_validation(method, models, base, validation.mean_accuracy, context=context)


def select_per_task(method: MergeMethod, models, base, context: "TaskContext") -> Selection:
    """Per-task methods pick their grid value for each task on that task's own validation split."""
    if not method.grid:
        return merge_with_defaults(method, models, base)
    (name, values), = method.grid.items()
    validation = context.evaluator("val")
    scores: dict[float, list[float]] = {}
    for value in values:
        index = method(models, base, **{name: value})
        scores[value] = [validation.accuracy(method.reconstruct_fn(index, t), [task])[task] for t, task in enumerate(context.tasks)]
    best = [max(values, key=lambda v: scores[v][t]) for t in range(len(context.tasks))]
    trials = [{name: value, "task": task, "score": scores[value][t]} for value in values for t, task in enumerate(context.tasks)]
    chosen = method.hyperparameters({name: best})
    return Selection(method.name, chosen, None, trials, method(models, base, **{name: best}))


def results_paths(output: Path) -> tuple[Path, Path]:
    return output.with_name(output.name + ".results.json"), output.with_name(output.name + ".results.md")


def printable(hparams: dict) -> dict:
    return {k: v for k, v in hparams.items() if k != "matrix_keys"}


def report_results(output: Path, method: MergeMethod, selection: Selection, context: "TaskContext") -> None:
    """Each task's test accuracy (per-task methods: of that task's own model), written beside the output."""
    test = context.evaluator("test")
    if method.per_task:
        accuracy = {task: test.accuracy(method.reconstruct_fn(selection.merged, t), [task])[task] for t, task in enumerate(context.tasks)}
    else:
        accuracy = test.accuracy(selection.merged or load_state_dict(output))
    mean = sum(accuracy.values()) / len(accuracy)
    report = {
        "method": method.name, "hparams": printable(selection.hparams), "selected_on": "val" if selection.trials else None,
        "validation_accuracy": selection.score, "test_accuracy": {**accuracy, "mean": mean},
        "trials": selection.trials, "notes": context.notes.get(method.name),
    }
    json_path, md_path = results_paths(output)
    write_json_atomic(json_path, report)
    lines = [f"# {method.name}: {output.name}", "", f"Hyperparameters: {json.dumps(report['hparams'])}", "",
             "| task | test accuracy (%) |", "|---|---|"]
    lines += [f"| {task} | {100 * value:.1f} |" for task, value in accuracy.items()] + [f"| mean | {100 * mean:.1f} |"]
    if selection.trials:
        keys = [k for k in selection.trials[0] if k != "score"]
        lines += ["", "Validation grid:", "", "| " + " | ".join(keys) + " | val accuracy (%) |", "|" + "---|" * (len(keys) + 1)]
        lines += ["| " + " | ".join(str(t[k]) for k in keys) + f" | {100 * t['score']:.1f} |" for t in selection.trials]
    write_text_atomic(md_path, "\n".join(lines) + "\n")
