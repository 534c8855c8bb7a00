"""LiNeS: scale a merged task vector layer by layer, less near the input and more near the output.

Wang et al. 2024, "LiNeS: Post-training Layer Scaling Prevents Forgetting and Enhances Model
Merging", https://arxiv.org/abs/2410.17146, as the authors' code (wang-kee/LiNeS: the merges of
src/eval/aggregation.py, the scaling LiNeS_scaling of src/eval/eval.py):

  tau_m = the task vector of a base merge (task arithmetic's sum, TIES, or consensus), unscaled;
  theta = theta_0 + s(key) * tau_m, with s = alpha + beta * l / (L - 1) for the tensors of residual
  block l (0 .. L-1) and s = alpha for every tensor outside the blocks (patch/positional embeddings,
  ln_pre, but also ln_post and proj, as the reference does).

Deliberate choices, where the reference hard-codes things for its ViTs:
  * A tensor belongs to block l when `block_keys` (a regular expression; its first group is the
    block index) matches its name, first match; by default `blocks\\.(\\d+)\\.`, which finds open_clip's
    `transformer.resblocks.<l>.` (the reference tests the substring `.<l>.` with L fixed to 12 or 24
    by model name; on open_clip ViT names both rules give the same blocks). L is the largest block
    index found plus one; with a single block (L = 1) that block is scaled by alpha. No matching name
    is an error, since LiNeS would then be a plain rescaling.
  * lines_alpha 'auto' is the reference's multi-task rule alpha = ||sum_t tau_t||_1 / ||tau_m||_1 / T
    (L1 norms over all floating tensors), so 1/T for task arithmetic (set exactly, without a pass);
    a number sets alpha directly (the reference's single-task form uses alpha = lam, beta = 1 - lam).
  * The base merge runs at its registered defaults, which are the reference's settings: TIES with
    k = 20 and the disjoint mean ("dis-mean"), consensus with k = 2 tasks per entry (mask lambda 0.4:
    the reference uses TALL masks tuned per task on validation). Its own lam is not applied.
  * beta is searched on validation over 0.1, 0.2, ..., 1.5: the reference searches 0.1 .. 1.0 for
    task arithmetic and consensus and 0.1 .. 1.5 for TIES, and the grid here is one for all three.
    Without validation beta = 0.5 (mima's choice; the reference always tunes beta).
Integer tensors come from theta_0.

Streaming: 'auto' needs the two L1 norms first, so the base merge runs twice (once to measure,
once to write); a number for alpha (or task arithmetic) needs one run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from mima.core.errors import MimaError
from mima.core.linalg import require_finite
from mima.merging.common import block_depths, summed_task_vectors, tensor_step
from mima.merging.consensus import consensus
from mima.merging.registry import ScaledItem, StreamingMerge, combine_tensor, floating_keys, get_method, register
from mima.merging.task_arithmetic import task_arithmetic
from mima.merging.ties import ties

# The base merges, each a scaled_fn (key, theta_0, merged task vector or None) run at its own defaults.
BASE_MERGES: dict[str, Callable[..., Iterable[ScaledItem]]] = {
    "task_arithmetic": task_arithmetic,
    "ties": ties,
    "consensus": consensus,
}


def layer_scale(depth: int | None, blocks: int, alpha: float, beta: float) -> float:
    """alpha + beta * l / (L - 1) inside block l; alpha outside the blocks and when L = 1."""
    if depth is None or blocks < 2:
        return alpha
    return alpha + beta * depth / (blocks - 1)


def base_merge_run(name: str, models, base) -> Iterator[ScaledItem]:
    """One run of the base merge at its registered defaults (without its lam)."""
    settings = {k: v for k, v in get_method(name).defaults.items() if k != "lam"}
    return iter(BASE_MERGES[name](models, base, **settings))


def auto_alpha(models, base, base_merge: str) -> float:
    """||sum_t tau_t||_1 / ||tau_m||_1 / T (the reference's multi-task alpha)."""
    tasks = len(models)
    if base_merge == "task_arithmetic":  # tau_m is the sum itself
        return 1.0 / tasks
    summed = whole_model_l1(summed_task_vectors(models, base), models, base)
    merged = whole_model_l1(base_merge_run(base_merge, models, base), models, base)
    if merged == 0:
        raise MimaError(f"merge method 'lines': the {base_merge} task vector is zero, so lines_alpha 'auto' "
                        "(a ratio of its L1 norm) is undefined; give lines_alpha a number")
    return summed / merged / tasks


def whole_model_l1(items: Iterable[ScaledItem], models, base) -> float:
    """The L1 norm over every (key, anchor, vector) item's vector; a vector holding NaN or Inf is
    refused, naming its tensor: it would decide alpha, so every entry of the merge."""
    total = 0.0
    for key, _, vector in items:
        if vector is None:
            continue
        with tensor_step(key, models, base):
            require_finite(vector, "lines_alpha 'auto' (L1 norms over the whole model)")
        total += float(vector.abs().sum())
    return total


def lines(models, base, base_merge: str, lines_alpha, lines_beta: float, block_keys: str):
    """(key, merged tensor) per key; the block pattern and 'auto' alpha are settled before the first key."""
    depths = block_depths(floating_keys(base), block_keys, "lines")
    blocks = max(depths.values()) + 1
    alpha = auto_alpha(models, base, base_merge) if lines_alpha == "auto" else float(lines_alpha)
    return _scaled(base_merge_run(base_merge, models, base), depths, blocks, alpha, lines_beta)


def _scaled(items: Iterator[ScaledItem], depths: dict[str, int], blocks: int, alpha: float, beta: float):
    for key, anchor, vector in items:
        yield key, combine_tensor(anchor, vector, layer_scale(depths.get(key), blocks, alpha, beta))


register(
    StreamingMerge(
        name="lines",
        stream_fn=lines,
    )
)
