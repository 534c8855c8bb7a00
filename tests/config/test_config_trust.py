"""The trust boundary of a config (issue 41, item 6; mima.config.trust): a config or a command line that
names code outside mima's list is refused in one line before anything imports it; the trust comes from
the environment (MIMA_TRUST_CODE=1), never from the config. Run as `python -m mima fit` in a subprocess
without the tests' trust, with a sitecustomize hook that reports which modules were imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mima.config.trust import TRUST_ENV, code_names
from tests.helpers import REPO, TWO, fit_config

# Printed at exit by every process of the command: whether the named modules were ever imported.
REPORT_IMPORTS = """
import atexit, json, sys
atexit.register(lambda: print("IMPORTED " + json.dumps(sorted(m for m in ("this", "antigravity", "tests.helpers",
    "http.server") if m in sys.modules)), file=sys.stderr))
"""


def _fit(tmp_path: Path, small_clip: str, *extra: str, trusted: bool = False, change=None) -> subprocess.CompletedProcess:
    tmp_path.mkdir(parents=True, exist_ok=True)
    config = fit_config(tmp_path / "run", small_clip, TWO, steps=4, iterations=1)
    if change is not None:
        change(config)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    hook = tmp_path / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(REPORT_IMPORTS)
    environment = {key: value for key, value in os.environ.items() if key != TRUST_ENV}
    environment["PYTHONPATH"] = os.pathsep.join([str(hook), str(REPO)])
    if trusted:
        environment[TRUST_ENV] = "1"
    return subprocess.run([sys.executable, "-m", "mima", "fit", "--config", str(tmp_path / "c.yaml"), *extra], cwd=REPO,
                          env=environment, capture_output=True, text=True, timeout=300)


def _imported(result: subprocess.CompletedProcess) -> list[str]:
    lines = [line for line in result.stderr.splitlines() if line.startswith("IMPORTED ")]
    assert lines, result.stderr[-2000:]
    return json.loads(lines[-1].removeprefix("IMPORTED "))


def _callbacks(*entries):
    def change(config: dict) -> None:
        config["trainer"]["callbacks"] = list(entries)
    return change


def _errors(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in result.stderr.splitlines() if not line.startswith("IMPORTED ")]


@pytest.mark.parametrize("entry, key, name", [
    ({"class_path": "this"}, "trainer.callbacks[0].class_path", "this"),
    ({"class_path": "tests.helpers.KillAtStep", "init_args": {"step": 1}}, "trainer.callbacks[0].class_path",
     "tests.helpers.KillAtStep"),
    ({"class_path": "lightning.pytorch.callbacks.LambdaCallback", "init_args": {"on_train_start": "antigravity.fly"}},
     "trainer.callbacks[0].class_path", "lightning.pytorch.callbacks.LambdaCallback"),
    ({"class_path": "EarlyStopping", "init_args": {"monitor": "http.server.test"}}, "trainer.callbacks[0].init_args.monitor",
     "http.server.test"),
], ids=["bare-module", "outside-module", "callable-taking-callback", "callable-string"])
def test_a_config_naming_code_outside_the_list_imports_nothing(tmp_path, small_clip, entry, key, name):
    result = _fit(tmp_path, small_clip, change=_callbacks(entry))
    assert result.returncode == 2
    errors = _errors(result)
    assert len(errors) == 1 and f"{key}: {name!r} names code outside mima's list" in errors[0], result.stderr
    assert f"{TRUST_ENV}=1" in errors[0] and "Traceback" not in result.stderr
    assert _imported(result) == []
    assert not (tmp_path / "run").exists()


def test_the_command_line_is_held_to_the_same_list(tmp_path, small_clip):
    result = _fit(tmp_path, small_clip, "--trainer.callbacks+=tests.helpers.RaiseAtStep")
    assert result.returncode == 2 and "'tests.helpers.RaiseAtStep' names code outside mima's list" in result.stderr
    assert _imported(result) == []


def test_the_config_cannot_grant_itself_the_trust(tmp_path, small_clip):
    def change(config: dict) -> None:
        config[TRUST_ENV] = "1"
        config["trust_code"] = True
        _callbacks({"class_path": "tests.helpers.RaiseAtStep", "init_args": {"step": 1}})(config)
    result = _fit(tmp_path, small_clip, change=change)
    assert result.returncode == 2 and "names code outside mima's list" in result.stderr
    assert _imported(result) == []


@pytest.mark.slow
def test_lightnings_listed_callbacks_run_and_trust_opens_the_rest(tmp_path, small_clip):
    listed = _fit(tmp_path / "listed", small_clip, change=_callbacks(
        {"class_path": "EarlyStopping", "init_args": {"monitor": "train/loss/rot90", "strict": False}},
        {"class_path": "lightning.pytorch.callbacks.EarlyStopping", "init_args": {"monitor": "x", "strict": False}}))
    assert listed.returncode == 0, listed.stderr[-2000:]
    trusted = _fit(tmp_path / "trusted", small_clip, trusted=True, change=_callbacks(
        {"class_path": "tests.helpers.ShouldStopAtStep", "init_args": {"step": 100}}))
    assert trusted.returncode == 0, trusted.stderr[-2000:]
    assert _imported(trusted) == ["tests.helpers"]


def test_names_that_only_look_like_code_pass():
    config = {"data": {"root": "checkpoints.v2", "custom_tasks": [{"name": "a.b", "path": "x.y"}]},
              "model": {"pretrained": "weights.safetensors", "clip": "ViT-B-32"}, "trainer": {"strategy": "ddp"}}
    assert list(code_names(config, "")) == []
    assert list(code_names({"trainer": {"plugins": "os.system"}}, "")) == [("trainer.plugins", "os.system")]
