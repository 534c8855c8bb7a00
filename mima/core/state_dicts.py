"""Pure arithmetic on state dicts (mappings from parameter name to tensor).

These helpers never hold more than one key's tensors from each input at a time, so the
inputs may be lazy mappings backed by files.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from mima.core.errors import MimaError

StateDict = dict[str, torch.Tensor]
TensorMap = Mapping[str, torch.Tensor]


def is_mergeable(tensor: torch.Tensor) -> bool:
    """Floating tensors are averaged and merged; integer ones (counters, masks) are copied."""
    return is_mergeable_dtype(tensor.dtype)


def is_mergeable_dtype(dtype: torch.dtype) -> bool:
    """is_mergeable of a tensor of `dtype` (a file's header gives the dtype without the tensor)."""
    return dtype.is_floating_point


def check_compatible(named_state_dicts: Mapping[str, TensorMap]) -> list[str]:
    """Check that all state dicts share keys, shapes and dtypes; return the common key order.

    `named_state_dicts` maps a label (usually the file name) to a state dict, so errors can
    say which input differs from which.
    """
    if not named_state_dicts:
        raise MimaError("no state dicts given")
    labels = list(named_state_dicts)
    reference_label = labels[0]
    reference = named_state_dicts[reference_label]
    keys = list(reference.keys())
    key_set = set(keys)
    for label in labels[1:]:
        other = named_state_dicts[label]
        missing = sorted(key_set - set(other.keys()))
        extra = sorted(set(other.keys()) - key_set)
        if missing:
            raise MimaError(f"key '{missing[0]}' is in {reference_label} but not in {label}")
        if extra:
            raise MimaError(f"key '{extra[0]}' is in {label} but not in {reference_label}")
        for key in keys:
            a, b = reference[key], other[key]
            if a.shape != b.shape:
                raise MimaError(
                    f"key '{key}': shape {tuple(a.shape)} in {reference_label} "
                    f"but {tuple(b.shape)} in {label}"
                )
            if a.dtype != b.dtype:
                raise MimaError(f"key '{key}': dtype {a.dtype} in {reference_label} but {b.dtype} in {label}")
    return keys


def check_weights(named_state_dicts: Mapping[str, TensorMap]) -> None:
    """Models that share their keys and dtypes (check_compatible) hold something to merge: at least
    one tensor, and a floating-point one (integer tensors, counters and masks, are copied, not
    merged: a model of integers alone would come back unchanged, without a word)."""
    label, reference = next(iter(named_state_dicts.items()))
    if len(reference) == 0:
        raise MimaError(f"{label}: holds no tensors; give the models' state dicts (their weights by name)")
    if not any(is_mergeable_dtype(tensor.dtype) for tensor in reference.values()):
        dtypes = sorted({str(tensor.dtype).removeprefix("torch.") for tensor in reference.values()})
        raise MimaError(f"{label}: holds no floating-point tensor ({', '.join(dtypes)} only); nothing to merge "
                        "(integer tensors are copied from the models, not merged)")


def mean_state_dict(state_dicts: Sequence[TensorMap]) -> StateDict:
    """Element-wise mean of floating tensors (accumulated in float32 or wider); others from the first."""
    if not state_dicts:
        raise MimaError("cannot average an empty list of state dicts")
    first = state_dicts[0]
    merged: StateDict = {}
    for key, tensor in first.items():
        if not is_mergeable(tensor):
            merged[key] = tensor.clone()
            continue
        total = accumulator(tensor)
        for state_dict in state_dicts:
            total += state_dict[key]
        merged[key] = (total / len(state_dicts)).to(tensor.dtype)
    return merged


def accumulator(tensor: torch.Tensor) -> torch.Tensor:
    """A zero tensor for sums: at least float32, so low-precision inputs do not lose mass."""
    dtype = torch.promote_types(tensor.dtype, torch.float32)
    return torch.zeros(tensor.shape, dtype=dtype, device=tensor.device)


def difference(a: TensorMap, b: TensorMap, keys: Sequence[str] | None = None) -> StateDict:
    """a - b over `keys` (default: the floating keys of a), computed in float32 or wider."""
    keys = [k for k in a if is_mergeable(a[k])] if keys is None else list(keys)
    return {key: _widen(a[key]) - _widen(b[key]) for key in keys}


def _widen(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to(torch.promote_types(tensor.dtype, torch.float32))


def gram_matrix(vectors: Sequence[TensorMap], keys: Sequence[str]) -> torch.Tensor:
    """Inner products <v_i, v_j> of flattened vectors, accumulated key by key in float64."""
    count = len(vectors)
    gram = torch.zeros(count, count, dtype=torch.float64)
    for key in keys:
        stacked = torch.stack([v[key].detach().reshape(-1).to("cpu", torch.float64) for v in vectors])
        gram += stacked @ stacked.T
    return gram


def cosine_matrix(vectors: Sequence[TensorMap], keys: Sequence[str]) -> torch.Tensor:
    """Pairwise cosine similarity of flattened vectors; a zero vector has cosine 0 with everything."""
    return cosine_from_gram(gram_matrix(vectors, keys))


def cosine_from_gram(gram: torch.Tensor) -> torch.Tensor:
    """Cosines from a Gram matrix of inner products; a zero vector has cosine 0 with everything."""
    norms = gram.diagonal().clamp_min(0).sqrt()
    denom = torch.outer(norms, norms)
    return torch.where(denom > 0, gram / denom.clamp_min(1e-300), torch.zeros_like(gram))


def mean_off_diagonal(matrix: torch.Tensor) -> float:
    """Mean of the entries off the diagonal (the mean pairwise value); NaN for a 1x1 matrix."""
    count = matrix.shape[0]
    if count < 2:
        return float("nan")
    mask = ~torch.eye(count, dtype=torch.bool)
    return float(matrix[mask].mean())


def task_vector_cosines(base: TensorMap, models: Sequence[TensorMap]) -> torch.Tensor:
    """Pairwise cosine of the task vectors tau_t = theta_t - theta_0 over all floating tensors."""
    keys = [key for key, value in base.items() if is_mergeable(value)]
    return cosine_matrix([difference(model, base, keys) for model in models], keys)
