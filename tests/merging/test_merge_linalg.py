"""The merges' linear algebra on degenerate input (issue 49, item 2): every SVD, polar factor and
solve has fallbacks (mima.core.linalg), a decomposition that cannot run is one line naming the
method and the tensor, the NaN/Inf wording is kept for non-finite input, RegMean takes half-precision
models and singular Gram matrices, and `--allow-non-finite` follows one rule across the catalogue.

A note on the TSV case of the issue (a ViT-B/32 run whose 768 x 768 task vectors, of norms 0.0144 and
0.0126, made MKL's SVD fail to converge in `polar_factor`): a run made the same way here (random
weights, random-image tasks, 6 AdamW steps at lr 1e-5, on the CPU), its matrices under 1, 2 and 4
threads, MKL's AVX2 and SSE4.2 code paths and a few hundred constructed pairs (shared parts, sign
updates, low rank) never failed to converge with torch 2.14's LAPACK, so no saved pair reproduces
it. The failure is therefore injected through the helpers' own `routes` (and, for `mima merge`,
their default, mima.core.linalg.SVD_ROUTES), never by patching torch.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from mima.cli import main
from mima.core import linalg
from mima.core.errors import MimaError
from mima.core.safetensors_io import load_state_dict, save_state_dict
from mima.merging import get_method
from mima.merging.catalogue import STRATEGIES
from tests.helpers import TinyPool, assert_one_line, cli, unchanged

NON_CONVERGENCE = ("linalg.svd: The algorithm failed to converge because the input matrix is ill-conditioned or has "
                   "too many repeated singular values (error code: 383).")


def failing_svd(matrix: torch.Tensor):
    raise torch.linalg.LinAlgError(NON_CONVERGENCE)


def failing_solve(system: torch.Tensor, rhs: torch.Tensor, prior):
    raise torch.linalg.LinAlgError("torch.linalg.solve: The solver failed because the input matrix is singular.")


def nan_svd(matrix: torch.Tensor):
    u, s, vh = linalg.lapack_svd(matrix)
    return u, s * float("nan"), vh


FAILING_FIRST = (("default driver", failing_svd), *linalg.SVD_ROUTES[1:])


def numpy_polar(matrix: np.ndarray) -> np.ndarray:
    u, _, vt = np.linalg.svd(matrix.astype(np.float64), full_matrices=False)
    return u @ vt


def seeded(shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale


# ----------------------------------------------------------------------------- the helpers' chains
@pytest.mark.parametrize("shape", [(40, 40), (56, 24), (24, 56)], ids=["square", "tall", "wide"])
@pytest.mark.parametrize("route", [name for name, _ in linalg.SVD_ROUTES])
def test_every_svd_route_gives_the_decomposition_numpy_gives(shape, route):
    matrix = seeded(shape, 1)
    only = [entry for entry in linalg.SVD_ROUTES if entry[0] == route]
    decomposition = linalg.svd(matrix, routes=only)
    expected_s = np.linalg.svd(matrix.double().numpy(), compute_uv=False)
    np.testing.assert_allclose(decomposition.s.numpy(), expected_s, rtol=1e-5)
    np.testing.assert_allclose(decomposition.low_rank(min(shape)).numpy(), matrix.numpy(), atol=1e-5)
    np.testing.assert_allclose(linalg.polar_factor(matrix, routes=only).numpy(), numpy_polar(matrix.numpy()), atol=1e-5)


def test_a_default_driver_that_fails_to_converge_falls_back_to_float64():
    matrix = seeded((48, 48), 2)
    decomposition = linalg.svd(matrix, routes=FAILING_FIRST)
    assert decomposition.u.dtype == torch.float32  # handed back in the dtype asked for
    np.testing.assert_allclose(decomposition.s.numpy(), np.linalg.svd(matrix.double().numpy(), compute_uv=False), rtol=1e-6)
    np.testing.assert_allclose(linalg.polar_factor(matrix, routes=FAILING_FIRST).numpy(), numpy_polar(matrix.numpy()),
                               atol=1e-6)


def test_a_route_giving_nan_for_finite_input_is_passed_over():
    matrix = seeded((16, 16), 3)
    routes = (("default driver", nan_svd), *linalg.SVD_ROUTES[1:])
    assert bool(torch.isfinite(linalg.svd(matrix, routes=routes).s).all())


def test_every_route_failing_is_one_line_naming_each_route():
    with pytest.raises(linalg.LinalgFailure) as failure:
        linalg.svd(seeded((8, 8), 4), routes=(("default driver", failing_svd), ("float64", failing_svd)))
    assert failure.value.finite
    assert str(failure.value) == (f"its SVD failed on every route tried (default driver: {NON_CONVERGENCE[:117]}...; "
                                  f"float64: {NON_CONVERGENCE[:117]}...)")


def test_a_non_finite_matrix_reaches_no_route():
    called = []
    matrix = seeded((8, 8), 5)
    matrix[2, 3] = float("inf")
    with pytest.raises(linalg.LinalgFailure) as failure:
        linalg.svd(matrix, routes=(("recording", lambda m: called.append(m) or linalg.lapack_svd(m)),))
    assert not failure.value.finite and not called
    assert str(failure.value) == "its SVD got NaN or Inf values"


def test_singular_values_beyond_float32_are_refused_but_the_polar_factor_is_computed():
    """Entries near 1e38: float32's default driver gives infinite singular values (or fails), float64
    computes them; an SVD handed back in float32 cannot hold them, a polar factor needs none of them."""
    matrix = (torch.rand(24, 24, generator=torch.Generator().manual_seed(6)) * 2 - 1) * 1e38
    with pytest.raises(linalg.LinalgFailure, match=r"^its singular values exceed float32's range \(the largest [0-9.]+e\+38\)"):
        linalg.svd(matrix)
    np.testing.assert_allclose(linalg.polar_factor(matrix).numpy(), numpy_polar(matrix.double().numpy()), atol=1e-5)


def test_a_scaled_svd_keeps_singular_values_the_library_would_overflow():
    matrix = seeded((16, 16), 7).double() * 1e150  # squares beyond float64's range
    u, s, vh = linalg.scaled_svd(matrix)
    np.testing.assert_allclose((s / 1e150).numpy(), np.linalg.svd((matrix / 1e150).numpy(), compute_uv=False), rtol=1e-12)
    np.testing.assert_allclose(((u * s) @ vh / 1e150).numpy(), (matrix / 1e150).numpy(), atol=1e-10)


def test_a_singular_solve_takes_the_documented_ridge_toward_its_prior():
    g = torch.Generator().manual_seed(8)
    basis = torch.randn(6, 3, generator=g)
    system = (basis @ basis.T).float()  # rank 3 of 6
    rhs, prior = torch.randn(6, 4, generator=g), torch.randn(6, 4, generator=g)
    solved = linalg.solve(system, rhs, prior, routes=(("default", failing_solve), ("float64", failing_solve),
                                                      *linalg.SOLVE_ROUTES[2:]))
    a, b, x0 = system.double().numpy(), rhs.double().numpy(), prior.double().numpy()
    ridge = linalg.RIDGE * np.trace(a) / 6
    expected = np.linalg.solve(a + ridge * np.eye(6), b + ridge * x0)
    np.testing.assert_allclose(solved.numpy(), expected.astype(np.float32), rtol=1e-5)
    assert solved.dtype == torch.float32


def test_a_zero_system_gives_the_prior():
    prior = seeded((5, 2), 9)
    np.testing.assert_allclose(linalg.solve(torch.zeros(5, 5), torch.zeros(5, 2), prior).numpy(), prior.numpy(), rtol=1e-7)


def test_a_solve_that_fails_in_float32_is_solved_in_float64():
    system, rhs = seeded((6, 6), 10), seeded((6, 2), 11)
    solved = linalg.solve(system, rhs, routes=(("default", failing_solve), *linalg.SOLVE_ROUTES[1:]))
    np.testing.assert_allclose(solved.numpy(), np.linalg.solve(system.double().numpy(), rhs.double().numpy()), rtol=1e-5)


# ----------------------------------------------------------------------------- TSV through mima merge
TSV_KEY = "transformer.resblocks.6.attn.out_proj.weight"


@pytest.fixture()
def tsv_pair(tmp_path):
    """theta_0 and two task models whose task vectors are built as the issue's pair: a shared part and
    each task's own, of norms 0.0144 and 0.0126 (here 96 x 96, not 768 x 768)."""
    base = {TSV_KEY: seeded((96, 96), 20, 0.036), "transformer.resblocks.6.attn.out_proj.bias": torch.zeros(96)}
    shared = seeded((96, 96), 21)
    paths = {"base": tmp_path / "base.safetensors"}
    save_state_dict(paths["base"], base)
    taus = []
    for index, norm in ((1, 0.0144), (2, 0.0126)):
        tau = shared + seeded((96, 96), 21 + index)
        taus.append(tau * norm / tau.norm())
        paths[f"m{index}"] = tmp_path / f"m{index}.safetensors"
        save_state_dict(paths[f"m{index}"], {TSV_KEY: base[TSV_KEY] + taus[-1], "transformer.resblocks.6.attn.out_proj.bias":
                                             torch.full((96,), 1e-4 * index)})
    return paths, base, taus


def numpy_tsv(taus: list[torch.Tensor]) -> np.ndarray:
    """TSV's merged matrix in float64 (Gargiulo et al.: top 1/T triplets per task, polar factors)."""
    decompositions = [np.linalg.svd(tau.double().numpy(), full_matrices=False) for tau in taus]
    k = decompositions[0][1].size // len(taus)
    u = np.concatenate([d[0][:, :k] for d in decompositions], axis=1)
    s = np.concatenate([d[1][:k] for d in decompositions])
    v = np.concatenate([d[2][:k] for d in decompositions], axis=0)
    return numpy_polar(u) @ np.diag(s) @ numpy_polar(v)


def tsv_argv(paths, output) -> list:
    return ["merge", "--method", "tsv", "--base", paths["base"], "--models", paths["m1"], paths["m2"], "--output", output]


def test_tsv_whose_svd_does_not_converge_falls_back_and_merges(tsv_pair, tmp_path, capfd, monkeypatch):
    paths, base, taus = tsv_pair
    monkeypatch.setattr(linalg, "SVD_ROUTES", FAILING_FIRST)  # the helpers' default routes: mima's, not torch's
    result = cli(tsv_argv(paths, tmp_path / "tsv.safetensors"), capfd)
    assert result.code == 0 and "Traceback" not in result.err, result.err
    merged = load_state_dict(tmp_path / "tsv.safetensors")[TSV_KEY]
    expected = base[TSV_KEY].double().numpy() + numpy_tsv(taus)
    np.testing.assert_allclose(merged.numpy(), expected, atol=2e-7)


def test_tsv_whose_svd_fails_on_every_route_is_one_line_naming_the_tensor(tsv_pair, tmp_path, capfd, monkeypatch):
    paths, _, _ = tsv_pair
    monkeypatch.setattr(linalg, "SVD_ROUTES", tuple((name, failing_svd) for name, _ in linalg.SVD_ROUTES))
    with unchanged(tmp_path):
        result = cli(tsv_argv(paths, tmp_path / "tsv.safetensors"), capfd)
    line = assert_one_line(result.code, result.err, f"tsv: tensor '{TSV_KEY}': its SVD failed on every route tried "
                           "(default driver: linalg.svd: The algorithm failed to converge", "float64 via QR: ")
    assert "NaN" not in line and "allow_non_finite" not in line  # finite input is not said to hold them


# ----------------------------------------------------------------------------- weights near 1e38
def huge_encoders(encoders, folder, same_sign: bool) -> list:
    """m1 and m2 with every matrix's entries near float32's limit (finite): random signs in +-1e38,
    or both +1.8e38 (whose sum overflows)."""
    paths = []
    for index, name in enumerate(("m1", "m2")):
        state = load_state_dict(encoders[name])
        g = torch.Generator().manual_seed(30 + index)
        for key, value in state.items():
            if value.is_floating_point() and value.ndim == 2:
                state[key] = torch.full_like(value, 1.8e38) if same_sign else (torch.rand(value.shape, generator=g) * 2 - 1) * 1e38
        paths.append(folder / f"huge-{name}.safetensors")
        save_state_dict(paths[-1], state)
    return paths


@pytest.mark.parametrize("method", ["iso_c", "iso_cts", "cart_indexing", "tsv"])
def test_weights_near_1e38_are_one_line_saying_float32_cannot_hold_the_merge(encoders, tmp_path, capfd, method):
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    models = huge_encoders(encoders, inputs, same_sign=False)
    with unchanged(tmp_path):
        result = cli(["merge", "--method", method, "--base", encoders["base"], "--models", *models,
                      "--output", tmp_path / "out.safetensors"], capfd)
    line = assert_one_line(result.code, result.err, f"{method}: tensor '", "singular values exceed float32's range",
                           "weights this large cannot be merged in float32")
    assert "NaN" not in line and "MKL" not in result.out + result.err


@pytest.mark.parametrize("method", ["iso_c", "iso_cts"])
def test_finite_weights_whose_sum_overflows_are_not_said_to_hold_nan(encoders, tmp_path, capfd, method):
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    models = huge_encoders(encoders, inputs, same_sign=True)
    result = cli(["merge", "--method", method, "--base", encoders["base"], "--models", *models,
                  "--output", tmp_path / "out.safetensors"], capfd)
    line = assert_one_line(result.code, result.err, f"{method}: tensor '", "its SVD got NaN or Inf values computed from "
                           "finite weights", "weights this large cannot be merged in float32")
    assert "allow_non_finite" not in line and "SLASCL" not in result.out + result.err


# ----------------------------------------------------------------------------- RegMean
class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Module()
        self.mlp.c_fc = nn.Linear(4, 4)
        self.mlp.c_proj = nn.Linear(4, 4)

    def forward(self, x):
        return x + self.mlp.c_proj(torch.tanh(self.mlp.c_fc(x)))


class TinyBlocks(nn.Module):
    """Two residual blocks named as open_clip's (`transformer.resblocks.<l>.mlp.c_fc`): what CART's,
    LiNeS's and RegMean++'s default patterns find."""

    def __init__(self) -> None:
        super().__init__()
        self.transformer = nn.Module()
        self.transformer.resblocks = nn.ModuleList([Block(), Block()])

    def forward(self, x):
        for block in self.transformer.resblocks:
            x = block(x)
        return x


def tiny_setting(seed: int = 40):
    """(encoder, pool, theta_0, two task models) on the tiny blocks."""
    g = torch.Generator().manual_seed(seed)
    encoder = TinyBlocks()
    heads = {task: torch.randn(3, 4, generator=g) for task in ("a", "b")}
    data = {task: {split: (torch.randn(16, 4, generator=g), torch.randint(0, 3, (16,), generator=g))
                   for split in ("train", "val", "test")} for task in heads}
    base = {key: value.detach().clone() for key, value in encoder.state_dict().items()}
    models = [{key: value + 0.05 * torch.randn(value.shape, generator=g) for key, value in base.items()} for _ in heads]
    return encoder, TinyPool(encoder, heads, data), base, models


def numpy_regmean(pool: TinyPool, models, key: str, alpha: float) -> np.ndarray:
    """RegMean of the first block's c_fc (its inputs are the examples themselves), in float64."""
    grams, rhs = [], 0
    for model, task in zip(models, pool.tasks):
        x = pool.data[task]["train"][0].double().numpy()
        gram = x.T @ x / len(x)
        gram = gram * (alpha + (1 - alpha) * np.eye(len(gram)))
        grams.append(gram)
        rhs = rhs + gram @ model[key].double().numpy().T
    return np.linalg.solve(sum(grams), rhs).T


@pytest.mark.parametrize("method", ["regmean", "regmean_plus_plus"])
def test_regmean_on_weights_scaled_by_1e_30_keeps_the_average_where_the_data_say_nothing(method):
    """The inputs of c_proj underflow to zero (tanh of 1e-30 x): their Gram matrices are zero, the
    solve is singular, and the ridge gives the average there; c_fc's inputs are the examples, whose
    Gram matrix is regular, and get RegMean's solution."""
    _, pool, _, models = tiny_setting()
    tiny = [{key: value * 1e-30 for key, value in model.items()} for model in models]
    merged = get_method(method).merge(tiny, None, pool, examples=16, alpha=0.6).state
    for key, value in merged.items():
        assert bool(torch.isfinite(value).all()), key
        if "c_proj.weight" in key or key.endswith("bias"):
            torch.testing.assert_close(value, (tiny[0][key] + tiny[1][key]) / 2, rtol=1e-6, atol=0)
    first = "transformer.resblocks.0.mlp.c_fc.weight"
    np.testing.assert_allclose(merged[first].numpy(), numpy_regmean(pool, tiny, first, 0.6), rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("method", ["regmean", "regmean_plus_plus", "fisher"])
def test_data_merges_of_half_precision_models_compute_in_float32_and_keep_their_dtype(method, dtype):
    """The merge of the same models widened to float32, in the models' dtype: exactly for RegMean and
    Fisher; RegMean++'s blocks below l are the merge as written (in the models' dtype), so its inputs
    to block l differ by that rounding."""
    _, pool, _, models = tiny_setting()
    half = [{key: value.to(dtype) for key, value in model.items()} for model in models]
    merged = get_method(method).merge(half, None, pool, examples=16).state
    widened = get_method(method).merge([{k: v.float() for k, v in m.items()} for m in half], None, pool, examples=16).state
    exact = method != "regmean_plus_plus"
    for key, value in merged.items():
        assert value.dtype == dtype, key
        torch.testing.assert_close(value.float(), widened[key].to(dtype).float(), rtol=0 if exact else 2e-2,
                                   atol=0 if exact else 2e-2, msg=key)


def test_regmean_of_float16_files_through_mima_merge(small_clip, tmp_path, capfd):
    import open_clip
    import yaml

    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"model": {"clip": small_clip, "pretrained": None},
                                      "data": {"suite": "digits", "tasks": ["rot90", "mirror"]}}))
    base = open_clip.create_model(small_clip).visual.state_dict()
    paths = []
    for seed in (1, 2):
        g = torch.Generator().manual_seed(seed)
        paths.append(tmp_path / f"m{seed}.safetensors")
        save_state_dict(paths[-1], {key: (value + 0.01 * torch.randn(value.shape, generator=g)).half()
                                    for key, value in base.items()})
    out = tmp_path / "regmean.safetensors"
    result = cli(["merge", "--method", "regmean", "--models", *paths, "--output", out, "--config", config,
                  "--examples", "8"], capfd)
    assert result.code == 0, result.err
    merged = load_state_dict(out)
    assert {value.dtype for value in merged.values()} == {torch.float16}
    assert all(bool(torch.isfinite(value).all()) for value in merged.values())


# ----------------------------------------------------------------------------- --allow-non-finite: one rule
POISONED = "transformer.resblocks.0.mlp.c_fc.weight"
ENTRY = (1, 2)
# What a NaN or Inf is compared with: a finite value of the largest magnitude, which a ranking
# (TIES's, Breadcrumbs', DELLA's) places where it places NaN and Inf.
STAND_IN = 1e30


def poisoned_models(models, value: float):
    changed = [{key: tensor.clone() for key, tensor in model.items()} for model in models]
    changed[1][POISONED][ENTRY] = value
    return changed


def merged_models(method, models, base, pool):
    """The merge's model (a per-task merge: each task's model rebuilt from its index)."""
    output = method.merge(models, base if method.needs_base else None, pool, allow_non_finite=True).state
    return [method.reconstruct(output, task) for task in range(len(models))] if method.per_task else [output]


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_allow_non_finite_keeps_nan_where_it_is_or_refuses_naming_the_tensor(name, value):
    """The rule (docs/merging.md, "Degenerate inputs"): with allow_non_finite a merge either refuses in
    one line naming the tensor (a step computed from the whole tensor or model would spread it), or
    holds the NaN/Inf in that entry alone (or nowhere: MagMax's comparison passes a NaN over), every
    other entry being what the merge gives with a finite value there."""
    method = get_method(name)
    _, pool, base, models = tiny_setting()
    try:
        poisoned = merged_models(method, poisoned_models(models, value), base, pool)
    except MimaError as refusal:
        line = str(refusal)
        assert "\n" not in line and f"tensor '{POISONED}' holds NaN or Inf values" in line, line
        assert "allow_non_finite" in line
        return
    stood_in = merged_models(method, poisoned_models(models, STAND_IN), base, pool)
    for got, expected in zip(poisoned, stood_in, strict=True):
        for key, tensor in got.items():
            mask = torch.ones_like(tensor, dtype=torch.bool)
            if key == POISONED:
                mask[ENTRY] = False
            torch.testing.assert_close(tensor[mask], expected[key][mask], msg=f"{name}: {key}")


def test_lines_auto_alpha_of_another_merge_refuses_nan():
    _, _, base, models = tiny_setting()
    with pytest.raises(MimaError) as refusal:
        get_method("lines").merge(poisoned_models(models, float("nan")), base, allow_non_finite=True, base_merge="ties")
    assert str(refusal.value) == (f"lines: tensor '{POISONED}' holds NaN or Inf values, which allow_non_finite "
                                  "(--allow-non-finite) let through; its lines_alpha 'auto' (L1 norms over the whole model) "
                                  "cannot take them")


def test_a_merge_written_with_nan_says_so_and_one_that_cannot_refuses(tmp_path, capfd):
    _, _, base, models = tiny_setting()
    paths = {"base": tmp_path / "base.safetensors", "m1": tmp_path / "m1.safetensors", "m2": tmp_path / "m2.safetensors"}
    save_state_dict(paths["base"], base)
    for path, model in zip((paths["m1"], paths["m2"]), poisoned_models(models, float("nan"))):
        save_state_dict(path, model)
    out = tmp_path / "ta.safetensors"
    argv = ["--base", paths["base"], "--models", paths["m1"], paths["m2"], "--allow-non-finite"]
    result = cli(["merge", "--method", "task_arithmetic", *argv, "--output", out], capfd)
    assert result.code == 0 and result.err.strip().splitlines() == [
        f"mima: warning: {out.name} was written with NaN or Inf in 1 tensor(s) ('{POISONED}'), which allow_non_finite "
        "(--allow-non-finite) let through"], result.err
    assert int(torch.isnan(load_state_dict(out)[POISONED]).sum()) == 1
    with unchanged(tmp_path):
        refused = cli(["merge", "--method", "model_stock", *argv, "--output", tmp_path / "ms.safetensors"], capfd)
    assert_one_line(refused.code, refused.err, f"model_stock: tensor '{POISONED}' holds NaN or Inf values",
                    "its angle between the task vectors cannot take them")
