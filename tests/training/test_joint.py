"""The joint multi-task baseline (`model.mode: joint`) against a hand-written training loop."""

from __future__ import annotations

import json

import pytest
import yaml
import torch
import torch.nn.functional as F

from mima.core.run_folder import RunFolder
from mima.data.sampler import stream_seed
from mima.pools import task_pool
from mima.commands.fit.run import run_fit
from tests.helpers import fit_config

TASKS = ["rot90", "mirror"]


def _hand_batch(task: str, train_size: int, seed: int, step: int, batch_size: int) -> list[int]:
    """Examples [step*B, (step+1)*B) of the task's stream: one fresh seeded permutation per epoch."""
    indices = []
    for position in range(step * batch_size, (step + 1) * batch_size):
        epoch, offset = divmod(position, train_size)
        order = torch.randperm(train_size, generator=torch.Generator().manual_seed(stream_seed(seed, task, epoch)))
        indices.append(int(order[offset]))
    return indices


def test_joint_mode_equals_a_hand_written_loop_over_the_combined_batch(tmp_path, small_clip):
    steps, lr, weight_decay = 3, 1e-3, 0.1
    config = fit_config(tmp_path / "run", small_clip, TASKS, steps=steps, iterations=1, mode="joint",
                        warmup_steps=0, lr_schedule="constant", weight_decay=weight_decay)
    run = RunFolder(run_fit(config).run_dir)
    assert run.is_joint() and run.task_order() == TASKS and run.iterations() is None
    assert not any(run.final_file(task).exists() for task in TASKS)

    pool = task_pool(run)  # the run's encoder (theta_0), frozen heads and data splits
    encoder = pool.encoder
    encoder.load_state_dict(run.pretrained())
    encoder.train()
    encoder.requires_grad_(True)
    optimizer = torch.optim.AdamW(encoder.parameters(), lr=lr, weight_decay=weight_decay)
    seed, batch_size = config["data"]["seed"], config["data"]["batch_size"]
    for step in range(steps):
        images, labels, owner = [], [], []
        for slot, task in enumerate(TASKS):
            train = pool.splits[task].train
            for index in _hand_batch(task, len(train), seed, step, batch_size):
                image, label = train[index]
                images.append(image)
                labels.append(label)
                owner.append(slot)
        features = encoder(torch.stack(images))
        labels, owner = torch.tensor(labels), torch.tensor(owner)
        losses = []
        for slot, task in enumerate(TASKS):
            rows = owner == slot
            logits = F.normalize(features[rows], dim=-1) @ pool.heads[task].T
            losses.append(F.cross_entropy(logits, labels[rows]))
        optimizer.zero_grad()
        torch.stack(losses).mean().backward()
        optimizer.step()

    joint = run.joint()
    expected = encoder.state_dict()
    for key, value in joint.items():
        torch.testing.assert_close(value, expected[key], rtol=0, atol=1e-6, msg=key)
    assert any(not torch.equal(value, run.pretrained()[key]) for key, value in joint.items())


def test_evaluate_adds_the_joint_row_to_every_n(tmp_path, small_clip):
    from mima.cli import main

    mima_run = run_fit(fit_config(tmp_path / "n1", small_clip, TASKS, steps=2, iterations=1)).run_dir
    joint_run = run_fit(fit_config(tmp_path / "joint", small_clip, TASKS, steps=2, iterations=1, mode="joint")).run_dir
    out = tmp_path / "table"
    assert main(["evaluate", str(mima_run), str(joint_run), "--out", str(out), "--merges", "uniform"]) == 0
    rows = [row for row in json.loads((out / "results.json").read_text()) if row["model"] == "joint"]
    assert {row["N"] for row in rows} == {1}

    pool = task_pool(RunFolder(joint_run))
    pool.encoder.load_state_dict(RunFolder(joint_run).joint())
    pool.encoder.eval()
    for task in TASKS:  # a hand count over the test split
        test = pool.splits[task].test
        correct = 0
        with torch.no_grad():
            for index in range(len(test)):
                image, label = test[index]
                logits = F.normalize(pool.encoder(image[None]), dim=-1) @ pool.heads[task].T
                correct += int(logits.argmax(dim=1).item() == label)
        row = next(r for r in rows if r["task"] == task)
        assert row["accuracy"] == pytest.approx(correct / len(test), abs=1e-6)  # torchmetrics counts in float32

    assert main(["evaluate", str(joint_run), "--out", str(tmp_path / "only-joint")]) == 2  # no MIMA run: one-line error


@pytest.mark.slow
def test_joint_mode_on_two_processes_is_data_parallel_over_the_combined_batch(tmp_path, small_clip):
    """Two gloo processes each take half of every task's batch; DDP averages their gradients, which is
    the gradient of the whole combined batch: the same model as one process, up to float rounding."""
    from tests.helpers import run_job, write_config

    finals = {}
    for devices in (1, 2):
        config = write_config(tmp_path / f"joint{devices}.yaml", small_clip, TASKS, devices)
        raw = yaml.safe_load(config.read_text())
        raw["model"].update(mode="joint", steps=6)
        config.write_text(yaml.safe_dump(raw))
        result = run_job(config, tmp_path / f"run{devices}")
        assert result.returncode == 0, result.stderr[-2000:]
        finals[devices] = RunFolder(tmp_path / f"run{devices}").joint()
    for key, value in finals[1].items():
        one, two = value, finals[2][key]
        if key.endswith("attn.in_proj_bias"):
            # The key projection's bias cancels in the softmax: its gradient is rounding noise, which
            # Adam scales up to full-size steps. Compare the query and value biases only.
            width = value.numel() // 3
            one, two = torch.cat([one[:width], one[2 * width:]]), torch.cat([two[:width], two[2 * width:]])
        torch.testing.assert_close(two, one, rtol=0, atol=1e-5, msg=key)
