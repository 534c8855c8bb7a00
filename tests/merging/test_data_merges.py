"""Data-dependent merges, validation selection and checkpoint conversion on a small real open_clip CLIP."""

from __future__ import annotations

import collections
import json
import os
import sys
import types

import numpy as np
import open_clip
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mima.cli import main
from mima.convert.pickle_reader import convert_checkpoint
from mima.core.errors import MimaError
from mima.merging import get_method
from mima.pools import task_pool
from mima.merging.fisher import diagonal_fisher
from mima.merging.fw_merging import CANDIDATE_INITIAL
from mima.core.run_folder import RunFolder
from mima.core.safetensors_io import load_state_dict
from tests.conftest import fit_config

TASKS = ["rot90", "mirror"]


@pytest.fixture(scope="module")
def pool(small_clip):
    return task_pool({"model": {"clip": small_clip, "pretrained": None}, "data": {"suite": "digits", "tasks": TASKS}})


@pytest.fixture(scope="module")
def task_models(pool):
    """theta_0 and two perturbed copies standing in for fine-tuned task models."""
    base = {k: v.detach().clone() for k, v in pool.encoder.state_dict().items()}
    models = []
    for seed in (1, 2):
        g = torch.Generator().manual_seed(seed)
        models.append({k: v + 0.05 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v for k, v in base.items()})
    return base, models


def test_adamerging_lowers_the_prediction_entropy(pool, task_models):
    base, models = task_models
    for granularity in ("task", "layer"):
        note = get_method("adamerging").merge(models, base, pool=pool, granularity=granularity, steps=25, lr=0.01).notes
        assert note["entropy_after"] < note["entropy_before"], note
        coefficients = np.array(note["coefficients"])
        assert coefficients.shape[1] == 2 and coefficients.min() >= 0 and coefficients.max() <= 1


def test_adamerging_merges_a_batchnorm_encoder_its_statistics_by_the_mean_coefficients(batchnorm_clip):
    """BatchNorm's running statistics are buffers, not parameters: they take the mean of the learnt
    coefficients, detached (batch_norm refuses statistics that carry a gradient; the offline suite's
    MobileNetV2 failed so). Checked against the merge written out from the coefficients noted."""
    bn_pool = task_pool({"model": {"clip": batchnorm_clip, "pretrained": None}, "data": {"suite": "digits", "tasks": TASKS}})
    base = {k: v.detach().clone() for k, v in bn_pool.encoder.state_dict().items()}
    models = []
    for seed in (1, 2):
        g = torch.Generator().manual_seed(seed)
        models.append({k: v + 0.05 * torch.rand(v.shape, generator=g) if v.is_floating_point() else v for k, v in base.items()})
    buffers = [k for k in base if "running_" in k]
    assert buffers and all(k not in dict(bn_pool.encoder.named_parameters()) for k in buffers)
    output = get_method("adamerging").merge(models, base, pool=bn_pool, granularity="layer", steps=3, lr=0.01)
    layers, coefficients = output.notes["layers"], torch.tensor(output.notes["coefficients"])
    assert not set(buffers) & set(layers)  # a coefficient per parameter only
    mean_row = coefficients.mean(dim=0)
    for key in buffers:
        expected = base[key] + sum(mean_row[t] * (models[t][key] - base[key]) for t in range(2))
        assert torch.allclose(output.state[key], expected, atol=1e-6), key
    key = layers[0]
    expected = base[key] + sum(coefficients[0, t] * (models[t][key] - base[key]) for t in range(2))
    assert torch.allclose(output.state[key], expected, atol=1e-6)
    cart = get_method("adamerging_cart").merge(models, base, pool=bn_pool, granularity="task", steps=2, lr=0.01,
                                               matrix_keys="head.proj.weight")
    assert not set(buffers) & set(cart.notes.get("layers", [])) and all(torch.isfinite(cart.state[k]).all() for k in buffers)


def _independent_gradient(pool, clip: str, weights: dict, examples: int) -> dict[str, torch.Tensor]:
    """Cross-entropy gradient with a real module holding `weights` (not functional_call)."""
    encoder = open_clip.create_model(clip).visual
    encoder.load_state_dict(weights)
    total = {n: torch.zeros_like(p) for n, p in encoder.named_parameters()}
    for task in pool.tasks:
        encoder.zero_grad()
        loss = 0
        for images, labels in pool.examples(task, "train", examples):
            features = F.normalize(encoder(images), dim=-1)
            loss = loss + F.cross_entropy(features @ pool.heads[task].T, labels, reduction="sum")
        (loss / (examples * len(pool.tasks))).backward()
        for n, p in encoder.named_parameters():
            total[n] += p.grad
    return total


def test_fw_hard_first_step_goes_to_the_vertex_most_aligned_with_the_negative_gradient(pool, task_models, small_clip):
    base, models = task_models
    output = get_method("fw_merging").merge(models, base, pool=pool, iterations=1, start="pretrained", examples=8,
                                            step_size=0.5, lam=1.0)
    merged = output.state
    gradient = _independent_gradient(pool, small_clip, base, 8)
    vertices = [*models, base]  # the initial merge is theta_0 here

    def cosine(a: np.ndarray, b: np.ndarray) -> float:  # 0 against a zero vector (theta_0 has zero biases)
        norms = np.linalg.norm(a) * np.linalg.norm(b)
        return float(np.dot(a.ravel(), b.ravel()) / norms) if norms > 0 else 0.0

    scores = [sum(cosine(g.numpy(), v[k].float().numpy()) for k, g in gradient.items()) for v in vertices]
    pick = int(np.argmin(scores))
    assert output.notes["steps"][0]["vertex"] == [*TASKS, CANDIDATE_INITIAL][pick]
    gamma = 2.0 / 2 * 0.5 * 1.0  # 2 / (t + 2) * step_size * lam at t = 0
    for key in gradient:
        expected = base[key] + gamma * (vertices[pick][key] - base[key])
        torch.testing.assert_close(merged[key], expected, rtol=1e-5, atol=1e-6)


def test_diagonal_fisher_equals_the_expectation_over_classes(pool, task_models):
    base, models = task_models
    keys = ["proj", "ln_post.weight"]
    fisher = diagonal_fisher(pool, models[0], keys, "rot90", examples=3)
    params = {k: models[0][k].float() for k in keys}
    expected = {k: torch.zeros_like(v) for k, v in params.items()}
    for images, _ in pool.examples("rot90", "train", 3, batch_size=1):
        def log_probs(p):
            return pool.logits({**models[0], **p}, "rot90", images).log_softmax(dim=1)[0]
        jacobian = torch.func.jacrev(log_probs)(params)  # [classes, *param]
        probs = log_probs(params).exp().detach()
        for k in keys:
            expected[k] += (probs.reshape(-1, *[1] * params[k].ndim) * jacobian[k].pow(2)).sum(0)
    for k in keys:
        torch.testing.assert_close(fisher[k], expected[k] / 3, rtol=1e-4, atol=1e-9)


def test_regmean_merges_the_linear_layers_that_run_and_averages_the_rest(pool, task_models):
    base, models = task_models
    output = get_method("regmean").merge(models, base, pool=pool, examples=16)
    merged, layers = output.state, output.notes["linear_layers"]
    assert layers and all(name.endswith(("mlp.c_fc.weight", "mlp.c_proj.weight")) for name in layers)
    for key in ("proj", "transformer.resblocks.0.attn.in_proj_weight", "transformer.resblocks.0.mlp.c_fc.bias"):
        torch.testing.assert_close(merged[key], (models[0][key] + models[1][key]) / 2)
    assert not torch.allclose(merged[layers[0]], (models[0][layers[0]] + models[1][layers[0]]) / 2)


def test_select_on_val_through_the_cli_writes_a_results_table(tmp_path, small_clip, capsys):
    from mima.commands.fit.run import run_fit

    run = run_fit(fit_config(tmp_path / "run", small_clip, TASKS, steps=4, iterations=2)).run_dir
    out = tmp_path / "cart.safetensors"
    assert main(["merge", "--method", "cart", "--models", str(run), "--output", str(out), "--select-on", "val"]) == 0
    report = json.loads((tmp_path / "cart.safetensors.results.json").read_text())
    trials = report["trials"]
    assert len(trials) == 4 * 11 and report["selected_on"] == "val"
    best = max(trials, key=lambda t: t["score"])
    assert report["validation_accuracy"] == best["score"]
    assert (report["hparams"]["rank_ratio"], report["hparams"]["lam"]) == (best["rank_ratio"], best["lam"])
    assert set(report["test_accuracy"]) == {*TASKS, "mean"}
    assert (tmp_path / "cart.safetensors.results.md").read_text().startswith("# cart")
    out2 = tmp_path / "tall.safetensors"
    assert main(["merge", "--method", "tall", "--models", str(run), "--output", str(out2), "--select-on", "val"]) == 0
    tall = json.loads((tmp_path / "tall.safetensors.results.json").read_text())
    assert len(tall["hparams"]["mask_lam"]) == 2  # one lambda per task
    assert main(["merge", "--method", "fisher", "--models", str(run), "--output", str(tmp_path / "f.safetensors"),
                 "--examples", "4"]) == 0
    fisher = json.loads((tmp_path / "f.safetensors.results.json").read_text())
    assert fisher["hparams"] == {"examples": 4} and set(fisher["notes"]["fisher_norms"]) == set(TASKS)
    capsys.readouterr()
    # the run's task files, not the run folder: no config comes with them
    finals = [str(RunFolder(run).final_file(task)) for task in TASKS]
    code = main(["merge", "--method", "adamerging", "--models", *finals, "--base",
                 str(run / "pretrained.safetensors"), "--output", str(tmp_path / "a.safetensors")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "needs --config" in err and not (tmp_path / "a.safetensors").exists()


# ------------------------------------------------------------------------------- convert
def _fake_task_vectors_module(monkeypatch):
    """task_vectors' src.modeling.ImageEncoder, defined here (the converter must not import it)."""
    modeling = types.ModuleType("src.modeling")

    class ImageEncoder(nn.Module):
        def __init__(self, clip: str) -> None:
            super().__init__()
            self.model, self.train_preprocess, self.val_preprocess = open_clip.create_model_and_transforms(clip)
            delattr(self.model, "transformer")

    ImageEncoder.__module__, ImageEncoder.__qualname__ = "src.modeling", "ImageEncoder"
    modeling.ImageEncoder = ImageEncoder
    monkeypatch.setitem(sys.modules, "src", types.ModuleType("src"))
    monkeypatch.setitem(sys.modules, "src.modeling", modeling)
    return ImageEncoder


def test_convert_a_pickled_image_encoder(tmp_path, small_clip, monkeypatch, capsys):
    encoder = _fake_task_vectors_module(monkeypatch)(small_clip)
    torch.save(encoder, tmp_path / "finetuned.pt")
    monkeypatch.delitem(sys.modules, "src.modeling")  # as on a machine without task_vectors installed
    assert main(["convert", str(tmp_path / "finetuned.pt"), str(tmp_path / "out.safetensors")]) == 0
    converted = load_state_dict(tmp_path / "out.safetensors")
    reference = encoder.model.visual.state_dict()
    assert set(converted) == set(reference) and all(torch.equal(converted[k], reference[k]) for k in reference)
    whole = convert_checkpoint(tmp_path / "finetuned.pt", prefix="")
    assert "model.logit_scale" in whole and "model.visual.proj" in whole


class _Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_convert_refuses_other_callables_without_running_them(tmp_path, capsys):
    marker = tmp_path / "ran"
    torch.save({"state_dict": {"w": torch.zeros(2)}, "extra": _Payload(str(marker))}, tmp_path / "evil.pt")
    code = main(["convert", str(tmp_path / "evil.pt"), str(tmp_path / "out.safetensors")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "refused" in err[0] and "system" in err[0]
    assert not marker.exists() and not (tmp_path / "out.safetensors").exists()
    with pytest.raises(MimaError, match="not a torch zip checkpoint"):
        (tmp_path / "plain.pt").write_bytes(b"not a zip")
        convert_checkpoint(tmp_path / "plain.pt")


class _MemberByGetattr:
    """Pickles as `getattr(owner, name)`, the way Python 3.11.0-3.11.4 pickle an enum member."""

    def __init__(self, owner, name: str) -> None:
        self.owner, self.name = owner, name

    def __reduce__(self):
        return (getattr, (self.owner, self.name))


def test_convert_reads_an_enum_member_pickled_by_getattr_and_refuses_other_getattrs(tmp_path, capsys):
    from torchvision.transforms import InterpolationMode

    weights = {"visual.proj": torch.randn(4, 3)}
    torch.save({"state_dict": weights, "mode": _MemberByGetattr(InterpolationMode, "BICUBIC")}, tmp_path / "enum.pt")
    converted = convert_checkpoint(tmp_path / "enum.pt", prefix="")
    assert torch.equal(converted["visual.proj"], weights["visual.proj"])
    # getattr on anything that is not a stand-in model class is refused before it runs
    torch.save({"state_dict": weights, "call": _MemberByGetattr(collections.OrderedDict, "fromkeys")}, tmp_path / "bad.pt")
    assert main(["convert", str(tmp_path / "bad.pt"), str(tmp_path / "out.safetensors")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "getattr(OrderedDict, 'fromkeys')" in err[0] and "bad.pt" in err[0]
    assert not (tmp_path / "out.safetensors").exists()


def _rewrite_archive(source, target, change) -> None:
    """Copy a torch zip checkpoint member by member, letting `change(name, data)` return
    (new data, compression) for each member."""
    import zipfile

    with zipfile.ZipFile(source) as old, zipfile.ZipFile(target, "w") as new:
        for info in old.infolist():
            data, compression = change(info.filename, old.read(info.filename))
            new.writestr(info.filename, data, compress_type=compression)


@pytest.mark.parametrize("damage, fragment", [("truncated-storage", "its record says 256"),
                                              ("compressed-storage", "compressed"),
                                              ("shrunk-record", "needs 64 elements of its storage, which holds 8")])
def test_convert_refuses_storages_that_do_not_hold_their_tensors(tmp_path, capsys, damage, fragment):
    import pickletools
    import zipfile

    weights = {"w": torch.arange(64, dtype=torch.float32).reshape(8, 8), "b": torch.ones(8)}
    torch.save({"state_dict": weights}, tmp_path / "good.pt")

    def change(name, data):
        if damage == "truncated-storage" and "/data/" in name and len(data) == 256:
            return data[:100], zipfile.ZIP_STORED  # the 8x8 tensor's storage, cut short
        if damage == "compressed-storage" and "/data/" in name:
            return data, zipfile.ZIP_DEFLATED
        return data, zipfile.ZIP_STORED

    _rewrite_archive(tmp_path / "good.pt", tmp_path / "bad.pt", change)
    if damage == "shrunk-record":
        # a consistent archive whose storage is too small for the view that the pickle asks for:
        # the storage of 8 elements is read as an 8x8 tensor (more elements than it holds)
        torch.save({"state_dict": {"w": torch.ones(8)}}, tmp_path / "small.pt")
        with zipfile.ZipFile(tmp_path / "small.pt") as archive:
            pickle_name = next(n for n in archive.namelist() if n.endswith("data.pkl"))
            program = archive.read(pickle_name)
        # torch.Size([8]) and stride (1,) in the pickle become (8, 8) and (8, 1)
        ops = [op for op in pickletools.genops(program)]
        assert any(arg == 8 for _, arg, _ in ops)
        patched = program.replace(b"K\x08\x85q", b"K\x08K\x08\x86q", 1).replace(b"K\x01\x85q", b"K\x08K\x01\x86q", 1)
        assert patched != program
        _rewrite_archive(tmp_path / "small.pt", tmp_path / "bad.pt",
                         lambda name, data: (patched if name == pickle_name else data, zipfile.ZIP_STORED))
    out = tmp_path / "out.safetensors"
    code = main(["convert", str(tmp_path / "bad.pt"), str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and str(tmp_path / "bad.pt") in err[0] and fragment in err[0], err
    assert not out.exists()
