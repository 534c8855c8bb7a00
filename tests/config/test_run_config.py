"""One run configuration: every command sees the values `mima fit` used, defaults included."""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from mima.cli import main
from mima.core.errors import MimaError
from mima.core.run_folder import RunFolder
from mima.data.datamodule import TaskSuiteDataModule
from mima.pools import model_pool
from mima.training.module import MimaModule
from mima.config.run_config import load_run_config
from mima.commands.fit.run import run_fit
from tests.helpers import fit_config

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
TASKS = ["rot90", "mirror"]


# Every default written out (the docs state the ones a user meets: optimizer_state keep, lr_schedule
# cosine with schedule_scope run, sync_merge uniform, batchnorm frozen, probe_shots null) rather than
# read from the signatures the parser reads: a changed default must be changed here, on purpose.
MODEL_DEFAULTS = {
    "pretrained": "openai", "quick_gelu": "auto", "steps": 2000, "iterations": 20, "lr": 1e-05, "weight_decay": 0.1, "warmup_steps": 200,
    "lr_schedule": "cosine", "schedule_scope": "run", "optimizer_state": "keep", "heads": "zero_shot",
    "batchnorm": "frozen", "cache_dir": None, "mode": "mima", "segment_warmup_steps": 0, "probe_shots": None,
    "grad_checkpointing": "auto", "sync_merge": "uniform", "sync_merge_args": None, "phase_schedule": "equal",
    "phase_ratio": 2.0, "proximal_mu": 0.0, "compile": "auto", "batch_tasks": "auto",
}
DATA_DEFAULTS = {
    "suite": "digits", "tasks": None, "benchmark": None, "root": None, "batch_size": 128, "eval_batch_size": 256,
    "num_workers": 0, "seed": 0, "split_seed": 0, "download": False, "custom_tasks": None, "cache": False,
    "cache_dir": None,
}


def test_defaults_are_the_documented_ones_for_every_command_and_for_fit():
    config = load_run_config({"model": {"clip": "embedded:tiny-digits"}})
    assert config.model_args() == {"clip": "embedded:tiny-digits", **MODEL_DEFAULTS}
    assert config.data_args() == DATA_DEFAULTS
    assert config.model.pretrained == "openai"
    # `mima fit` builds MimaModule and TaskSuiteDataModule from their own signatures: the same values
    for cls, expected in ((MimaModule, MODEL_DEFAULTS), (TaskSuiteDataModule, DATA_DEFAULTS)):
        signature = {name: p.default for name, p in inspect.signature(cls.__init__).parameters.items()
                     if name not in ("self", "clip")}
        assert signature == expected, cls.__name__


def test_a_run_folder_written_before_this_change_still_loads():
    """tests/fixtures/run_config_v0.1.yaml is the config.yaml of a demo run written by mima 0.1.0."""
    raw = yaml.safe_load((FIXTURES / "run_config_v0.1.yaml").read_text())
    config = load_run_config(FIXTURES / "run_config_v0.1.yaml")
    assert config.model_args() == {**raw["model"], "quick_gelu": "auto", "mode": "mima", "segment_warmup_steps": 0,
                                    "probe_shots": None, "grad_checkpointing": "auto", "sync_merge": "uniform", "sync_merge_args": None,
                                    "phase_schedule": "equal", "phase_ratio": 2.0, "proximal_mu": 0.0,
                                    "compile": "auto", "batch_tasks": "auto"}  # added since: defaults
    assert config.data_args() == {**raw["data"], "cache": False, "cache_dir": None, "benchmark": None}  # options added since
    assert config.seed == raw["seed_everything"] and config.other["trainer"] == raw["trainer"]


@pytest.mark.parametrize(
    "section, fragment",
    [
        ({"model": {"clipp": "x"}}, "clipp"),
        ({"model": {"steps": "many"}}, "model.steps"),
        ({"model": {"optimizer_state": "sometimes"}}, "model.optimizer_state"),
        ({"data": {"seed": "x"}}, "data.seed"),
        ({"data": ["digits"]}, "'data:' must be a mapping"),
    ],
)
def test_a_bad_config_is_one_clear_error_naming_the_key(section, fragment):
    with pytest.raises(MimaError) as error:
        load_run_config({"model": {"clip": "embedded:tiny-digits"}, **section} if "model" not in section else section)
    assert fragment in str(error.value) and "\n" not in str(error.value)


def test_a_config_file_that_is_not_a_mapping_is_refused(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("- model\n- data\n")
    with pytest.raises(MimaError, match="expected a mapping"):
        load_run_config(path)
    with pytest.raises(MimaError, match="no such file"):
        load_run_config(tmp_path / "missing.yaml")


def test_a_config_without_pretrained_gives_the_same_model_everywhere(tmp_path, small_clip, monkeypatch, capsys):
    """The regression: fit trained on MimaModule's default `pretrained` while merge, evaluate and the
    analyses loaded the config with a default of their own (random weights)."""
    import mima.pools
    import mima.training.module

    loads: list[tuple[str, str, object, object]] = []

    def recorder(where, original):
        def load_clip(name, pretrained=None, cache_dir=None, quick_gelu="auto"):
            loads.append((where, name, pretrained, quick_gelu))
            return original(name, pretrained, cache_dir=cache_dir, quick_gelu=quick_gelu)

        return load_clip

    monkeypatch.setattr(mima.training.module, "load_clip", recorder("fit", mima.training.module.load_clip))
    monkeypatch.setattr(mima.pools, "load_clip", recorder("pool", mima.pools.load_clip))

    config = fit_config(tmp_path / "run", small_clip, TASKS, steps=2, iterations=1, quick_gelu=True)
    assert "pretrained" not in config["model"]
    config_file = tmp_path / "hand-written.yaml"
    config_file.write_text(yaml.safe_dump({k: v for k, v in config.items() if k != "out"}))
    run = RunFolder(run_fit(config).run_dir)

    assert main(["merge", "--method", "uniform", "--models", str(run.path), "--config", str(config_file),
                 "--output", str(tmp_path / "m.safetensors")]) == 0
    assert main(["evaluate", str(run.path), "--out", str(tmp_path / "evaluation"), "--merges", "uniform"]) == 0
    analysis_pool = model_pool([run.path]).task_pool()  # what every analysis that needs data builds
    capsys.readouterr()

    fit_loads = [(name, pretrained, quick) for where, name, pretrained, quick in loads if where == "fit"]
    pool_loads = [(name, pretrained, quick) for where, name, pretrained, quick in loads if where == "pool"]
    assert fit_loads == [(small_clip, "openai", True)]  # the activation too, as the config says
    assert len(pool_loads) == 3 and set(pool_loads) == set(fit_loads)
    theta_0 = run.pretrained()
    for key, value in analysis_pool.encoder.state_dict().items():
        assert torch.equal(value, theta_0[key]), key


def test_reading_a_run_config_imports_neither_lightning_nor_the_training_layer():
    """Merges, evaluation, reports and analyses read run configs: that must not pull in the trainer."""
    demo = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"
    script = (
        "import sys; from mima.config.run_config import load_run_config; "
        f"config = load_run_config({str(demo)!r}); "
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning', 'lightning_fabric') "
        "or m.startswith('mima.training')); "
        "print('LOADED', loaded); print('STEPS', config.model.steps, 'N', config.model.iterations)"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "LOADED []" in result.stdout, result.stdout
    written = yaml.safe_load(demo.read_text())["model"]
    assert f"STEPS {written['steps']} N {written['iterations']}" in result.stdout  # the file's own values
