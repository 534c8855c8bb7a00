"""`mima plan` (mima.training.resource_plan): its predictions against real runs and direct counts, and
`mima fit`'s refusal of a run the plan shows cannot fit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mima.core.layout import TaskLayout
from mima.core.plan import plan_for_budgets
from mima.models.footprint import measure_footprint, safetensors_file_bytes
from mima.training.resource_plan import utilisation
from tests.helpers import Outcome, cli

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "configs" / "demo.yaml"


def config_file(folder: Path, clip: str, **data) -> Path:
    """The demo's tasks and settings (configs/demo.yaml) with the small test CLIP, S = 32 and N = 4:
    every kind of checkpoint file in seconds; the run's logs as `mima fit` writes them by default."""
    config = yaml.safe_load(DEMO.read_text())
    config["model"].update(clip=clip, steps=32, warmup_steps=4)
    config["data"].update(data)
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def mima(*args: str, cwd: Path, capfd, monkeypatch) -> Outcome:
    """`mima ARGS` in this process, run from `cwd` (what it writes there shows)."""
    monkeypatch.chdir(cwd)
    return cli(args, capfd)


@pytest.mark.slow
def test_plan_predicts_bytes_written_and_peak_memory_of_real_runs(tmp_path, small_clip):
    """The plan's bytes written within 2 % and host memory within 25 % of what one- and three-process
    runs measure from the operating system's side (benchmarks/plan_accuracy.py: audit hook on renames,
    ru_maxrss), with the three processes owning 2, 1 and 1 tasks."""
    table = tmp_path / "table.json"
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "plan_accuracy.py"), "--config",
                           str(config_file(tmp_path, small_clip)), "--devices", "1", "3", "--json", str(table)],
                          cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(table.read_text())
    moments = 4 * 3 * 2 * measure_footprint(small_clip).parameter_bytes  # 4 tasks x 3 phases x two AdamW moments
    assert [row["devices"] for row in rows] == [1, 3]
    for row in rows:
        assert row["measured_bytes"] > moments  # the checkpoints were written
        assert abs(row["predicted_bytes"] / row["measured_bytes"] - 1) <= 0.02, row
        assert abs(row["predicted_host"] / row["measured_peak_rss"] - 1) <= 0.25, row
    # W = 3 writes fewer segment files than W = 1 (a process's last segment of a phase is followed by the
    # sync, whose average stands for it): 1 such file per phase instead of 3, 2 phases x 2 files x E less
    assert rows[0]["measured_bytes"] > rows[1]["measured_bytes"]


def test_plan_json_holds_the_promised_keys_and_its_layout(tmp_path, capfd, monkeypatch):
    done = mima("plan", "--config", str(DEMO), "--trainer.devices", "3", "--json", cwd=tmp_path, capfd=capfd,
                monkeypatch=monkeypatch)
    assert done.code == 0, done.err
    plan = json.loads(done.out)
    for key in ("bytes_written", "peak_disk_bytes", "host_memory_per_process", "device_memory_per_process"):
        assert isinstance(plan[key], int) and plan[key] > 0, key
    assert 0 < plan["utilisation"] <= 1
    # 4 equal tasks on 3 processes: 2, 1, 1 tasks; the two single-task processes wait half of each phase
    assert sorted(map(len, plan["tasks_per_process"])) == [1, 1, 2]
    assert plan["utilisation"] == pytest.approx(4 / (3 * 2))
    assert plan["better_world_sizes"] == [1, 2, 4]
    # the demo's model: 108,992 float32 parameters; weights, gradients, two moments: 4 x 4 B each
    for part, copies in (("weights", 1), ("gradients", 1), ("adamw_moments", 2)):
        assert plan["device_memory_parts"][part] == copies * 4 * 108_992
    assert not list(tmp_path.iterdir())  # a plan writes nothing (and reads no weights: the demo's are not cached here)


@pytest.mark.parametrize("budgets, world", [((320,) * 4, 3), ((64, 32, 32, 16), 2), ((64, 32, 32, 16), 3),
                                            ((10, 10, 10, 10, 10, 10), 4), ((8, 8), 4)])
def test_utilisation_is_stepping_time_of_the_schedules(budgets, world):
    """Stepping time over W x the longest process, counted from each process's PhasePlan (the schedule
    training walks), at N = 2."""
    layout = TaskLayout(len(budgets), world, budgets)
    lengths = [(budget // 2, budget // 2) for budget in budgets]
    names = [f"t{index}" for index in range(len(budgets))]
    steps = [plan_for_budgets(names, layout.local_tasks(rank), lengths, 2).local_steps for rank in range(world)]
    assert utilisation(budgets, world) == pytest.approx(sum(steps) / (world * max(steps)))


@pytest.mark.parametrize("clip", ["small_clip", "batchnorm_clip"])
def test_footprint_sizes_match_the_files_and_models_they_describe(tmp_path, clip, request):
    """The meta-device footprint of a ViT and a timm (BatchNorm) tower against a real file and real activations: the
    safetensors size formula against safetensors itself, the per-example activation bytes against the
    bytes autograd saves in a real float32 forward pass of the loaded tower (batch 8 minus batch 4)."""
    import torch
    from safetensors.torch import save_file

    from mima.models.clip import load_clip

    name = request.getfixturevalue(clip)
    loaded = load_clip(name)
    state = {key: value.contiguous() for key, value in loaded.encoder.state_dict().items()}
    save_file(state, tmp_path / "encoder.safetensors")
    footprint = measure_footprint(name)
    assert footprint.file_bytes == (tmp_path / "encoder.safetensors").stat().st_size == safetensors_file_bytes(state)
    assert footprint.parameters == sum(p.numel() for p in loaded.encoder.parameters())

    def saved(batch: int) -> int:
        kept: list[int] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t.numel() * t.element_size()) or t, lambda t: t):
            loaded.encoder.train()(torch.randn(batch, 3, footprint.image_size, footprint.image_size))
        return sum(kept)

    # on the meta device attention takes its unfused path, which keeps more than the CPU's fused kernel:
    # the trace may err high (the module says so), by little
    real = (saved(8) - saved(4)) // 4
    assert real <= footprint.activation_bytes_per_example <= 1.15 * real


def test_fit_refuses_a_run_the_plan_shows_cannot_fit(tmp_path, small_clip, capfd, monkeypatch):
    """A batch whose activations exceed this machine's memory: one line, nothing written; the plan first."""
    out = tmp_path / "run"
    config = config_file(tmp_path, small_clip, batch_size=1_000_000)  # within data.batch_size's range, beyond any host
    done = mima("fit", "--config", str(config), "--out", str(out), cwd=tmp_path, capfd=capfd, monkeypatch=monkeypatch)
    assert done.code == 2
    errors = done.err.strip().splitlines()
    assert len(errors) == 1 and "pass --force" in errors[0] and "GiB per node" in errors[0], done.err
    assert "plan: 4 tasks on W = 1" in done.out  # the plan was printed first
    assert not out.exists()


@pytest.mark.parametrize("args, expected", [
    (["--trainer.devices", "0"], "--trainer.devices 0: expected a positive number"),
    (["--trainer.devices", "5"], "5 processes (trainer.devices x trainer.num_nodes) do not fit 4 tasks"),
    (["--checkpoint_every", "often"], "--checkpoint_every must be"),
    (["--device-memory", "-1"], "--device-memory -1.0: expected a positive number of GiB"),
])
def test_plan_bad_input_is_one_line(tmp_path, args, expected, capfd, monkeypatch):
    done = mima("plan", "--config", str(DEMO), *args, cwd=tmp_path, capfd=capfd, monkeypatch=monkeypatch)
    assert done.code == 2
    assert done.err.count("\n") == 1 and expected in done.err, done.err


@pytest.mark.parametrize("merge, args, kept", [("outer_nesterov", {}, True), ("outer_nesterov", {"outer_momentum": 0.0}, False),
                                               ("uniform", None, False)])
def test_the_plan_counts_the_outer_optimisers_momentum(tmp_path, capfd, monkeypatch, merge, args, kept):
    """model.sync_merge outer_nesterov with momentum keeps one buffer of the encoder's state beside the phase
    average (mima.training.sync_merge): the plan's device memory holds it, the same size as the average."""
    config = yaml.safe_load(DEMO.read_text())
    config["model"].update(sync_merge=merge, sync_merge_args=args)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    done = mima("plan", "--config", str(path), "--json", cwd=tmp_path, capfd=capfd, monkeypatch=monkeypatch)
    assert done.code == 0, done.err
    parts = json.loads(done.out)["device_memory_parts"]
    assert parts.get("outer_momentum") == (parts["phase_average"] if kept else None)
    assert json.loads(done.out)["device_memory_per_process"] == sum(parts.values())
