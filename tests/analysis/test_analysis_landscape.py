"""`mima analyze landscape`: the plane of two task vectors, checked against flattened vectors and hand-counted errors."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.data import DataLoader

from mima.analysis.landscape.compute import (
    compute_landscape,
    error_function,
    grid_errors,
    merged_models,
    plane_basis,
    plane_coordinates,
    plane_point,
)
from mima.cli import main
from mima.core.errors import MimaError
from mima.core.subsets import fixed_subset
from mima.pools import task_pool
from mima.models.classifier import classify
from mima.core.run_folder import RunFolder
from mima.commands.fit.run import run_fit
from tests.helpers import fit_config

TASKS = ["rot90", "rot180", "mirror"]
PAIR = ("rot90", "rot180")
EXAMPLES = 40


@pytest.fixture(scope="module")
def run(tmp_path_factory, small_clip):
    # linear-probe heads: with the random small CLIP's zero-shot heads every model predicts one class,
    # and equal errors everywhere could not tell one point of the plane from another
    config = fit_config(tmp_path_factory.mktemp("landscape") / "N2", small_clip, TASKS, steps=4, iterations=2,
                        heads="linear_probe")
    return run_fit(config).run_dir


@pytest.fixture(scope="module")
def models(run):
    folder = RunFolder(run)
    return folder.pretrained(), [folder.final(task) for task in TASKS]


@pytest.fixture(scope="module")
def context(run):
    return task_pool(run)


def _flat(state_dict, keys) -> torch.Tensor:
    return torch.cat([state_dict[key].reshape(-1).double() for key in keys])


def _hand_errors(context, state_dict, tasks=PAIR) -> dict[str, float]:
    """Top-1 error in % counted in a plain loop on the same fixed subset, without the analysis' evaluator."""
    context.encoder.load_state_dict(state_dict)
    context.encoder.eval()
    errors = {}
    with torch.no_grad():
        for task in tasks:
            subset = fixed_subset(context.splits[task].test, EXAMPLES)
            wrong = sum(int((classify(context.encoder, context.heads[task], images).argmax(dim=1) != labels).sum())
                        for images, labels in DataLoader(subset, batch_size=7))
            errors[task] = 100.0 * wrong / len(subset)
    return errors


def test_basis_is_the_flattened_gram_schmidt_and_orthonormal(models):
    base, (a, b, _) = models
    basis = plane_basis(base, a, b)
    keys = basis.keys
    assert keys == [key for key, value in base.items() if value.is_floating_point()]
    tau_a, tau_b = _flat(a, keys) - _flat(base, keys), _flat(b, keys) - _flat(base, keys)
    u = tau_a / tau_a.norm()
    w = tau_b - (tau_b @ u) * u
    v = w / w.norm()
    flat_u, flat_v = _flat(basis.u, keys), _flat(basis.v, keys)
    torch.testing.assert_close(flat_u, u, rtol=0, atol=1e-12)
    torch.testing.assert_close(flat_v, v, rtol=0, atol=1e-12)
    assert abs(float(flat_u @ flat_u) - 1) < 1e-12 and abs(float(flat_v @ flat_v) - 1) < 1e-12
    assert abs(float(flat_u @ flat_v)) < 1e-12
    assert basis.norm_a == pytest.approx(float(tau_a.norm()), rel=1e-12)
    assert basis.norm_b == pytest.approx(float(tau_b.norm()), rel=1e-12)
    assert basis.cosine == pytest.approx(float(tau_a @ tau_b / (tau_a.norm() * tau_b.norm())), abs=1e-12)
    assert 0 < abs(basis.cosine) < 1  # two real fine-tunes: neither parallel nor exactly orthogonal


def test_coordinates_of_points_on_and_off_the_plane(models):
    base, (a, b, c) = models
    basis = plane_basis(base, a, b)
    keys = basis.keys
    on_plane = {key: base[key].double() + 2 * basis.u[key] - 3 * basis.v[key] for key in keys}
    where = plane_coordinates(basis, on_plane)
    assert (where.x, where.y) == (pytest.approx(2, abs=1e-9), pytest.approx(-3, abs=1e-9))
    assert where.off_plane < 1e-9

    # the third task's model is off the plane: projection and residual from the flattened vectors
    tau_c = _flat(c, keys) - _flat(base, keys)
    flat_u, flat_v = _flat(basis.u, keys), _flat(basis.v, keys)
    x, y = float(tau_c @ flat_u), float(tau_c @ flat_v)
    where = plane_coordinates(basis, c)
    assert (where.x, where.y) == (pytest.approx(x, abs=1e-9), pytest.approx(y, abs=1e-9))
    assert where.off_plane == pytest.approx(float((tau_c - x * flat_u - y * flat_v).norm()), rel=1e-9)
    assert where.off_plane > 0

    # task B sits at (<tau_B, u>, ||tau_B orthogonal part||) = ||tau_B|| (cos, sin)
    where = plane_coordinates(basis, b)
    sine = (1 - basis.cosine**2) ** 0.5
    assert (where.x, where.y) == (pytest.approx(basis.norm_b * basis.cosine), pytest.approx(basis.norm_b * sine))
    assert where.off_plane < 1e-6 * basis.norm_b


def test_plane_point_gives_back_the_task_models_exactly(models):
    base, (a, b, _) = models
    basis = plane_basis(base, a, b)
    for model in (base, a, b):
        where = plane_coordinates(basis, model)
        point = plane_point(basis, where.x, where.y)
        assert all(torch.equal(point[key], model[key]) for key in model)


def test_landscape_matches_hand_counted_errors_of_theta0_and_both_task_models(models, context):
    base, task_models = models
    errors, counts = error_function(context, PAIR, EXAMPLES)
    assert counts == {task: EXAMPLES for task in PAIR}
    merges = merged_models(["uniform"], task_models, base, lam=None)
    landscape, basis = compute_landscape(TASKS, task_models, base, PAIR, errors, resolution=3, margin=0.5, merges=merges)
    expected = {"theta_0": _hand_errors(context, base), "rot90": _hand_errors(context, task_models[0]),
                "rot180": _hand_errors(context, task_models[1])}

    # the landscape itself, evaluated at (0, 0) and at each task model's coordinates
    theta0, model_a, model_b, uniform = landscape.points
    assert len({tuple(hand.values()) for hand in expected.values()}) == 3  # the three points are told apart
    table = grid_errors(basis, [0.0, model_a.x, model_b.x], [model_a.y, model_b.y], errors)
    for task in PAIR:
        assert table[task][0][0] == pytest.approx(expected["theta_0"][task], abs=1e-9)
        assert table[task][0][1] == pytest.approx(expected["rot90"][task], abs=1e-9)
        assert table[task][1][2] == pytest.approx(expected["rot180"][task], abs=1e-9)
        for point in (theta0, model_a, model_b):
            assert point.error[task] == pytest.approx(expected[point.name][task], abs=1e-9)
            assert point.projected_error[task] == point.error[task]
    assert theta0.x == 0 and theta0.y == 0 and theta0.off_plane == 0

    # the uniform merge of all three tasks: off the plane, its own error vs its projection's
    mean = {key: sum(m[key].double() for m in task_models) / 3 for key in base}
    assert uniform.off_plane == pytest.approx(plane_coordinates(basis, mean).off_plane, rel=1e-5)
    assert uniform.off_plane > 0
    projection = {key: (base[key].double() + uniform.x * basis.u[key] + uniform.y * basis.v[key]).float() for key in base}
    assert uniform.projected_error == pytest.approx({**_hand_errors(context, projection),
                                                     "mean": sum(_hand_errors(context, projection).values()) / 2})

    # grid: the points' bounding box widened by half its size on each side; mean panel = average of the two
    xs = [p.x for p in landscape.points]
    span = max(xs) - min(xs)
    assert landscape.x[0] == pytest.approx(min(xs) - 0.5 * span) and landscape.x[-1] == pytest.approx(max(xs) + 0.5 * span)
    assert len(landscape.x) == len(landscape.y) == 3
    for row in range(3):
        for col in range(3):
            assert landscape.error["mean"][row][col] == pytest.approx(
                (landscape.error["rot90"][row][col] + landscape.error["rot180"][row][col]) / 2)
    corner = _hand_errors(context, plane_point(basis, landscape.x[2], landscape.y[0]))
    assert landscape.error["rot180"][0][2] == pytest.approx(corner["rot180"], abs=1e-9)


def test_parallel_task_vectors_span_no_plane(models):
    base, (a, _, _) = models
    doubled = {key: base[key] + 2 * (a[key] - base[key]) if base[key].is_floating_point() else base[key] for key in base}
    with pytest.raises(MimaError, match="parallel"):
        plane_basis(base, a, doubled)


def test_cli_writes_json_and_png(run, tmp_path, capsys):
    out = tmp_path / "landscape"
    argv = ["analyze", "landscape", str(run), "--tasks", *PAIR, "--resolution", "3", "--examples", str(EXAMPLES),
            "--merges", "uniform", "task_arithmetic", "--lam", "0.3", "--out", str(out)]
    assert main(argv) == 0
    report = json.loads((out / "landscape.json").read_text())
    assert (out / "landscape.png").stat().st_size > 0
    assert report["N"] == 2 and report["tasks"] == list(PAIR) and report["examples"] == {t: EXAMPLES for t in PAIR}
    assert [p["name"] for p in report["points"]] == ["theta_0", "rot90", "rot180", "uniform", "task_arithmetic"]
    assert report["points"][4]["hparams"] == {"lam": 0.3}
    assert all(len(report["grid"]["error"][key]) == 3 and len(report["grid"]["error"][key][0]) == 3
               for key in ("rot90", "rot180", "mean"))
    printed = capsys.readouterr().out
    assert "landscape N=2" in printed and "uniform" in printed
    assert main(argv) == 2  # outputs exist: refused without --overwrite
    assert "--overwrite" in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra, option",
    [
        (["--tasks", "rot90", "nosuch"], "--tasks"),
        (["--tasks", "rot90", "rot90"], "--tasks"),
        (["--tasks", *PAIR, "--merges", "cart_indexing"], "--merges"),
        (["--tasks", *PAIR, "--merges", "nosuch"], "--merges"),
        (["--tasks", *PAIR, "--resolution", "1"], "--resolution"),
        (["--tasks", *PAIR, "--margin", "-0.1"], "--margin"),
    ],
)
def test_cli_bad_input_is_one_line_naming_the_option(run, tmp_path, capsys, extra, option):
    assert main(["analyze", "landscape", str(run), *extra, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and option in err
    assert not (tmp_path / "o" / "landscape.json").exists()
