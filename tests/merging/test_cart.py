"""CART (paper 000) and the merges built on it, cart_indexing and adamerging_cart: the rank rule, the
truncated SVD of the centered task vectors against numpy, eq. 8 worked by hand, and the choice of
low-rank tensors.

The official CART code (https://github.com/JH-GEECS/CART_public) low-ranks the 2-D tensors whose key
contains `attn` or `mlp` and neither `ln` nor `bias`; every other tensor is averaged. The tests of that
rule write it again, literally (name-part checks, numpy SVD), on a model whose names are timm /
transformers style (`attn.in_proj.weight`, `mlp.fc1.weight`, `norm.weight`, ...), and compare cart,
cart_indexing and adamerging_cart with it. A `--matrix-keys` pattern replaces the rule; one that
selects nothing is an error before any work.
"""

from __future__ import annotations

import re
import warnings

import numpy as np
import open_clip
import pytest
import torch
from torch import nn

from mima.cli import main
from mima.core.errors import MimaError
from mima.core.safetensors_io import load_state_dict, save_state_dict
from mima.merging import get_method
from mima.merging.adamerging import centered_low_rank_vectors
from mima.merging.cart import DEFAULT_MATRIX_KEYS, cart_matrix_key, cart_rank, is_matrix, matrix_keys_of
from mima.merging.engine import OrderedView, merge_to_file, open_inputs
from mima.merging.selection import select_on_validation
from tests.helpers import MLP_MATRIX, TinyPool, assert_streamed_merge_matches, clip_like_models, perturbed_models, random_splits


# ------------------------------------------------------------------------------- the official rule
SHAPES = {
    "blocks.0.attn.in_proj.weight": (12, 8),  # low rank (the name mima's old open_clip pattern missed)
    "blocks.0.attn.in_proj.bias": (12,),
    "blocks.0.attn.out_proj.weight": (8, 8),  # low rank
    "blocks.0.attn.ln_1.weight": (8, 8),  # 2-D and `attn`, but `ln`: averaged
    "blocks.0.attn.scale": (8,),  # `attn`, but 1-D: averaged
    "blocks.0.mlp.fc1.weight": (16, 8),  # low rank
    "blocks.0.mlp.fc1.bias": (16,),
    "blocks.0.mlp.bias_table": (4, 8),  # 2-D and `mlp`, but `bias`: averaged
    "blocks.0.mlp.fc2.weight": (8, 16),  # low rank
    "blocks.0.norm.weight": (8,),
    "ln_1.weight": (8, 8),  # 2-D `ln` outside attn/mlp: averaged
    "pos_embed": (5, 8),  # 2-D, no attn/mlp: averaged
    "head.weight": (3, 8),  # 2-D, no attn/mlp: averaged
    "patch_embed.proj.weight": (8, 3, 2, 2),  # conv: averaged
    "blocks.0.mlp.conv.weight": (8, 8, 1, 1),  # `mlp` but 4-D: averaged
}


OLD_OPEN_CLIP_PATTERN = r"(attn\.in_proj_weight|attn\.out_proj\.weight|mlp\.c_fc\.weight|mlp\.c_proj\.weight)$"


def official_rule(key: str, tensor: torch.Tensor) -> bool:
    """The official code's rule, written again here: 2-D, `attn` or `mlp` in the key, no `ln`, no `bias`."""
    return tensor.ndim == 2 and tensor.is_floating_point() and ("attn" in key or "mlp" in key) \
        and "ln" not in key and "bias" not in key


def _timm_named_models(count: int, seed: int, shapes=SHAPES):
    g = torch.Generator().manual_seed(seed)
    base = {key: torch.randn(shape, generator=g) for key, shape in shapes.items()}
    base["num_batches_tracked"] = torch.tensor(5)
    models = [{k: v + 0.5 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v.clone()
               for k, v in base.items()} for _ in range(count)]
    return base, models


def _truncated(matrix: np.ndarray, rank: int) -> np.ndarray:
    u, s, vh = np.linalg.svd(matrix, full_matrices=False)
    return (u[:, :rank] * s[:rank]) @ vh[:rank]


def _rank(shape, ratio: float) -> int:
    return max(1, int(np.floor(ratio * min(shape))))


LOW_RANK = {"blocks.0.attn.in_proj.weight", "blocks.0.attn.out_proj.weight", "blocks.0.mlp.fc1.weight", "blocks.0.mlp.fc2.weight"}


def test_the_official_rule_picks_the_attention_and_mlp_weights_of_the_synthetic_model():
    base, _ = _timm_named_models(1, seed=0)
    assert {key for key, value in base.items() if official_rule(key, value)} == LOW_RANK
    assert set(matrix_keys_of(base)) == LOW_RANK
    # mima's old open_clip pattern found only attn.out_proj.weight here and averaged the other three
    assert {key for key in base if re.search(OLD_OPEN_CLIP_PATTERN, key)} == {"blocks.0.attn.out_proj.weight"}


@pytest.mark.parametrize("ratio, lam", [(0.25, 1.0), (0.5, 1.7)])
def test_cart_equals_the_official_rule_written_again(ratio, lam):
    base, models = _timm_named_models(3, seed=1)
    merged = get_method("cart")(models, None, lam=lam, rank_ratio=ratio)
    for key, value in base.items():
        if not value.is_floating_point():
            assert torch.equal(merged[key], models[0][key])
            continue
        stacked = np.stack([m[key].double().numpy() for m in models])
        average = stacked.mean(0)
        if official_rule(key, value):
            expected = average + lam * sum(_truncated(t - average, _rank(value.shape, ratio)) for t in stacked)
            assert np.abs(expected - average).max() > 0.1  # the low-rank part matters: averaging it would fail
        else:
            expected = average
        np.testing.assert_allclose(merged[key].numpy(), expected, rtol=1e-4, atol=1e-5, err_msg=key)


def test_cart_selection_on_validation_uses_the_same_rule():
    _, models = _timm_named_models(3, seed=2)
    method = get_method("cart")
    for setting, anchor, direction in method.sweep(models, None, {"rank_ratio": (0.25, 0.5)}):
        assert set(direction) == LOW_RANK, setting
        merged = method(models, None, lam=1.0, **setting)
        for key in LOW_RANK:
            torch.testing.assert_close(anchor[key] + direction[key], merged[key], rtol=1e-5, atol=1e-6)


def test_cart_indexing_reconstruction_equals_the_official_rule_written_again():
    base, models = _timm_named_models(3, seed=3)
    method = get_method("cart_indexing")
    index = method(models, rank_ratio=0.25)
    for t, model in enumerate(models):
        rebuilt = method.reconstruct(index, t)
        for key, value in base.items():
            if not value.is_floating_point():
                assert torch.equal(rebuilt[key], model[key])
                continue
            average = np.stack([m[key].double().numpy() for m in models]).mean(0)
            if official_rule(key, value):
                expected = average + _truncated(model[key].double().numpy() - average, _rank(value.shape, 0.25))
                assert f"task{t}/{key}/left" in index
            else:  # every other tensor comes back exactly
                expected = model[key].double().numpy()
                assert f"task{t}/{key}/full" in index
            np.testing.assert_allclose(rebuilt[key].numpy(), expected, rtol=1e-4, atol=1e-5, err_msg=key)


def test_adamerging_cart_vectors_equal_the_official_rule_written_again():
    base, models = _timm_named_models(3, seed=4)
    average, keys, vectors = centered_low_rank_vectors(models, 0.25, DEFAULT_MATRIX_KEYS)
    assert "num_batches_tracked" not in keys
    for t, model in enumerate(models):
        for key in keys:
            mean = np.stack([m[key].double().numpy() for m in models]).mean(0)
            centered = model[key].double().numpy() - mean
            expected = _truncated(centered, _rank(centered.shape, 0.25)) if official_rule(key, base[key]) else centered
            np.testing.assert_allclose(vectors[t][key].numpy(), expected, rtol=1e-4, atol=1e-5, err_msg=key)


# ------------------------------------------------------------------ the rank and the truncated SVD
@pytest.mark.parametrize(
    "shape, ratio, rank",
    [((192, 64), 0.08, 5), ((10, 10), 0.08, 1), ((100, 50), 0.32, 16), ((100, 100), 0.29, 29), ((7, 9), 1.0, 7), ((7, 9), 0.0, 0)],
)
def test_cart_rank_rule(shape, ratio, rank):
    assert cart_rank(shape, ratio) == rank


@pytest.mark.parametrize("ratio", [0.25, 0.5])
def test_cart_low_rank_part_is_the_truncated_svd_of_centered_vectors(ratio):
    base, models = clip_like_models(3, seed=3)
    lam = 1.7
    merged = get_method("cart")(models, base, lam=lam, rank_ratio=ratio)
    for key, value in base.items():
        if not value.is_floating_point():
            continue
        stacked = np.stack([m[key].numpy().astype(np.float64) for m in models])
        average = stacked.mean(axis=0)
        if key.endswith(("attn.in_proj_weight", "mlp.c_fc.weight")):
            rank = max(1, int(np.floor(ratio * min(value.shape))))
            expected = average + lam * sum(_truncated(t - average, rank) for t in stacked)
        else:  # biases, positional embedding, projection: the plain average
            expected = average
        np.testing.assert_allclose(merged[key].numpy(), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("hparams", [{"rank_ratio": 1.0, "lam": 2.3}, {"rank_ratio": 0.08, "lam": 0.0}])
def test_cart_full_rank_or_zero_lambda_is_the_uniform_average(hparams):
    base, models = clip_like_models(4, seed=4)
    merged = get_method("cart")(models, base, **hparams)
    uniform = get_method("uniform")(models)
    for key in uniform:
        torch.testing.assert_close(merged[key], uniform[key], rtol=1e-5, atol=1e-5)


def test_cart_matrix_keys_select_only_attention_and_mlp_weights():
    import re

    keys = ["transformer.resblocks.3.attn.in_proj_weight", "transformer.resblocks.3.attn.out_proj.weight",
            "transformer.resblocks.3.mlp.c_fc.weight", "transformer.resblocks.3.mlp.c_proj.weight"]
    others = ["proj", "positional_embedding", "conv1.weight", "transformer.resblocks.3.mlp.c_fc.bias", "text_projection"]
    assert all(re.search(DEFAULT_MATRIX_KEYS, k) for k in keys)
    assert not any(re.search(DEFAULT_MATRIX_KEYS, k) for k in others)


def test_selection_over_cart_ratios_and_lambdas():
    g = torch.Generator().manual_seed(6)
    key = "transformer.resblocks.0.attn.in_proj_weight"  # 50 x 40: ratios 4/8/16/32% -> ranks 1/3/6/12
    models = [{key: torch.randn(50, 40, generator=g)} for _ in range(3)]
    base = None
    method = get_method("cart")
    target = method(models, base, rank_ratio=0.16, lam=2.2)
    chosen = select_on_validation(method, models, base, lambda m: -float((m[key] - target[key]).abs().sum()))
    assert (chosen.hparams["rank_ratio"], chosen.hparams["lam"]) == (0.16, pytest.approx(2.2))
    assert len(chosen.trials) == 4 * 11


def test_cart_indexing_reconstructs_each_task_from_its_truncated_centered_vector():
    base, models = perturbed_models(3, seed=7)
    method = get_method("cart_indexing")
    index = method(models, rank_ratio=0.25)  # 12 x 8 matrix: rank max(1, floor(0.25 * 8)) = 2
    average = {k: torch.stack([m[k].double() for m in models]).mean(0) for k in (MLP_MATRIX, "ln.weight", "proj")}
    for t, model in enumerate(models):
        rebuilt = method.reconstruct(index, t)
        u, s, vh = np.linalg.svd((model[MLP_MATRIX].double() - average[MLP_MATRIX]).numpy(), full_matrices=False)
        expected = average[MLP_MATRIX].numpy() + (u[:, :2] * s[:2]) @ vh[:2]
        np.testing.assert_allclose(rebuilt[MLP_MATRIX].numpy(), expected, rtol=1e-4, atol=1e-5)
        for key in ("ln.weight", "proj"):  # not an attention/MLP weight: kept exactly
            torch.testing.assert_close(rebuilt[key], model[key], rtol=1e-6, atol=1e-6)
        assert int(rebuilt["counter"]) == 7


# ------------------------------------------------------------------ AdaMerging+CART: eq. 8 by hand
class MlpBlock(nn.Module):
    """One `mlp.c_fc` layer (a CART matrix key) mapping 2 inputs to 3 features."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Module()
        self.mlp.c_fc = nn.Linear(2, 3)

    def forward(self, x):
        return self.mlp.c_fc(x)


W, B = "mlp.c_fc.weight", "mlp.c_fc.bias"


def _cart_pool(seed: int, tasks: int) -> TinyPool:
    g = torch.Generator().manual_seed(seed)
    heads = {f"t{i}": torch.randn(4, 3, generator=g) for i in range(tasks)}
    return TinyPool(MlpBlock(), heads, {task: random_splits(g, 2, 4, train=8) for task in heads})


def test_adamerging_cart_with_given_coefficients_is_eq_8_by_hand():
    # Paper 000, eq. 8: theta = theta_avg + sum_t lam_t^l SVD_k(theta_t - theta_avg). Three tasks around
    # an average A (values exact in binary), 3 x 2 weight matrices, rank_ratio 0.5 -> k = max(1, floor(1)) = 1:
    #   D1 = [[2, 0], [0, 0], [0, 0]]   SVD_1(D1) = D1
    #   D2 = [[0, 0], [0, 1], [0, 0]]   SVD_1(D2) = D2
    #   D3 = -D1 - D2                   SVD_1(D3) = [[-2, 0], [0, 0], [0, 0]] (singular values 2 > 1)
    # With every coefficient at the prior p (lr so small that Adam cannot move them), the merged
    # weight is A + p (D1 + D2 - 2 e11) = A + p e22. Biases keep their full centered differences,
    # which sum to zero: the average bias.
    average = torch.tensor([[0.5, -1.25], [2.0, 0.75], [-0.5, 1.5]])
    d1 = torch.tensor([[2.0, 0.0], [0.0, 0.0], [0.0, 0.0]])
    d2 = torch.tensor([[0.0, 0.0], [0.0, 1.0], [0.0, 0.0]])
    bias = torch.tensor([0.25, -0.5, 1.0])
    offsets = [torch.tensor([0.5, 0.0, -1.0]), torch.tensor([-0.25, 0.5, 0.5]), torch.tensor([-0.25, -0.5, 0.5])]
    models = [{W: average + d, B: bias + o} for d, o in zip((d1, d2, -d1 - d2), offsets)]
    prior = 1.75
    for granularity in ("layer", "task"):
        output = get_method("adamerging_cart").merge(models, None, _cart_pool(0, 3), granularity=granularity, steps=2,
                                                     lr=1e-30, prior=prior, rank_ratio=0.5)
        expected = average.clone()
        expected[1, 1] += prior
        torch.testing.assert_close(output.state[W], expected, rtol=0, atol=1e-6)
        torch.testing.assert_close(output.state[B], bias, rtol=0, atol=1e-6)
        rows = 2 if granularity == "layer" else 1
        assert np.array(output.notes["coefficients"]).shape == (rows, 3)
        assert np.all(np.array(output.notes["coefficients"]) == np.float32(prior))


def test_adamerging_cart_with_learnt_coefficients_is_eq_8_by_hand():
    # Two tasks: theta_1,2 = A +- D with D = [[3, 0], [0, 1], [0, 0]]; SVD_1(+-D) = +-3 e11, so
    # eq. 8 gives A + 3 (lam_1 - lam_2) e11 on the weight and a + (lam_1 - lam_2) d on the bias,
    # with each tensor's own learnt coefficients (layer-wise, reported in the notes).
    average = torch.tensor([[0.5, -1.25], [2.0, 0.75], [-0.5, 1.5]])
    d = torch.tensor([[3.0, 0.0], [0.0, 1.0], [0.0, 0.0]])
    bias, bias_offset = torch.tensor([0.25, -0.5, 1.0]), torch.tensor([0.5, -1.0, 0.25])
    models = [{W: average + d, B: bias + bias_offset}, {W: average - d, B: bias - bias_offset}]
    output = get_method("adamerging_cart").merge(models, None, _cart_pool(1, 2), steps=5, lr=0.1, rank_ratio=0.5)
    notes = output.notes
    coefficients = dict(zip(notes["layers"], np.array(notes["coefficients"], dtype=np.float64)))
    assert set(coefficients) == {W, B} and notes["granularity"] == "layer"
    for key in (W, B):
        assert np.all((coefficients[key] >= 0) & (coefficients[key] <= 3))  # clamped to CART's lam range
        assert coefficients[key][0] != coefficients[key][1]  # learnt apart, so the check below has teeth
    (w1, w2), (b1, b2) = coefficients[W], coefficients[B]
    expected_w = average.double().numpy().copy()
    expected_w[0, 0] += 3 * (w1 - w2)
    np.testing.assert_allclose(output.state[W].numpy(), expected_w, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(output.state[B].numpy(), bias.numpy() + (b1 - b2) * bias_offset.numpy(), rtol=1e-6, atol=1e-6)
    assert notes["entropy_after"] < notes["entropy_before"]


# --------------------------------------------------------------------- AdaMerging+CART, end to end
class Encoder(nn.Module):
    """A tiny encoder named as timm/transformers name theirs: attn.in_proj, attn.ln_1, mlp.fc1, norm, head."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Module()
        self.attn.in_proj = nn.Linear(4, 6)
        self.attn.ln_1 = nn.Linear(6, 6, bias=False)  # 2-D but `ln`: not low-ranked
        self.mlp = nn.Module()
        self.mlp.fc1 = nn.Linear(6, 5)
        self.norm = nn.LayerNorm(5)
        self.head = nn.Linear(5, 3)  # 2-D without attn/mlp: not low-ranked

    def forward(self, x):
        return self.head(self.norm(self.mlp.fc1(torch.tanh(self.attn.ln_1(self.attn.in_proj(x))))))


class StubPool:
    """The shape of mima.merging.pool.Pool: fixed random inputs per task, logits = encoder(x) @ head^T."""

    def __init__(self, seed: int, tasks: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.encoder = Encoder()
        self.tasks = [f"t{i}" for i in range(tasks)]
        self.heads = {task: torch.randn(4, 3, generator=g) for task in self.tasks}
        self.inputs = {task: torch.randn(32, 4, generator=g) for task in self.tasks}
        self.batches = 0

    def loader(self, task, split, batch_size, shuffle=False, seed=None):
        self.batches += 1
        images = self.inputs[task]
        return ((images[i : i + batch_size], torch.zeros(len(images[i : i + batch_size]), dtype=torch.long))
                for i in range(0, len(images), batch_size))

    def examples(self, task, split, count, batch_size=32, seed=None):
        return self.loader(task, split, batch_size)

    def logits(self, weights, task, images):
        return torch.func.functional_call(self.encoder, dict(weights), (images,)) @ self.heads[task].T


def _encoder_models(count: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    base = {k: torch.randn(v.shape, generator=g) for k, v in Encoder().state_dict().items()}
    return [{k: v + 0.3 * torch.randn(v.shape, generator=g) for k, v in base.items()} for _ in range(count)]


@pytest.mark.parametrize("granularity", ["layer", "task"])
def test_adamerging_cart_merge_equals_the_official_rule_written_again(granularity):
    # With a learning rate too small to move them, every coefficient stays at the prior p: the merge is
    # theta_avg + p * sum_t SVD_r(theta_t - theta_avg) on the official rule's matrices and theta_avg
    # + p * sum_t (theta_t - theta_avg) = theta_avg elsewhere.
    models = _encoder_models(3, seed=5)
    prior, ratio = 1.5, 0.5
    output = get_method("adamerging_cart").merge(models, None, StubPool(6, 3), granularity=granularity, steps=1,
                                                 lr=1e-30, prior=prior, rank_ratio=ratio)
    low_rank = {key for key, value in models[0].items() if official_rule(key, value)}
    assert low_rank == {"attn.in_proj.weight", "mlp.fc1.weight"}
    for key in models[0]:
        stacked = np.stack([m[key].double().numpy() for m in models])
        average = stacked.mean(0)
        if key in low_rank:
            expected = average + prior * sum(_truncated(t - average, _rank(average.shape, ratio)) for t in stacked)
            assert np.abs(expected - average).max() > 0.05
        else:
            expected = average
        np.testing.assert_allclose(output.state[key].numpy(), expected, rtol=1e-4, atol=1e-5, err_msg=key)


# ------------------------------------------------------------------------------------ the override
def test_a_pattern_replaces_the_rule_and_still_requires_2d():
    base, models = _timm_named_models(3, seed=7)
    # `weight$` also matches the norm (1-D) and the convolutions (4-D): only 2-D tensors are low-ranked
    assert set(matrix_keys_of(base, r"weight$")) == {key for key, value in base.items()
                                                      if key.endswith("weight") and value.ndim == 2}
    merged = get_method("cart")(models, None, rank_ratio=0.25, matrix_keys=r"^head\.weight$")
    stacked = np.stack([m["head.weight"].double().numpy() for m in models])
    average = stacked.mean(0)
    expected = average + sum(_truncated(t - average, _rank(average.shape, 0.25)) for t in stacked)
    np.testing.assert_allclose(merged["head.weight"].numpy(), expected, rtol=1e-4, atol=1e-5)
    uniform = get_method("uniform")(models)
    torch.testing.assert_close(merged["blocks.0.attn.in_proj.weight"], uniform["blocks.0.attn.in_proj.weight"])


@pytest.mark.parametrize("name", ["cart", "cart_indexing"])
def test_a_pattern_that_matches_nothing_is_an_error(name):
    _, models = _timm_named_models(2, seed=8)
    pattern = r"attn\.in_proj_weight"  # the open_clip name; these models say attn.in_proj.weight
    with pytest.raises(MimaError, match=re.escape(f"merge method '{name}': matrix_keys (--matrix-keys) {pattern!r} matches no 2-D floating tensor")):
        get_method(name)(models, None, matrix_keys=pattern)
    with pytest.raises(MimaError, match=r"\(--matrix-keys\) 'conv' matches no 2-D"):  # matches only a 4-D tensor
        get_method(name)(models, None, matrix_keys="conv")


def test_adamerging_cart_checks_the_pattern_before_touching_the_data():
    pool = StubPool(9, 2)
    models = _encoder_models(2, seed=9)
    with pytest.raises(MimaError, match=r"merge method 'adamerging_cart': matrix_keys \(--matrix-keys\) 'qkv' matches no"):
        get_method("adamerging_cart").merge(models, None, pool, steps=1, matrix_keys="qkv")
    assert pool.batches == 0


def test_the_default_rule_selecting_nothing_in_a_model_with_matrices_is_an_error():
    _, models = _timm_named_models(2, seed=10, shapes={"blocks.0.qkv.weight": (6, 4), "blocks.0.fc.weight": (4, 4), "norm.weight": (4,)})
    for name in ("cart", "cart_indexing"):
        with pytest.raises(MimaError, match=r"default rule .* selects none of the models' 2-D tensors .*--matrix-keys"):
            get_method(name)(models, None)
    merged = get_method("cart")(models, None, matrix_keys=r"(qkv|fc)\.weight$")  # the way out the message names
    assert not torch.allclose(merged["blocks.0.qkv.weight"], get_method("uniform")(models)["blocks.0.qkv.weight"])


def test_a_model_without_2d_tensors_is_the_uniform_merge_with_a_warning():
    # MobileNetV2 (the offline suite): convolutions are 4-D, so CART has no matrix by its definition
    _, models = _timm_named_models(3, seed=11, shapes={"conv.weight": (4, 3, 1, 1), "bn.weight": (4,), "bn.bias": (4,)})
    with pytest.warns(UserWarning, match="no 2-D floating tensor, so CART .* equals the uniform average"):
        merged = get_method("cart")(models, None, rank_ratio=0.5, lam=2.0)
    uniform = get_method("uniform")(models)
    for key in uniform:
        torch.testing.assert_close(merged[key], uniform[key])
    with pytest.raises(MimaError, match=r"\(--matrix-keys\) 'conv' matches no 2-D floating tensor of the models \(it has none\)"):
        get_method("cart")(models, None, matrix_keys="conv")


def test_streaming_checks_the_pattern_from_the_headers_before_the_output_is_opened(tmp_path, monkeypatch):
    _, models = _timm_named_models(2, seed=12)
    paths = [tmp_path / f"m{i}.safetensors" for i in range(2)]
    for path, model in zip(paths, models):
        save_state_dict(path, model)

    def no_tensor_read(self, key):
        raise AssertionError(f"tensor {key} read before the pattern was checked")

    with open_inputs(paths, None) as inputs:
        monkeypatch.setattr(OrderedView, "__getitem__", no_tensor_read)
        with pytest.raises(MimaError, match=r"\(--matrix-keys\) 'nothing' matches no"):
            merge_to_file(get_method("cart"), inputs, tmp_path / "out.safetensors", {"matrix_keys": "nothing"}, {})
        assert set(matrix_keys_of(inputs.models[0])) == LOW_RANK  # the default rule, from the headers alone
    assert not (tmp_path / "out.safetensors").exists()
    monkeypatch.undo()
    with open_inputs(paths, None) as inputs:  # and the streamed merge is the in-memory one
        merge_to_file(get_method("cart"), inputs, tmp_path / "out.safetensors", {"rank_ratio": 0.25}, {})
    expected = get_method("cart")(models, None, rank_ratio=0.25)
    streamed = load_state_dict(tmp_path / "out.safetensors")
    for key in expected:
        torch.testing.assert_close(streamed[key], expected[key])


@pytest.mark.parametrize("method", ["cart", "cart_indexing"])
def test_mima_merge_with_a_pattern_matching_nothing_is_a_one_line_error(tmp_path, capsys, method):
    _, models = _timm_named_models(2, seed=13)
    paths = [tmp_path / f"m{i}.safetensors" for i in range(2)]
    for path, model in zip(paths, models):
        save_state_dict(path, model)
    out = tmp_path / "merged.safetensors"
    code = main(["merge", "--method", method, "--models", *map(str, paths), "--output", str(out),
                 "--matrix-keys", "in_proj_weight"])
    err = capsys.readouterr().err
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("mima merge: error: ") and "(--matrix-keys) 'in_proj_weight' matches no" in lines[0]
    assert not out.exists()


# ----------------------------------------------------------- open_clip: the same tensors as before
@pytest.mark.parametrize("arch", ["ViT-B-32", "ViT-B-16", "ViT-L-14"])
def test_on_open_clip_vits_the_rule_selects_what_the_old_open_clip_pattern_did(arch):
    # So the demo's and the configs' CART merges do not change (meta tensors: shapes only, no memory).
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = open_clip.create_model(arch, pretrained=None, device="meta")
    for state in (model.visual.state_dict(), model.state_dict()):
        old = [key for key, value in state.items() if value.ndim == 2 and re.search(OLD_OPEN_CLIP_PATTERN, key)]
        assert old and matrix_keys_of(state) == old
        assert [key for key, value in state.items() if official_rule(key, value)] == old


def test_the_default_pattern_is_the_rule():
    """DEFAULT_MATRIX_KEYS (the rule as a pattern, for the rank sweep's --matrix-keys) agrees with the rule."""
    keys = [*SHAPES, "visual.transformer.resblocks.11.attn.in_proj_weight", "transformer.resblocks.0.mlp.c_proj.weight",
            "transformer.resblocks.0.ln_1.weight", "attnpool.q_proj.weight", "vision_model.encoder.layers.0.self_attn.k_proj.weight",
            "encoder.layer.0.mlp.fc2.bias", "ln_post.weight", "proj", "kiln.attn.w", "mlpx", "attn\nln", "ATTN.weight", ""]
    for key in keys:
        assert (re.search(DEFAULT_MATRIX_KEYS, key) is not None) == cart_matrix_key(key), key
        assert is_matrix(key, (2, 2)) == cart_matrix_key(key) == is_matrix(key, (2, 2), f"(?:{DEFAULT_MATRIX_KEYS})")
        assert not is_matrix(key, (2,)) and not is_matrix(key, (2, 2, 1, 1))


# --------------------------------------------------------------------------------------- streaming
def _numpy_cart(models, key, ratio=0.08, lam=1.0):
    stacked = np.stack([m[key].double().numpy() for m in models])
    average = stacked.mean(0)
    if key != MLP_MATRIX:  # only attention/MLP weights are low-rank; the rest is the average
        return average
    rank = max(1, int(np.floor(ratio * min(average.shape))))
    total = 0
    for t in stacked:
        total = total + _truncated(t - average, rank)
    return average + lam * total


@pytest.mark.parametrize("name", ["cart"])
def test_streamed_file_merge_matches_the_formula(tmp_path, name):  # rank 8%, lam 1
    assert_streamed_merge_matches(tmp_path, name, lambda base, models: {key: _numpy_cart(models, key)
                                                                         for key in (MLP_MATRIX, "ln.weight", "proj")})
