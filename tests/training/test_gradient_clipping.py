"""Gradient clipping with a fused AdamW (issue 47, item 2).

Lightning's mixed precision refuses to clip the gradients of any fused optimiser (a fused AdamW
unscales a gradient scaler's gradients itself, after clipping would have seen them scaled). mima
chooses a fused AdamW on CUDA only where no scaler runs (bf16-mixed, 32-true), and clips those
gradients itself, so the paper configs (clipping at norm 1.0, bf16) keep the fused kernel. Fused
AdamW runs on the CPU too, which lets these checks run here.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins import MixedPrecision

from mima.commands.fit.run import run_fit
from mima.training.module import MimaModule
from tests.helpers import fit_config


def _gradients(module: MimaModule, scale: float) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    params = list(module.encoder.parameters())
    for param in params:
        param.grad = scale * torch.randn(param.shape, generator=generator)
    return [param.grad.clone() for param in params]


def test_lightning_refuses_to_clip_a_fused_optimizer_under_mixed_precision(small_clip):
    module = MimaModule(clip=small_clip)
    _gradients(module, 1.0)
    optimizer = torch.optim.AdamW(module.encoder.parameters(), fused=True)
    with pytest.raises(RuntimeError, match="fused"):
        MixedPrecision("bf16-mixed", "cpu").clip_gradients(optimizer, 1.0)


@pytest.mark.parametrize("algorithm, limit", [("norm", 1.0), ("value", 0.01)])
def test_the_module_clips_a_fused_adamws_gradients(small_clip, algorithm, limit):
    module = MimaModule(clip=small_clip)
    before = _gradients(module, 1.0)
    optimizer = torch.optim.AdamW(module.encoder.parameters(), fused=True)
    module.configure_gradient_clipping(optimizer, limit, algorithm)
    after = [param.grad for param in module.encoder.parameters()]
    if algorithm == "value":  # every entry into [-limit, limit], the ones inside untouched
        for old, new in zip(before, after):
            assert torch.equal(new, old.clamp(-limit, limit))
        return
    # by norm: every gradient scaled by one factor, to a total norm of `limit`
    old_norm = torch.cat([g.flatten() for g in before]).double().norm()
    new_norm = torch.cat([g.flatten() for g in after]).double().norm()
    assert old_norm > 10 * limit and new_norm == pytest.approx(limit, rel=1e-5)
    factor = limit / (float(old_norm) + 1e-6)  # torch's clip_grad_norm_ coefficient, written out
    for old, new in zip(before, after):
        assert torch.allclose(new.double(), old.double() * factor, rtol=1e-5, atol=1e-12)


class RecordFused(Callback):
    """Writes whether the run's AdamW is fused (its param group's flag) to `path`, at the first step."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == 0:
            Path(self.path).write_text(str(trainer.optimizers[0].param_groups[0]["fused"]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused AdamW is chosen on CUDA only")
def test_a_bf16_fit_with_clipping_keeps_the_fused_adamw_on_cuda(tmp_path, small_clip):
    record = tmp_path / "fused.txt"
    config = fit_config(tmp_path / "run", small_clip, ["rot90", "mirror"], steps=4, iterations=2)
    config["trainer"].update(accelerator="gpu", precision="bf16-mixed", gradient_clip_val=1.0,
                             callbacks=[{"class_path": "tests.training.test_gradient_clipping.RecordFused",
                                         "init_args": {"path": str(record)}}])
    run_dir = run_fit(config).run_dir
    assert record.read_text() == "True"
    assert all((run_dir / "final" / f"{task}.safetensors").is_file() for task in ("rot90", "mirror"))
