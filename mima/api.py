"""mima from Python (a notebook, a script): the commands as functions, in the caller's process.

    import mima
    run = mima.fit("configs/demo.yaml", out="runs/demo-N2", model={"iterations": 2})   # `mima fit`
    merged = mima.merge(run, "ties")                       # a state dict; output=... writes the file
    rows = mima.evaluate([run], out="results")             # `mima evaluate`, its results.json rows
    rows = mima.load_results("results")                    # any results folder's rows (plain dicts)
    cost = mima.plan("configs/demo.yaml", devices=2)       # `mima plan --json`, as a dict

Each function runs the program the command runs (mima.services: its checks and its runner), so a
mistake raises mima.MimaError with the one line the command prints after `error:`, and what it
writes is what the command writes. docs/api.md shows every function on the demo (tests/test_api.py
runs the page). The API is a front beside the commands, over the services: it imports nothing from
mima/commands/ and parses no command line (tests/test_architecture.py); nothing in the package
imports it, and `import mima` loads it only when one of these names is first used (mima/__init__.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mima.core.errors import MimaError

if TYPE_CHECKING:
    import torch

__all__ = ["MimaError", "evaluate", "fit", "load_results", "merge", "plan"]

PathLike = str | os.PathLike
StateDict = Mapping[str, "torch.Tensor"]


# ------------------------------------------------------------------------------------------ merge
def merge(models: PathLike | Sequence[PathLike | StateDict], method: str, base: PathLike | StateDict | None = None,
          output: PathLike | None = None, *, config: PathLike | None = None, select_on: str | None = None,
          overwrite: bool = False, allow_non_finite: bool = False, device: str = "auto",
          **hyperparameters: object) -> dict[str, torch.Tensor] | Path:
    """`mima merge`: the merged state dict, or with `output` the file written (and returned).

    `models`: safetensors files, one `mima fit` run folder (its final task models, its theta_0 as the
    base, its config for data-dependent methods), or in-memory state dicts; `base` likewise a file
    or a state dict. The hyperparameters are the method's, by name (lam=0.3, k=20.0), checked as
    `mima merge` checks its flags. With `output`, every model and the base must be files (the
    command itself runs: the same checks, the same atomic file, and its results beside it when a
    config judges the merge); without it nothing is written.
    """
    from mima.commands.merge.run import check_hyperparameter_flags
    from mima.merging import get_method
    from mima.merging.catalogue import check_method_name
    from mima.merging.engine import expand_models, merge_device, open_inputs

    check_method_name(method)
    _check_names(hyperparameters)
    device = _device_spelling(device)
    if select_on not in (None, "val"):
        raise MimaError(f"argument --select-on: invalid choice: {select_on!r} (choose from 'val') (see mima merge --help)")
    listed = [models] if isinstance(models, (str, os.PathLike)) else list(models)
    in_memory = [item for item in [*listed, base] if isinstance(item, Mapping)]
    if output is not None:
        if in_memory:
            raise MimaError("output: writing a merge of in-memory state dicts is not supported; pass files, "
                            "or save the returned state dict")
        return _merge_files(listed, method, base, Path(output), config, select_on, overwrite, allow_non_finite, device,
                            hyperparameters)
    strategy = get_method(method)
    check_hyperparameter_flags(strategy, hyperparameters)
    target = merge_device(device, "--device")  # an absent GPU is refused before any input is read
    if in_memory:
        tensors = [_state_dict(item) for item in listed]
        theta_0 = _state_dict(base) if base is not None else None
        return _merged(strategy, target, tensors, theta_0, config, select_on, hyperparameters, allow_non_finite)
    paths, run_tasks, run_base = expand_models([Path(item) for item in listed])
    base_path = Path(base) if base is not None else run_base
    with open_inputs(paths, base_path) as inputs:
        # as `mima merge` reads them: through the checked views, so that a NaN or Inf is named by its file
        checked = strategy.check(inputs.models, inputs.base, allow_non_finite, **hyperparameters)
        config = config if config is not None else (listed[0] if run_tasks is not None else None)
        tensors = [dict(view.items()) for view in checked.models]
        theta_0 = dict(checked.base.items()) if checked.base is not None else None
    return _merged(strategy, target, tensors, theta_0, config, select_on, hyperparameters, allow_non_finite)


def _device_spelling(device: str) -> str:
    """`device` checked as `mima merge --device` checks its spelling (whether the machine has it: later)."""
    import argparse

    from mima.commands.common import device_spelling

    try:
        return device_spelling(device)
    except argparse.ArgumentTypeError as mistake:
        raise MimaError(f"argument --device: {mistake} (see mima merge --help)") from None


def _check_names(hyperparameters: Mapping[str, object]) -> None:
    """A name that is no hyperparameter at all, refused as `mima merge` refuses its flag (with the
    nearest known one); a known one the method does not take is check_hyperparameter_flags' line."""
    from mima.commands.common import suggest_option
    from mima.merging.catalogue import HYPERPARAMETERS

    flags = [spec.flag for spec in HYPERPARAMETERS.values()]
    for name in hyperparameters:
        if name not in HYPERPARAMETERS:
            flag = "--" + name.replace("_", "-")
            suggestion = suggest_option(flag, flags)
            hint = f"; did you mean {suggestion}?" if suggestion else ""
            raise MimaError(f"unrecognized option {flag}{hint} (see mima merge --help)")


def _merged(strategy, device, models: list[dict], base: dict | None, config: PathLike | None, select_on: str | None,
            given: Mapping[str, object], allow_non_finite: bool) -> dict[str, torch.Tensor]:
    """The state dict `mima merge` would write: the strategy on `device`, its hyperparameters chosen on
    the validation splits with select_on="val" (a task pool from `config`)."""
    from mima.commands.merge.run import choose
    from mima.config.source import check_config_source

    if (strategy.needs_data or select_on) and config is None:
        raise MimaError(f"merge method '{strategy.name}' with these options needs --config (the tasks' model and data)")
    pool = None
    if config is not None:
        from mima.pools import task_pool

        check_config_source(Path(config))
        pool = task_pool(Path(config))
        if len(models) != len(pool.tasks):
            raise MimaError(f"{len(models)} models given but the config has {len(pool.tasks)} tasks ({', '.join(pool.tasks)})")
    return dict(choose(strategy.on(device), models, base, pool, given, select_on, allow_non_finite).merged)


def _state_dict(item: PathLike | StateDict) -> dict:
    from mima.core.safetensors_io import load_state_dict

    return dict(item) if isinstance(item, Mapping) else load_state_dict(Path(item))


def _merge_files(models: list, method: str, base, output: Path, config, select_on, overwrite: bool,
                 allow_non_finite: bool, device: str, hyperparameters: Mapping[str, object]) -> Path:
    from mima.commands.merge.options import MergeOptions
    from mima.commands.merge.run import run_merge
    from mima.config.source import check_config_source

    options = MergeOptions(method=method, models=tuple(Path(model) for model in models), output=output,
                           base=None if base is None else Path(base), config=None if config is None else Path(config),
                           select_on=select_on, overwrite=overwrite, allow_non_finite=allow_non_finite,
                           device=device, hyperparameters=dict(hyperparameters))
    if options.config is not None:
        check_config_source(options.config)
    run_merge(options)
    return output


# --------------------------------------------------------------------------------------- evaluate
def evaluate(runs: PathLike | Sequence[PathLike], out: PathLike, *, merges: Sequence[str] | None = None,
             select: bool = True, overwrite: bool = False, precision: str | None = None, val_examples: int | None = None,
             skip_unfinished: bool = False, merge_device: str | None = None,
             num_workers: int | None = None, cache: str | None = None) -> list[dict[str, Any]]:
    """`mima evaluate RUNS --out OUT` in this process (one device): writes OUT's results files and cells,
    as the command does, and returns results.json's rows (`load_results(out)`). `merges`: the data-free
    strategies compared (default: the command's); select=False is --no-select; `cache`: --cache (auto, on, off)."""
    from mima.services.evaluate.options import evaluate_options

    options = evaluate_options(runs, out, merges=merges, no_select=not select, overwrite=overwrite, precision=precision,
                               val_examples=val_examples, skip_unfinished=skip_unfinished, merge_device=merge_device,
                               num_workers=num_workers, cache=cache)  # refused as the command refuses its words
    from mima.services.evaluate.runs import run_evaluation

    run_evaluation(options)
    return load_results(out)


def load_results(folder: PathLike) -> list[dict[str, Any]]:
    """The rows of a results folder's results.json (`mima evaluate`, `mima demo`, a sweep), as plain
    dicts: `pandas.DataFrame(mima.load_results(folder))` is the table (docs/results.md names the fields)."""
    from mima.core.files import read_json
    from mima.core.run_folder import SweepFolder

    sweep = SweepFolder(Path(folder))
    if not sweep.results_json.is_file():
        raise MimaError(f"{folder}: no results.json (a folder that `mima evaluate --out` or `mima demo` wrote)")
    return list(read_json(sweep.results_json, expect=list))


# ------------------------------------------------------------------------------------------- plan
def plan(config: PathLike | Mapping[str, Any], *, devices: int | None = None, num_nodes: int | None = None,
         benchmark: str | None = None, batch_size: int | None = None, iterations: int | None = None,
         checkpoint_every: str | None = None, device_memory: float | None = None) -> dict[str, Any]:
    """`mima plan --config CONFIG --json` as a dict: what a `mima fit` run of `config` (a file, a run
    folder or a config dict) will cost; each keyword is the command's option of that name (devices:
    --trainer.devices, iterations: --model.iterations, ...), None leaving the config's value. The
    command runs in a process of its own (see below), its mistakes raised as MimaError."""
    options = {"--trainer.devices": devices, "--trainer.num_nodes": num_nodes, "--data.benchmark": benchmark,
               "--data.batch_size": batch_size, "--model.iterations": iterations,
               "--checkpoint_every": checkpoint_every, "--device-memory": device_memory}
    with _config_file(config) as path:
        argv = ["plan", "--config", str(path), "--json"]
        for flag, value in options.items():
            if value is not None:
                argv += [flag, str(value)]
        # a fresh process, as `mima plan`: a fit process's host memory starts from the resident memory
        # of an interpreter with the fit stack imported, which this one (a notebook) would overstate
        done = subprocess.run([sys.executable, "-m", "mima", *argv], capture_output=True, text=True)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        prefix = "mima plan: error: "
        if lines and lines[-1].startswith(prefix):
            raise MimaError(lines[-1][len(prefix):])
        raise RuntimeError(f"mima plan failed (exit status {done.returncode}): {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout)


@contextlib.contextmanager
def _config_file(config: PathLike | Mapping[str, Any]):
    """A config given as a dict, written as the YAML file a command reads (removed afterwards)."""
    if not isinstance(config, Mapping):
        yield Path(config)
        return
    import yaml

    with tempfile.TemporaryDirectory(prefix="mima-api-") as folder:
        path = Path(folder) / "config.yaml"
        path.write_text(yaml.safe_dump(dict(config), sort_keys=False))
        yield path


# -------------------------------------------------------------------------------------------- fit
def fit(config: PathLike | Mapping[str, Any], out: PathLike | None = None, **overrides: Mapping[str, Any] | object) -> Path:
    """`mima fit --config CONFIG --out OUT` in this process, on one device; returns the run folder.

    `config`: a config file or a config dict (as the YAML would hold it). Each keyword overrides a top-level key of the config; a section's keys are
    merged into the config's section: model={"iterations": 2} is `--model.iterations 2`,
    trainer={"accelerator": "cpu"}, overwrite=True; ckpt_path="last" with the same `out` resumes a
    stopped run. The run has one process on one device whatever the config says (trainer.devices and
    trainer.num_nodes 1; for several processes run the `mima fit` command).
    """
    for key in ("devices", "num_nodes"):
        wanted = (overrides.get("trainer") or {}).get(key, 1) if isinstance(overrides.get("trainer"), Mapping) else 1
        if wanted != 1:
            raise MimaError(f"trainer.{key} {wanted}: mima.fit runs in this process on one device "
                            f"(run `mima fit` for several processes)")
    from mima.services.fit.config import one_device_layers

    # checked as `mima fit` checks its --config files, before Lightning is imported
    layers, config_name = one_device_layers(config, overrides, out)
    from mima.services.fit.run import fit_config

    return Path(fit_config(layers, config_name).run_dir)
