"""MIMA training on a small real open_clip CLIP: sync semantics, N = 1 baseline, output contract."""

from __future__ import annotations

import json

import lightning as L
import numpy as np
import open_clip
import pytest
import torch
import yaml
from lightning.pytorch.callbacks import Callback

from mima.data.datamodule import TaskSuiteDataModule
from mima.core.safetensors_io import load_state_dict, read_metadata
from mima.training.module import MimaModule
from mima.commands.fit.run import run_fit
from tests.helpers import assert_trained, finals, fit_config

TASKS = ["rot90", "rot180", "mirror"]


def _snapshot(module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.encoder.state_dict().items()}


class Recorder(Callback):
    """Weights at every segment start and end, and the optimiser state there (runs before the sync)."""

    def __init__(self) -> None:
        self.starts, self.ends, self.start_moments, self.end_moments = {}, {}, {}, {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        position = pl_module.plan.position(trainer.global_step)
        if position.starts_segment:
            key = (position.phase, position.slot)
            self.starts[key] = _snapshot(pl_module)
            self.start_moments[key] = _moments(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step - 1
        if pl_module.plan.ends_segment(step):
            position = pl_module.plan.position(step)
            key = (position.phase, position.slot)
            self.ends[key] = _snapshot(pl_module)
            self.end_moments[key] = _moments(trainer)


def _moments(trainer) -> list[torch.Tensor]:
    state = trainer.optimizers[0].state
    return [state[p]["exp_avg"].clone() for p in trainer.optimizers[0].param_groups[0]["params"] if p in state]


def _fit_with_recorder(tmp_path, small_clip, iterations=3, steps=6, optimizer_state="reset", batchnorm="frozen"):
    module = MimaModule(clip=small_clip, steps=steps, iterations=iterations, lr=1e-3, warmup_steps=2,
                        optimizer_state=optimizer_state, batchnorm=batchnorm)
    data = TaskSuiteDataModule(suite="digits", tasks=TASKS, batch_size=16, seed=3)
    recorder = Recorder()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[recorder], default_root_dir=tmp_path,
    )
    trainer.fit(module, datamodule=data)
    return recorder, module


def _mean64(states: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The mean of every floating entry (parameters and buffers such as BatchNorm statistics)."""
    return {k: torch.stack([s[k].double() for s in states]).mean(0) for k in states[0] if states[0][k].is_floating_point()}


@pytest.mark.parametrize("clip_fixture", ["small_clip", "batchnorm_clip"])
def test_every_phase_starts_all_tasks_from_the_mean_of_the_previous_phase(tmp_path, request, clip_fixture):
    # train-mode BatchNorm, so that running statistics move per task and their averaging is tested
    recorder, module = _fit_with_recorder(tmp_path, request.getfixturevalue(clip_fixture), batchnorm="train")
    theta_0 = {k: v for k, v in load_state_dict(tmp_path / "pretrained.safetensors").items() if v.is_floating_point()}
    slots = range(len(TASKS))
    for phase in range(3):
        expected = theta_0 if phase == 0 else _mean64([recorder.ends[(phase - 1, s)] for s in slots])
        for slot in slots:
            start = recorder.starts[(phase, slot)]
            for key, value in expected.items():
                torch.testing.assert_close(start[key].double(), value.double(), rtol=0, atol=1e-6)
            assert recorder.start_moments[(phase, slot)] == []  # fresh AdamW moments for each segment
        # tasks really moved apart within the phase (statistics too), so the check above is not vacuous
        for key in expected:
            assert not torch.equal(recorder.ends[(phase, 0)][key], recorder.ends[(phase, 1)][key]) or key == "counter"
    # after the last sync the working encoder holds the uniform average of the final task models
    final_mean = _mean64([recorder.ends[(2, s)] for s in slots])
    for key, value in final_mean.items():
        torch.testing.assert_close(module.encoder.state_dict()[key].double(), value, rtol=0, atol=1e-6)
    assert any("running_mean" in key for key in final_mean) == (clip_fixture == "batchnorm_clip")


def test_frozen_batchnorm_keeps_theta_0_statistics_while_its_weights_train(tmp_path, batchnorm_clip):
    recorder, module = _fit_with_recorder(tmp_path, batchnorm_clip)  # batchnorm: frozen (the default)
    theta_0 = load_state_dict(tmp_path / "pretrained.safetensors")
    statistics = [k for k in theta_0 if k.endswith(("running_mean", "running_var", "num_batches_tracked"))]
    affine = [k.replace("running_mean", "weight") for k in statistics if k.endswith("running_mean")]
    assert statistics and affine
    for state in recorder.ends.values():
        for key in statistics:
            assert torch.equal(state[key], theta_0[key]), key
    assert any(not torch.equal(recorder.ends[(2, 0)][k], theta_0[k]) for k in affine)
    bn_modes = [m.training for m in module.encoder.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    assert bn_modes and not any(bn_modes)
    module.train()  # Lightning or a user switching the module to train mode keeps BatchNorm frozen
    assert not any(m.training for m in module.encoder.modules() if isinstance(m, torch.nn.BatchNorm2d))


def test_logged_cosines_match_an_independent_computation(tmp_path, small_clip):
    recorder, module = _fit_with_recorder(tmp_path, small_clip)
    theta_0 = load_state_dict(tmp_path / "pretrained.safetensors")
    params = [name for name, _ in module.encoder.named_parameters()]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["phase"] for r in records] == [1, 2, 3] and [r["step"] for r in records] == [2, 4, 6]

    def mean_pairwise_cos(vectors):
        flat = np.stack([np.concatenate([v[k].double().numpy().ravel() for k in params]) for v in vectors])
        unit = flat / np.linalg.norm(flat, axis=1, keepdims=True)
        cos = unit @ unit.T
        return cos[~np.eye(len(vectors), dtype=bool)].mean()

    for phase, record in enumerate(records):
        ends = [recorder.ends[(phase, s)] for s in range(3)]
        start = recorder.starts[(phase, 0)]
        taus = [{k: e[k] - theta_0[k] for k in params} for e in ends]
        deltas = [{k: e[k] - start[k] for k in params} for e in ends]
        assert record["mean_cos_tau"] == pytest.approx(mean_pairwise_cos(taus), abs=1e-6)
        assert record["mean_cos_delta"] == pytest.approx(mean_pairwise_cos(deltas), abs=1e-6)
        assert set(record["loss"]) == set(TASKS)
    assert records[0]["mean_cos_tau"] == pytest.approx(records[0]["mean_cos_delta"])  # delta = tau in phase 1


def test_keep_optimizer_state_carries_each_tasks_moments_across_phases(tmp_path, small_clip):
    recorder, _ = _fit_with_recorder(tmp_path, small_clip, optimizer_state="keep")
    for slot in range(3):
        assert recorder.start_moments[(0, slot)] == []
        for phase in (1, 2):
            carried, saved = recorder.start_moments[(phase, slot)], recorder.end_moments[(phase - 1, slot)]
            assert len(carried) == len(saved) > 0
            for a, b in zip(carried, saved):
                torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_n1_equals_independent_fine_tuning(tmp_path, small_clip):
    together = run_fit(fit_config(tmp_path / "together", small_clip, ["rot90", "mirror"], steps=6, iterations=1)).run_dir
    for task in ("rot90", "mirror"):
        alone = run_fit(fit_config(tmp_path / task, small_clip, [task], steps=6, iterations=1)).run_dir
        joint, single = load_state_dict(together / "final" / f"{task}.safetensors"), load_state_dict(alone / "final" / f"{task}.safetensors")
        pretrained = load_state_dict(alone / "pretrained.safetensors")
        assert set(joint) == set(single)
        for key in joint:
            assert torch.equal(joint[key], single[key]), key
        assert any(not torch.equal(single[k], pretrained[k]) for k in single)  # it did train


def test_run_folder_contract_and_config_round_trip(tmp_path, small_clip):
    run = run_fit(fit_config(tmp_path / "run", small_clip, ["rot90", "rot270"], steps=4, iterations=2)).run_dir
    pretrained = load_state_dict(run / "pretrained.safetensors")
    for task in ("rot90", "rot270"):
        weights = load_state_dict(run / "final" / f"{task}.safetensors")
        assert {k: v.shape for k, v in weights.items()} == {k: v.shape for k, v in pretrained.items()}
        meta = json.loads((run / "final" / f"{task}.json").read_text())
        assert (meta["task"], meta["N"], meta["K"], meta["S"], meta["seed"]) == (task, 2, 2, 4, 3)
        assert meta["config"]["model"]["clip"] == small_clip
        assert read_metadata(run / "final" / f"{task}.safetensors")["mima"]["task"] == task
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2
    assert {"phase", "step", "mean_cos_tau", "mean_cos_delta", "loss"} <= set(records[0])
    config = yaml.safe_load((run / "config.yaml").read_text())
    assert config["model"]["iterations"] == 2 and config["data"]["tasks"] == ["rot90", "rot270"]

    again = run_fit(["--config", str(run / "config.yaml"), "--out", str(tmp_path / "again")]).run_dir
    theta_0 = open_clip.create_model(small_clip).visual.state_dict()  # not the run's own pretrained.safetensors
    assert_trained(finals(run, ["rot90", "rot270"]), theta_0, at_least=1e-3)  # so equal is not "both untrained"
    for task in ("rot90", "rot270"):
        a, b = load_state_dict(run / "final" / f"{task}.safetensors"), load_state_dict(again / "final" / f"{task}.safetensors")
        assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("clip_fixture", ["small_clip", "batchnorm_clip"])
def test_gradient_checkpointing_trains_the_same_weights(tmp_path, request, clip_fixture):
    clip = request.getfixturevalue(clip_fixture)  # an open_clip ViT tower and a timm tower
    runs = {}
    for enabled in (False, True):
        config = fit_config(tmp_path / str(enabled), clip, ["rot90", "mirror"], steps=4, iterations=2, grad_checkpointing=enabled)
        runs[enabled] = run_fit(config).run_dir
    # 4 AdamW steps at lr 1e-3 (2 of warm-up) move the largest weight by about 3e-3: close is not "both untrained"
    assert_trained(finals(runs[False], ["rot90", "mirror"]), open_clip.create_model(clip).visual.state_dict(), at_least=1e-3)
    for task in ("rot90", "mirror"):
        plain = load_state_dict(runs[False] / "final" / f"{task}.safetensors")
        recomputed = load_state_dict(runs[True] / "final" / f"{task}.safetensors")
        for key in plain:
            torch.testing.assert_close(recomputed[key], plain[key], rtol=0, atol=1e-6)


def test_gradient_checkpointing_on_a_tower_without_it_is_one_line(tmp_path, capsys):
    from mima.cli import main
    from tests.helpers import SMALL_CLIP_CFG, save_local_dir_clip

    # open_clip's ModifiedResNet accepts set_grad_checkpointing and ignores it
    resnet = {"embed_dim": 32, "vision_cfg": {"image_size": 16, "layers": [1, 1, 1, 1], "width": 8},
              "text_cfg": SMALL_CLIP_CFG["text_cfg"]}
    clip = f"local-dir:{save_local_dir_clip(tmp_path / 'rn', resnet, seed=0)}"
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(fit_config(tmp_path / "run", clip, ["rot90"], steps=2, iterations=1, grad_checkpointing=True)))
    assert main(["fit", "--config", str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.grad_checkpointing" in err[0] and "no gradient checkpointing" in err[0], err
