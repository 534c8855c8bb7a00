"""`mima analyze ctl MODELS`: cross-task linearity of two task models, layer by layer (paper 003).

Writes ctl.json, ctl.png and (with theta_0) ctl_arithmetic.png, by default into RUN/analysis/ctl.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import ConcatDataset, DataLoader

from mima.analysis.common import output_folder, write_json
from mima.analysis.ctl.compute import (
    LinearityResult,
    StateDict,
    cross_task_linearity,
    layer_batch_dims,
    select_layers,
    task_arithmetic_linearity,
)
from mima.analysis.ctl.options import NAME, CtlOptions
from mima.core.errors import MimaError
from mima.core.run_folder import RunFolder
from mima.core.safetensors_io import load_state_dict
from mima.core.state_dicts import check_compatible
from mima.core.subsets import fixed_subset
from mima.pools import task_pool


@dataclass
class _Inputs:
    tasks: list[str]  # the two tasks, in model order
    paths: list[Path]
    base_path: Path | None
    config: Path
    run: RunFolder | None


def _resolve_inputs(options: CtlOptions) -> _Inputs:
    """Pick the two model files (without loading every task model of a run)."""
    paths = list(options.models)
    if len(paths) == 1 and paths[0].is_dir():
        run = RunFolder(paths[0])
        tasks = run.task_order()
        if len(tasks) < 2:
            raise MimaError(f"{paths[0]}: the run has one task ({tasks[0]}); CTL needs two task models")
        chosen = list(options.tasks) if options.tasks else tasks[:2]
        for task in chosen:
            if task not in tasks:
                raise MimaError(f"--tasks {task}: not a task of {paths[0]} (tasks: {', '.join(tasks)})")
        if chosen[0] == chosen[1]:
            raise MimaError(f"--tasks: give two different tasks (got {chosen[0]} twice)")
        picked = [run.final_file(task) for task in chosen]
        base = options.base if options.base is not None else run.pretrained_file
        return _Inputs(chosen, picked, base, options.config or paths[0], run)
    if len(paths) != 2 or any(path.is_dir() for path in paths):
        raise MimaError(
            f"MODELS: give one `mima fit` run folder, or two .safetensors files MODEL_A MODEL_B (got {len(paths)} paths)"
        )
    if options.config is None:
        raise MimaError("--config: needed with two model files: the `mima fit` config or run folder defining their tasks")
    tasks = list(options.tasks) if options.tasks else [path.stem for path in paths]
    return _Inputs(tasks, paths, options.base, options.config, None)


def _check_options(options: CtlOptions) -> None:
    bad = [a for a in options.alphas if not 0.0 <= a <= 1.0]
    if bad:
        raise MimaError(f"--alphas {bad[0]:g}: each alpha must lie in [0, 1]")
    if options.examples < 2:
        raise MimaError(f"--examples {options.examples}: need at least 2 (one image of each task)")
    if options.batch_size < 1:
        raise MimaError(f"--batch-size {options.batch_size}: must be at least 1")


def _load(path: Path, option: str) -> StateDict:
    if not path.is_file():
        raise MimaError(f"{option} {path}: no such model file")
    return load_state_dict(path)


def main(options: CtlOptions) -> dict:
    from mima.analysis.ctl.plot import ARITHMETIC_TEXT, plot_linearity
    from mima.analysis.figures import save_figure

    started = time.perf_counter()
    _check_options(options)
    inputs = _resolve_inputs(options)
    files = ["ctl.json", "ctl.png", "ctl_arithmetic.png"]
    folder = output_folder(options.out, inputs.run, NAME, files, options.overwrite, create=False,
                           inputs=options.read_paths)
    weights_a, weights_b, base = _load_models(inputs, with_base=not options.no_arithmetic)
    encoder, subsets = _encoder_and_images(inputs, options.examples, weights_a)
    folder.mkdir(parents=True, exist_ok=True)  # only now: a mistake above leaves no empty folder behind
    layers = select_layers(encoder, options.layers)
    batch_dims = layer_batch_dims(encoder, layers)

    device = _device(options.device)
    encoder.to(device)
    weights_a, weights_b = _to(weights_a, device), _to(weights_b, device)
    batches = _Images(DataLoader(ConcatDataset(subsets), batch_size=options.batch_size,
                                 pin_memory=torch.device(device).type == "cuda"), device)
    result = cross_task_linearity(encoder, layers, weights_a, weights_b, batches, options.alphas, batch_dims)
    arithmetic = None
    if base is not None:
        arithmetic = task_arithmetic_linearity(
            encoder, layers, _to(base, device), weights_a, weights_b, batches, options.lam, batch_dims
        )
    seconds = time.perf_counter() - started

    pair = f"{inputs.tasks[0]} (A) vs {inputs.tasks[1]} (B)"
    report = {
        "tasks": inputs.tasks,
        "models": [str(p) for p in inputs.paths],
        "base": str(inputs.base_path) if base is not None else None,
        "config": str(inputs.config),
        "examples_per_task": {task: len(s) for task, s in zip(inputs.tasks, subsets)},
        "interpolation": result.to_json(),
        "task_arithmetic": None if arithmetic is None else {"lambda": options.lam, **arithmetic.to_json()},
        "seconds": seconds,
    }
    write_json(folder / "ctl.json", report)
    save_figure(plot_linearity(result, f"Cross-task linearity of weight interpolation, {pair}"), folder / "ctl.png")
    written = files[:2]
    if arithmetic is not None:
        title = f"Task addition (Eq. 2, λ = {options.lam:g}): θ_0 + λ(τ_A + τ_B), {pair}"
        save_figure(plot_linearity(arithmetic, title, ARITHMETIC_TEXT), folder / files[2])
        written.append(files[2])
    elif (folder / files[2]).exists():
        (folder / files[2]).unlink()  # an older run's figure would contradict ctl.json
    skipped = "--no-arithmetic" if options.no_arithmetic else "needs theta_0: a run folder or --base"
    print(summary(result, arithmetic, pair, options.lam, skipped))
    print(f"wrote {', '.join(str(folder / f) for f in written)} in {seconds:.1f} s")
    return report


def _load_models(inputs: _Inputs, with_base: bool) -> tuple[StateDict, StateDict, StateDict | None]:
    weights_a, weights_b = (_load(path, "MODELS") for path in inputs.paths)
    base = _load(Path(inputs.base_path), "--base") if with_base and inputs.base_path is not None else None
    named = {str(inputs.paths[0]): weights_a, str(inputs.paths[1]): weights_b}
    if base is not None:
        named[str(inputs.base_path)] = base
    check_compatible(named)
    return weights_a, weights_b, base


def _encoder_and_images(inputs: _Inputs, examples: int, weights: StateDict) -> tuple[nn.Module, list]:
    """The config's image encoder, and the test images: half from task A, the rest from task B."""
    pool = task_pool(inputs.config)
    for task in inputs.tasks:
        if task not in pool.tasks:
            raise MimaError(f"--tasks {task}: not a task of --config {inputs.config} (tasks: {', '.join(pool.tasks)}); "
                            "name the tasks of MODEL_A and MODEL_B")
    expected = set(pool.encoder.state_dict())
    if set(weights) != expected:
        odd = sorted(set(weights) ^ expected)[0]
        raise MimaError(f"{inputs.paths[0]}: key '{odd}' does not match the image encoder of --config {inputs.config}")
    half = examples // 2
    subsets = [fixed_subset(pool.splits[task].test, count, seed=pool.seed)
               for task, count in zip(inputs.tasks, (half, examples - half))]
    return pool.encoder, subsets


def _device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(name)
    except RuntimeError:
        raise MimaError(f"--device {name}: not a torch device (e.g. cpu, cuda, cuda:1)") from None


class _Images:
    """The loader's images only, on the device; iterable more than once."""

    def __init__(self, loader: DataLoader, device: torch.device) -> None:
        self.loader, self.device = loader, device

    def __iter__(self):
        for images, _labels in self.loader:
            yield images.to(self.device)


def _to(weights: Mapping[str, torch.Tensor], device: torch.device) -> StateDict:
    return {key: value.to(device) for key, value in weights.items()}


def summary(result: LinearityResult, arithmetic: LinearityResult | None, pair: str, lam: float, skipped: str = "") -> str:
    """A table of means over the images: baseline cosine, then cosine and length ratio per alpha."""
    width = max(len("layer"), *(len(layer.layer) for layer in result.layers))
    columns = [f"cos a={a:g}" for a in result.alphas] + [f"ratio a={a:g}" for a in result.alphas]
    lines = [
        f"cross-task linearity, {pair}, {result.examples} test images (means over images)",
        f"{'layer':<{width}}  {'base cos':>10}" + "".join(f"  {c:>12}" for c in columns),
    ]
    for layer in result.layers:
        values = [layer.cosine[a].mean for a in result.alphas] + [layer.length_ratio[a].mean for a in result.alphas]
        row = f"{layer.layer:<{width}}  {layer.baseline_cosine.mean:>10.4f}"
        lines.append(row + "".join(f"  {v:>12.4f}" for v in values))
    if arithmetic is not None:
        lines.append(f"task addition: theta_0 + {lam:g} (tau_A + tau_B) vs the mean of theta_0 + {2 * lam:g} tau_A and "
                     f"theta_0 + {2 * lam:g} tau_B")
        lines.append(f"{'layer':<{width}}  {'base cos':>10}  {'cos':>11}  {'ratio':>11}")
        for layer in arithmetic.layers:
            lines.append(f"{layer.layer:<{width}}  {layer.baseline_cosine.mean:>10.4f}  {layer.cosine[0.5].mean:>11.4f}"
                         f"  {layer.length_ratio[0.5].mean:>11.4f}")
    else:
        lines.append(f"task addition: skipped ({skipped})")
    return "\n".join(lines)
