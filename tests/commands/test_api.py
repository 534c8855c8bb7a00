"""The Python API (mima.api): docs/api.md's examples run as written, and each result equals what the
command gives on the same inputs (the same tensors bit for bit, the same JSON, the same error line);
`import mima` stays free of torch."""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import yaml

import mima
from mima.cli import main
from mima.core.errors import MimaError
from mima.core.safetensors_io import load_state_dict
from mima.merging import HYPERPARAMETERS, MERGE_METHODS
from tests.helpers import fit_config, merge_argv

PAGE = Path(__file__).resolve().parents[2] / "docs" / "api.md"


def python_blocks(page: Path) -> list[tuple[int, str]]:
    """(line, code) of each ```python block of the page, in order."""
    blocks, code, start = [], None, 0
    for number, line in enumerate(page.read_text().splitlines(), start=1):
        if code is None and line.strip() == "```python":
            code, start = [], number + 1
        elif code is not None and line.strip() == "```":
            blocks.append((start, "\n".join(code) + "\n"))
            code = None
        elif code is not None:
            code.append(line)
    return blocks


def close(ours, theirs, rel: float = 1e-3) -> bool:
    """Nested JSON values equal, numbers to `rel`."""
    if isinstance(theirs, dict):
        return isinstance(ours, dict) and ours.keys() == theirs.keys() and all(close(ours[k], theirs[k], rel) for k in theirs)
    if isinstance(theirs, list):
        return isinstance(ours, list) and len(ours) == len(theirs) and all(close(a, b, rel) for a, b in zip(ours, theirs))
    if isinstance(theirs, (int, float)) and not isinstance(theirs, bool):
        return ours == pytest.approx(theirs, rel=rel)
    return ours == theirs


def command(*argv: str) -> tuple[int, str, str]:
    """`mima ARGV...` in this process: (status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main([str(word) for word in argv])
    return status, out.getvalue(), err.getvalue()


def test_the_page_has_an_example_of_every_function():
    code = "".join(block for _, block in python_blocks(PAGE))
    assert len(python_blocks(PAGE)) >= 6
    for name in ("fit", "plan", "merge", "evaluate", "load_results", "MimaError"):
        assert f"mima.{name}(" in code or f"mima.{name} " in code, name


@pytest.mark.slow
def test_the_pages_examples_run_and_equal_the_commands(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    printed = io.StringIO()
    for line, code in python_blocks(PAGE):
        with contextlib.redirect_stdout(printed):
            exec(compile(code, f"{PAGE}:{line}", "exec"), namespace)  # noqa: S102  (the page's own code)
    run, config = namespace["run"], namespace["config"]
    shown = printed.getvalue()

    # fit: the command on the same config (the override as its flag) trains the same task models
    config_file = tmp_path / "config.yaml"
    config_file.write_text(yaml.safe_dump(config))
    status, _, err = command("fit", "--config", config_file, "--model.iterations", "2", "--out", tmp_path / "runs/cli-N2")
    assert status == 0, err
    for task in ("rot90", "mirror"):
        ours, theirs = load_state_dict(run / "final" / f"{task}.safetensors"), load_state_dict(tmp_path / f"runs/cli-N2/final/{task}.safetensors")
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert yaml.safe_load((run / "config.yaml").read_text())["model"]["iterations"] == 2

    # plan: `mima plan --json` of the same config (written as mima.plan writes a dict), in a process of its
    # own as mima.plan runs it; that process's resident memory (the interpreter's share of host memory)
    # is measured, not computed, so it is left out
    with tempfile.TemporaryDirectory(prefix="mima-api-") as folder:
        (Path(folder) / "config.yaml").write_text(yaml.safe_dump(config))
        done = subprocess.run([sys.executable, "-m", "mima", "plan", "--config", str(Path(folder) / "config.yaml"),
                               "--trainer.devices", "2", "--json"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    ours, theirs = namespace["cost"], json.loads(done.stdout)
    assert ours.keys() == theirs.keys() and ours["world_size"] == 2 and ours["tasks_per_process"] == theirs["tasks_per_process"]
    measured = {"host_memory_per_process", "host_memory_parts", "host_memory_per_node"}
    # the planned file sizes (and the SLURM lead they give) come from states serialised in each process,
    # which vary between two `mima plan` processes of the same config (a process state of 18.7 KB
    # differed by 64 bytes, 0.34 %, on a loaded clean clone): equal to 1 %
    sizes = {"checkpoint_file_bytes", "checkpoint_files", "bytes_written", "bytes_written_parts", "peak_disk_bytes", "choices"}
    differing = {key: (ours[key], theirs[key]) for key in theirs if ours[key] != theirs[key] and key not in measured | sizes}
    assert differing == {}, differing
    for key in sizes & theirs.keys():
        assert close(ours[key], theirs[key], rel=0.01), (key, ours[key], theirs[key])
    assert ours["host_memory_parts"]["interpreter_and_libraries"] == pytest.approx(
        theirs["host_memory_parts"]["interpreter_and_libraries"], rel=0.1)

    # merge in memory: bit for bit the file `mima merge` writes, from the run folder and from tensors
    status, _, err = command("merge", "--method", "task_arithmetic", "--models", run, "--output", tmp_path / "ta.safetensors",
                             "--lam", "0.5")
    assert status == 0, err
    written = load_state_dict(tmp_path / "ta.safetensors")
    for merged in (namespace["merged"], namespace["same"]):
        assert list(merged) == list(written) and all(torch.equal(merged[k], written[k]) for k in written)
    theta_0 = load_state_dict(run / "pretrained.safetensors")
    tuned = [load_state_dict(run / "final" / f"{task}.safetensors") for task in ("rot90", "mirror")]
    key = next(iter(written))  # the rule itself: theta_0 + lam * (tau_1 + tau_2)
    assert torch.allclose(written[key], theta_0[key] + 0.5 * ((tuned[0][key] - theta_0[key]) + (tuned[1][key] - theta_0[key])),
                          atol=1e-6)
    assert "True\n" in shown

    # merge to a file: the command's file and results
    status, _, err = command("merge", "--method", "ties", "--models", run, "--output", tmp_path / "cli-ties.safetensors",
                             "--k", "20")
    assert status == 0, err
    ours, theirs = load_state_dict(tmp_path / "ties.safetensors"), load_state_dict(tmp_path / "cli-ties.safetensors")
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs) and ours.keys() == theirs.keys()
    results = [json.loads((tmp_path / f"{name}.safetensors.results.json").read_text()) for name in ("ties", "cli-ties")]
    assert results[0] == results[1] and set(results[0]["test_accuracy"]) == {"rot90", "mirror", "mean"}

    # the error: the command's line after "error: "
    status, _, err = command("merge", "--method", "ties", "--models", run, "--output", tmp_path / "x.safetensors", "--lamda", "2.0")
    assert status == 2 and err.strip() == f"mima merge: error: {namespace['message']}"
    assert namespace["message"] == "unrecognized option --lamda; did you mean --lam? (see mima merge --help)"

    # evaluate and load_results: results.json's rows, as `mima evaluate` writes them
    status, _, err = command("evaluate", run, "--out", tmp_path / "cli-table", "--merges", "task_arithmetic", "--no-select")
    assert status == 0, err
    expected = json.loads((tmp_path / "cli-table" / "results.json").read_text())
    assert namespace["rows"] == expected == json.loads((tmp_path / "table" / "results.json").read_text())
    assert {row["model"] for row in expected} == {"zero_shot", "fine_tuned", "task_arithmetic"}
    assert shown.rstrip().endswith("True")


# ------------------------------------------------------------------------------ without the page
# quick settings for the strategies that learn or gather statistics (their defaults take minutes here)
QUICK = {"adamerging": {"steps": 3}, "adamerging_cart": {"steps": 3}, "fisher": {"examples": 4},
         "fw_merging": {"examples": 4, "ada_steps": 3}, "regmean": {"examples": 4}, "regmean_plus_plus": {"examples": 4},
         "wudi": {"steps": 5}}


@pytest.fixture(scope="module")
def tasks_config(tmp_path_factory, small_clip) -> Path:
    """A `mima fit` config of the encoders' CLIP on two digits tasks: the data a data-dependent merge needs."""
    folder = tmp_path_factory.mktemp("tasks-config")
    (folder / "config.yaml").write_text(yaml.safe_dump(fit_config(folder / "run", small_clip, ["rot90", "mirror"], 4, 2)))
    return folder / "config.yaml"


@pytest.mark.parametrize("method", sorted(MERGE_METHODS))
def test_every_strategy_writes_the_commands_bytes_and_returns_its_tensors(method, encoders, tasks_config, tmp_path):
    """mima.merge(..., output=...) writes the bytes `mima merge` writes (the model, and with a config its
    results), and mima.merge without an output returns the tensors of that file, from the files and from
    state dicts in memory: one merge service below both."""
    hyperparameters = QUICK.get(method, {})
    config = tasks_config if MERGE_METHODS[method].needs_data else None
    flags = [word for name, value in hyperparameters.items() for word in (HYPERPARAMETERS[name].flag, str(value))]
    flags += ["--config", config] if config is not None else []
    (tmp_path / "cli").mkdir()
    (tmp_path / "api").mkdir()
    status, _, err = command(*merge_argv(method, encoders, tmp_path / "cli" / "m.safetensors", *flags))
    assert status == 0, err
    models = [encoders["m1"], encoders["m2"]]
    given = dict(base=encoders["base"], config=config, **hyperparameters)
    assert mima.merge(models, method, output=tmp_path / "api" / "m.safetensors", **given) == tmp_path / "api" / "m.safetensors"
    written = sorted(path.name for path in (tmp_path / "cli").iterdir())
    assert written == sorted(path.name for path in (tmp_path / "api").iterdir())
    assert len(written) == (3 if config is not None else 1)  # with a config, its results beside it
    for name in written:
        assert (tmp_path / "api" / name).read_bytes() == (tmp_path / "cli" / name).read_bytes(), name
    merged_file = load_state_dict(tmp_path / "cli" / "m.safetensors")
    from_files = mima.merge(models, method, **given)
    in_memory = mima.merge([load_state_dict(path) for path in models], method,
                           **{**given, "base": load_state_dict(encoders["base"])})
    for merged in (from_files, in_memory):
        assert merged.keys() == merged_file.keys()
        assert all(torch.equal(merged[key], merged_file[key]) for key in merged_file)


def test_the_cache_switch_reaches_the_task_pool(encoders, tasks_config, tmp_path):
    """--cache on (cache="on") goes to the task pool that judges the merge: the digits tasks are tensors,
    which the decoded-image cache cannot hold, refused by both fronts in one line (auto, off on the CPU,
    is what every merge above ran with)."""
    status, _, err = command(*merge_argv("ties", encoders, tmp_path / "m.safetensors", "--config", tasks_config,
                                         "--cache", "on"))
    assert status == 2 and "which the decoded-image cache cannot hold" in err
    with pytest.raises(MimaError) as raised:
        mima.merge([encoders["m1"], encoders["m2"]], "ties", base=encoders["base"], config=tasks_config, cache="on")
    assert err.strip() == f"mima merge: error: {raised.value}"
    assert not (tmp_path / "m.safetensors").exists()


@pytest.mark.parametrize("call, argv", [
    (dict(method="tie"), ["--method", "tie"]),
    (dict(method="ties", lamda=2.0), ["--method", "ties", "--lamda", "2.0"]),
    (dict(method="uniform", lam=0.5), ["--method", "uniform", "--lam", "0.5"]),
    (dict(method="ties", k=-1.0), ["--method", "ties", "--k", "-1.0"]),
    (dict(method="task_arithmetic", base=None), ["--method", "task_arithmetic"]),
    (dict(method="ties", cache="yes"), ["--method", "ties", "--cache", "yes"]),
], ids=["unknown-method", "unknown-hyperparameter", "not-the-methods", "bad-value", "no-base", "cache-spelling"])
def test_a_mistake_is_the_commands_line(encoders, tmp_path, call, argv):
    call = {"base": encoders["base"], **call}
    models = [encoders["m1"], encoders["m2"]]
    if call["base"] is not None and "--method" in argv:
        argv = argv + ["--base", str(encoders["base"])]
    status, _, err = command("merge", *argv, "--models", *models, "--output", tmp_path / "m.safetensors")
    assert status == 2
    line = re.sub(r"^mima merge: error: ", "", err.strip())
    with pytest.raises(MimaError) as raised:
        mima.merge(models, **call)
    assert str(raised.value) == line
    with pytest.raises(MimaError) as raised:  # in memory too
        mima.merge([load_state_dict(path) for path in models], **{**call, "base": load_state_dict(call["base"])
                                                                    if call["base"] is not None else None})
    assert str(raised.value) == line
    assert not (tmp_path / "m.safetensors").exists()


def test_plan_raises_the_commands_line(tmp_path):
    done = subprocess.run([sys.executable, "-m", "mima", "plan", "--config", "missing.yaml", "--trainer.devices", "0"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 2
    with pytest.raises(MimaError) as raised:
        mima.plan(tmp_path / "missing.yaml", devices=0)
    assert done.stderr.strip() == f"mima plan: error: {raised.value}".replace(str(tmp_path / "missing.yaml"), "missing.yaml")
    assert str(raised.value).endswith("--trainer.devices 0: expected a positive number (see mima plan --help)")


def test_load_results_reads_the_rows_and_names_a_missing_file(tmp_path):
    rows = [{"N": 1, "model": "fine_tuned", "task": "rot90", "accuracy": 0.5, "mean_cos_tau": None},
            {"N": 1, "model": "fine_tuned", "task": "mean", "accuracy": 0.5, "mean_cos_tau": None}]
    (tmp_path / "results.json").write_text(json.dumps(rows))
    assert mima.load_results(tmp_path) == rows
    with pytest.raises(MimaError, match=re.escape(f"{tmp_path / 'none'}: no results.json")):
        mima.load_results(tmp_path / "none")


def test_fit_refuses_several_devices_before_any_work(tmp_path):
    with pytest.raises(MimaError, match=r"^trainer.devices 2: mima.fit runs in this process on one device"):
        mima.fit({"model": {"clip": "embedded:tiny-digits"}}, out=tmp_path / "run", trainer={"devices": 2})
    with pytest.raises(MimaError, match=r"^--config missing.yaml: no such file$"):  # `mima fit`'s own check
        mima.fit("missing.yaml")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("call, argv", [
    (dict(precision="fp8"), ["--precision", "fp8"]),
    (dict(val_examples="many"), ["--val-examples", "many"]),
    (dict(val_examples=0), ["--val-examples", "0"]),
    (dict(merge_device="gpu"), ["--merge-device", "gpu"]),
    (dict(num_workers=-1), ["--num-workers", "-1"]),
    (dict(cache="sometimes"), ["--cache", "sometimes"]),
    (dict(merges=[]), ["--merges"]),
    (dict(runs=[]), []),
], ids=["precision", "not-a-number", "no-examples", "device", "workers", "cache", "no-merges", "no-runs"])
def test_an_evaluate_mistake_is_the_commands_line(tmp_path, call, argv):
    """mima.evaluate checks its values without the command's parser: each mistake is still the
    command's line, and nothing is written."""
    runs = call.pop("runs", [tmp_path / "run"])
    status, _, err = command("evaluate", *runs, "--out", tmp_path / "table", *argv)
    assert status == 2 and err.startswith("mima evaluate: error: "), err
    with pytest.raises(MimaError) as raised:
        mima.evaluate(runs, tmp_path / "table", **call)
    assert str(raised.value) == err.strip().removeprefix("mima evaluate: error: ")
    assert not (tmp_path / "table").exists()


def test_fits_config_layers_are_parsed_as_the_commands_config_files(tmp_path):
    """mima.fit hands its config file, overrides and out to the program as layers (no YAML strings on a
    command line): parsed, they are the config the command makes of the same file and overrides as
    --config values, down to the YAML the run folder stores (a section's keys and a class's init_args
    merged, a dict value replaced)."""
    from mima.commands.fit.parser import ParsedOnly, build_cli
    from mima.services.fit.config import one_device_layers
    from mima.services.fit.program import build_program

    config_file = tmp_path / "base.yaml"
    config_file.write_text(yaml.safe_dump({
        "model": {"clip": "embedded:tiny-digits", "steps": {"rot90": 8, "mirror": 4}, "lr": "1e-3"},
        "data": {"tasks": ["rot90", "mirror"]},
        "trainer": {"accelerator": "cpu", "devices": 2,
                    "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": "a"}}}}))
    overrides = {"model": {"steps": {"rot90": 6}, "iterations": 1}, "trainer": {"logger": {"init_args": {"name": "b"}}}}
    layers, name = one_device_layers(config_file, overrides, tmp_path / "run")
    ours = build_program(layers, ParsedOnly)
    one_device = yaml.safe_dump({"trainer": {"devices": 1, "num_nodes": 1}})
    theirs = build_cli(["--config", str(config_file), "--config", yaml.safe_dump(overrides), "--config", one_device,
                        "--out", str(tmp_path / "run")], ParsedOnly)
    assert name == "base"
    assert ours.parser.dump(ours.config, skip_none=False) == theirs.parser.dump(theirs.config, skip_none=False)
    stored = yaml.safe_load(ours.parser.dump(ours.config, skip_none=False))
    assert stored["model"]["steps"] == {"rot90": 6} and stored["trainer"]["devices"] == 1
    assert stored["trainer"]["logger"]["init_args"]["save_dir"] == "a" and stored["trainer"]["logger"]["init_args"]["name"] == "b"


def test_import_mima_loads_no_torch_until_a_function_is_used():
    script = ("import sys, mima\n"
              "heavy = lambda: sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'lightning', 'open_clip'))\n"
              "print('BEFORE', heavy(), 'mima.api' in sys.modules)\n"
              "mima.load_results\n"
              "print('AFTER', 'mima.api' in sys.modules)\n"
              "try:\n    mima.nothing\nexcept AttributeError as error:\n    print('MISSING', error)\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "BEFORE [] False" in result.stdout and "AFTER True" in result.stdout, result.stdout
    assert "MISSING module 'mima' has no attribute 'nothing'" in result.stdout
