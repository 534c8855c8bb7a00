"""The import rules of the package, read from the source (every `import`, also inside functions).

    core  <-  data  <-  config  <-  models  <-  training  (one direction: a lower layer never imports a higher one)
    core  <-  merging                                   (strategies and the streaming engine: core only)
    merging  <-  training                               (the phase-end operator, model.sync_merge, is a merge)
    core, models  <-  evaluation
    pools (model and task pools for data-dependent merges) sit above merging, training and evaluation
    convert (reading pickled modules without running them; transformers CLIP <-> open_clip) above models
    analysis, then the services (mima/services/: the programs of `mima fit`, `mima merge` and `mima evaluate`,
    which both fronts run), then the commands (mima/commands/: one module or package per command, its options,
    parse and main, and what only it runs; the COMMANDS table), then the CLI (mima.cli, mima.__main__: parse
    and dispatch)
    beside the commands, over the services, the Python API (mima.api: the commands as functions), which
    nothing in the package imports and which imports nothing from the commands
    nothing imports the CLI, and only the CLI imports the commands
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mima.core.errors import MimaError
from mima.core.safetensors_io import save_state_dict
from mima.merging.catalogue import STRATEGIES

PACKAGE = Path(__file__).resolve().parents[2] / "mima"

# layer -> the layers its modules may import (a layer may always import itself)
ALLOWED: dict[str, set[str]] = {
    "core": set(),
    "data": {"core"},
    "config": {"core", "data"},  # the run configuration: read by every command, imports no Lightning
    "models": {"core", "data", "config"},
    "training": {"core", "data", "config", "models", "merging"},  # the phase-end operator is a merge
    "merging": {"core"},
    "evaluation": {"core", "data", "config", "models"},
    "pools": {"core", "data", "config", "models", "training", "merging", "evaluation"},
    "analysis": {"core", "data", "config", "models", "training", "merging", "evaluation", "pools"},
    "convert": {"core", "data", "config", "models"},
    "services": {"core", "data", "config", "models", "training", "merging", "evaluation", "pools", "analysis", "convert"},
    "commands": {"core", "data", "config", "models", "training", "merging", "evaluation", "pools", "analysis", "convert",
                 "services"},
    "cli": {"core", "data", "config", "models", "training", "merging", "evaluation", "pools", "analysis", "convert",
            "services", "commands"},
    # mima.api: the commands as Python functions (mima/__init__.py loads it by name, on first use)
    "api": {"core", "data", "config", "models", "training", "merging", "evaluation", "pools", "analysis", "convert",
            "services"},
    "package": set(),  # mima/__init__.py
}
# third-party packages a layer must not import (the core and the merge engine stay light)
FORBIDDEN_LIBRARIES: dict[str, set[str]] = {
    "core": {"lightning", "open_clip", "matplotlib", "torchmetrics", "timm"},
    "merging": {"lightning", "pytorch_lightning", "open_clip", "torchvision", "matplotlib", "torchmetrics", "timm"},
    "config": {"lightning", "open_clip", "matplotlib", "torchmetrics", "timm"},
    "data": {"lightning.pytorch.callbacks"},
}
def layer_of(module: str) -> str:
    if module in ("mima", "mima.__init__"):
        return "package"
    if module in ("mima.cli", "mima.__main__"):
        return "cli"
    if module == "mima.pools":
        return "pools"
    parts = module.split(".")
    if len(parts) >= 2 and parts[1] in ALLOWED:
        return parts[1]
    raise AssertionError(f"{module}: no layer assigned; add it to tests/architecture/test_architecture.py")


def module_name(path: Path) -> str:
    relative = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(relative.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imported_modules(source: str, module: str) -> set[str]:
    """Every module named by an import statement anywhere in the source (relative imports resolved)."""
    found: set[str] = set()
    package = module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # `from mima import cli`
    return found


def violations(sources: dict[str, str]) -> list[str]:
    """The broken rules in {module name: source}, one line each."""
    problems = []
    known = set(sources)
    for module, source in sources.items():
        layer = layer_of(module)
        for target in sorted(imported_modules(source, module)):
            if target.split(".")[0] == "mima":
                if target not in known and target.rsplit(".", 1)[0] in known:
                    target = target.rsplit(".", 1)[0]  # `from mima.x import name`: the module is mima.x
                if target in ("mima", module):
                    continue
                target_layer = layer_of(target)
                if target_layer == "cli" and layer != "cli":
                    problems.append(f"{module} imports the CLI ({target})")
                elif target_layer != layer and target_layer not in ALLOWED[layer]:
                    problems.append(f"{module} ({layer}) imports {target} ({target_layer})")
            else:
                for banned in FORBIDDEN_LIBRARIES.get(layer, ()):
                    if target == banned or target.startswith(banned + "."):
                        problems.append(f"{module} ({layer}) imports {target}")
    return problems


def package_sources() -> dict[str, str]:
    return {module_name(path): path.read_text() for path in sorted(PACKAGE.rglob("*.py"))}


def test_the_package_follows_its_import_rules():
    assert violations(package_sources()) == []


@pytest.mark.parametrize(
    "module, added, expected",
    [
        ("mima.core.state_dicts", "from mima.training.module import MimaModule", "mima.core.state_dicts (core) imports mima.training.module (training)"),
        ("mima.data.sampler", "from mima.training import module", "mima.data.sampler (data) imports mima.training.module (training)"),
        ("mima.merging.ties", "import mima.pools", "mima.merging.ties (merging) imports mima.pools (pools)"),
        ("mima.merging.cart", "    from mima.data.registry import SUITES", "mima.merging.cart (merging) imports mima.data.registry (data)"),
        ("mima.core.plan", "import lightning", "mima.core.plan (core) imports lightning"),
        ("mima.merging.engine", "from open_clip import create_model", "mima.merging.engine (merging) imports open_clip"),
        ("mima.commands.report.page", "from mima.cli import main", "mima.commands.report.page imports the CLI (mima.cli)"),
        ("mima.convert.pickle_reader", "    from mima.cli import main", "mima.convert.pickle_reader imports the CLI (mima.cli)"),
        ("mima.models.hf_clip", "from mima.convert.hf_conversion import HF_CONFIG",
         "mima.models.hf_clip (models) imports mima.convert.hf_conversion (convert)"),
        ("mima.convert.hf_writer", "from mima.commands.common import no_empty_folder_left",
         "mima.convert.hf_writer (convert) imports mima.commands.common (commands)"),
        ("mima.pools", "    from mima.services.evaluate.runs import evaluate_runs",
         "mima.pools (pools) imports mima.services.evaluate.runs (services)"),
        ("mima.analysis.cosine.command", "    from mima.commands import COMMANDS",
         "mima.analysis.cosine.command (analysis) imports mima.commands (commands)"),
        ("mima.commands.merge", "    from mima.cli import main", "mima.commands.merge imports the CLI (mima.cli)"),
        ("mima.training.sync", "from mima.pools import TaskPool", "mima.training.sync (training) imports mima.pools (pools)"),
        ("mima.services.merge", "    from mima.api import merge", "mima.services.merge (services) imports mima.api (api)"),
        ("mima.services.merge", "from mima.commands.common import device_spelling",
         "mima.services.merge (services) imports mima.commands.common (commands)"),
        ("mima.api", "    from mima.commands.merge import parse", "mima.api (api) imports mima.commands.merge (commands)"),
        ("mima.api", "from mima.cli import main", "mima.api imports the CLI (mima.cli)"),
    ],
)
def test_an_added_forbidden_import_is_caught(module, added, expected):
    sources = package_sources()
    assert module in sources
    if added.startswith(" "):  # an import inside a function counts too
        sources[module] += f"\n\ndef _late():\n{added}\n"
    else:
        sources[module] = f"{added}\n" + sources[module]
    assert expected in violations(sources)


# the spelling of `--cache` (`mima merge --help` lists it): no torch, nothing of the evaluation loop
LIGHT_EVALUATION = ("mima.evaluation", "mima.evaluation.cache_use")


def test_merging_files_loads_neither_lightning_nor_open_clip(tmp_path):
    """`mima merge` of plain files must not pay for (or depend on) the training stack: with every
    strategy, the engine and the selection loaded, no model, data, training or evaluation module is."""
    base = {"w": torch.zeros(3, 2), "b": torch.zeros(2)}
    save_state_dict(tmp_path / "base.safetensors", base)
    for name, shift in (("a", 1.0), ("b", 3.0)):
        save_state_dict(tmp_path / f"{name}.safetensors", {key: value + shift for key, value in base.items()})
    script = (
        "import sys; from mima.cli import main; "
        f"code = main(['merge', '--method', 'task_arithmetic', '--base', '{tmp_path}/base.safetensors', "
        f"'--models', '{tmp_path}/a.safetensors', '{tmp_path}/b.safetensors', '--output', '{tmp_path}/m.safetensors', '--lam', '0.5']); "
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in HEAVY "
        "or m.startswith(('mima.pools', 'mima.data', 'mima.models', 'mima.training', 'mima.evaluation')) "
        "and m not in LIGHT); "
        "merging = sorted(m for m in sys.modules if m.startswith('mima.merging')); "
        "print('LOADED', heavy); print('MERGING', ' '.join(merging)); sys.exit(code)"
    ).replace("LIGHT", repr(LIGHT_EVALUATION)).replace("HEAVY", repr(("lightning", "pytorch_lightning", "open_clip", "torchvision", "torchmetrics", "timm", "matplotlib")))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "LOADED []" in result.stdout, result.stdout
    loaded = set(result.stdout.split("MERGING ")[1].split())
    strategies = {f"mima.merging.{strategy.module}" for strategy in STRATEGIES.values()}
    assert strategies <= loaded, sorted(strategies - loaded)  # every strategy was imported, and none pulled those in
    from mima.core.safetensors_io import load_state_dict

    merged = load_state_dict(tmp_path / "m.safetensors")
    assert torch.equal(merged["w"], torch.full((3, 2), 0.5 * (1.0 + 3.0)))  # theta_0 + lam * (tau_a + tau_b)


# `mima fit`'s builder reads the task count to size the strategy before anything is fitted
BUILDERS = {"mima.config.run_config"}


def cross_reads(sources: dict[str, str]) -> list[str]:
    """Training code that reads the datamodule's attributes (other than the one `connect` call), and
    data code that reaches for the LightningModule: they must exchange what they need through
    `TaskSuiteDataModule.connect` instead."""
    problems = []
    for module, source in sources.items():
        layer = layer_of(module)
        for node in ast.walk(ast.parse(source)):
            if not isinstance(node, ast.Attribute):
                continue
            owner = node.value
            owner_name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else ""
            during_fit = layer == "training" and module not in BUILDERS
            if during_fit and owner_name == "datamodule" and node.attr != "connect":
                problems.append(f"{module} reads datamodule.{node.attr}")
            if layer == "data" and node.attr == "lightning_module":
                problems.append(f"{module} reads trainer.lightning_module")
    return problems


def test_module_and_datamodule_meet_only_in_connect():
    sources = package_sources()
    assert cross_reads(sources) == []
    sources["mima.training.sync"] += "\n\ndef _seed(trainer):\n    return trainer.datamodule.hparams.seed\n"
    sources["mima.data.datamodule"] += "\n\ndef _plan(self):\n    return self.trainer.lightning_module.plan\n"
    assert cross_reads(sources) == ["mima.data.datamodule reads trainer.lightning_module", "mima.training.sync reads datamodule.hparams"]


# ------------------------------------------------------------------------------- the tests themselves
TESTS = Path(__file__).resolve().parents[1]


def cross_test_imports(sources: dict[str, str]) -> list[str]:
    """Test files that import another test file or the conftest (`tests.test_x`, `from tests import
    test_x`, `.test_x`, `tests.conftest`, anywhere in the file), one line each: what several test files
    share belongs in tests/helpers.py (functions and values, imported) or is a fixture of
    tests/conftest.py (which pytest hands to the tests that name it), so that no test depends on another
    test file's private helpers."""

    def is_test_module(module: str) -> bool:
        return any(part.startswith("test_") or part == "conftest" for part in module.split("."))

    problems = set()
    for name, source in sources.items():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                problems.update(f"{name} imports {alias.name}" for alias in node.names if is_test_module(alias.name))
            elif isinstance(node, ast.ImportFrom):
                module = "." * node.level + (node.module or "")
                if is_test_module(module):
                    problems.add(f"{name} imports {module}")
                else:  # from tests import test_x
                    problems.update(f"{name} imports {module}.{alias.name}" for alias in node.names
                                    if is_test_module(alias.name))
    return sorted(problems)


def test_no_test_file_imports_another():
    sources = {path.name: path.read_text() for path in sorted(TESTS.rglob("test_*.py"))}
    assert len(sources) > 40
    assert cross_test_imports(sources) == []
    sources["test_cli.py"] += "\n\ndef _late():\n    from tests.test_hostile_inputs import cli\n"
    sources["test_report.py"] = "from tests import test_run_lock\n" + sources["test_report.py"]
    sources["test_joint.py"] = "import tests.test_distributed as distributed\n" + sources["test_joint.py"]
    sources["test_splits.py"] += "\n\nfrom .test_real_tasks import SIZE\n"
    sources["test_seeds.py"] += "\n\nfrom tests.conftest import SMALL_CLIP_CFG\n"
    sources["test_study.py"] = "from tests import conftest\n" + sources["test_study.py"]
    assert cross_test_imports(sources) == ["test_cli.py imports tests.test_hostile_inputs",
                                           "test_joint.py imports tests.test_distributed",
                                           "test_report.py imports tests.test_run_lock",
                                           "test_seeds.py imports tests.conftest",
                                           "test_splits.py imports .test_real_tasks",
                                           "test_study.py imports tests.conftest"]


# ------------------------------------------------------------------------------- the commands table
def test_every_command_module_imports_nothing_heavy():
    """Every module the COMMANDS and DATA_COMMANDS tables name has parse(argv) and main(argv), and
    importing all of them (as `--help` does one) loads none of torch, Lightning, open_clip."""
    heavy = {"torch", "lightning", "pytorch_lightning", "open_clip", "torchvision", "timm", "matplotlib"}
    script = (
        "import importlib, sys\n"
        "from mima.commands import COMMANDS, DATA_COMMANDS\n"
        "for command in COMMANDS + DATA_COMMANDS:\n"
        "    module = importlib.import_module(command.module)\n"
        "    assert callable(module.parse) and callable(module.main), command.module\n"
        f"print('HEAVY', sorted(m for m in sys.modules if m.split('.')[0] in {heavy!r}))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "HEAVY []" in result.stdout, result.stdout


def _help_of(run, *argv: str) -> str:
    import contextlib
    import io

    shown = io.StringIO()
    with contextlib.redirect_stdout(shown), contextlib.suppress(SystemExit):
        run(*argv)
    return shown.getvalue()


def test_the_commands_table_drives_usage_dispatch_and_parse():
    """Each command of the table is listed once by `mima --help`, named in the unknown-command error,
    reached by `mima NAME --help` and known to `parse`; the same for the data subcommands. (fit's
    --help is LightningCLI's: tests/commands/test_help_options.py runs it.)"""
    from mima.analysis import ANALYSES
    from mima.cli import main, parse
    from mima.commands import COMMANDS, DATA_COMMANDS, names

    assert len(set(names(COMMANDS))) == len(COMMANDS) and len(set(names(DATA_COMMANDS))) == len(DATA_COMMANDS)
    usage = _help_of(main, ["--help"]).splitlines()
    for command in COMMANDS:
        assert [line for line in usage if line.split()[:1] == [command.name]] == [f"  {command.name:<8} {command.summary}"]
    with pytest.raises(MimaError, match=re.escape(f"(commands: {', '.join(names(COMMANDS))})")):
        parse("bogus", [])
    for command in COMMANDS:
        if command.handles_sigterm:
            continue  # fit: LightningCLI's parser
        if command.subcommands:
            assert _help_of(main, [command.name, "--help"]).startswith(f"usage: mima {command.name} ")
            subcommands = names(DATA_COMMANDS) if command.name == "data" else tuple(ANALYSES)
            for subcommand in subcommands:
                expected = f"usage: mima {command.name} {subcommand} "
                assert _help_of(main, [command.name, subcommand, "--help"]).startswith(expected)
                assert _help_of(parse, command.name, [subcommand, "--help"]).startswith(expected)
        else:
            assert _help_of(main, [command.name, "--help"]).startswith(f"usage: mima {command.name} ")
            assert _help_of(parse, command.name, ["--help"]).startswith(f"usage: mima {command.name} ")


def test_the_cli_writes_no_command_name():
    """mima/cli.py reads every command name from the table: none is written there as a string."""
    from mima.commands import COMMANDS, DATA_COMMANDS, names

    written = {node.value for node in ast.walk(ast.parse((PACKAGE / "cli.py").read_text()))
               if isinstance(node, ast.Constant) and isinstance(node.value, str)}
    assert written & set(names(COMMANDS) + names(DATA_COMMANDS)) == set()


# ------------------------------------------------------------------------------- who parses argv
ARGV_PARSERS = {"parse_args", "parse_known_args", "parse_intermixed_args", "parse_known_intermixed_args"}


def argv_parsing(module: str, source: str) -> list[str]:
    """Where `source` parses a command line: an argparse parse call, `sys.argv`, or a LightningCLI with
    Lightning's own parse_arguments (which parses a command line when built; `mima fit`'s program in
    mima.services.fit.program has its own, which parses a config mapping). Allowed only in
    mima/commands/, mima.cli and mima.__main__."""
    if module.startswith("mima.commands") or module in ("mima.cli", "mima.__main__"):
        return []
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in ARGV_PARSERS:
            found.append(f"{module}:{node.lineno} calls {node.attr}")
        elif isinstance(node, ast.Attribute) and node.attr == "argv" and isinstance(node.value, ast.Name) \
                and node.value.id == "sys":
            found.append(f"{module}:{node.lineno} reads sys.argv")
        elif isinstance(node, ast.ClassDef) and any(isinstance(base, ast.Name) and base.id == "LightningCLI"
                                                    for base in node.bases) \
                and not any(isinstance(item, ast.FunctionDef) and item.name == "parse_arguments" for item in node.body):
            found.append(f"{module}:{node.lineno} defines a LightningCLI")
    return found


def test_only_the_commands_parse_argv():
    sources = package_sources()
    assert [line for module, source in sources.items() for line in argv_parsing(module, source)] == []


@pytest.mark.parametrize("added, expected", [
    ("import sys\nARGS = sys.argv[1:]", "reads sys.argv"),
    ("def f(parser):\n    return parser.parse_args([])", "calls parse_args"),
    ("from lightning.pytorch.cli import LightningCLI\nclass C(LightningCLI):\n    pass", "defines a LightningCLI"),
    ("from lightning.pytorch.cli import LightningCLI\nclass C(LightningCLI):\n"
     "    def parse_arguments(self, parser, args):\n        self.config = parser.parse_args(args)", "calls parse_args"),
])
def test_an_added_argv_parser_is_caught(added, expected):
    found = argv_parsing("mima.training.module", package_sources()["mima.training.module"] + "\n" + added + "\n")
    assert len(found) == 1 and found[0].endswith(expected), found
    assert argv_parsing("mima.commands.fit", added) == []


def test_a_lightning_cli_that_parses_a_mapping_is_no_argv_parser():
    program = ("from lightning.pytorch.cli import LightningCLI\nclass C(LightningCLI):\n"
               "    def parse_arguments(self, parser, args):\n        self.config = parser.parse_object(args)\n")
    assert argv_parsing("mima.services.fit.program", program) == []
