"""The phase-end operators of federated optimisation (issue 38, item 3): DiLoCo's outer Nesterov step
(`model.sync_merge: outer_nesterov`) and FedProx's proximal term (`model.proximal_mu`).

The outer step is checked op for op against torch.optim.SGD(nesterov=True) on the pseudo-gradient,
and its momentum on disk against the phase's end weights; real runs check that outer_lr 1 with
momentum 0 is MIMA up to rounding, that mu = 0 is MIMA bit for bit, and that both operators give the
same task models at W = 1 and W = 2, after a SIGKILL and resume, and (the outer momentum) after an
elastic resume onto another W.
"""

from __future__ import annotations

import signal

import pytest
import torch

from mima.cli import main
from mima.config.config_changes import compare_configs
from mima.core.errors import MimaError
from mima.core.safetensors_io import load_state_dict
from mima.training.module import MimaModule
from mima.training.sync_merge import SyncMerge, outer_nesterov_step
from tests.helpers import (FOUR, TWO, assert_identical, assert_killed_and_resumed_ends_as, assert_trained, finals, run_job,
                           write_config)

OUTER = {"sync_merge": "outer_nesterov", "sync_merge_args": {"outer_lr": 0.7, "outer_momentum": 0.9}}
PLAIN_OUTER = {"sync_merge": "outer_nesterov", "sync_merge_args": {"outer_lr": 1.0, "outer_momentum": 0.0}}
PROXIMAL = {"proximal_mu": 0.5}


def _distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The whole model's Euclidean distance, in float64."""
    return sum(float((a[key].double() - b[key].double()).square().sum()) for key in a) ** 0.5


# ------------------------------------------------------------------------------ the outer step itself
@pytest.mark.parametrize("lr, momentum", [(0.7, 0.9), (1.0, 0.0), (1.3, 0.5)])
def test_the_outer_step_is_sgd_with_nesterov_momentum_on_the_pseudo_gradient(lr, momentum):
    generator = torch.Generator().manual_seed(0)
    shapes = {"w": (6, 4), "b": (4,)}
    start = {key: torch.randn(shape, generator=generator) for key, shape in shapes.items()}
    params = {key: torch.nn.Parameter(value.clone()) for key, value in start.items()}
    sgd = torch.optim.SGD(list(params.values()), lr=lr, momentum=momentum, nesterov=momentum > 0)
    kept: dict[str, torch.Tensor] = {}
    for _ in range(4):  # four syncs: the momentum buffer carries over
        average = {key: value + 0.1 * torch.randn(value.shape, generator=generator) for key, value in start.items()}
        for key, param in params.items():
            param.grad = param.detach() - average[key]  # DiLoCo's pseudo-gradient: start minus average
        sgd.step()
        start, kept = outer_nesterov_step(start, average, kept, lr, momentum)
        for key, param in params.items():
            assert torch.equal(start[key], param.detach()), key  # the same ops, so the same bits
            if momentum:
                assert torch.equal(kept[key], sgd.state[param]["momentum_buffer"]), key
    assert (kept == {}) == (momentum == 0)  # no buffer without momentum, as SGD keeps none


def test_the_outer_step_leaves_its_inputs_unchanged_and_lr_one_without_momentum_is_the_average():
    generator = torch.Generator().manual_seed(1)
    start = {"w": torch.randn(50, generator=generator)}
    average = {"w": start["w"] + 1e-2 * torch.randn(50, generator=generator)}
    momentum = {"w": torch.randn(50, generator=generator)}
    copies = [{k: v.clone() for k, v in state.items()} for state in (start, average, momentum)]
    outer = SyncMerge("outer_nesterov", {"outer_lr": 0.7, "outer_momentum": 0.9}).outer
    outer.step(start, average, momentum)
    for state, copy in zip((start, average, momentum), copies):
        assert torch.equal(state["w"], copy["w"])  # a checkpoint writer may still be reading them
    plain, kept = outer_nesterov_step(start, average, {}, 1.0, 0.0)
    assert kept == {}
    difference = float((plain["w"] - average["w"]).abs().max())
    # start - (start - avg): two roundings of numbers no larger than the start's entries
    assert difference <= 2 * torch.finfo(torch.float32).eps * float(start["w"].abs().max())


@pytest.mark.parametrize("args, fragment", [
    ({"lr": 0.7}, "model.sync_merge_args: outer_nesterov takes outer_lr, outer_momentum, got ['lr']"),
    ({"outer_lr": 0}, "model.sync_merge_args.outer_lr: 0 is out of range"),
    ({"outer_momentum": 1.0}, "model.sync_merge_args.outer_momentum: 1.0 is out of range"),
    ({"outer_lr": "fast"}, "model.sync_merge_args.outer_lr: 'fast' is not a finite number"),
])
def test_outer_nesterov_options_are_checked_in_one_line(args, fragment):
    with pytest.raises(MimaError, match="^" + fragment.replace("[", "\\[").replace("]", "\\]").replace(".", "[.]")):
        SyncMerge("outer_nesterov", args)
    defaults = SyncMerge("outer_nesterov").outer
    assert (defaults.lr, defaults.momentum) == (0.7, 0.9)  # DiLoCo's


@pytest.mark.parametrize("model, fragment", [
    ({"sync_merge": "adamerging"}, "model.sync_merge: 'adamerging' learns from task data"),
    ({"sync_merge": "nope"}, "model.sync_merge: unknown merge method 'nope'"),
    ({"sync_merge": "task_arithmetic", "sync_merge_args": {"lamb": 0.3}}, "model.sync_merge_args:"),
    ({"sync_merge": "outer_nesterov", "sync_merge_args": {"outer_lr": 20}},
     "model.sync_merge_args.outer_lr: 20 is out of range; expected a finite number > 0 and <= 10"),
    ({"proximal_mu": -0.1}, "model.proximal_mu: -0.1 is out of range; expected a finite number in 0 .. 100"),
    ({"proximal_mu": 0.1, "mode": "joint"}, "model.proximal_mu: the joint baseline has no phases"),
])
def test_a_bad_operator_option_stops_fit_in_one_line(tmp_path, small_clip, capsys, model, fragment):
    config = write_config(tmp_path / "bad.yaml", small_clip, TWO, 1, model=model)
    assert main(["fit", "--config", str(config), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fragment in err[0], err
    assert not (tmp_path / "run" / "final").exists()


def test_a_run_written_before_the_proximal_term_resumes_with_mu_zero_only():
    stored = {"model": {"lr": 0.001}}

    def same_layout(old, new) -> bool:
        return True
    assert not compare_configs(stored, {"model": {"lr": 0.001, "proximal_mu": 0.0}}, same_layout).refused
    refused = compare_configs(stored, {"model": {"lr": 0.001, "proximal_mu": 0.1}}, same_layout).refused
    assert refused == {"model.proximal_mu": (0.0, 0.1)}


# ---------------------------------------------------------------------------------- the proximal term
def test_the_proximal_gradient_is_mu_times_the_distance_to_the_phase_start(small_clip):
    module = MimaModule(clip=small_clip, pretrained=None, proximal_mu=0.5)
    generator = torch.Generator().manual_seed(2)
    trained = {name for name, param in module.encoder.named_parameters()}
    first = sorted(trained)[0]
    module.encoder.get_parameter(first).requires_grad_(False)  # a frozen parameter takes no part
    module.phase_start = {key: value.detach() + 0.05 * torch.randn(value.shape, generator=generator)
                          for key, value in module.encoder.state_dict().items()}
    expected = sum(float((param.detach().double() - module.phase_start[name].double()).square().sum())
                   for name, param in module.encoder.named_parameters() if name != first)
    distance = module.distance_to_phase_start()
    assert float(distance.detach()) == pytest.approx(expected, rel=1e-5)
    (module.hparams.proximal_mu / 2 * distance).backward()
    for name, param in module.encoder.named_parameters():
        if name == first:
            assert param.grad is None
            continue
        hand = 0.5 * (param.detach().double() - module.phase_start[name].double())  # mu (theta - theta_s)
        torch.testing.assert_close(param.grad.double(), hand, rtol=1e-6, atol=1e-9)


def test_proximal_mu_zero_is_mima_bit_for_bit(tmp_path, small_clip, reference):
    out = tmp_path / "mu0"
    result = run_job(write_config(tmp_path / "mu0.yaml", small_clip, TWO, 1, model={"proximal_mu": 0.0}), out)
    assert result.returncode == 0, result.stderr[-3000:]
    mima = reference(1, TWO)
    assert_trained(mima, load_state_dict(out / "pretrained.safetensors"), at_least=1e-3)
    assert_identical(finals(out, TWO), mima)


def test_the_proximal_term_keeps_each_task_nearer_its_start(tmp_path, small_clip):
    """N = 1: the phase's start is theta_0, so a strong pull ends every task nearer theta_0 than MIMA."""
    ends = {}
    for mu in (0.0, 20.0):
        out = tmp_path / f"mu{mu:g}"
        model = {"proximal_mu": mu, "iterations": 1, "steps": 12}
        assert run_job(write_config(tmp_path / f"mu{mu:g}.yaml", small_clip, TWO, 1, model=model), out).returncode == 0
        ends[mu] = finals(out, TWO)
    theta_0 = load_state_dict(out / "pretrained.safetensors")
    for task in TWO:
        free, pulled = _distance(ends[0.0][task], theta_0), _distance(ends[20.0][task], theta_0)
        assert pulled < 0.9 * free, f"{task}: {pulled:.4g} from theta_0 with mu = 20, {free:.4g} without"


# ------------------------------------------------------------------------------------ the outer step in runs
def test_outer_lr_one_without_momentum_is_mima_up_to_rounding(tmp_path, small_clip, reference):
    out = tmp_path / "outer"
    result = run_job(write_config(tmp_path / "outer.yaml", small_clip, TWO, 1, model=PLAIN_OUTER), out)
    assert result.returncode == 0, result.stderr[-3000:]
    mima = reference(1, TWO)
    theta_0 = load_state_dict(out / "pretrained.safetensors")
    outer = finals(out, TWO)
    # start - (start - avg) rounds differently from avg; two syncs and 24 AdamW steps later the task
    # models differ by far less than training moved them (measured over the whole model: AdamW can turn
    # a rounding of an entry with a near-zero gradient into a step of up to lr; see test_distributed's ATM).
    # Measured 2026-11-27: 5.2e-4 and 6.6e-4 from MIMA (largest entry 2.4e-4, 3.0e-4), training moved 0.66.
    for task in TWO:
        difference, moved = _distance(outer[task], mima[task]), _distance(mima[task], theta_0)
        largest = max(float((outer[task][key] - mima[task][key]).abs().max()) for key in outer[task])
        assert difference < 1e-2 * moved, \
            f"{task}: {difference:.3g} from MIMA (largest entry {largest:.3g}), training moved {moved:.3g}"


@pytest.mark.slow
def test_outer_nesterov_is_the_same_at_w2_after_a_sigkill_and_after_an_elastic_resume(tmp_path, small_clip):
    one = tmp_path / "w1"
    assert run_job(write_config(tmp_path / "w1.yaml", small_clip, FOUR, 1, model=OUTER), one).returncode == 0
    expected = finals(one, FOUR)
    # MIMA's run, its checkpoints kept: its first average is the outer step's first input (phase 1 is the same)
    uniform = tmp_path / "mima"
    kept = run_job(write_config(tmp_path / "mima.yaml", small_clip, FOUR, 1), uniform, "--keep_checkpoints", "true")
    assert kept.returncode == 0, kept.stderr[-3000:]
    mima = finals(uniform, FOUR)
    assert all(any(not torch.equal(expected[t][k], mima[t][k]) for k in mima[t]) for t in FOUR)  # the operator acts
    two = tmp_path / "w2"
    assert run_job(write_config(tmp_path / "w2.yaml", small_clip, FOUR, 2, model=OUTER), two).returncode == 0
    assert_identical(finals(two, FOUR), expected)
    for devices_after, name in ((2, "same"), (1, "elastic")):
        killed_out = tmp_path / name
        # at W = 2 each process runs two tasks of K = 8 steps: step 20 is in the second phase, after a sync
        kill = write_config(tmp_path / f"kill-{name}.yaml", small_clip, FOUR, 2, [("KillAtStep", {"step": 20})],
                            model=OUTER)
        killed = run_job(kill, killed_out)
        assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
        if name == "same":
            first_average = load_state_dict(uniform / "checkpoints" / "averages" / "phase-0000.safetensors")
            _check_the_momentum_on_disk(killed_out, first_average)
        resume = write_config(tmp_path / f"resume-{name}.yaml", small_clip, FOUR, devices_after, model=OUTER)
        resumed = run_job(resume, killed_out, "--ckpt_path", "last")
        assert resumed.returncode == 0 and "resuming from" in resumed.stdout, resumed.stderr[-3000:]
        if name == "elastic":
            assert "elastic resume" in resumed.stdout + resumed.stderr
        assert_identical(finals(killed_out, FOUR), expected)


def _check_the_momentum_on_disk(run, average):
    """After the first sync, with `average` MIMA's first average (mean_t theta_t): the momentum file
    holds m = g = theta_0 - average and the phase's start point is theta_0 - lr (g + mu m)."""
    checkpoints = run / "checkpoints"
    momentum = load_state_dict(checkpoints / "averages" / "phase-0000-outer-momentum.safetensors")
    start = load_state_dict(checkpoints / "averages" / "phase-0000.safetensors")
    theta_0 = load_state_dict(run / "pretrained.safetensors")
    lr, mu = OUTER["sync_merge_args"]["outer_lr"], OUTER["sync_merge_args"]["outer_momentum"]
    assert set(momentum) == set(start) == set(average)
    for key in momentum:
        g = theta_0[key].double() - average[key].double()
        torch.testing.assert_close(momentum[key].double(), g, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(start[key].double(), theta_0[key].double() - lr * (1 + mu) * g, rtol=1e-5, atol=1e-7)
    assert max(float(value.abs().max()) for value in momentum.values()) > 1e-4  # the tasks moved: a real momentum


@pytest.mark.slow
def test_the_proximal_term_is_the_same_at_w2_and_after_a_sigkill(tmp_path, small_clip, reference):
    one = tmp_path / "w1"
    assert run_job(write_config(tmp_path / "w1.yaml", small_clip, FOUR, 1, model=PROXIMAL), one).returncode == 0
    expected = finals(one, FOUR)
    mima = reference(1, FOUR)
    assert all(any(not torch.equal(expected[t][k], mima[t][k]) for k in mima[t]) for t in FOUR)  # the term acts
    two = tmp_path / "w2"
    assert run_job(write_config(tmp_path / "w2.yaml", small_clip, FOUR, 2, model=PROXIMAL), two).returncode == 0
    assert_identical(finals(two, FOUR), expected)
    assert_killed_and_resumed_ends_as(tmp_path, small_clip, FOUR, PROXIMAL, expected)
