"""CART's choice of low-rank tensors: the official code's rule, on models named otherwise than open_clip.

The official CART code (https://github.com/JH-GEECS/CART_public) low-ranks the 2-D tensors whose key
contains `attn` or `mlp` and neither `ln` nor `bias`; every other tensor is averaged. Each test
below writes that rule again, literally (name-part checks, numpy SVD), on a model whose names are
timm / transformers style (`attn.in_proj.weight`, `mlp.fc1.weight`, `norm.weight`, ...), and
compares cart, cart_indexing and adamerging_cart with it. A `--matrix-keys` pattern replaces the
rule; one that selects nothing is an error before any work.
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
from mima.merging.cart import DEFAULT_MATRIX_KEYS, cart_matrix_key, is_matrix, matrix_keys_of
from mima.merging.engine import OrderedView, merge_to_file, open_inputs

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


def _models(count: int, seed: int, shapes=SHAPES):
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
    base, _ = _models(1, seed=0)
    assert {key for key, value in base.items() if official_rule(key, value)} == LOW_RANK
    assert set(matrix_keys_of(base)) == LOW_RANK
    # mima's old open_clip pattern found only attn.out_proj.weight here and averaged the other three
    assert {key for key in base if re.search(OLD_OPEN_CLIP_PATTERN, key)} == {"blocks.0.attn.out_proj.weight"}


@pytest.mark.parametrize("ratio, lam", [(0.25, 1.0), (0.5, 1.7)])
def test_cart_equals_the_official_rule_written_again(ratio, lam):
    base, models = _models(3, seed=1)
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
    _, models = _models(3, seed=2)
    method = get_method("cart")
    for setting, anchor, direction in method.sweep(models, None, {"rank_ratio": (0.25, 0.5)}):
        assert set(direction) == LOW_RANK, setting
        merged = method(models, None, lam=1.0, **setting)
        for key in LOW_RANK:
            torch.testing.assert_close(anchor[key] + direction[key], merged[key], rtol=1e-5, atol=1e-6)


def test_cart_indexing_reconstruction_equals_the_official_rule_written_again():
    base, models = _models(3, seed=3)
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
    base, models = _models(3, seed=4)
    average, keys, vectors = centered_low_rank_vectors(models, 0.25, DEFAULT_MATRIX_KEYS)
    assert "num_batches_tracked" not in keys
    for t, model in enumerate(models):
        for key in keys:
            mean = np.stack([m[key].double().numpy() for m in models]).mean(0)
            centered = model[key].double().numpy() - mean
            expected = _truncated(centered, _rank(centered.shape, 0.25)) if official_rule(key, base[key]) else centered
            np.testing.assert_allclose(vectors[t][key].numpy(), expected, rtol=1e-4, atol=1e-5, err_msg=key)


# ------------------------------------------------------------------ AdaMerging+CART, end to end
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


# ------------------------------------------------------------------------------ the override
def test_a_pattern_replaces_the_rule_and_still_requires_2d():
    base, models = _models(3, seed=7)
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
    _, models = _models(2, seed=8)
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
    _, models = _models(2, seed=10, shapes={"blocks.0.qkv.weight": (6, 4), "blocks.0.fc.weight": (4, 4), "norm.weight": (4,)})
    for name in ("cart", "cart_indexing"):
        with pytest.raises(MimaError, match=r"default rule .* selects none of the models' 2-D tensors .*--matrix-keys"):
            get_method(name)(models, None)
    merged = get_method("cart")(models, None, matrix_keys=r"(qkv|fc)\.weight$")  # the way out the message names
    assert not torch.allclose(merged["blocks.0.qkv.weight"], get_method("uniform")(models)["blocks.0.qkv.weight"])


def test_a_model_without_2d_tensors_is_the_uniform_merge_with_a_warning():
    # MobileNetV2 (the offline suite): convolutions are 4-D, so CART has no matrix by its definition
    _, models = _models(3, seed=11, shapes={"conv.weight": (4, 3, 1, 1), "bn.weight": (4,), "bn.bias": (4,)})
    with pytest.warns(UserWarning, match="no 2-D floating tensor, so CART .* equals the uniform average"):
        merged = get_method("cart")(models, None, rank_ratio=0.5, lam=2.0)
    uniform = get_method("uniform")(models)
    for key in uniform:
        torch.testing.assert_close(merged[key], uniform[key])
    with pytest.raises(MimaError, match=r"\(--matrix-keys\) 'conv' matches no 2-D floating tensor of the models \(it has none\)"):
        get_method("cart")(models, None, matrix_keys="conv")


def test_streaming_checks_the_pattern_from_the_headers_before_the_output_is_opened(tmp_path, monkeypatch):
    _, models = _models(2, seed=12)
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
    _, models = _models(2, seed=13)
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


# ------------------------------------------------------- open_clip: the same tensors as before
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
