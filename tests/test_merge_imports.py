"""mima.merging depends only on mima.core and itself: no pools, data, models, training, evaluation,
lightning or open_clip (strategies see a task pool only through duck typing)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

MERGING = Path(__file__).resolve().parents[1] / "mima" / "merging"
FORBIDDEN_THIRD_PARTY = ("open_clip", "lightning", "pytorch_lightning", "torchvision", "torchmetrics")


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path.name}: relative import"
            names.append(node.module)
    return names


def test_merging_modules_import_only_core_and_merging():
    files = sorted(MERGING.glob("*.py"))
    assert len(files) > 10
    for path in files:
        for name in _imports(path):
            if name == "mima" or name.startswith("mima."):
                assert name.startswith(("mima.core.", "mima.merging")) or name == "mima.core", f"{path.name} imports {name}"
            assert name.split(".")[0] not in FORBIDDEN_THIRD_PARTY, f"{path.name} imports {name}"


def test_importing_every_strategy_loads_no_model_or_data_stack():
    code = (
        "import sys, mima.merging, mima.merging.engine, mima.merging.selection; "
        "assert len(mima.merging.MERGE_METHODS) > 20; "  # the package's names load every strategy
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('open_clip', 'lightning', 'torchvision') "
        "or m.startswith(('mima.pools', 'mima.data', 'mima.models', 'mima.training', 'mima.evaluation'))); "
        "print(','.join(bad))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == ""
