"""A run whose loss becomes NaN or inf stops after that step with one line; nothing non-finite is written.

The divergence is provoked by a callback of this file (`PoisonAtStep`, loaded by `mima fit` by class
path) that turns one encoder weight into NaN at the start of a step, so that step's loss is NaN, or one
that makes a gradient inf under clipping. Every state left on disk is read back here and checked element by element.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from pathlib import Path

import pytest
import torch
import yaml
from lightning.pytorch.callbacks import Callback
from torch.profiler import ProfilerActivity, profile

from mima.cli import main
from mima.core.safetensors_io import load_state_dict
from mima.training.divergence import nonfinite_key
from tests.helpers import TWO, assert_identical, finals, run_job, write_config

MARK = "__mima_file__"  # a state's reference to a file, spelled independently of mima.training.checkpoint_format


class PoisonAtStep(Callback):
    """At the start of process step `step` of rank `rank`: one encoder weight becomes NaN, so that the
    step's loss is NaN (as a run that diverged would have it)."""

    def __init__(self, step: int, rank: int = 0) -> None:
        self.step, self.rank = step, rank

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            with torch.no_grad():
                next(pl_module.encoder.parameters()).view(-1)[0] = float("nan")


def poisoned_config(path: Path, clip: str, devices: int, step: int, rank: int = 0, **model) -> Path:
    config = yaml.safe_load(write_config(path, clip, TWO, devices, model=model or None).read_text())
    config["trainer"]["callbacks"] = [{"class_path": f"{__name__}.PoisonAtStep", "init_args": {"step": step, "rank": rank}}]
    path.write_text(yaml.safe_dump(config))
    return path


def tensors_of(obj: object, run: Path) -> list[torch.Tensor]:
    """Every tensor of a saved state, and of every file it refers to."""
    if torch.is_tensor(obj):
        return [obj]
    if isinstance(obj, dict):
        if MARK in obj:
            return list(load_state_dict(run / obj[MARK]).values())
        return [t for value in obj.values() for t in tensors_of(value, run)]
    if isinstance(obj, (list, tuple)):
        return [t for value in obj for t in tensors_of(value, run)]
    return []


def all_finite(tensors: list[torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point())


def states(run: Path) -> list[Path]:
    return sorted((run / "checkpoints" / "ranks").glob("rank-*/*.ckpt"))


def divergence_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "diverged" in line]


def the_divergence_line(result) -> str:
    """The one divergence line of a job that stopped with exit status 2 (asserted)."""
    assert result.returncode == 2, result.stderr[-3000:]
    lines = divergence_lines(result.stderr)
    assert len(lines) == 1, result.stderr[-3000:]
    return lines[0]


@pytest.mark.slow
def test_a_run_that_diverges_stops_with_one_line_and_resumes_from_its_last_good_state(tmp_path, small_clip, reference):
    out = tmp_path / "run"
    # one process, K = 8, two tasks: rot90 takes steps 0-7, mirror 8-15 of each phase; the state at step 8
    # (mirror's segment start) is saved, then mirror's loss is NaN at step 11
    result = run_job(poisoned_config(tmp_path / "poison.yaml", small_clip, 1, step=11), out)
    lines = [the_divergence_line(result)]
    assert re.fullmatch(r"mima fit: error: task mirror diverged: loss nan at process step 11; last good checkpoint: "
                        rf"process steps 8 in {re.escape(str(out / 'checkpoints'))} \(--ckpt_path last resumes from it\)",
                        lines[0]), lines[0]
    assert not (out / "final").exists()
    saved = states(out)
    assert [p.name for p in saved] == ["phase-0000-step-00000008.ckpt"]
    assert all_finite(tensors_of(torch.load(saved[0], weights_only=True), out))
    # the same run resumed without the poison ends as the uninterrupted one
    resumed = run_job(write_config(tmp_path / "plain.yaml", small_clip, TWO, 1), out, "--ckpt_path", "last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from process steps 8" in resumed.stdout
    assert_identical(finals(out, TWO), reference(1, TWO))


def test_a_run_that_diverges_before_its_first_checkpoint_says_so(tmp_path, small_clip):
    out = tmp_path / "run"
    result = run_job(poisoned_config(tmp_path / "early.yaml", small_clip, 1, step=2), out)  # rot90's first segment
    lines = [the_divergence_line(result)]
    assert lines[0] == ("mima fit: error: task rot90 diverged: loss nan at process step 2; no checkpoint was saved before "
                        "it (nothing non-finite was written; --ckpt_path last starts afresh)"), lines[0]
    assert not (out / "final").exists()
    assert states(out) == []


def test_a_joint_run_whose_weights_diverge_writes_no_final_model(tmp_path, small_clip):
    out = tmp_path / "run"
    config = poisoned_config(tmp_path / "joint.yaml", small_clip, 1, step=5, mode="joint")
    result = run_job(config, out, "--checkpoint_every", "0")  # nothing saved before the end: found at final/
    lines = [the_divergence_line(result)]
    assert re.fullmatch(r"mima fit: error: task joint diverged: non-finite weights \(\S+\) at process step 23; "
                        r"no checkpoint was saved before it .*", lines[0]), lines[0]
    assert not (out / "final").exists()


class InfiniteGradientAtStep(Callback):
    """After the backward pass of process step `step`: one gradient element becomes inf (the loss
    stays finite; clipping by the norm then turns the gradients into NaN)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_after_backward(self, trainer, pl_module) -> None:
        if trainer.global_step == self.step:
            with torch.no_grad():
                next(p for p in pl_module.encoder.parameters() if p.grad is not None).grad.view(-1)[0] = math.inf


def test_an_infinite_gradient_norm_under_clipping_stops_the_run_at_its_step(tmp_path, small_clip):
    out = tmp_path / "run"
    config = yaml.safe_load(write_config(tmp_path / "grad.yaml", small_clip, TWO, 1).read_text())
    config["trainer"]["gradient_clip_val"] = 1.0
    config["trainer"]["callbacks"] = [{"class_path": f"{__name__}.InfiniteGradientAtStep", "init_args": {"step": 3}}]
    (tmp_path / "grad.yaml").write_text(yaml.safe_dump(config))
    result = run_job(tmp_path / "grad.yaml", out)
    lines = [the_divergence_line(result)]
    assert "task rot90 diverged: gradient norm inf at process step 3; no checkpoint was saved" in lines[0], \
        result.stderr[-3000:]
    assert not (out / "final").exists() and states(out) == []


@pytest.mark.slow
def test_when_one_of_two_processes_diverges_both_stop(tmp_path, small_clip, reference):
    out = tmp_path / "run"
    # one task per process, K = 8: after the first sync (step 8) rank 1's loss is NaN at step 11, found at its
    # segment end (step 15) before the sync; rank 0 waits at that sync and stops there, saving its state (sync
    # pending), which cannot form a cut with rank 1's last good state (step 8): the cut is both at step 8
    result = run_job(poisoned_config(tmp_path / "poison.yaml", small_clip, 2, step=11, rank=1), out, timeout=180)
    lines = [the_divergence_line(result)]
    assert re.fullmatch(r"mima fit: error: task mirror diverged: loss nan at process step 11 of process 1; last good "
                        r"checkpoint: process steps 8 in .* \(--ckpt_path last resumes from it\)", lines[0]), lines[0]
    assert not (out / "final").exists()
    for state in states(out):
        assert all_finite(tensors_of(torch.load(state, weights_only=True), out)), state
    assert [p.name for p in (out / "checkpoints" / "ranks" / "rank-00001").glob("*.ckpt")] == ["phase-0001-step-00000008.ckpt"]
    resumed = run_job(write_config(tmp_path / "plain.yaml", small_clip, TWO, 2), out, "--ckpt_path", "last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_identical(finals(out, TWO), reference(1, TWO))  # the same at any W <= T


def test_a_checkpoint_made_non_finite_is_refused_on_resume(tmp_path, small_clip, capsys):
    out = tmp_path / "run"
    stopped = run_job(write_config(tmp_path / "stop.yaml", small_clip, TWO, 1, [("TouchStopAtStep", {"step": 11})]), out)
    assert stopped.returncode == 0 and "stopped by" in stopped.stdout, stopped.stderr[-3000:]
    # the state saved at step 11 (inside mirror's segment) holds the working encoder itself
    state_file = out / "checkpoints" / "ranks" / "rank-00000" / "phase-0000-step-00000011.ckpt"
    state = torch.load(state_file, weights_only=True)
    key = next(k for k, v in state["state_dict"].items() if torch.is_tensor(v) and v.is_floating_point())
    state["state_dict"][key].view(-1)[3] = math.inf
    torch.save(state, state_file)
    before = state_file.read_bytes()
    plain = write_config(tmp_path / "plain.yaml", small_clip, TWO, 1)
    assert main(["fit", "--config", str(plain), "--out", str(out), "--ckpt_path", "last"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert f"{state_file} holds non-finite values (state_dict.{key})" in err[0] and "cannot resume" in err[0], err[0]
    assert state_file.read_bytes() == before and not (out / "final").exists()


# ------------------------------------------------------------------ the finiteness check itself
def _state(count: int = 60) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(8, 4, generator=generator) for i in range(count)}


def _operators(check) -> Counter:
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        check()
    return Counter(event.name for event in profiler.events() if event.name.startswith("aten::"))


def test_a_finite_state_is_checked_by_one_norm_without_a_tensor_by_tensor_search():
    state = _state()
    operators = _operators(lambda: nonfinite_key(state))
    assert nonfinite_key(state) is None
    # the one total norm's check, not one per tensor (the search's isfinite and all per tensor). The
    # norms themselves: one grouped (foreach) kernel per dtype on CUDA; torch has no grouped CPU kernel
    assert operators["aten::isfinite"] == 1 and operators["aten::all"] <= 1, operators


def test_a_nan_or_inf_is_found_by_name_and_the_first_one_is_named():
    for value in (float("nan"), float("inf"), -float("inf")):
        state = _state()
        state["layer41.weight"][2, 1] = value
        state["layer7.weight"][0, 0] = value
        assert nonfinite_key(state) == "layer7.weight", value
        assert nonfinite_key({"state": {3: {"exp_avg": state["layer7.weight"]}}}) == "state.3.exp_avg"


def test_finite_values_whose_norm_overflows_are_finite():
    state = _state()
    state["layer3.weight"].fill_(3e38)  # float32's largest is 3.4e38: the squares overflow to inf
    assert not torch.isfinite(torch.nn.utils.get_total_norm(list(state.values())))
    assert nonfinite_key(state) is None
