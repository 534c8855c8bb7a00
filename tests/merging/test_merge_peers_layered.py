"""LiNeS, EMR, DELLA and RegMean++, each against a hand-worked example or the reference's rule
written again here (numpy, or the reference's own loop), and through `mima merge`."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch
import yaml
from torch import nn

from mima.cli import main
from mima.core.errors import MimaError
from mima.core.safetensors_io import load_state_dict, save_state_dict
from mima.merging import get_method
from mima.merging.della import keep_probabilities, magprune
from tests.helpers import TinyPool, numpy_ties

# open_clip-like names: three residual blocks, tensors before and after them, a 4-D patch
# embedding, a 0-D tensor and an integer counter
SHAPES = {
    "conv1.weight": (4, 3, 2, 2),
    "class_embedding": (4,),
    "transformer.resblocks.0.attn.in_proj_weight": (12, 4),
    "transformer.resblocks.0.ln_1.weight": (4,),
    "transformer.resblocks.1.mlp.c_fc.weight": (8, 4),
    "transformer.resblocks.1.mlp.c_fc.bias": (8,),
    "transformer.resblocks.2.mlp.c_proj.weight": (4, 8),
    "ln_post.weight": (4,),
    "proj": (4, 3),
    "logit_bias": (),
}
FLOATING = list(SHAPES)


def _models(count: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    base = {key: torch.randn(shape, generator=g) for key, shape in SHAPES.items()}
    base["counter"] = torch.tensor(7)
    models = [{k: v + 0.5 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v.clone() for k, v in base.items()}
              for _ in range(count)]
    return base, models


def _taus(base, models) -> dict[str, np.ndarray]:
    """[T, ...] task vectors, subtracted in float32 as the strategies do, then widened."""
    return {key: np.stack([(m[key] - base[key]).numpy() for m in models]).astype(np.float64) for key in FLOATING}


def _ties_reference(taus: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The official TIES (k = 20) of test_merge_strategies; 0-D tensors pass as one-entry vectors
    (TIES is entry-wise after its global trim) and come back 0-D."""
    merged = numpy_ties({key: tau.reshape(len(tau), -1) for key, tau in taus.items()}, k=20)
    return {key: merged[key].reshape(taus[key].shape[1:]) for key in taus}


def _save(tmp_path, base, models):
    save_state_dict(tmp_path / "base.safetensors", base)
    paths = []
    for index, model in enumerate(models):
        paths.append(tmp_path / f"m{index}.safetensors")
        save_state_dict(paths[-1], model)
    return tmp_path / "base.safetensors", paths


def _merge_cli(method: str, base_path, paths, out, *flags) -> int:
    return main(["merge", "--method", method, "--base", str(base_path), "--models", *map(str, paths),
                 "--output", str(out), *flags])


# ----------------------------------------------------------------------------------- LiNeS
def _reference_lines_scale(key: str, alpha: float, beta: float, num_blocks: int) -> float:
    """LiNeS_scaling of the authors' src/eval/eval.py, written again: the first i (0 ..) whose
    '.i.' is in the name gives alpha + beta * i / (num_blocks - 1); no such i gives alpha."""
    for layer in range(num_blocks):
        if f".{layer}." in key:
            return alpha + beta * (layer / (num_blocks - 1))
    return alpha


def test_lines_on_task_arithmetic_by_hand():
    # T = 2, theta_0 = 0, so tau_m = sum of the models; auto alpha = 1 / T = 0.5, beta 0.6, L = 3:
    # scales 0.5 outside the blocks and in block 0, 0.8 in block 1, 1.1 in block 2.
    base = {"pre": torch.zeros(1), "transformer.resblocks.0.w": torch.zeros(2), "transformer.resblocks.1.w": torch.zeros(2),
            "transformer.resblocks.2.w": torch.zeros(2), "n": torch.tensor(3)}
    models = [
        {"pre": torch.tensor([1.0]), "transformer.resblocks.0.w": torch.tensor([1.0, -2.0]),
         "transformer.resblocks.1.w": torch.tensor([0.5, 0.0]), "transformer.resblocks.2.w": torch.tensor([2.0, 1.0]), "n": torch.tensor(3)},
        {"pre": torch.tensor([3.0]), "transformer.resblocks.0.w": torch.tensor([1.0, 0.0]),
         "transformer.resblocks.1.w": torch.tensor([1.5, -1.0]), "transformer.resblocks.2.w": torch.tensor([0.0, 1.0]), "n": torch.tensor(3)},
    ]
    merged = get_method("lines")(models, base, lines_beta=0.6)
    torch.testing.assert_close(merged["pre"], torch.tensor([2.0]))  # 0.5 * 4
    torch.testing.assert_close(merged["transformer.resblocks.0.w"], torch.tensor([1.0, -1.0]))  # 0.5 * (2, -2)
    torch.testing.assert_close(merged["transformer.resblocks.1.w"], torch.tensor([1.6, -0.8]))  # 0.8 * (2, -1)
    torch.testing.assert_close(merged["transformer.resblocks.2.w"], torch.tensor([2.2, 2.2]))  # 1.1 * (2, 2)
    assert int(merged["n"]) == 3
    # a given alpha replaces the automatic one: 0.2 + 0.6 * 1 / 2 = 0.5 in block 1
    fixed = get_method("lines")(models, base, lines_alpha=0.2, lines_beta=0.6)
    torch.testing.assert_close(fixed["transformer.resblocks.1.w"], torch.tensor([1.0, -0.5]))
    torch.testing.assert_close(fixed["pre"], torch.tensor([0.8]))


@pytest.mark.parametrize("base_merge", ["task_arithmetic", "ties", "consensus"])
def test_lines_matches_the_reference_rule_on_each_base_merge(base_merge):
    base, models = _models(3, seed=1)
    taus = _taus(base, models)
    total = {key: value.sum(0) for key, value in taus.items()}
    if base_merge == "task_arithmetic":
        merged_tv = total
    elif base_merge == "ties":  # k = 20, global trim, disjoint mean (the reference's LiNeS+TIES)
        merged_tv = _ties_reference(taus)
    else:  # TALL masks at lambda 0.4, kept where at least 2 tasks select the entry
        merged_tv = {key: total[key] * ((np.abs(taus[key]) > 0.4 * np.abs(total[key] - taus[key])).sum(0) >= 2) for key in taus}
    # the reference's multi-task alpha: (||sum tau||_1 / ||merged tau||_1) / num_tasks
    alpha = sum(np.abs(v).sum() for v in total.values()) / sum(np.abs(v).sum() for v in merged_tv.values()) / 3
    merged = get_method("lines")(models, base, base_merge=base_merge, lines_beta=0.7)
    for key in FLOATING:
        scale = _reference_lines_scale(key, alpha, 0.7, num_blocks=3)
        np.testing.assert_allclose(merged[key].numpy(), base[key].numpy() + scale * merged_tv[key], rtol=1e-5, atol=1e-5,
                                   err_msg=key)
    assert int(merged["counter"]) == 7
    if base_merge != "task_arithmetic":
        assert abs(alpha - 1 / 3) > 1e-3  # the automatic alpha is not task arithmetic's 1 / T here


def test_lines_refuses_names_without_blocks_and_an_undefined_auto_alpha():
    base, models = _models(2, seed=2)
    with pytest.raises(MimaError, match=r"no tensor name matches block_keys 'layer\(\\d\+\)'"):
        get_method("lines")(models, base, block_keys=r"layer(\d+)")
    # disjoint task vectors: each entry is selected by one task only, so consensus (k = 2) keeps nothing
    zero = {"transformer.resblocks.0.w": torch.zeros(2)}
    disjoint = [{"transformer.resblocks.0.w": torch.tensor([1.0, 0.0])}, {"transformer.resblocks.0.w": torch.tensor([0.0, 1.0])}]
    with pytest.raises(MimaError, match="lines_alpha 'auto' .* is undefined"):
        get_method("lines")(disjoint, zero, base_merge="consensus")


# ------------------------------------------------------------------------------------- EMR
def test_emr_by_hand():
    # Sums (2, -2, -0.5, 0, 0): gamma (+, -, -, -, -), a zero sum counting as -. Masks: t1 (1, 1, 0, 0, 0),
    # t2 (0, 1, 0, 0, 1), t3 (1, 0, 1, 0, 0); tau_uni = (2, -3, -2, 0, -1). Rescalers (one tensor, so the
    # means of 5 entries): t1 0.9 / 1.0, t2 1.2 / 0.8 = 1.5, t3 1.0 / 0.8 = 1.25; the fourth task has a
    # zero task vector and gets theta_0 back (rescaler 0).
    base = {"w": torch.ones(5)}
    deltas = [[2.0, -1.0, 0.5, 0.0, 1.0], [-1.0, -3.0, 1.0, 0.0, -1.0], [1.0, 2.0, -2.0, 0.0, 0.0], [0.0] * 5]
    models = [{"w": base["w"] + torch.tensor(d)} for d in deltas]
    method = get_method("emr")
    index = method(models, base)
    expected = [[2.8, -1.7, 1, 1, 1], [1, -3.5, 1, 1, -0.5], [3.5, 1, -1.5, 1, 1], [1, 1, 1, 1, 1]]
    for task, row in enumerate(expected):
        torch.testing.assert_close(method.reconstruct(index, task)["w"], torch.tensor(row, dtype=torch.float32))
    assert [float(index[f"task{t}/rescaler"]) for t in range(4)] == pytest.approx([0.9, 1.5, 1.25, 0.0])


def _numpy_emr(taus: dict[str, np.ndarray]):
    """FusionBench's emr_merge written again: flag = sign of the sum (0 -> -1), masks agree with it,
    unified = flag * largest agreeing magnitude, rescaler = sum of per-tensor mean|tau_t| over sum of
    per-tensor mean|mask_t * unified|."""
    tasks = len(next(iter(taus.values())))
    unified, masks = {}, {}
    scales, new_scales = np.zeros(tasks), np.zeros(tasks)
    for key, tau in taus.items():
        flag = np.where(tau.sum(0) > 0, 1.0, -1.0)
        masks[key] = tau * flag > 0
        unified[key] = np.max(np.abs(tau) * masks[key], axis=0) * flag
        scales += np.abs(tau).reshape(tasks, -1).mean(1)
    for key in taus:
        new_scales += np.abs(unified[key] * masks[key]).reshape(tasks, -1).mean(1)
    return unified, masks, scales / new_scales


def _check_emr(index, base, models):
    unified, masks, rescalers = _numpy_emr(_taus(base, models))
    method = get_method("emr")
    for task in range(len(models)):
        rebuilt = method.reconstruct(index, task)
        for key in FLOATING:
            expected = base[key].numpy() + unified[key] * masks[key][task] * rescalers[task]
            np.testing.assert_allclose(rebuilt[key].numpy(), expected, rtol=1e-5, atol=1e-6, err_msg=key)
        assert int(rebuilt["counter"]) == 7
    return rescalers


def test_emr_matches_fusionbench_rule_over_tensors_of_different_sizes():
    base, models = _models(3, seed=3)
    rescalers = _check_emr(get_method("emr")(models, base), base, models)
    assert not np.allclose(rescalers, 1.0)


# ----------------------------------------------------------------------------------- DELLA
def test_della_keep_probabilities_by_hand():
    # magnitudes ranked 0.1 < 0.5 < 2 < 3 -> ranks 0, 1, 2, 3; p = 0.35 + 0.3 * rank / 3
    row = torch.tensor([[0.1, -3.0, 2.0, 0.5], [1.0, 1.0, -1.0, 0.0]])
    expected = torch.tensor([[0.35, 0.65, 0.55, 0.45], [0.45, 0.55, 0.65, 0.35]])  # equal magnitudes: earlier first
    torch.testing.assert_close(keep_probabilities(row, density=0.5, epsilon=0.15), expected)
    assert torch.equal(keep_probabilities(torch.tensor([[4.0]]), 0.3, 0.1), torch.tensor([[0.3]]))


def test_della_without_drop_is_the_disjoint_mean_with_zero_sums_elected_positive():
    # density 1 keeps every entry unscaled; sums (4, -1, 0): elected (+, -, +);
    # means (1 + 3) / 2, -2 / 1 and 1 / 1 (a zero sum elects +, unlike TIES's model-wide majority)
    base = {"w": torch.zeros(3)}
    models = [{"w": torch.tensor([1.0, -2.0, 1.0])}, {"w": torch.tensor([3.0, 1.0, -1.0])}]
    merged = get_method("della")(models, base, density=1.0, lam=0.5)
    torch.testing.assert_close(merged["w"], 0.5 * torch.tensor([2.0, -2.0, 1.0]))


def _reference_keep(seed: int, task: int, key: str, shape) -> np.ndarray:
    """The documented draws: torch.rand(rows x width) seeded by sha256('della/<seed>/<task>/<key>')."""
    digest = hashlib.sha256(f"della/{seed}/{task}/{key}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    return torch.rand(shape, generator=generator).numpy()


def _numpy_magprune(tau: np.ndarray, density: float, epsilon: float, seed: int, task: int, key: str) -> np.ndarray:
    """mergekit's della_magprune with 1 / p rescaling (the paper's), ranks within rows of the first dimension."""
    rows = tau.reshape(tau.shape[0], -1) if tau.ndim >= 2 else tau.reshape(1, -1)
    width = rows.shape[1]
    if width == 1:
        probs = np.full(rows.shape, density)
    else:
        ranks = np.empty(rows.shape)
        for r, row in enumerate(rows):
            ranks[r, np.argsort(np.abs(row), kind="stable")] = np.arange(width)
        probs = (density - epsilon) + 2 * epsilon * ranks / (width - 1)
    kept = _reference_keep(seed, task, key, rows.shape) < probs
    return (rows * kept / probs).reshape(tau.shape)


def _numpy_della(base, models, density, epsilon, seed, lam) -> dict[str, np.ndarray]:
    out = {}
    for key, tau in _taus(base, models).items():
        pruned = np.stack([_numpy_magprune(t, density, epsilon, seed, i, key) for i, t in enumerate(tau)])
        elected = np.where(pruned.sum(0) >= 0, 1.0, -1.0)
        agree = np.sign(pruned) == elected
        merged = (pruned * agree).sum(0) / np.maximum(agree.sum(0), 1)
        out[key] = base[key].numpy() + lam * merged
    return out


@pytest.mark.parametrize("density, epsilon, seed", [(0.5, 0.15, 0), (0.3, 0.2, 4)])
def test_della_matches_a_numpy_reimplementation(density, epsilon, seed):
    base, models = _models(3, seed=5)
    merged = get_method("della")(models, base, lam=1.3, density=density, epsilon=epsilon, seed=seed)
    for key, expected in _numpy_della(base, models, density, epsilon, seed, 1.3).items():
        np.testing.assert_allclose(merged[key].numpy(), expected, rtol=1e-5, atol=1e-5, err_msg=key)
    assert int(merged["counter"]) == 7
    other = get_method("della")(models, base, lam=1.3, density=density, epsilon=epsilon, seed=seed + 1)
    assert not torch.equal(other["proj"], merged["proj"])  # the seed is used


def test_magprune_is_unbiased_and_keeps_density_on_average():
    tau = torch.randn(4, 50, generator=torch.Generator().manual_seed(6))
    draws = torch.stack([magprune(tau, 0.4, 0.2, seed, 0, "w") for seed in range(2000)])
    torch.testing.assert_close(draws.mean(0), tau, rtol=0, atol=0.25)  # E[kept / p] = tau entry by entry
    kept = (draws != 0).float().mean(0)
    assert abs(float(kept.mean()) - 0.4) < 0.01
    order = tau.abs().argsort(dim=1)
    assert float(kept.gather(1, order[:, -5:]).mean()) > float(kept.gather(1, order[:, :5]).mean()) + 0.2


def test_della_refuses_a_window_outside_zero_one():
    base, models = _models(2, seed=7)
    with pytest.raises(MimaError, match=r"density - epsilon and density \+ epsilon must lie in \(0, 1\), got density=0.9, epsilon=0.15"):
        get_method("della")(models, base, density=0.9)


# ------------------------------------------------------------------------------- RegMean++
class Block(nn.Module):
    """x + fc2(tanh(fc1(x))): two linear layers inside one residual block."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 5), nn.Linear(5, 4)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)))


class TwoBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(3, 4)  # outside the blocks: averaged
        self.resblocks = nn.ModuleList([Block(), Block()])

    def forward(self, x):
        h = self.stem(x)
        for block in self.resblocks:
            h = block(h)
        return h


def _regmean_solve(grams, weights, alpha):
    reduced = [g * (alpha + (1 - alpha) * np.eye(len(g))) for g in grams]
    return np.linalg.solve(sum(reduced), sum(r @ w.T for r, w in zip(reduced, weights))).T


def test_regmean_plus_plus_propagates_through_the_merged_blocks_below():
    g = torch.Generator().manual_seed(8)
    encoder = TwoBlocks()
    heads = {"a": torch.randn(2, 4, generator=g), "b": torch.randn(2, 4, generator=g)}
    data = {task: {"train": (torch.randn(12, 3, generator=g), torch.zeros(12, dtype=torch.long))} for task in heads}
    base = {k: v.detach().clone() for k, v in encoder.state_dict().items()}
    models = [{k: v + 0.4 * torch.randn(v.shape, generator=g) for k, v in base.items()} for _ in range(2)]
    output = get_method("regmean_plus_plus").merge(models, None, TinyPool(encoder, heads, data), examples=12, alpha=0.7)

    w = [{k: v.double().numpy() for k, v in m.items()} for m in models]
    mean = {k: (w[0][k] + w[1][k]) / 2 for k in w[0]}
    expected = dict(mean)
    # inputs of block 0: each task's data through the averaged stem
    hidden = [data[t]["train"][0].double().numpy() @ mean["stem.weight"].T + mean["stem.bias"] for t in heads]
    for block in (0, 1):
        p = f"resblocks.{block}."
        grams1, grams2 = [], []
        for h, m in zip(hidden, w):  # task t's own block on inputs from the merged blocks below
            inner = np.tanh(h @ m[p + "fc1.weight"].T + m[p + "fc1.bias"])
            grams1.append(h.T @ h / len(h))
            grams2.append(inner.T @ inner / len(inner))
        expected[p + "fc1.weight"] = _regmean_solve(grams1, [m[p + "fc1.weight"] for m in w], 0.7)
        expected[p + "fc2.weight"] = _regmean_solve(grams2, [m[p + "fc2.weight"] for m in w], 0.7)
        hidden = [h + np.tanh(h @ expected[p + "fc1.weight"].T + mean[p + "fc1.bias"]) @ expected[p + "fc2.weight"].T
                  + mean[p + "fc2.bias"] for h in hidden]  # through the merged block
    for key, value in expected.items():
        np.testing.assert_allclose(output.state[key].numpy(), value, rtol=1e-4, atol=1e-5, err_msg=key)
    assert output.notes == {"linear_layers": [f"resblocks.{b}.fc{i}.weight" for b in (0, 1) for i in (1, 2)], "blocks": 2}
    # plain RegMean (each model's own inputs) gives another second block: the check above has teeth
    plain = get_method("regmean").merge(models, None, TinyPool(encoder, heads, data), examples=12, alpha=0.7).state
    assert not np.allclose(plain["resblocks.1.fc2.weight"].numpy(), expected["resblocks.1.fc2.weight"], atol=1e-3)


def test_regmean_plus_plus_needs_blocks():
    encoder = nn.Linear(3, 2)
    pool = TinyPool(encoder, {"a": torch.eye(2)}, {"a": {"train": (torch.randn(4, 3), torch.zeros(4, dtype=torch.long))}})
    state = {k: v.detach().clone() for k, v in encoder.state_dict().items()}
    with pytest.raises(MimaError, match="regmean_plus_plus': no tensor name matches block_keys"):
        get_method("regmean_plus_plus").merge([state, state], None, pool)


# ------------------------------------------------------------------------------ mima merge
def test_help_lists_the_new_flags_and_methods(capsys):
    with pytest.raises(SystemExit):
        main(["merge", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag in ("--base-merge", "--lines-alpha", "--lines-beta", "--block-keys", "--epsilon", "--density", "--seed"):
        assert flag in text, flag
    for name in ("lines", "della", "emr", "regmean_plus_plus"):
        assert name in text, name


def test_merge_command_writes_lines_della_and_emr_from_files(tmp_path, capsys):
    base, models = _models(3, seed=9)
    base_path, paths = _save(tmp_path, base, models)
    assert _merge_cli("lines", base_path, paths, tmp_path / "lines.safetensors", "--base-merge", "ties", "--lines-beta", "0.9") == 0
    written = load_state_dict(tmp_path / "lines.safetensors")
    taus = _taus(base, models)
    ties_tv = _ties_reference(taus)
    alpha = sum(np.abs(v.sum(0)).sum() for v in taus.values()) / sum(np.abs(v).sum() for v in ties_tv.values()) / 3
    for key in FLOATING:
        expected = base[key].numpy() + _reference_lines_scale(key, alpha, 0.9, 3) * ties_tv[key]
        np.testing.assert_allclose(written[key].numpy(), expected, rtol=1e-5, atol=1e-5, err_msg=key)

    assert _merge_cli("della", base_path, paths, tmp_path / "della.safetensors", "--density", "0.6", "--epsilon", "0.1",
                      "--seed", "3", "--lam", "0.9") == 0
    written = load_state_dict(tmp_path / "della.safetensors")
    for key, expected in _numpy_della(base, models, 0.6, 0.1, 3, 0.9).items():
        np.testing.assert_allclose(written[key].numpy(), expected, rtol=1e-5, atol=1e-5, err_msg=key)
    assert int(written["counter"]) == 7

    assert _merge_cli("emr", base_path, paths, tmp_path / "emr.safetensors") == 0
    _check_emr(load_state_dict(tmp_path / "emr.safetensors"), base, models)


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (["--method", "lines", "--lines-beta", "nan"], "--lines-beta must be a finite number, got nan"),
        (["--method", "lines", "--lines-alpha", "often"], "argument --lines-alpha: invalid"),
        (["--method", "lines", "--base-merge", "dare"], "argument --base-merge: invalid choice: 'dare'"),
        (["--method", "lines", "--block-keys", "layer"], "--block-keys must be a regular expression with a group"),
        (["--method", "lines", "--block-keys", r"layer(\d+)"], "no tensor name matches block_keys"),
        (["--method", "lines", "--block-keys", r"(res)blocks"], "its first group captured 'res' in"),
        (["--method", "lines", "--k", "20"], "--k does not apply to merge method 'lines'"),
        (["--method", "della", "--epsilon", "0.5"], "--epsilon must be a number in [0, 0.5), got 0.5"),
        (["--method", "della", "--density", "0.9"], "density - epsilon and density + epsilon must lie in (0, 1)"),
        (["--method", "emr", "--lam", "1"], "--lam does not apply to merge method 'emr'"),
        (["--method", "regmean_plus_plus", "--alpha", "1.5"], "--alpha must be a number in [0, 1], got 1.5"),
    ],
)
def test_bad_hyperparameters_are_one_line(tmp_path, capsys, flags, fragment):
    base, models = _models(2, seed=10)
    base_path, paths = _save(tmp_path, base, models)
    out = tmp_path / "out.safetensors"
    code = main(["merge", *flags, "--base", str(base_path), "--models", *map(str, paths), "--output", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and fragment in err[0], err
    assert not out.exists()


# ------------------------------------------------------- with task data: small CLIP, digits
TASKS = ["rot90", "mirror"]


@pytest.fixture(scope="module")
def clip_files(small_clip, tmp_path_factory):
    """A config file of the small CLIP on two digits tasks, theta_0 and two perturbed task models."""
    from mima.pools import task_pool

    folder = tmp_path_factory.mktemp("layered")
    config = {"model": {"clip": small_clip, "pretrained": None}, "data": {"suite": "digits", "tasks": TASKS}}
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    base = {k: v.detach().clone() for k, v in task_pool(config).encoder.state_dict().items()}
    models = []
    for seed in (1, 2):
        g = torch.Generator().manual_seed(seed)
        models.append({k: v + 0.05 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v for k, v in base.items()})
    base_path, paths = _save(folder, base, models)
    return folder / "config.yaml", base, models, base_path, paths


def test_lines_select_on_val_searches_beta_and_writes_that_merge(clip_files, tmp_path, capsys):
    config, base, models, base_path, paths = clip_files
    out = tmp_path / "lines.safetensors"
    assert _merge_cli("lines", base_path, paths, out, "--config", str(config), "--select-on", "val") == 0
    report = json.loads((tmp_path / "lines.safetensors.results.json").read_text())
    assert report["selected_on"] == "val" and [t["lines_beta"] for t in report["trials"]] == [round(0.1 * i, 1) for i in range(1, 16)]
    best = max(report["trials"], key=lambda t: t["score"])  # the first best on ties, as selection keeps
    assert report["hparams"]["lines_beta"] == best["lines_beta"] and report["validation_accuracy"] == best["score"]
    written = load_state_dict(out)
    blocks = 1 + max(int(k.split(".")[2]) for k in base if k.startswith("transformer.resblocks."))
    for key, value in base.items():
        if not value.is_floating_point():
            continue
        tau = sum(m[key].double() - value.double() for m in models)  # task arithmetic; alpha 1 / T
        expected = value.double() + _reference_lines_scale(key, 0.5, best["lines_beta"], blocks) * tau
        np.testing.assert_allclose(written[key].numpy(), expected.numpy(), rtol=1e-5, atol=1e-6, err_msg=key)


def test_regmean_plus_plus_through_the_merge_command(clip_files, tmp_path, capsys):
    config, base, models, base_path, paths = clip_files
    out = tmp_path / "rpp.safetensors"
    code = main(["merge", "--method", "regmean_plus_plus", "--models", *map(str, paths), "--output", str(out),
                 "--config", str(config), "--examples", "8"])
    assert code == 0, capsys.readouterr().err
    report = json.loads((tmp_path / "rpp.safetensors.results.json").read_text())
    layers = report["notes"]["linear_layers"]
    assert report["notes"]["blocks"] == 2 and report["hparams"]["examples"] == 8
    assert layers and all(name.endswith(("mlp.c_fc.weight", "mlp.c_proj.weight")) for name in layers)
    written = load_state_dict(out)
    for key in ("proj", "ln_post.weight", "transformer.resblocks.1.attn.in_proj_weight", "transformer.resblocks.0.mlp.c_fc.bias"):
        torch.testing.assert_close(written[key], (models[0][key] + models[1][key]) / 2)  # averaged, not RegMean
    assert not torch.allclose(written[layers[-1]], (models[0][layers[-1]] + models[1][layers[-1]]) / 2)
