"""Merging files into a file, tensor by tensor.

The inputs are opened lazily (mima.core.tensor_files.SafetensorsReader), checked against each
other from their headers alone (keys, shapes, dtypes; the error names the key and both files), and
the merged tensors are written as they are produced. Peak memory is therefore a few tensors per
input plus what a strategy keeps between passes (TIES: one model-sized float32 buffer while it finds
a task's trim threshold), not T models.

Inputs may be safetensors state dicts or `mima fit` run folders (their final/<task>.safetensors in
task order, and pretrained.safetensors as theta_0).

Reading overlaps the arithmetic: the inputs are read through one GroupPrefetcher
(mima.core.tensor_files), whose background thread reads the next key's tensor from every input while
the strategy computes on the current key (one group ahead; the bytes are those a direct read gives).
With a `device` the strategy's arithmetic runs there: each tensor it reads is moved to the device, and
each merged tensor comes back to the CPU to be written (DataFreeMerge.stream; `merge_device` turns the
command line's spelling into a device, refusing one this machine lacks).
"""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from mima.core.errors import MimaError
from mima.core.file_identity import first_duplicate
from mima.core.run_folder import RunFolder
from mima.core.spelling import DEVICE_SPELLINGS
from mima.core.state_dicts import check_compatible, check_weights
from mima.core.threads import intra_op_threads
from mima.core.tensor_files import GroupPrefetcher, SafetensorsReader, SafetensorsWriter, TensorInfo
from mima.merging.common import all_finite, some_keys
from mima.merging.registry import DataFreeMerge, MergeMethod


Read = Callable[[str], tuple[torch.Tensor, bool | None]]  # a key's tensor and whether it is finite (None: unknown)


class OrderedView(Mapping[str, torch.Tensor]):
    """A reader seen through a fixed key order (so every input iterates alike), its tensors read by
    `read` (through the inputs' prefetcher: (tensor, whether it is finite, or None where not known);
    the reader itself without one). NaN and Inf are the method's to refuse (MergeMethod.check), which
    names the input by `path` and asks `known_finite` what the prefetcher found."""

    def __init__(self, reader: SafetensorsReader, order: Sequence[str], path: Path | None = None,
                 read: Read | None = None) -> None:
        self.reader, self.order, self.path = reader, list(order), path
        self.read = read if read is not None else lambda key: (reader[key], None)
        self.infos: dict[str, TensorInfo] = {key: reader.infos[key] for key in self.order}
        self.last_read: tuple[str, bool | None] = ("", None)  # the key read last, and whether it is finite

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self.infos:
            raise KeyError(key)  # as a Mapping should
        tensor, finite = self.read(key)
        self.last_read = (key, finite)
        return tensor

    def known_finite(self, key: str) -> bool | None:
        """Whether the tensor just read for `key` is finite, where the thread that read it ahead checked
        (mima.merging.common.FiniteView asks right after reading); None where nobody has."""
        read_key, finite = self.last_read
        return finite if read_key == key else None

    def __iter__(self) -> Iterator[str]:
        return iter(self.order)

    def __len__(self) -> int:
        return len(self.order)


@dataclass
class MergeInputs:
    base: OrderedView | None
    models: list[OrderedView]
    prefetching: bool = False  # read ahead by a background thread (open_inputs)


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


def refuse_duplicate_inputs(paths: Sequence[Path], base_given: bool) -> None:
    """One line when two inputs hold the same bytes (one file under two names, a hard link, a copy): a
    model given twice would count twice in the merge, and a model equal to --base adds no task vector.
    `paths`: --base first when `base_given`, then the models."""
    pair = first_duplicate(paths)
    if pair is None:
        return
    first, second = (("--base" if base_given and index == 0 else "--models", paths[index]) for index in pair)
    raise MimaError(f"{second[0]} {second[1]}: holds the same bytes as {first[0]} {first[1]}; each model must be given "
                    "once and differ from the base (a duplicate would count twice in the merge)")


@contextlib.contextmanager
def open_inputs(model_files: Sequence[Path], base_path: Path | None, prefetch: bool = True) -> Iterator[MergeInputs]:
    """The safetensors files (`expand_models` turns a run folder into them), checked against each other
    from their headers; read ahead in the background unless `prefetch` is False (the same bytes)."""
    paths = ([Path(base_path)] if base_path is not None else []) + [Path(file) for file in model_files]
    if all(p.is_file() for p in paths):  # a missing file is named by its reader below
        refuse_duplicate_inputs(paths, base_given=base_path is not None)
    with contextlib.ExitStack() as stack:
        readers = [stack.enter_context(SafetensorsReader(path)) for path in paths]
        named = {str(path): reader.infos for path, reader in zip(paths, readers)}
        check_compatible(named)
        check_weights(named)  # an empty model, or one of integers alone, would be merged without a word
        order = list(readers[0].infos)
        # entered after the readers, so it stops reading before they close; it checks that each tensor
        # it reads ahead is finite, so that the merge's own thread need not (MergeMethod.check)
        prefetcher = stack.enter_context(GroupPrefetcher(readers, order, inspect=all_finite)) if prefetch else None
        views = [OrderedView(reader, order, path, read_through(prefetcher, index))
                 for index, (reader, path) in enumerate(zip(readers, paths))]
        base = views[0] if base_path is not None else None
        yield MergeInputs(base, views[1:] if base_path is not None else views, prefetcher is not None)


def read_through(prefetcher: GroupPrefetcher | None, source: int) -> Read | None:
    """How input `source` reads a key: through the prefetcher, or (None) from its reader directly."""
    if prefetcher is None:
        return None
    return lambda key: prefetcher.read_inspected(source, key)


def merge_to_file(
    method: DataFreeMerge,
    inputs: MergeInputs,
    output: Path,
    hparams: Mapping[str, object],
    metadata: Mapping[str, object],
    overwrite: bool = False,
    allow_non_finite: bool = False,
    device: torch.device | None = None,
) -> None:
    """Stream `method`'s merge of `inputs` into `output` (atomically); an input or merged tensor holding
    NaN or Inf is an error unless `allow_non_finite`. With `device` (default: the method's own,
    MergeMethod.on) the arithmetic runs there, one key's tensors at a time, and the output is the same
    file within the device's rounding (the CPU's: bit for bit)."""
    reference = inputs.base if inputs.base is not None else inputs.models[0]
    specs = [(key, info.shape, info.dtype) for key, info in reference.infos.items()]
    # checks before the file is opened
    stream = method.stream(inputs.models, inputs.base, allow_non_finite, device=device, **hparams)
    holding: list[str] = []  # with allow_non_finite: the keys written holding NaN or Inf
    with SafetensorsWriter(output, specs, metadata=metadata, overwrite=overwrite) as writer, \
            intra_op_threads(arithmetic_threads(method, inputs, method.target(device))):
        for key, tensor in stream:
            writer.write(key, checked_output(method.name, key, tensor, allow_non_finite, holding))
    say_non_finite_output(output, holding)


def arithmetic_threads(method: MergeMethod, inputs: MergeInputs, device: torch.device | None) -> int | None:
    """The intra-op threads of a streamed merge on the CPU: one fewer than torch's own while a thread
    reads ahead, for a strategy whose result does not depend on them (MergeMethod.entrywise); None
    keeps torch's. Measured on 2 cores: two torch threads beside the reader waited for each other at
    every operation (a task arithmetic of 9 ViT-B/32-sized files about 5x slower, 15-20 s against
    3.5-4.5 s); one computes while the reader reads (benchmarks/merge_overlap.py)."""
    if not inputs.prefetching or not method.entrywise or (device is not None and device.type != "cpu"):
        return None
    return max(1, torch.get_num_threads() - 1)


def write_state_dict(output: Path, state: Mapping[str, torch.Tensor], order: Sequence[str], metadata, overwrite=False,
                     allow_non_finite: bool = False) -> None:
    """Write an in-memory merge (data-dependent strategies) in the inputs' key order."""
    specs = [(key, state[key].shape, state[key].dtype) for key in order]
    method = str(metadata.get("method", "the merge"))
    holding: list[str] = []
    with SafetensorsWriter(output, specs, metadata=metadata, overwrite=overwrite) as writer:
        for key in order:
            writer.write(key, checked_output(method, key, state[key], allow_non_finite, holding))
    say_non_finite_output(output, holding)


def check_finite_output(method: str, key: str, tensor: torch.Tensor) -> torch.Tensor:
    """Finite inputs can still overflow (say `--lam 1e308`); such a model is refused, not written."""
    if not all_finite(tensor):
        raise MimaError(f"{method}: the merged tensor '{key}' overflows to Inf or NaN; check the hyperparameters (e.g. --lam)")
    return tensor


def checked_output(method: str, key: str, tensor: torch.Tensor, allow_non_finite: bool, holding: list[str]) -> torch.Tensor:
    """A merged tensor as it is written: refused when it is not finite, unless `allow_non_finite`, in
    which case its key joins `holding` (said once the file is written: say_non_finite_output)."""
    if not allow_non_finite:
        return check_finite_output(method, key, tensor)
    if not all_finite(tensor):
        holding.append(key)
    return tensor


def say_non_finite_output(output: Path, holding: Sequence[str]) -> None:
    """A merge holding NaN or Inf is never written silently (docs/merging.md, "Degenerate inputs")."""
    if holding:
        # the file's name only: a merge judged on tasks is written into a staging folder first
        sys.stderr.write(f"mima: warning: {output.name} was written with NaN or Inf in {len(holding)} tensor(s) "
                         f"({some_keys(holding)}), which allow_non_finite (--allow-non-finite) let through\n")


def merge_device(spelling: str, option: str = "--device") -> torch.device:
    """The device a merge computes on, from its command-line spelling: 'auto' is the first CUDA device
    where torch sees one and the CPU elsewhere; 'cpu', 'cuda' (the current CUDA device) or 'cuda:N'.
    A device this machine lacks is a one-line error naming `option`, raised before any input is read.
    Nothing here opens a CUDA context (is_available and device_count do not)."""
    text = spelling.strip().lower()
    if text == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if text == "cpu":
        return torch.device("cpu")
    match = re.fullmatch(r"cuda(?::(\d+))?", text)
    if match is None:
        raise MimaError(f"{option} {spelling}: expected {DEVICE_SPELLINGS}")
    if not torch.cuda.is_available():
        raise MimaError(f"{option} {spelling}: torch sees no CUDA device on this machine; use {option} cpu (or auto)")
    count = torch.cuda.device_count()
    if match.group(1) is None:
        return torch.device("cuda")
    index = int(match.group(1))
    if index >= count:
        present = "cuda:0" if count == 1 else f"cuda:0 .. cuda:{count - 1}"
        raise MimaError(f"{option} {spelling}: this machine has {count} CUDA device{'s' if count > 1 else ''} ({present})")
    return torch.device("cuda", index)
