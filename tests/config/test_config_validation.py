"""A run config's file and numbers are checked before anything runs, the same way by `mima fit` and
`mima plan` (issue 40): a YAML alias bomb, a file that is not UTF-8, a section that is not a mapping and
every number outside its declared range (mima.core.settings.option) are one line on stderr, exit status 2,
no traceback, and no run folder."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from mima.config.options import check_value
from mima.config.source import read_config_file
from mima.core.bounded_yaml import MAX_CONFIG_BYTES, MAX_CONFIG_NODES
from mima.core.errors import MimaError
from mima.core.run_folder import RunFolder
from mima.core.settings import LIGHTNING_SEED_MAX, SEED_MAX, SYNC_LAMBDA_MAX
from tests.helpers import assert_one_line, calls_at_most, cli, fit_config

TASKS = ["rot90", "mirror"]

# nine levels of nine aliases: 9^9 (387 million) list items from 300 bytes; on the model: section, which
# `mima fit` hands to jsonargparse and `mima plan` parses and copies
ALIAS_BOMB = "".join(
    f"l{level}: &l{level} [{', '.join([f'*l{level - 1}'] * 9) if level else ', '.join(['x'] * 9)}]\n" for level in range(9)
) + "model: {sync_merge_args: {lam: *l8}}\n"


def config_file(folder: Path, clip: str, change=None, text: str | bytes | None = None) -> Path:
    path = folder / "config.yaml"
    if text is not None:
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        return path
    config = fit_config(folder / "run", clip, TASKS, steps=8, iterations=2)
    del config["out"]
    if change is not None:
        change(config)
    path.write_text(yaml.safe_dump(config))
    return path


def setting(dotted: str, value):
    def change(config: dict) -> None:
        *sections, key = dotted.split(".")
        target = config
        for section in sections:
            target = target.setdefault(section, {})
        target[key] = value
    return change


def both(*changes):
    def change(config: dict) -> None:
        for each in changes:
            each(config)
    return change


def refused(tmp_path: Path, capfd, path: Path, *fragments: str, extra_fit=(), extra_plan=()) -> None:
    """`mima plan` and `mima fit` both refuse `path` with the same one line holding every fragment, and
    `mima fit` writes no run folder."""
    plan = cli(["plan", "--config", path, *extra_plan], capfd)
    plan_line = assert_one_line(plan.code, plan.err, *fragments)
    run = tmp_path / "run"
    fit = cli(["fit", "--config", path, "--out", run, *extra_fit], capfd)
    fit_line = assert_one_line(fit.code, fit.err, *fragments)
    assert plan_line.removeprefix("mima plan: ") == fit_line.removeprefix("mima fit: ")
    assert not run.exists()


# ------------------------------------------------------------------ the file
# Reading the bomb takes about 10,000 Python calls (YAML's parser on a few hundred bytes, the size counted
# once per distinct node); a count that stopped at the bound would take one call per node, up to
# MAX_CONFIG_NODES; walking the expansion, 10^9.
BOMB_CALLS = 2 * MAX_CONFIG_NODES


def test_a_yaml_alias_bomb_is_refused_without_expanding_it(tmp_path, small_clip, capfd):
    path = config_file(tmp_path, small_clip, text=ALIAS_BOMB)
    with calls_at_most(BOMB_CALLS), pytest.raises(MimaError, match="alias"):
        read_config_file(path, "--config")
    # the nodes it stands for: list l0 is itself and 9 scalars, each l_k itself and 9 copies of l_(k-1);
    # the root mapping holds 9 keys with their lists and `model` -> {sync_merge_args -> {lam -> l8}}
    lists = [10]
    for _ in range(8):
        lists.append(1 + 9 * lists[-1])
    nodes = 1 + sum(1 + size for size in lists) + 5 + lists[-1]
    refused(tmp_path, capfd, path, str(path), f"its aliases expand to {nodes} YAML nodes", f"at most {MAX_CONFIG_NODES}",
            "alias bomb")


def test_aliases_within_the_bound_still_load(tmp_path):
    path = tmp_path / "aliases.yaml"
    path.write_text("base: &tasks [rot90, mirror]\ndata: {tasks: *tasks}\n")
    assert read_config_file(path, "--config")["data"] == {"tasks": ["rot90", "mirror"]}


def test_a_self_referencing_alias_is_refused(tmp_path):
    path = tmp_path / "loop.yaml"
    path.write_text("a: &a [1, *a]\n")
    with pytest.raises(MimaError, match="alias"):
        read_config_file(path, "--config")


def test_a_file_larger_than_a_config_is_refused_before_it_is_read(tmp_path, small_clip, capfd):
    path = config_file(tmp_path, small_clip, text="#" * (MAX_CONFIG_BYTES + 1))
    refused(tmp_path, capfd, path, str(path), f"not a run config ({MAX_CONFIG_BYTES + 1} bytes; a run config is at most {MAX_CONFIG_BYTES} bytes)")


def test_a_config_that_is_not_utf8_is_named_as_such(tmp_path, small_clip, capfd):
    path = config_file(tmp_path, small_clip, text=b"model:\n  clip: caf\xe9\n")
    refused(tmp_path, capfd, path, str(path), "not valid YAML (not a text file): byte 0xe9 at offset 18 is not UTF-8")  # len("model:\n  clip: caf")


@pytest.mark.parametrize("section, value, shown", [("model", [1, 2], "list [1, 2]"), ("trainer", "x", "str 'x'"),
                                                   ("data", 3, "int 3")])
def test_a_section_that_is_not_a_mapping(tmp_path, small_clip, capfd, section, value, shown):
    path = config_file(tmp_path, small_clip, setting(section, value))
    refused(tmp_path, capfd, path, str(path), f"'{section}:' must be a mapping of options, got {shown}")


# ------------------------------------------------------------------ the values
INTEGER_RANGE = "expected an integer in"
CASES = {
    "seed_everything_text": (setting("seed_everything", "abc"), "seed_everything: 'abc' is not an integer in 0 .. 4294967295"),
    "seed_everything_list": (setting("seed_everything", [1]), "seed_everything: [1] is not an integer in 0 .. 4294967295"),
    "seed_everything_beyond_lightning": (setting("seed_everything", LIGHTNING_SEED_MAX + 1),
                                         f"seed_everything: {LIGHTNING_SEED_MAX + 1} is out of range; {INTEGER_RANGE} 0 .. {LIGHTNING_SEED_MAX}"),
    "huge_phase_ratio": (both(setting("model.phase_schedule", "geometric"), setting("model.phase_ratio", 1e300)),
                         "model.phase_ratio: 1e+300 is out of range; expected a finite number in 0.01 .. 100"),
    "steps_1e30": (setting("model.steps", 10**30),
                   f"model.steps: {10**30} is out of range; {INTEGER_RANGE} 1 .. 1000000000"),
    "per_task_steps_1e30": (setting("model.steps", {"rot90": 8, "mirror": 10**30}),
                            f"model.steps.mirror: {10**30} is out of range; {INTEGER_RANGE} 1 .. 1000000000"),
    "lr_nan": (setting("model.lr", float("nan")), "model.lr: nan is not a finite number > 0 and <= 10"),
    "lr_inf": (setting("model.lr", float("inf")), "model.lr: inf is not a finite number > 0 and <= 10"),
    "devices_0": (setting("trainer.devices", 0), f"trainer.devices: 0 is out of range; {INTEGER_RANGE} 1 .. 65536"),
    "devices_minus_1": (setting("trainer.devices", -1), f"trainer.devices: -1 is out of range; {INTEGER_RANGE} 1 .. 65536"),
    "collective_timeout_0": (setting("collective_timeout", 0), f"collective_timeout: 0 is out of range; {INTEGER_RANGE} 1 .. 604800"),
    "collective_timeout_minus_1": (setting("collective_timeout", -1),
                                   f"collective_timeout: -1 is out of range; {INTEGER_RANGE} 1 .. 604800"),
    "huge_threads": (setting("threads_per_process", 10**6),
                     f"threads_per_process: 1000000 is out of range; {INTEGER_RANGE} 1 .. {4 * (os.cpu_count() or 1)}"),
    "negative_workers": (setting("data.num_workers", -1), f"data.num_workers: -1 is out of range; {INTEGER_RANGE} 0 .. 1024"),
    "data_seed_2_64": (setting("data.seed", 2**64), f"data.seed: {2**64} is out of range; {INTEGER_RANGE} 0 .. {SEED_MAX}"),
    "data_seed_negative": (setting("data.seed", -1), f"data.seed: -1 is out of range; {INTEGER_RANGE} 0 .. {SEED_MAX}"),
    "split_seed_2_64": (setting("data.split_seed", 2**64), f"data.split_seed: {2**64} is out of range; {INTEGER_RANGE} 0 .. {SEED_MAX}"),
    "accumulate_0": (setting("trainer.accumulate_grad_batches", 0),
                     f"trainer.accumulate_grad_batches: 0 is out of range; {INTEGER_RANGE} 1 .. 1048576"),
    "sync_lambda_1e30": (both(setting("model.sync_merge", "task_arithmetic"), setting("model.sync_merge_args", {"lam": 1e30})),
                         "model.sync_merge_args.lam: 1e+30 is out of range; expected a finite number in -10 .. 10"),
    "batch_size_0": (setting("data.batch_size", 0), f"data.batch_size: 0 is out of range; {INTEGER_RANGE} 1 .. 1048576"),
    "eval_batch_size_0": (setting("data.eval_batch_size", 0), f"data.eval_batch_size: 0 is out of range; {INTEGER_RANGE} 1 .. 1048576"),
    # issue 41: options that end trainer.fit before the plan's last step (the run said "finished" without final/)
    **{f"cut_short_{key}_{value}": (setting(f"trainer.{key}", value), f"trainer.{key}={value!r}: would end the run "
                                    "before its plan; the run length is set by model.steps and model.iterations")
       for key, value in (("limit_train_batches", 3), ("limit_train_batches", 0.5), ("fast_dev_run", True),
                          ("fast_dev_run", 2), ("overfit_batches", 1), ("overfit_batches", 0.1), ("max_steps", 4),
                          ("max_epochs", 1))},
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_value_out_of_range_is_one_line_from_plan_and_fit(tmp_path, small_clip, capfd, case):
    change, line = CASES[case]
    refused(tmp_path, capfd, config_file(tmp_path, small_clip, change), line)


@pytest.mark.parametrize("option, value, line", [
    ("--trainer.devices", "0", "trainer.devices: '0' is out of range; expected an integer in 1 .. 65536"),
    ("--trainer.devices", "-1", "trainer.devices: '-1' is out of range; expected an integer in 1 .. 65536"),
    ("--collective_timeout", "0", "collective_timeout: 0 is out of range; expected an integer in 1 .. 604800"),
    ("--collective_timeout", "-1", "collective_timeout: -1 is out of range; expected an integer in 1 .. 604800"),
    ("--threads_per_process", "100000", "threads_per_process: 100000 is out of range; expected an integer in 1 .. "),
])
def test_fit_command_line_values_out_of_range(tmp_path, small_clip, capfd, option, value, line):
    run = tmp_path / "run"
    outcome = cli(["fit", "--config", config_file(tmp_path, small_clip), "--out", run, option, value], capfd)
    assert_one_line(outcome.code, outcome.err, f"mima fit: error: {line}")
    assert not run.exists()


def test_a_geometric_schedule_whose_powers_overflow_is_refused_before_computing_them(tmp_path, small_clip, capfd):
    # 100^(10^6 - 1) overflows a float: today an OverflowError
    change = both(setting("model.steps", 10**9), setting("model.iterations", 10**6),
                  setting("model.phase_schedule", "geometric"), setting("model.phase_ratio", 100.0))
    refused(tmp_path, capfd, config_file(tmp_path, small_clip, change), "model.phase_ratio=100.0: over model.iterations=1000000 phases")


def test_the_bounds_themselves_pass_and_one_beyond_fails():
    for key, low, high in (("data.seed", 0, SEED_MAX), ("seed_everything", 0, LIGHTNING_SEED_MAX),
                           ("model.sync_merge_args.lam", -SYNC_LAMBDA_MAX, SYNC_LAMBDA_MAX)):
        check_value(key, low)
        check_value(key, high)
        for beyond in (low - 1, high + 1):
            with pytest.raises(MimaError, match=f"^{key.replace('.', '[.]')}: "):
                check_value(key, beyond)
    check_value("model.lr", "1e-3")  # YAML 1.1 reads 1e-3 as a string; the parser converts it
    check_value("model.sync_merge_args.mask_lam", [0.1, 0.4])  # one per task
    with pytest.raises(MimaError, match="mask_lam: 50"):
        check_value("model.sync_merge_args.mask_lam", [0.1, 50])
    with pytest.raises(MimaError, match="is not an integer"):
        check_value("data.batch_size", True)


def test_a_run_folders_config_is_read_with_the_same_bounds(tmp_path):
    """A run folder handed to merge, evaluate or report reads its config.yaml through the same bounded
    reader as --config: an alias bomb there is refused in one line, as cheaply."""
    (tmp_path / "config.yaml").write_text(ALIAS_BOMB)
    refused = f"config.yaml: its aliases expand to .* at most {MAX_CONFIG_NODES}"
    with calls_at_most(BOMB_CALLS), pytest.raises(MimaError, match=refused):
        RunFolder(tmp_path).config_dict()
