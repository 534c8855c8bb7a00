"""What the analyses share: the models to analyse, the tasks they are judged on, output folders, figures."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib
import torch
from torch.utils.data import Dataset, Subset

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from mima.errors import MimaError  # noqa: E402
from mima.merging.engine import expand_models  # noqa: E402
from mima.safetensors_io import load_state_dict, write_json_atomic  # noqa: E402

StateDict = dict[str, torch.Tensor]


@dataclass
class ModelSet:
    """Fine-tuned task models (in task order), theta_0 if known, and where their tasks are defined."""

    tasks: list[str]
    models: list[StateDict]
    base: StateDict | None
    config: Path | None  # a `mima fit` config file or run folder: the tasks' model, heads and data
    run_dir: Path | None  # set when the models came from one run folder

    def require_base(self, option: str = "--base") -> StateDict:
        if self.base is None:
            raise MimaError(f"{option}: this analysis needs theta_0 (the pretrained state dict); give --base or a run folder")
        return self.base


def load_model_set(paths: Sequence[Path], base: Path | None = None, config: Path | None = None) -> ModelSet:
    """One `mima fit` run folder, or safetensors files (task names = file stems) with --base/--config."""
    files, tasks, run_base = expand_models(list(paths))
    for file in files:
        if not file.is_file():
            raise MimaError(f"{file}: no such model file")
    base_path = base if base is not None else run_base
    if base_path is not None and not Path(base_path).is_file():
        raise MimaError(f"--base {base_path}: no such file")
    run_dir = Path(paths[0]) if tasks is not None else None
    return ModelSet(
        tasks=tasks if tasks is not None else [file.stem for file in files],
        models=[load_state_dict(file) for file in files],
        base=load_state_dict(base_path) if base_path is not None else None,
        config=config if config is not None else run_dir,
        run_dir=run_dir,
    )


def task_context(model_set: ModelSet, option: str = "--config"):
    """The TaskContext (encoder, frozen heads, data splits) of the models' tasks."""
    from mima.merging.context import context_from_config

    if model_set.config is None:
        raise MimaError(f"{option}: accuracy needs the tasks' model and data; give a `mima fit` config or run folder")
    context = context_from_config(model_set.config)
    if len(context.tasks) != len(model_set.tasks):
        raise MimaError(f"{option} {model_set.config}: {len(context.tasks)} tasks but {len(model_set.models)} models were given")
    return context


def run_iterations(config: Path | None) -> int | None:
    """N of a run (model.iterations of its config file or run folder), when the config says."""
    import yaml

    if config is None:
        return None
    path = Path(config) / "config.yaml" if Path(config).is_dir() else Path(config)
    try:
        value = ((yaml.safe_load(path.read_text()) or {}).get("model") or {}).get("iterations")
    except (OSError, yaml.YAMLError, AttributeError):
        return None
    return value if isinstance(value, int) else None


def add_model_arguments(parser: argparse.ArgumentParser, nargs: str = "+") -> None:
    parser.add_argument("models", type=Path, nargs=nargs, help="one `mima fit` run folder, or fine-tuned .safetensors files")
    parser.add_argument("--base", type=Path, help="theta_0 (pretrained .safetensors); taken from the run folder if one is given")
    parser.add_argument("--config", type=Path, help="a `mima fit` config or run folder defining the tasks (with .safetensors files)")


def add_output_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument("--out", type=Path, help=f"output folder (default: RUN/analysis/{name}, or analysis/{name})")
    parser.add_argument("--overwrite", action="store_true", help="replace outputs already in --out")


def output_dir(out: Path | None, run_dir: Path | None, name: str, files: Sequence[str], overwrite: bool) -> Path:
    """Resolve --out and refuse to replace earlier outputs unless --overwrite."""
    folder = out if out is not None else (run_dir / "analysis" / name if run_dir is not None else Path("analysis") / name)
    existing = [file for file in files if (folder / file).exists()]
    if existing and not overwrite:
        raise MimaError(f"--out {folder}: already holds {', '.join(existing)}; pass --overwrite or another --out")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def save_figure(figure, path: Path) -> None:
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def write_json(path: Path, obj: object) -> None:
    write_json_atomic(path, obj)


def fixed_subset(dataset: Dataset, count: int | None, seed: int = 0) -> Dataset:
    """At most `count` examples drawn in a fixed random order (the whole dataset for None or more)."""
    size = len(dataset)
    if count is None or count >= size:
        return dataset
    order = torch.randperm(size, generator=torch.Generator().manual_seed(seed))[:count]
    return Subset(dataset, sorted(order.tolist()))
