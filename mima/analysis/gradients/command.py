"""`mima analyze gradients RUN`: per-epoch gradients of fine-tuning each task from theta_0, and
merges of one-epoch vs converged task vectors (paper 004). Writes gradients.json and gradients.png,
by default into RUN/analysis/gradients.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from mima.analysis.common import output_folder, write_json
from mima.analysis.gradients.compute import (
    GradientSettings,
    StateDict,
    analyse_gradients,
    snapshot,
)
from mima.analysis.gradients.options import DEFAULT_LR, NAME, GradientsOptions
from mima.core.errors import MimaError
from mima.core.names import ZERO_SHOT
from mima.core.run_folder import RunFolder
from mima.core.safetensors_io import load_state_dict
from mima.pools import task_pool

JSON_FILE = f"{NAME}.json"
FIGURE_FILE = f"{NAME}.png"


def settings_from_options(options: GradientsOptions) -> GradientSettings:
    weight_decay = options.weight_decay
    if weight_decay is None:
        weight_decay = 0.1 if options.optimizer == "adamw" else 0.0
    settings = GradientSettings(
        epochs=options.epochs,
        optimizer=options.optimizer,
        lr=options.lr if options.lr is not None else DEFAULT_LR[options.optimizer],
        weight_decay=weight_decay,
        batch_size=options.batch_size,
        train_examples=options.train_examples,
        seed=options.seed,
    )
    settings.check()
    return settings


def _source(run: Path) -> tuple[RunFolder | None, Path | None]:
    """(the run folder or None for a config file, its theta_0 file if it has one)."""
    if run.is_dir():
        folder = RunFolder(run)
        if not folder.config_file.is_file():
            raise MimaError(f"RUN {run}: no {folder.config_file.name} (give a `mima fit` run folder or a fit config file)")
        return folder, folder.pretrained_file if folder.pretrained_file.is_file() else None
    if not run.is_file():
        raise MimaError(f"RUN {run}: no such run folder or config file")
    return None, None


def _run_config(run: Path):
    """The run's configuration; a config file given as RUN is named RUN in messages, not --config
    (the wording of mima.config.run_config.load_run_config, which this command has no flag for)."""
    from mima.config.run_config import load_run_config

    try:
        return load_run_config(run)
    except MimaError as error:
        raise MimaError(str(error).replace(f"--config {run}", f"RUN {run}", 1)) from None


def _choose_tasks(available: Sequence[str], wanted: Sequence[str] | None) -> list[str]:
    if not wanted:
        return list(available)
    unknown = [task for task in wanted if task not in available]
    if unknown:
        raise MimaError(f"--tasks: unknown task '{unknown[0]}' (the run's tasks: {', '.join(available)})")
    if len(set(wanted)) != len(wanted):
        raise MimaError("--tasks: a task is given twice")
    return list(wanted)


def _theta_0(pool, pretrained: Path | None) -> StateDict:
    if pretrained is None:
        return snapshot(pool.encoder)
    theta_0 = load_state_dict(pretrained)
    expected = set(pool.encoder.state_dict())
    if set(theta_0) != expected:
        missing = sorted(expected - set(theta_0)) or sorted(set(theta_0) - expected)
        raise MimaError(f"{pretrained}: does not fit the config's model (key '{missing[0]}' differs)")
    return theta_0


def _summary(results: Mapping) -> list[str]:
    lines = [f"per-epoch gradients ({results['settings']['optimizer']}, lr={results['settings']['lr']:g}, "
             f"{results['settings']['epochs']} epochs):"]
    for task, row in results["per_task"].items():
        shares = " ".join(f"{v:.2f}" for v in row["share"])
        cosines = " ".join(f"{v:.2f}" for v in row["cos_first"])
        acc = row["test_accuracy"]
        lines.append(f"  {task:<10} share [{shares}]  cos(g_k,g_1) [{cosines}]  "
                     f"own test acc: 0-shot {100 * acc[ZERO_SHOT]:.1f}%, 1 epoch {100 * acc['one_epoch']:.1f}%, "
                     f"converged {100 * acc['converged']:.1f}%")
    for name, label in (("one_epoch", "1-epoch"), ("converged", "converged")):
        merged = results["merged"][name]
        lines.append(f"task arithmetic of {label} task vectors: lam={merged['lam']:g}, mean test acc "
                     f"{100 * merged['test_mean']:.1f}% (val {100 * merged['val_mean']:.1f}%)")
    return lines


def main(options: GradientsOptions) -> None:
    from mima.analysis.gradients.plot import plot_gradients

    started = time.perf_counter()
    settings = settings_from_options(options)
    run, pretrained = _source(options.run)
    pool = task_pool(_run_config(options.run))
    tasks = _choose_tasks(pool.tasks, options.tasks)
    theta_0 = _theta_0(pool, pretrained)
    # After every check that can fail on the inputs, so that a mistake leaves no empty folder behind.
    folder = output_folder(options.out, run, NAME, [JSON_FILE, FIGURE_FILE], options.overwrite, inputs=[options.run])
    try:
        device = torch.device(options.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError:
        raise MimaError(f"--device {options.device!r}: not a torch device (e.g. cpu, cuda, cuda:1)") from None
    pool.encoder.to(device)
    results = analyse_gradients(pool, tasks, theta_0, settings, log=print)
    results["source"] = str(options.run)
    results["seconds"] = time.perf_counter() - started
    write_json(folder / JSON_FILE, results)
    plot_gradients(results, folder / FIGURE_FILE)
    print("\n".join(_summary(results)))
    print(f"wrote {folder / JSON_FILE} and {folder / FIGURE_FILE} in {results['seconds']:.1f} s")
