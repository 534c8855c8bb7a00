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
from mima.core.run_folder import RunFolder
from mima.core.state_dicts import check_compatible
from mima.core.tensor_files import SafetensorsReader, SafetensorsWriter, TensorInfo
from mima.merging.common import all_finite
from mima.merging.registry import MergeMethod


class OrderedView(Mapping[str, torch.Tensor]):
    """A reader seen through a fixed key order (so every input iterates alike). NaN and Inf are the
    method's to refuse (MergeMethod.check), which names the input by `path`."""

    def __init__(self, reader: SafetensorsReader, order: Sequence[str], path: Path | None = None) -> None:
        self.reader, self.order, self.path = reader, list(order), path
        self.infos: dict[str, TensorInfo] = {key: reader.infos[key] for key in self.order}

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.reader[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.order)

    def __len__(self) -> int:
        return len(self.order)


@dataclass
class MergeInputs:
    base: OrderedView | None
    models: list[OrderedView]


def expand_models(paths: Sequence[Path]) -> tuple[list[Path], list[str] | None, Path | None]:
    """Run folders become their final task files (in task order) and suggest their theta_0; done once
    per command (by its caller), and `open_inputs` takes the files it gives."""
    if len(paths) == 1 and Path(paths[0]).is_dir():
        run = RunFolder(Path(paths[0]))
        tasks = run.task_order()
        return [run.final_file(task) for task in tasks], tasks, run.pretrained_file
    for path in paths:
        if Path(path).is_dir():
            raise MimaError(f"--models {path}: a folder; give one `mima fit` run folder alone, or safetensors files")
    return [Path(p) for p in paths], None, None


@contextlib.contextmanager
def open_inputs(model_files: Sequence[Path], base_path: Path | None) -> Iterator[MergeInputs]:
    """The safetensors files (`expand_models` turns a run folder into them), checked against each other
    from their headers."""
    paths = ([Path(base_path)] if base_path is not None else []) + [Path(file) for file in model_files]
    if len({p.resolve() for p in paths if p.exists()}) != len(paths) and all(p.exists() for p in paths):
        raise MimaError("the same file is given twice among --base and --models")
    with contextlib.ExitStack() as stack:
        readers = [stack.enter_context(SafetensorsReader(path)) for path in paths]
        check_compatible({str(path): reader.infos for path, reader in zip(paths, readers)})
        order = list(readers[0].infos)
        views = [OrderedView(reader, order, path) for reader, path in zip(readers, paths)]
        base = views[0] if base_path is not None else None
        yield MergeInputs(base, views[1:] if base_path is not None else views)


def merge_to_file(
    method: MergeMethod,
    inputs: MergeInputs,
    output: Path,
    hparams: Mapping[str, object],
    metadata: Mapping[str, object],
    overwrite: bool = False,
    allow_non_finite: bool = False,
) -> None:
    """Stream `method`'s merge of `inputs` into `output` (atomically); an input or merged tensor holding
    NaN or Inf is an error unless `allow_non_finite`."""
    reference = inputs.base if inputs.base is not None else inputs.models[0]
    specs = [(key, info.shape, info.dtype) for key, info in reference.infos.items()]
    stream = method.stream(inputs.models, inputs.base, allow_non_finite, **hparams)  # checks before the file is opened
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


def check_finite_output(method: str, key: str, tensor: torch.Tensor) -> torch.Tensor:
    """Finite inputs can still overflow (say `--lam 1e308`); such a model is refused, not written."""
    if not all_finite(tensor):
        raise MimaError(f"{method}: the merged tensor '{key}' overflows to Inf or NaN; check the hyperparameters (e.g. --lam)")
    return tensor
