"""Merging files into a file, tensor by tensor.

The inputs are opened lazily (mima.core.tensor_files.SafetensorsReader), checked against each
other from their headers alone (keys, shapes, dtypes; the error names the key and both files), and
the merged tensors are written as they are produced. Peak memory is therefore a few tensors per
input plus what a strategy keeps between passes (TIES: one model-sized float32 buffer while it finds
a task's trim threshold), not T models.

Inputs may be safetensors state dicts or `mima fit` run folders (their final/<task>.safetensors in
task order, and pretrained.safetensors as theta_0).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from mima.core.errors import MimaError
from mima.merging.registry import MergeMethod
from mima.core.tensor_files import SafetensorsReader, SafetensorsWriter, TensorInfo
from mima.core.run_folder import RunFolder
from mima.core.state_dicts import check_compatible


class OrderedView(Mapping[str, torch.Tensor]):
    """A reader seen through a fixed key order (so every input iterates alike)."""

    def __init__(self, reader: SafetensorsReader, order: Sequence[str], path: Path | None = None,
                 allow_non_finite: bool = False) -> None:
        self.reader, self.order, self.path = reader, list(order), path
        self.allow_non_finite = allow_non_finite
        self.infos: dict[str, TensorInfo] = {key: reader.infos[key] for key in self.order}

    def __getitem__(self, key: str) -> torch.Tensor:
        tensor = self.reader[key]
        # a NaN or Inf in one input silently poisons every merge of it (sums, signs, SVDs)
        if not self.allow_non_finite and not all_finite(tensor):
            raise MimaError(f"{self.path or 'an input'}: tensor '{key}' holds NaN or Inf values; a merge needs finite "
                            "weights (--allow-non-finite merges them as they are)")
        return tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self.order)

    def __len__(self) -> int:
        return len(self.order)


@dataclass
class MergeInputs:
    base: OrderedView | None
    models: list[OrderedView]
    tasks: list[str] | None  # known when the models come from a run folder
    paths: list[Path]


def expand_models(paths: Sequence[Path]) -> tuple[list[Path], list[str] | None, Path | None]:
    """Run folders become their final task files (in task order) and suggest their theta_0."""
    if len(paths) == 1 and Path(paths[0]).is_dir():
        run = RunFolder(Path(paths[0]))
        tasks = run.task_order()
        return [run.final_file(task) for task in tasks], tasks, run.pretrained_file
    for path in paths:
        if Path(path).is_dir():
            raise MimaError(f"--models {path}: a folder; give one `mima fit` run folder alone, or safetensors files")
    return [Path(p) for p in paths], None, None


@contextlib.contextmanager
def open_inputs(model_paths: Sequence[Path], base_path: Path | None, allow_non_finite: bool = False) -> Iterator[MergeInputs]:
    """The inputs, checked against each other from their headers; with `allow_non_finite` their NaN
    and Inf values are handed to the strategy instead of refused."""
    models, tasks, run_base = expand_models(model_paths)
    base_path = base_path if base_path is not None else run_base
    paths = ([base_path] if base_path is not None else []) + models
    if len({p.resolve() for p in paths if p.exists()}) != len(paths) and all(p.exists() for p in paths):
        raise MimaError("the same file is given twice among --base and --models")
    with contextlib.ExitStack() as stack:
        readers = [stack.enter_context(SafetensorsReader(path)) for path in paths]
        check_compatible({str(path): reader.infos for path, reader in zip(paths, readers)})
        order = list(readers[0].infos)
        views = [OrderedView(reader, order, path, allow_non_finite) for reader, path in zip(readers, paths)]
        base = views[0] if base_path is not None else None
        yield MergeInputs(base, views[1:] if base_path is not None else views, tasks, paths)


def merge_to_file(
    method: MergeMethod,
    inputs: MergeInputs,
    output: Path,
    hparams: Mapping[str, object],
    metadata: Mapping[str, object],
    overwrite: bool = False,
    allow_non_finite: bool = False,
) -> None:
    """Stream `method`'s merge of `inputs` into `output` (atomically); a merged tensor holding NaN or
    Inf is an error unless `allow_non_finite`."""
    reference = inputs.base if inputs.base is not None else inputs.models[0]
    specs = [(key, info.shape, info.dtype) for key, info in reference.infos.items()]
    stream = method.stream(inputs.models, inputs.base, **hparams)  # checks before the file is opened
    with SafetensorsWriter(output, specs, metadata=metadata, overwrite=overwrite) as writer:
        for key, tensor in stream:
            writer.write(key, tensor if allow_non_finite else check_finite_output(method.name, key, tensor))


def write_state_dict(output: Path, state: Mapping[str, torch.Tensor], order: Sequence[str], metadata, overwrite=False,
                     allow_non_finite: bool = False) -> None:
    """Write an in-memory merge (data-dependent strategies) in the inputs' key order."""
    specs = [(key, state[key].shape, state[key].dtype) for key in order]
    method = str(metadata.get("method", "the merge"))
    with SafetensorsWriter(output, specs, metadata=metadata, overwrite=overwrite) as writer:
        for key in order:
            writer.write(key, state[key] if allow_non_finite else check_finite_output(method, key, state[key]))


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every entry of a tensor is finite (non-floating tensors always are).

    A NaN or an infinity among the entries makes their sum NaN or infinite (IEEE arithmetic keeps
    them), so a finite sum settles it in one pass with no temporary. Only a sum that overflows from
    finite entries needs the entry-wise check, whose mask makes it about five times slower: run on
    every tensor read, it was the largest part of a streamed task arithmetic's time."""
    if not tensor.is_floating_point():
        return True
    return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())


def check_finite_output(method: str, key: str, tensor: torch.Tensor) -> torch.Tensor:
    """Finite inputs can still overflow (say `--lam 1e308`); such a model is refused, not written."""
    if not all_finite(tensor):
        raise MimaError(f"{method}: the merged tensor '{key}' overflows to Inf or NaN; check the hyperparameters (e.g. --lam)")
    return tensor
