"""A run whose loss becomes NaN or inf stops after that step with one line; nothing non-finite is written.

The divergence is provoked by a callback (`tests.helpers.PoisonAtStep`, loaded by `mima fit` by class
path) that turns one encoder weight into NaN at the start of a step, so that step's loss is NaN, or one
that makes a gradient inf under clipping. Every state left on disk is read back here and checked element by element.
"""

from __future__ import annotations

import json
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
from mima.core.run_folder import RunFolder
from mima.core.safetensors_io import load_state_dict
from mima.training.divergence import nonfinite_key
from tests.helpers import TWO, assert_identical, finals, run_command, run_job, write_config

MARK = "__mima_file__"  # a state's reference to a file, spelled independently of mima.training.checkpoint_format


def poisoned_config(path: Path, clip: str, devices: int, step: int, rank: int = 0, **model) -> Path:
    config = yaml.safe_load(write_config(path, clip, TWO, devices, model=model or None).read_text())
    config["trainer"]["callbacks"] = [{"class_path": "tests.helpers.PoisonAtStep", "init_args": {"step": step, "rank": rank}}]
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
    state = out / "checkpoints" / "ranks" / "rank-00000" / "phase-0000-step-00000008.ckpt"
    assert lines[0] == ("mima fit: error: task mirror diverged: loss nan at process step 11; last good checkpoint: "
                        f"the state of phase 0 at process step 8 ({state}); --ckpt_path last resumes from it"), lines[0]
    assert not (out / "final").exists()
    saved = states(out)
    assert [p.name for p in saved] == ["phase-0000-step-00000008.ckpt"]
    assert all_finite(tensors_of(torch.load(saved[0], weights_only=True), out))
    # the same run resumed without the poison ends as the uninterrupted one
    resumed = run_job(write_config(tmp_path / "plain.yaml", small_clip, TWO, 1), out, "--ckpt_path", "last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"mima fit: resuming from the state of phase 0 at process step 8 ({state})" in resumed.stdout.splitlines()
    assert_identical(finals(out, TWO), reference(1, TWO))
    assert not (out / "diverged.json").exists()  # the run has finished: it no longer counts as diverged


def test_a_run_that_diverges_before_its_first_checkpoint_says_so(tmp_path, small_clip):
    out = tmp_path / "run"
    result = run_job(poisoned_config(tmp_path / "early.yaml", small_clip, 1, step=2), out)  # rot90's first segment
    lines = [the_divergence_line(result)]
    assert lines[0] == ("mima fit: error: task rot90 diverged: loss nan at process step 2; no checkpoint was saved before "
                        "it (nothing non-finite was written; --ckpt_path last starts afresh)"), lines[0]
    assert not (out / "final").exists()
    assert states(out) == []
    # the run folder keeps what happened, for a sweep or study called again (which then does not refit it)
    report = json.loads((out / "diverged.json").read_text())["report"]
    assert report == "task rot90 diverged: loss nan at process step 2" and RunFolder(out).divergence() == report
    evaluated = run_command(["evaluate", out, "--out", tmp_path / "table"])
    assert evaluated.returncode == 2 and evaluated.stderr.strip() == (
        f"mima evaluate: error: {out}: diverged ({report}); it has no final/ task models to evaluate")


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


def newest_cut(run: Path) -> dict[int, tuple[int, int]]:
    """rank -> (phase, step) of the state each process resumes from, by the rule written out here: the
    newest phase in which every process has a state, and each process's newest state of that phase (one
    task per process, so no replicas need to agree)."""
    saved: dict[int, list[tuple[int, int]]] = {}
    for path in states(run):
        phase, step = (int(n) for n in re.fullmatch(r"phase-(\d+)-step-(\d+)\.ckpt", path.name).groups())
        saved.setdefault(int(path.parent.name.split("-")[1]), []).append((phase, step))
    phase = min(max(p for p, _ in pairs) for pairs in saved.values())
    while not all(any(p == phase for p, _ in pairs) for pairs in saved.values()):
        phase -= 1
    return {rank: max(pair for pair in pairs if pair[0] == phase) for rank, pairs in sorted(saved.items())}


def cut_in_words(line: str) -> dict[int, tuple[int, int]]:
    """rank -> (phase, step) as a "last good checkpoint" or "resuming from" line of two processes names it."""
    same = re.search(r"the states of phase (\d+) at process step (\d+) of all 2 processes", line)
    if same:
        return {rank: (int(same.group(1)), int(same.group(2))) for rank in (0, 1)}
    mixed = re.search(r"the states of phase (\d+) with process 0 at step (\d+), process 1 at step (\d+) ", line)
    assert mixed, line
    return {0: (int(mixed.group(1)), int(mixed.group(2))), 1: (int(mixed.group(1)), int(mixed.group(3)))}


@pytest.mark.slow
def test_when_one_of_two_processes_diverges_both_stop(tmp_path, small_clip, reference):
    out = tmp_path / "run"
    # one task per process, K = 8: after the first sync (step 8) rank 1's loss is NaN at step 11, found at the
    # latest at its segment end (step 15). Where rank 0 hears of it depends on the two processes' speeds: at
    # a step boundary of phase 1 (it saves a state there) or at the sync it waits in (its state there, sync
    # pending, cannot form a cut with rank 1's). Whatever it was, the line names the one cut on disk.
    result = run_job(poisoned_config(tmp_path / "poison.yaml", small_clip, 2, step=11, rank=1), out, timeout=300)
    line = the_divergence_line(result)
    assert line.startswith("mima fit: error: task mirror diverged: loss nan at process step 11 of process 1; last good "
                           "checkpoint: the states of phase 1 ") and line.endswith("; --ckpt_path last resumes from it"), line
    assert not (out / "final").exists()
    for state in states(out):
        assert all_finite(tensors_of(torch.load(state, weights_only=True), out)), state
    # rank 1 saved nothing after its last good state, whatever rank 0 did
    assert [p.name for p in (out / "checkpoints" / "ranks" / "rank-00001").glob("*.ckpt")] == ["phase-0001-step-00000008.ckpt"]
    cut = newest_cut(out)
    assert cut[1] == (1, 8) and cut[0][0] == 1 and 8 <= cut[0][1] <= 16, cut
    assert cut_in_words(line) == cut, (line, cut)
    resumed = run_job(write_config(tmp_path / "plain.yaml", small_clip, TWO, 2), out, "--ckpt_path", "last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    resuming = next(line for line in resumed.stdout.splitlines() if line.startswith("mima fit: resuming from "))
    assert resuming.removeprefix("mima fit: resuming from ") == line.split("last good checkpoint: ")[1].split("; --ckpt_path")[0]
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


# ------------------------------------------------------------------ the one cut, in words
def test_a_cut_is_named_by_its_phase_each_process_step_and_its_files(tmp_path):
    from mima.training.resume import ResumeCut

    ranks = tmp_path / "checkpoints" / "ranks"
    one = ranks / "rank-00000" / "phase-0000-step-00000008.ckpt"
    assert ResumeCut({0: one}, 1).describe() == f"the state of phase 0 at process step 8 ({one})"
    same = {rank: ranks / f"rank-0000{rank}" / "phase-0001-step-00000008.ckpt" for rank in (0, 1, 2)}
    assert ResumeCut(same, 3).describe() == \
        f"the states of phase 1 at process step 8 of all 3 processes ({ranks}/rank-*/phase-0001-step-00000008.ckpt)"
    mixed = {1: ranks / "rank-00001" / "phase-0001-step-00000008.ckpt", 0: ranks / "rank-00000" / "phase-0001-step-00000012.ckpt"}
    words = ResumeCut(mixed, 2).describe()
    assert words == f"the states of phase 1 with process 0 at step 12, process 1 at step 8 ({mixed[0]}, {mixed[1]})"
    assert cut_in_words(words + " ") == {0: (1, 12), 1: (1, 8)}
