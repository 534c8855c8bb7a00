"""RegMean++: RegMean whose Gram matrices for block l come from inputs that went through the
already merged blocks below l.

Nguyen et al. 2025, "RegMean++: Enhancing Effectiveness and Generalization of Regression Mean for
Model Merging", https://arxiv.org/abs/2508.03121, as FusionBench's implementation
(fusion_bench/method/regmean_plusplus, RegMeanAlgorithmPlusPlus and its CLIP subclass):
  1. every tensor outside the residual blocks, the embeddings first, is averaged over the models;
  2. for each block l in depth order and each task t: task t's `examples` training examples go
     through the merged model below block l (averaged embeddings, merged blocks 0 .. l-1) and then
     through task t's own block l; the Gram matrix G_t = X^T X / rows of the inputs of each nn.Linear
     of block l whose forward runs (all tokens are rows) is collected on the way;
  3. block l's linear weights are merged as RegMean does, W* = (sum_t G_t)^-1 sum_t G_t W_t^T with
     the off-diagonal entries scaled by `alpha` (mima.merging.regmean.regmean_weight), and the rest
     of block l (biases, norms, and linear weights whose module never runs its own forward, such as
     open_clip's attention in_proj and out_proj) is averaged;
  4. the next block's inputs come through the merged block l.
Blocks are found by `block_keys` on the tensor names (as LiNeS, mima.merging.lines: its first group is
the block index; by default open_clip's `transformer.resblocks.<l>.`); no match is an error. The
Gram matrices are those of mima.merging.regmean.input_grams, computed on a forward pass of the
whole encoder with the weights above: the blocks above l do not change them.
Deliberate difference: FusionBench's merged model starts as the pretrained model and only its
embeddings and encoder layers are written, so its final layer norm keeps theta_0's value; here every
tensor outside the blocks is averaged (RegMean's rule), so no theta_0 is needed. Linear layers
outside the blocks are averaged too (FusionBench merges only the encoder layers by RegMean).
Defaults: 256 examples per task, alpha 0.95 (FusionBench's clip_regmean_plusplus settings). Cost:
one forward pass of every task's examples per block, L times RegMean's. Notes: the weights merged by
RegMean (`linear_layers`) and the number of blocks (`blocks`).
"""

from __future__ import annotations

import torch

from mima.merging.common import block_depths, tensor_step, mean_tensor
from mima.merging.pool import Pool
from mima.merging.registry import DataMerge, MergeOutput, register
from mima.merging.regmean import input_grams, regmean_weight


def regmean_plus_plus(models, base, pool: Pool, examples: int, alpha: float, block_keys: str) -> MergeOutput:
    depths = block_depths(list(models[0]), block_keys, "regmean_plus_plus")
    merged: dict[str, torch.Tensor] = {key: mean_tensor(models, key) for key in models[0]}
    linear: list[str] = []
    for block in sorted(set(depths.values())):
        keys = [key for key, depth in depths.items() if depth == block]
        grams = []
        for model, task in zip(models, pool.tasks):
            # merged below block l (and everywhere outside this block); task t's own block l
            weights = {**merged, **{key: model[key] for key in keys}}
            grams.append(input_grams(pool, weights, task, examples))
        for key in keys:
            if all(key in task_grams for task_grams in grams):
                with tensor_step(key, models):
                    weight = regmean_weight([g[key] for g in grams], [model[key] for model in models], alpha)
                merged[key] = weight.to(models[0][key].dtype)
                linear.append(key)
    return MergeOutput(merged, {"linear_layers": linear, "blocks": len(set(depths.values()))})


register(
    DataMerge(
        name="regmean_plus_plus",
        data_fn=regmean_plus_plus,
    )
)
