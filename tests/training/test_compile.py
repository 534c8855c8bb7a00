"""model.compile (issue 47, item 1): the encoder compiled in place once per process.

On the CPU (TorchInductor's C++ kernels) a compiled fit of the small CLIP must end within a stated
tolerance of the eager fit on the same batches, keep the encoder's state_dict keys, and compile
nothing after its first task segment: every later phase start, task start and optimiser reload
copies weights into the compiled encoder's tensors. "Nothing compiles" is checked with torch's
public stance `fail_on_recompile`, set by a callback after the first segment: any frame dynamo would
compile from then on raises. A run that switches the encoder to eval mode after that point (a
guard the compiled code holds) shows that the probe catches a recompilation.
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from mima.commands.fit.run import run_fit
from mima.config.model import ModelSettings
from mima.core.safetensors_io import load_state_dict
from mima.training.plan_choices import COMPILE_S, COMPILED_STEP_OVERHEAD_S, STEP_OVERHEAD_S, choose_compile, step_timing
from tests.helpers import assert_trained, finals, fit_config

TASKS = ["rot90", "mirror"]
STEPS, ITERATIONS = 6, 3  # 3 phases x 2 tasks = 6 segments, 3 steps each: 5 segment starts after the first
# Compiled kernels fuse and reorder float32 arithmetic. AdamW divides each gradient entry by its own
# running scale, so a rounding difference in a near-zero gradient entry can move that entry by up to
# lr: over 9 steps per task at lr 1e-3 the task models drift apart by rounding only. Measured on the
# CPU (2026-11-28): ||compiled - eager|| = 1.4e-3 ||tau|| (max entry 2.8e-4 against max |tau| 4.0e-3).
# The bound, 1 % of the task vector's norm, is far below what a phase or task started from the wrong
# weights gives (the whole of a segment's update, a sizeable share of tau).
RELATIVE_TOLERANCE = 1e-2


class NoCompileAfterFirstSegment(Callback):
    """From the end of the first task segment on, torch.compile may compile nothing (public stance
    `fail_on_recompile`); `eval_after`: switch the encoder to eval mode there too (a recompilation the
    probe must catch). The stance is set back however the fit ends."""

    def __init__(self, eval_after: bool = False) -> None:
        self.eval_after = eval_after
        self.strict = False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self.strict and pl_module.plan.ends_segment(trainer.global_step - 1):
            torch.compiler.set_stance("fail_on_recompile")
            self.strict = True
            if self.eval_after:
                pl_module.encoder.eval()

    def on_train_end(self, trainer, pl_module) -> None:
        torch.compiler.set_stance("default")

    def on_exception(self, trainer, pl_module, exception) -> None:
        torch.compiler.set_stance("default")


def _fit(tmp_path, small_clip, name: str, compile_setting, *callbacks: dict) -> dict[str, dict[str, torch.Tensor]]:
    config = fit_config(tmp_path / name, small_clip, TASKS, steps=STEPS, iterations=ITERATIONS, compile=compile_setting)
    config["trainer"]["callbacks"] = list(callbacks)
    try:
        run_dir = run_fit(config).run_dir
    finally:
        torch.compiler.set_stance("default")
        torch.compiler.reset()  # other tests in this process start with no compiled code
    return finals(run_dir, TASKS)


@pytest.mark.slow
def test_a_compiled_fit_equals_the_eager_fit_within_rounding_and_compiles_nothing_after_its_first_segment(
        tmp_path, small_clip, capsys):
    probe = {"class_path": "tests.training.test_compile.NoCompileAfterFirstSegment"}
    compiled = _fit(tmp_path, small_clip, "compiled", True, probe)
    printed = capsys.readouterr().out
    eager = _fit(tmp_path, small_clip, "eager", False)
    theta_0 = load_state_dict(tmp_path / "eager" / "pretrained.safetensors")
    assert_trained(eager, theta_0, at_least=1e-3)
    for task in TASKS:
        assert list(compiled[task]) == list(eager[task])  # the same keys: compiled in place, no `_orig_mod.`
        worst = max(float((compiled[task][key] - eager[task][key]).abs().max()) for key in eager[task])
        tau = torch.cat([(eager[task][key] - theta_0[key]).flatten() for key in eager[task]])
        gap = torch.cat([(compiled[task][key] - eager[task][key]).flatten() for key in eager[task]])
        print(f"{task}: max |compiled - eager| = {worst:.2e}, max |tau| {float(tau.abs().max()):.2e}, "
              f"||compiled - eager|| / ||tau|| = {float(gap.norm() / tau.norm()):.2e}")
        assert float(gap.norm()) <= RELATIVE_TOLERANCE * float(tau.norm()), task
    assert "model.compile: the first step, which compiled the encoder, took" in printed
    assert printed.count("compiled the encoder") == 1


@pytest.mark.slow
def test_the_probe_catches_a_recompilation(tmp_path, small_clip):
    probe = {"class_path": "tests.training.test_compile.NoCompileAfterFirstSegment", "init_args": {"eval_after": True}}
    with pytest.raises(Exception, match="fail_on_recompile"):
        _fit(tmp_path, small_clip, "recompiled", True, probe)


def test_compile_auto_is_on_exactly_with_cuda_and_given_values_are_kept():
    assert ModelSettings().compile == "auto"
    assert choose_compile("auto", on_gpu=True).value is True
    assert choose_compile("auto", on_gpu=False).value is False
    assert choose_compile(True, on_gpu=False).value is True and not choose_compile(True, on_gpu=False).chosen
    assert choose_compile(False, on_gpu=True).value is False
    assert choose_compile("auto", on_gpu=True, deterministic=True).value is False
    assert choose_compile(True, on_gpu=True, deterministic=True).value is True


def test_the_plan_counts_the_compile_time_once_and_the_compiled_step_overhead():
    flops, steps = 2.0e12, [10, 20, 30]
    eager = step_timing(flops, "NVIDIA H200", "bf16-mixed", steps)
    compiled = step_timing(flops, "NVIDIA H200", "bf16-mixed", steps, compiled=True)
    arithmetic = flops / (989e12 * eager.utilisation)
    assert eager.step_s == pytest.approx(STEP_OVERHEAD_S + arithmetic)
    assert compiled.step_s == pytest.approx(COMPILED_STEP_OVERHEAD_S + arithmetic)
    assert compiled.phase_s[0] == pytest.approx(10 * compiled.step_s + COMPILE_S)
    assert compiled.phase_s[1:] == pytest.approx((20 * compiled.step_s, 30 * compiled.step_s))
    assert compiled.run_s == pytest.approx(60 * compiled.step_s + COMPILE_S)
    assert eager.compile_s == 0 and eager.run_s == pytest.approx(60 * eager.step_s)



@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled GPU step (TorchInductor's Triton kernels)")
def test_a_compiled_bf16_fit_on_cuda_compiles_nothing_after_its_first_segment(tmp_path, small_clip):
    config = fit_config(tmp_path / "run", small_clip, TASKS, steps=STEPS, iterations=ITERATIONS)
    config["trainer"].update(accelerator="gpu", precision="bf16-mixed", gradient_clip_val=1.0,
                             callbacks=[{"class_path": "tests.training.test_compile.NoCompileAfterFirstSegment"}])
    try:  # model.compile auto: on with CUDA
        run_dir = run_fit(config).run_dir
    finally:
        torch.compiler.set_stance("default")
        torch.compiler.reset()
    assert_trained(finals(run_dir, TASKS), load_state_dict(run_dir / "pretrained.safetensors"), at_least=1e-3)
