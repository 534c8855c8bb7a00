"""What a newcomer meets first: every command's --help and argument errors answer before torch,
Lightning or open_clip are imported (mima fit's parser is LightningCLI's, so only its missing --config
is checked here), and the light tables the parsers read agree with the heavy modules they stand for."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest

from mima.merging.catalogue import KINDS, STRATEGIES

HEAVY = ("torch", "lightning", "open_clip", "torchvision", "timm")
# runs the command line as `mima` does, then names the heavy packages that were imported
WRAPPER = (
    "import sys\n"
    "from mima.cli import main\n"
    "try:\n"
    "    code = main(sys.argv[1:])\n"
    "except SystemExit as stop:\n"
    "    code = stop.code\n"
    f"print('HEAVY', sorted(m for m in sys.modules if m.split('.')[0] in {set(HEAVY)!r}))\n"
    "sys.exit(code)\n"
)

HELP = [
    ("--help", "usage: mima COMMAND [options]"),
    ("demo --help", "usage: mima demo "),
    ("prefetch --help", "usage: mima prefetch "),
    ("plan --help", "usage: mima plan "),
    ("merge --help", "usage: mima merge "),
    ("evaluate --help", "usage: mima evaluate "),
    ("convert --help", "usage: mima convert "),
    ("data --help", "usage: mima data SUBCOMMAND"),
    ("data check --help", "usage: mima data check "),
    ("data cache --help", "usage: mima data cache "),
    ("data splits --help", "usage: mima data splits "),
    ("data prepare --help", "usage: mima data prepare "),
    ("analyze --help", "usage: mima analyze ANALYSIS"),
    ("analyze cosine --help", "usage: mima analyze cosine "),
    ("analyze landscape --help", "usage: mima analyze landscape "),
    ("analyze rank-sweep --help", "usage: mima analyze rank-sweep "),
    ("analyze ctl --help", "usage: mima analyze ctl "),
    ("analyze gradients --help", "usage: mima analyze gradients "),
    ("report --help", "usage: mima report "),
]
# (command line, the one line it must answer on stderr); every one exits with status 2
ERRORS = [
    ("bogus", "mima bogus: error: unknown command 'bogus' (commands: demo, fit, plan, prefetch, merge, evaluate, convert, data, analyze, report)"),
    ("demo --iterations two", "mima demo: error: argument --iterations: invalid int value: 'two' (see mima demo --help)"),
    ("fit --config missing.yaml", "mima fit: error: --config missing.yaml: no such file"),
    ("fit --trainer.devices 2 --config=missing.yaml", "mima fit: error: --config missing.yaml: no such file"),
    ("merge --method uniform --models a.safetensors --output o.safetensors --config missing.yaml",
     "mima merge: error: --config missing.yaml: no such file or run folder"),
    ("analyze ctl m.safetensors --config missing.yaml --out x",
     "mima analyze ctl: error: --config missing.yaml: no such file or run folder"),
    ("plan --config missing.yaml", "mima plan: error: --config missing.yaml: no such file or run folder"),
    ("plan --config x.yaml --trainer.devices 0", "mima plan: error: --trainer.devices 0: expected a positive number (see mima plan --help)"),
    ("prefetch --config missing.yaml", "mima prefetch: error: --config missing.yaml: no such file or run folder"),
    ("prefetch", "mima prefetch: error: the following arguments are required: --config (see mima prefetch --help)"),
    ("merge --method ties", "mima merge: error: the following arguments are required: --models, --output (see mima merge --help)"),
    ("merge --method ties --models a b --output m --lamda 2",
     "mima merge: error: unrecognized option --lamda; did you mean --lam? (see mima merge --help)"),
    ("merge --method tie --models a b --output m", "mima merge: error: unknown merge method 'tie' (known: "
     + ", ".join(sorted(STRATEGIES)) + ")"),
    ("evaluate runs/a", "mima evaluate: error: the following arguments are required: --out (see mima evaluate --help)"),
    ("evaluate runs/a --out o --val-examples 0",
     "mima evaluate: error: --val-examples 0: expected a positive number of examples per task (see mima evaluate --help)"),
    ("convert a.pt b.safetensors --activation relu",
     "mima convert: error: argument --activation: invalid choice: 'relu' (choose from 'quick_gelu', 'gelu') (see mima convert --help)"),
    ("data bogus", "mima data bogus: error: unknown data subcommand 'bogus' (subcommands: check, cache, splits, prepare)"),
    ("data check --root /data --benchmark 9",
     "mima data check: error: argument --benchmark: invalid choice: '9' (choose from '8', '14', '20') (see mima data check --help)"),
    ("data cache --config missing.yaml", "mima data cache: error: --config missing.yaml: no such file or run folder"),
    ("data splits --config missing.yaml --out o", "mima data splits: error: --config missing.yaml: no such file or run folder"),
    ("data prepare --root /data --benchmark 8 --tasks Cars",
     "mima data prepare: error: argument --tasks: not allowed with argument --benchmark (see mima data prepare --help)"),
    ("data splits --config c.yaml", "mima data splits: error: the following arguments are required: --out (see mima data splits --help)"),
    ("analyze bogus", "mima analyze bogus: error: unknown analysis 'bogus' (analyses: cosine, landscape, rank-sweep, ctl, gradients)"),
    ("analyze cosine", "mima analyze cosine: error: the following arguments are required: runs (see mima analyze cosine --help)"),
    ("analyze landscape runs/x", "mima analyze landscape: error: the following arguments are required: --tasks "
     "(see mima analyze landscape --help)"),
    ("analyze rank-sweep runs/x --split train", "mima analyze rank-sweep: error: argument --split: invalid choice: 'train' "
     "(choose from 'test', 'val') (see mima analyze rank-sweep --help)"),
    ("analyze ctl runs/x --tasks A", "mima analyze ctl: error: argument --tasks: expected 2 arguments (see mima analyze ctl --help)"),
    ("analyze gradients runs/x --optimizer adam", "mima analyze gradients: error: argument --optimizer: invalid choice: 'adam' "
     "(choose from 'sgd', 'adamw') (see mima analyze gradients --help)"),
    ("report", "mima report: error: the following arguments are required: folder (see mima report --help)"),
]


def _run(command: str, tmp_path) -> tuple[int, str, str, str]:
    """Exit status, stdout without the HEAVY line, stderr, and the HEAVY line, of `mima COMMAND`."""
    result = subprocess.run([sys.executable, "-c", WRAPPER, *command.split()], capture_output=True, text=True,
                            timeout=300, cwd=tmp_path)
    lines = result.stdout.splitlines()
    assert lines and lines[-1].startswith("HEAVY "), result.stdout + result.stderr
    return result.returncode, "\n".join(lines[:-1]), result.stderr, lines[-1]


@pytest.mark.parametrize("command, first_line", HELP, ids=[command for command, _ in HELP])
def test_help_answers_before_torch(command, first_line, tmp_path):
    code, out, err, heavy = _run(command, tmp_path)
    assert (code, err) == (0, "")
    assert out.startswith(first_line), out[:200]
    assert heavy == "HEAVY []"


@pytest.mark.parametrize("command, line", ERRORS, ids=[command for command, _ in ERRORS])
def test_argument_errors_are_one_line_before_torch(command, line, tmp_path):
    code, out, err, heavy = _run(command, tmp_path)
    assert code == 2
    assert (out, err) == ("", line + "\n")
    assert heavy == "HEAVY []"


@pytest.mark.slow
def test_fit_help_is_lightning_cli_help(tmp_path):
    code, out, err, _ = _run("fit --help", tmp_path)
    assert code == 0, err
    assert out.startswith("usage: mima fit ") and "--model.iterations" in out and "--trainer.devices" in out


def test_the_catalogue_lists_every_registered_strategy_with_its_hyperparameters():
    from mima.merging import MERGE_METHODS

    assert {name: tuple(method.defaults) for name, method in MERGE_METHODS.items()} == {
        name: strategy.hyperparameters for name, strategy in STRATEGIES.items()
    }


def test_the_catalogues_kinds_are_the_registrys_types():
    from mima.merging import MERGE_METHODS
    from mima.merging.registry import KIND_TYPES

    assert set(KIND_TYPES) == set(KINDS)
    assert [name for name, strategy in STRATEGIES.items()
            if not isinstance(MERGE_METHODS[name], KIND_TYPES[strategy.kind])] == []
    # what the tables say of a kind is what the registered method does: it asks for data, or keeps one model per task
    assert {name: (method.needs_data, method.per_task) for name, method in MERGE_METHODS.items()} == {
        name: (strategy.needs_data, strategy.kind == "per-task") for name, strategy in STRATEGIES.items()}


def test_register_refuses_a_strategy_the_catalogue_does_not_list_as_it_is(monkeypatch):
    from mima.merging.registry import MERGE_METHODS, StreamingMerge, register

    stream = lambda models, base, **hp: iter(())  # noqa: E731
    with pytest.raises(ValueError, match="STRATEGIES must list it"):
        register(StreamingMerge(name="unlisted", stream_fn=stream))
    monkeypatch.setitem(STRATEGIES, "listed", replace(STRATEGIES["uniform"], defaults={"lam": float("nan")}))
    with pytest.raises(ValueError, match="default lam=nan is not a finite number"):
        register(StreamingMerge(name="listed", stream_fn=stream))
    assert not {"unlisted", "listed"} & set(MERGE_METHODS)


def test_convert_offers_the_activations_the_conversion_knows():
    from mima.commands.convert.options import ACTIVATIONS
    from mima.models.hf_clip import ACTIVATIONS as CONVERSION_ACTIVATIONS

    assert ACTIVATIONS == CONVERSION_ACTIVATIONS
