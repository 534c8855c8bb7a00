"""What several merge strategies share, in one place: a strategy takes its helpers from here, and from
another strategy's module only what defines that strategy (LiNeS's base merges, DARE-TIES's TIES,
TALL's consensus masks, the CART variants' rule and rank, RegMean++'s RegMean, FW-Merging's AdaMerging).

  task vectors       task_vectors_by_key, summed_task_vectors, mean_tensor
  matrices           which 2-D tensors a `matrix_keys` pattern selects, from the headers alone
  residual blocks    the block index of a tensor name (`block_keys`: LiNeS, RegMean++)
  per-task indexes   their shared entries; masks packed one bit per entry (TALL, EMR) and the
                     masked reconstruction
  finite inputs      NaN/Inf refused as a tensor is read, and named with its input and key; with
                     allow_non_finite, still refused where a step would spread them (a matrix's
                     decomposition, solve or Gram matrix: tensor_step; the data-dependent merges'
                     forward passes); every decomposition or solve that cannot run is one line
                     naming the method and the tensor
  devices            inputs read onto the device a merge computes on, in IEEE float32 matmuls

Every function works on mappings from key to tensor, which may be lazy file-backed readers: those
with `infos` (key -> TensorInfo) are asked for shapes and dtypes without reading a tensor.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np
import torch

from mima.core.errors import MimaError
from mima.core.linalg import LinalgFailure, first_line
from mima.core.state_dicts import accumulator

TensorMap = Mapping[str, torch.Tensor]
# transform(task index, key, tau) -> the tensor that enters the sum (DARE drops, Breadcrumbs masks)
Transform = Callable[[int, str, torch.Tensor], torch.Tensor]


# ----------------------------------------------------------------------------- task vectors
def task_vectors_by_key(models: Sequence[TensorMap], base: TensorMap):
    """(key, theta_0, [tau_t in float32] or None for integer tensors), one key of `base` at a time."""
    for key in base:
        anchor = base[key]
        if not anchor.is_floating_point():
            yield key, anchor, None
            continue
        yield key, anchor, [model[key].float() - anchor.float() for model in models]


def matrices_merged(models: Sequence[TensorMap], base: TensorMap, matrix_keys: str,
                    merge_matrix: Callable[[list[torch.Tensor]], torch.Tensor]):
    """(key, theta_0, merged task vector or None) per key: `merge_matrix` of the task vectors of each
    matrix that `matrix_keys` selects, their mean for every other float tensor (the reference
    implementations of Iso-C, Iso-CTS, TSV and ACE all average what is not such a matrix)."""
    for key, anchor, taus in task_vectors_by_key(models, base):
        if taus is None:
            yield key, anchor, None
        elif is_matrix_key(key, anchor, matrix_keys):
            with tensor_step(key, models, base):
                merged = merge_matrix(taus)
            yield key, anchor, merged
        else:
            yield key, anchor, torch.stack(taus).mean(dim=0)


def per_matrix(merge_matrix: Callable[[list[torch.Tensor]], torch.Tensor]):
    """The scaled_fn of a merge whose only hyperparameter besides lam is `matrix_keys`: `merge_matrix`
    on each selected matrix, the mean elsewhere (matrices_merged)."""

    def scaled(models: Sequence[TensorMap], base: TensorMap, matrix_keys: str):
        return matrices_merged(models, base, matrix_keys, merge_matrix)

    return scaled


def indexed_task_vectors(models: Sequence[TensorMap], base: TensorMap, index: dict[str, torch.Tensor]):
    """(key, the stacked task vectors [T, ...]) per float key of `base`, with every key's theta_0
    stored in `index` under base/KEY first: what each per-task index (TALL masks, EMR) begins with."""
    for key, anchor, vectors in task_vectors_by_key(models, base):
        index[f"base/{key}"] = anchor
        if vectors is not None:
            yield key, torch.stack(vectors)


def summed_task_vectors(models: Sequence[TensorMap], base: TensorMap, transform: Transform | None = None):
    """(key, theta_0, sum_t transform(tau_t) or None) per key, accumulated one task at a time."""
    for key in base:
        anchor = base[key]
        if not anchor.is_floating_point():
            yield key, anchor, None
            continue
        total = accumulator(anchor)
        reference = anchor.to(total.dtype)
        # without a transform, one buffer holds each task's tau in turn (fresh ones cost page faults);
        # the same arithmetic either way
        scratch = torch.empty_like(total) if transform is None else None
        for index, model in enumerate(models):
            tensor = model[key]
            if scratch is not None and torch.result_type(tensor, reference) == scratch.dtype:
                total += torch.sub(tensor, reference, out=scratch)
            else:
                tau = tensor - reference
                total += transform(index, key, tau) if transform is not None else tau
        yield key, anchor, total


def mean_tensor(models: Sequence[TensorMap], key: str) -> torch.Tensor:
    """The mean over models of one tensor, accumulated in float32 or wider, in the input dtype."""
    first = models[0][key]
    if not first.is_floating_point():
        return first.clone()
    total = accumulator(first)
    total += first
    for model in models[1:]:
        total += model[key]
    return (total / len(models)).to(first.dtype)


# ----------------------------------------------------------------------------- matrices
def is_matrix_key(key: str, tensor_or_shape, matrix_keys: str) -> bool:
    """Whether `key` gets a strategy's matrix treatment: a 2-D tensor whose key matches `matrix_keys`
    (re.search)."""
    shape = getattr(tensor_or_shape, "shape", tensor_or_shape)
    return len(shape) == 2 and re.search(matrix_keys, key) is not None


def tensor_headers(model: TensorMap) -> list[tuple[str, tuple[int, ...], bool]]:
    """(key, shape, floating) per tensor; from the file headers when `model` is a lazy reader."""
    infos = getattr(model, "infos", None)
    if infos is not None:
        return [(key, tuple(info.shape), info.dtype.is_floating_point) for key, info in infos.items()]
    return [(key, tuple(value.shape), value.is_floating_point()) for key, value in model.items()]


def two_d_keys(model: TensorMap) -> list[str]:
    """The keys of the floating 2-D tensors, the only ones any `matrix_keys` can select."""
    return [key for key, shape, floating in tensor_headers(model) if floating and len(shape) == 2]


def some_keys(keys: Sequence[str], shown: int = 3) -> str:
    """A few keys for an error message, with their count when there are more."""
    listed = ", ".join(repr(k) for k in keys[:shown])
    return listed + (f", ... ({len(keys)} in all)" if len(keys) > shown else "")


def check_matrix_keys(method: str, model: TensorMap, matrix_keys: str) -> list[str]:
    """The floating 2-D keys of `model` that `matrix_keys` selects (from the headers of lazy inputs).

    A pattern that selects none is an error: every strategy taking `matrix_keys` would quietly fall
    back to its treatment of the other tensors (for most, the plain average of the task vectors)."""
    two_d = two_d_keys(model)
    selected = [key for key in two_d if re.search(matrix_keys, key) is not None]
    if not selected:
        found = f"its 2-D tensors: {some_keys(two_d)}" if two_d else "it has none"
        raise MimaError(f"merge method '{method}': matrix_keys (--matrix-keys) {matrix_keys!r} matches no 2-D floating "
                        f"tensor of the models ({found})")
    return selected


# ----------------------------------------------------------------------------- residual blocks
def block_of(key: str, pattern: re.Pattern) -> int | None:
    """The residual block index of a tensor name (the pattern's first group), or None outside the blocks."""
    match = pattern.search(key)
    if match is None or match.group(1) is None:
        return None
    if not match.group(1).isdigit():
        raise MimaError(f"block_keys '{pattern.pattern}': its first group captured '{match.group(1)}' in '{key}', "
                        "not a block number")
    return int(match.group(1))


def block_depths(keys: Iterable[str], block_keys: str, method: str) -> dict[str, int]:
    """Block index of every key inside a block; an error naming `block_keys` when none is."""
    pattern = re.compile(block_keys)
    depths = {key: index for key in keys if (index := block_of(key, pattern)) is not None}
    if not depths:
        raise MimaError(f"merge method '{method}': no tensor name matches block_keys '{block_keys}'; "
                        "give the pattern of the model's residual blocks (its first group the block index)")
    return depths


# ----------------------------------------------------------------------------- packed masks
def pack(mask: torch.Tensor) -> torch.Tensor:
    """A boolean mask as one bit per entry (numpy.packbits of the flattened mask), on the CPU."""
    return torch.from_numpy(np.packbits(mask.reshape(-1).to("cpu").numpy()))


def unpack(packed: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    count = int(torch.Size(shape).numel())
    return torch.from_numpy(np.unpackbits(packed.numpy(), count=count).astype(bool)).reshape(shape)


def index_entries(index: Mapping[str, torch.Tensor], prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(key, tensor) of every `<prefix><key>` entry of a per-task index (its shared model, in order)."""
    for name, tensor in index.items():
        if name.startswith(prefix):
            yield name[len(prefix) :], tensor


def reconstruct_masked(index: Mapping[str, torch.Tensor], task: int, vector: str, scale: float = 1.0) -> dict[str, torch.Tensor]:
    """theta_0 + scale * (task's mask * shared vector) for every key of an index of the form
    base/<key>, <vector><key>, task<t>/<key>/mask (TALL masks; EMR's masks and rescalers); keys
    without a shared vector are theta_0's."""
    model = {}
    for key, base in index_entries(index, "base/"):
        if f"{vector}{key}" not in index:
            model[key] = base.clone()
            continue
        masked = unpack(index[f"task{task}/{key}/mask"], base.shape) * index[f"{vector}{key}"]
        model[key] = (base.float() + (masked if scale == 1.0 else masked * scale)).to(base.dtype)
    return model


# ----------------------------------------------------------------------------- finite inputs
def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every entry of a tensor is finite (non-floating tensors always are).

    A NaN or an infinity among the entries makes their sum NaN or infinite (IEEE arithmetic keeps
    them), so a finite sum settles it in one pass with no temporary. Only a sum that overflows from
    finite entries needs the entry-wise check, whose mask makes it about five times slower: run on
    every tensor read, it was the largest part of a streamed task arithmetic's time."""
    if not tensor.is_floating_point():
        return True
    return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())


class FiniteView(Mapping[str, torch.Tensor]):
    """A model whose tensors are checked as they are read: a NaN or an Inf in one input silently
    poisons every merge of it (sums, signs, SVDs), so it is an error naming the input and the key.
    Checked on read, not up front, so a streamed merge still reads each file once."""

    def __init__(self, model: TensorMap, name: str, spreading: str | None = None) -> None:
        # spreading: the data-dependent merge reading it, which allow_non_finite cannot help
        self.model, self.name, self.spreading = model, name, spreading
        # lazy readers keep answering shapes and dtypes from their headers, without a read
        self.infos = getattr(model, "infos", None)

    def __getitem__(self, key: str) -> torch.Tensor:
        tensor = self.model[key]
        finite = known_finite(self.model, key)
        if not (finite if finite is not None else all_finite(tensor)):
            raise MimaError(self.refusal(key))
        return tensor

    def refusal(self, key: str) -> str:
        if self.spreading is not None:
            return (f"{self.name}: tensor '{key}' holds NaN or Inf values; {self.spreading}'s forward passes through the "
                    "task pool would spread them to every weight it merges, so it needs finite weights even with "
                    "allow_non_finite (--allow-non-finite)")
        # the flag is named with its command: `mima evaluate` reaches here too and has no such flag
        return (f"{self.name}: tensor '{key}' holds NaN or Inf values; a merge needs finite weights "
                "(`mima merge --allow-non-finite`, or allow_non_finite=True, merges them as they are)")

    def __iter__(self) -> Iterator[str]:
        return iter(self.model)

    def __len__(self) -> int:
        return len(self.model)


def known_finite(model: TensorMap, key: str) -> bool | None:
    """Whether the tensor just read from `model` for `key` is finite, where the model already knows
    (the file engine's inputs, checked by the thread that read them ahead); None where it does not."""
    known = getattr(model, "known_finite", None)
    return known(key) if known is not None else None


def refusing_non_finite(model: TensorMap, name: str, spreading: str | None = None) -> FiniteView:
    """`model` seen through a FiniteView (once: a view already checking is returned as it is);
    `spreading`: the data-dependent merge that reads it (its refusal says why the flag cannot help)."""
    return model if isinstance(model, FiniteView) else FiniteView(model, name, spreading)


class TensorRefusal(MimaError):
    """A step computed from one whole tensor (a decomposition, a solve, a norm), refused in one line
    naming the tensor (tensor_step); the merge's entry points add the method's name
    (linalg_errors_as_refusals)."""


# The one rule of allow_non_finite (docs/merging.md, "Degenerate inputs"), as the refusals word it.
NON_FINITE_LET_THROUGH = "which allow_non_finite (--allow-non-finite) let through"
# float32's largest finite value, for the line saying that finite weights overflowed it
FLOAT32_MAX = float(torch.finfo(torch.float32).max)


@contextlib.contextmanager
def tensor_step(key: str, models: Sequence[TensorMap], base: TensorMap | None = None):
    """A step computed from the whole tensor `key` (an SVD, a solve, a Gram matrix, an angle or a
    norm) that cannot run (mima.core.linalg.LinalgFailure, raised there or by require_finite) as one
    line naming the tensor. One NaN or Inf in such a step would decide or poison every entry it
    computes, so it is refused even where allow_non_finite let the inputs through. Where the step's
    input held NaN or Inf, the inputs of `key` are read again (only then) to say whether they held
    them or finite weights overflowed float32 on the way; a finite matrix that no route could
    decompose says so."""
    try:
        yield
    except LinalgFailure as failure:
        raise TensorRefusal(step_refusal(key, failure, models, base)) from None


def step_refusal(key: str, failure: LinalgFailure, models: Sequence[TensorMap], base: TensorMap | None) -> str:
    if failure.finite:
        return f"tensor '{key}': {failure}"
    inputs = [*models, *([base] if base is not None else [])]
    if not all(all_finite(model[key]) for model in inputs):
        return f"tensor '{key}' holds NaN or Inf values, {NON_FINITE_LET_THROUGH}; its {failure.step} cannot take them"
    return (f"tensor '{key}': {failure} computed from finite weights (sums, differences or products of them "
            f"beyond float32's range, {FLOAT32_MAX:.3g}); weights this large cannot be merged in float32")


@contextlib.contextmanager
def linalg_errors_as_refusals(method: str):
    """A decomposition or solve that cannot run is one line naming the method and (tensor_step) the
    tensor, never a traceback: on NaN or Inf (let through by allow_non_finite, or overflowed from
    finite weights), or on a finite matrix that every fallback of mima.core.linalg failed on."""
    try:
        yield
    except (TensorRefusal, LinalgFailure) as refusal:
        raise MimaError(f"{method}: {refusal}") from None
    except torch.linalg.LinAlgError as error:  # a library call outside mima.core.linalg's helpers
        raise MimaError(f"{method}: {first_line(error)}") from None


def refusing_linalg_errors(method: str, items: Iterator) -> Iterator:
    """A streamed merge whose decompositions' failures are one-line errors (see above)."""
    with linalg_errors_as_refusals(method):
        yield from items


# ----------------------------------------------------------------------------- devices
class DeviceView(Mapping[str, torch.Tensor]):
    """A model whose tensors are moved to `device` as they are read, so that a strategy, which computes
    where its inputs are, computes there one key at a time. Moving a CPU tensor to the CPU returns it
    as it is: the CPU path runs the same functions on the same tensors."""

    def __init__(self, model: TensorMap, device: torch.device) -> None:
        self.model, self.device = model, device
        # lazy readers keep answering shapes and dtypes from their headers, and errors name their file
        self.infos = getattr(model, "infos", None)
        self.path = getattr(model, "path", None)

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.model[key].to(self.device)

    def known_finite(self, key: str) -> bool | None:
        return known_finite(self.model, key)

    def __iter__(self) -> Iterator[str]:
        return iter(self.model)

    def __len__(self) -> int:
        return len(self.model)


def on_device(model: TensorMap, device: torch.device | None) -> TensorMap:
    """`model` read onto `device`; as it is without a device."""
    if device is None or (isinstance(model, DeviceView) and model.device == device):
        return model
    return DeviceView(model, device)


def on_host(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A merge's tensors back in host memory (the same tensors when they are there already)."""
    return {key: tensor.to("cpu") for key, tensor in tensors.items()}


@contextlib.contextmanager
def ieee_matmuls(device: torch.device | None):
    """Float32 matrix products in full precision on a CUDA device while a merge runs there: a process
    that allowed TF32 for speed (evaluation does) would otherwise merge with 10-bit mantissas, far
    from the CPU's result. Restored afterwards; nothing changes on the CPU."""
    if device is None or device.type != "cuda":
        yield
        return
    allowed = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allowed
