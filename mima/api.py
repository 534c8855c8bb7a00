"""mima from Python (a notebook, a script): the commands as functions, in the caller's process.

    import mima
    run = mima.fit("configs/demo.yaml", out="runs/demo-N2", model={"iterations": 2})   # `mima fit`
    merged = mima.merge(run, "ties")                       # a state dict; output=... writes the file
    rows = mima.evaluate([run], out="results")             # `mima evaluate`, its results.json rows
    rows = mima.load_results("results")                    # any results folder's rows (plain dicts)
    cost = mima.plan("configs/demo.yaml", devices=2)       # `mima plan --json`, as a dict

Each function runs what its command runs, through mima.services (the programs behind both fronts:
the command parses its command line and calls the same service; `mima.merge` and `mima merge` run
mima.services.merge), so a mistake raises mima.MimaError with the one line the command prints after
`error:`, and what it writes is what the command writes. docs/api.md shows every function on the
demo (tests/commands/test_api.py runs the page). The API sits beside the commands, above the services, and
imports nothing from mima/commands/ (tests/architecture/test_architecture.py); nothing in the package imports
it, and `import mima` loads it only when one of these names is first used (mima/__init__.py).
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
          overwrite: bool = False, allow_non_finite: bool = False, device: str = "auto", cache: str = "auto",
          **hyperparameters: object) -> dict[str, torch.Tensor] | Path:
    """`mima merge`: the merged state dict, or with `output` the file written (and returned).

    `models`: safetensors files, one `mima fit` run folder (its final task models, its theta_0 as the
    base, its config for data-dependent methods), or in-memory state dicts; `base` likewise a file
    or a state dict. The hyperparameters are the method's, by name (lam=0.3, k=20.0), checked as
    `mima merge` checks its flags; `cache`: --cache (auto, on, off) for the task pool a config
    gives. With `output`, every model and the base must be files (the command's own merge runs: the
    same checks, the same atomic file, and its results beside it when a config judges the merge);
    without it nothing is written.
    """
    from mima.services.arguments import merge_inputs_of, optional_path_of, switch_of, text_of
    from mima.services.merge import check_request, merged_state, run_merge
    from mima.services.merge_request import MergeRequest

    listed, base = merge_inputs_of(models, base)  # each of a type the merge takes, else one line
    in_memory = any(isinstance(item, Mapping) for item in [*listed, base])
    request = MergeRequest(method=text_of(method), models=() if in_memory else tuple(listed),
                           output=optional_path_of("output", output), base=None if in_memory else base,
                           config=optional_path_of("config", config),
                           select_on=None if select_on is None else text_of(select_on),
                           overwrite=switch_of("overwrite", overwrite),
                           allow_non_finite=switch_of("allow_non_finite", allow_non_finite), device=text_of(device),
                           cache=text_of(cache), hyperparameters=dict(hyperparameters))
    if request.output is not None:
        if in_memory:
            check_request(request)  # a misspelling is named first, as for every call
            raise MimaError("output: writing a merge of in-memory state dicts is not supported; pass files, "
                            "or save the returned state dict")
        run_merge(request)
        return request.output
    if in_memory:
        return merged_state(request, listed, base)
    return merged_state(request)


# --------------------------------------------------------------------------------------- evaluate
def evaluate(runs: PathLike | Sequence[PathLike], out: PathLike, *, merges: Sequence[str] | None = None,
             select: bool = True, overwrite: bool = False, precision: str | None = None, val_examples: int | None = None,
             skip_unfinished: bool = False, merge_device: str | None = None,
             num_workers: int | None = None, cache: str | None = None) -> list[dict[str, Any]]:
    """`mima evaluate RUNS --out OUT` in this process (one device): writes OUT's results files and cells,
    as the command does, and returns results.json's rows (`load_results(out)`). `merges`: the data-free
    strategies compared (default: the command's); select=False is --no-select; `cache`: --cache (auto, on, off)."""
    from mima.services.arguments import switch_of
    from mima.services.evaluate.options import evaluate_options

    no_select = not switch_of("select", select)
    options = evaluate_options(runs, out, merges=merges, no_select=no_select, overwrite=overwrite, precision=precision,
                               val_examples=val_examples, skip_unfinished=skip_unfinished, merge_device=merge_device,
                               num_workers=num_workers, cache=cache)  # refused as the command refuses its words
    from mima.services.evaluate.runs import run_evaluation

    run_evaluation(options)
    return load_results(out)


def load_results(folder: PathLike) -> list[dict[str, Any]]:
    """The rows of a results folder's results.json (`mima evaluate`, `mima demo`, a sweep), as plain
    dicts: `pandas.DataFrame(mima.load_results(folder))` is the table (docs/results.md names the fields)."""
    from mima.core.run_folder import SweepFolder
    from mima.evaluation.results_files import read_result_rows
    from mima.services.arguments import path_of

    sweep = SweepFolder(path_of("folder", folder))
    if not sweep.results_json.is_file():
        raise MimaError(f"{folder}: no results.json (a folder that `mima evaluate --out` or `mima demo` wrote)")
    return read_result_rows(sweep)  # each row checked: a damaged one is one line naming it


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
    from mima.services.arguments import config_of

    config = config_of("config", config)  # a path, or a mapping YAML can hold: else one line
    if not isinstance(config, Mapping):
        yield config
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
