"""Issue 26 (items 2, 6, 9): outputs are never replaced silently, inputs that change under a merge are one
line, and a crafted module tree is one line.

- Two `mima merge` to one new --output at the same moment: one writes it, the other is refused, and the
  file is the winner's, whole (the no-replace check and the final rename are one atomic step).
- A merge input truncated and rewritten while a merge reads it: a clean one-line error or a finished
  merge, never a signal death (the reader does not map files), and no temporary file left.
- `mima convert` of a pickled module whose children nest 1000 deep, or contain themselves: one line.
"""

from __future__ import annotations

import io
import os
import pickle
import subprocess
import sys
import textwrap
import types
import zipfile
from pathlib import Path

import pytest

from tests.helpers import run_command
import torch

from mima.cli import main
from mima.core.errors import MimaError
from mima.core.files import atomic_path
from mima.core.publish import atomic_folder
from mima.core.safetensors_io import save_state_dict
from mima.core.tensor_files import SafetensorsReader

REPOSITORY = Path(__file__).resolve().parents[2]


def _one_line(code: int, err: str, *fragments: str) -> str:
    assert code == 2, err
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1, err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


# ============================================================== no-replace: the check and the rename at once
def test_atomic_path_without_overwrite_refuses_a_file_that_appeared_during_the_write(tmp_path):
    """The refusal before the work is not enough: a file created meanwhile (by another command) is not
    replaced, the write is refused and its temporary file removed."""
    target = tmp_path / "out.bin"
    with pytest.raises(MimaError, match="already exists"):
        with atomic_path(target, overwrite=False) as tmp:
            tmp.write_bytes(b"mine")
            target.write_bytes(b"theirs")  # another writer, between the early check and the rename
    assert target.read_bytes() == b"theirs"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.bin"]


def test_atomic_folder_places_all_or_nothing_and_keeps_earlier_outputs_on_failure(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("earlier")
    with pytest.raises(RuntimeError):
        with atomic_folder(out, ["a.txt"]) as staging:
            (staging / "a.txt").write_text("half")
            raise RuntimeError("the command failed")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    # a file of the set that appeared meanwhile: nothing of the set is placed
    with pytest.raises(MimaError, match="already holds b.txt"):
        with atomic_folder(out, ["a.txt", "b.txt"]) as staging:
            (staging / "a.txt").write_text("new a")
            (staging / "b.txt").write_text("new b")
            (out / "b.txt").write_text("theirs")
    assert sorted(p.name for p in out.iterdir()) == ["b.txt", "keep.txt"] and (out / "b.txt").read_text() == "theirs"
    with atomic_folder(out, ["a.txt", "sub/c.txt"]) as staging:
        (staging / "a.txt").write_text("new a")
        (staging / "sub").mkdir()
        (staging / "sub" / "c.txt").write_text("c")
    assert (out / "a.txt").read_text() == "new a" and (out / "sub" / "c.txt").read_text() == "c"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


RACE_DRIVER = textwrap.dedent("""
    import json, os, sys, time
    from pathlib import Path
    from mima.cli import main
    side, folder, rounds = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    argv = json.loads(sys.argv[4])
    codes = []
    for index in range(rounds):
        (folder / f"ready-{index}-{side}").touch()
        other = folder / f"ready-{index}-{'b' if side == 'a' else 'a'}"
        while not other.exists():  # both start each round's merge at the same moment
            time.sleep(0.0005)
        codes.append(main([a.replace("ROUND", str(index)) for a in argv]))
    (folder / f"codes-{side}.json").write_text(json.dumps(codes))
""")


def test_two_merges_to_one_output_one_wins_and_its_file_is_intact_20_times(tmp_path):
    """Two processes merge different inputs to the same --output (no --overwrite) at the same moment,
    20 rounds: every round exactly one exits 0, the other is refused in one line, and the output is the
    winner's merge byte for byte (on the old code both could exit 0, the later rename replacing the file)."""
    generator = torch.Generator().manual_seed(0)
    inputs = {}
    for name in ("a1", "a2", "b1", "b2"):
        inputs[name] = tmp_path / f"{name}.safetensors"
        save_state_dict(inputs[name], {f"w{i}": torch.randn(64, 64, generator=generator) for i in range(4)})
    argv = {side: ["merge", "--method", "uniform", "--models", str(inputs[f"{side}1"]), str(inputs[f"{side}2"]),
                   "--output", str(tmp_path / "out" / "merged-ROUND.safetensors")] for side in "ab"}
    # what each side writes when alone
    reference = {}
    for side in "ab":
        alone = tmp_path / f"alone-{side}.safetensors"
        assert main([a.replace(str(tmp_path / "out" / "merged-ROUND.safetensors"), str(alone)) for a in argv[side]]) == 0
        reference[side] = alone.read_bytes()
    assert reference["a"] != reference["b"]
    (tmp_path / "out").mkdir()
    rounds = 20
    import json

    jobs = {side: subprocess.Popen([sys.executable, "-c", RACE_DRIVER, side, str(tmp_path), str(rounds), json.dumps(argv[side])],
                                   cwd=REPOSITORY, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for side in "ab"}
    outputs = {side: job.communicate(timeout=600) for side, job in jobs.items()}
    for side, job in jobs.items():
        assert job.returncode == 0, outputs[side][1][-3000:]
    codes = {side: json.loads((tmp_path / f"codes-{side}.json").read_text()) for side in "ab"}
    for index in range(rounds):
        pair = (codes["a"][index], codes["b"][index])
        assert sorted(pair) == [0, 2], f"round {index}: exit codes {pair}"
        winner = "a" if pair[0] == 0 else "b"
        assert (tmp_path / "out" / f"merged-{index}.safetensors").read_bytes() == reference[winner], f"round {index}"
    refusals = [line for side in "ab" for line in outputs[side][1].splitlines() if line.strip()]
    assert len(refusals) == rounds and all("merged-" in line and "already exists" in line for line in refusals), refusals
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(f"merged-{i}.safetensors" for i in range(rounds))


# ======================================================================= a merge input changing under a merge
def test_a_file_truncated_and_rewritten_after_opening_is_one_line_not_new_bytes(tmp_path):
    """Truncated and written again in place (same size, other bytes): the reader notices the change
    instead of handing out bytes of another file (the old reader mapped the file and read them)."""
    path = tmp_path / "x.safetensors"
    save_state_dict(path, {"first": torch.ones(4096), "second": torch.ones(4096)})
    data = path.read_bytes()
    with SafetensorsReader(path) as reader:
        assert torch.equal(reader["first"], torch.ones(4096))
        os.truncate(path, 0)
        with open(path, "r+b") as stream:  # the same inode, the same size, other values
            stream.write(data.replace(torch.ones(4096).numpy().tobytes(), torch.zeros(4096).numpy().tobytes()))
        os.utime(path, ns=(0, 12345))  # a coarse clock could give the same time; the test must not depend on it
        with pytest.raises(MimaError, match="changed while being read"):
            reader["second"]


REWRITER = textwrap.dedent("""
    import os, sys, time
    path, stop = sys.argv[1], sys.argv[2]
    data = open(path, "rb").read()
    cut = len(data) - int(sys.argv[3])
    while not os.path.exists(stop):
        os.truncate(path, cut)
        with open(path, "r+b") as stream:
            stream.seek(cut)
            stream.write(data[cut:])
        time.sleep(0.0005)
""")


@pytest.mark.slow
def test_a_merge_input_truncated_and_rewritten_during_the_merge_is_never_a_signal(tmp_path):
    """Another process cuts the last four tensors off an input and writes them back, over and over,
    while `mima merge` reads it: the merge ends with a one-line error naming the file (or, if it read between two rewrites,
    a finished merge), never by SIGBUS (exit 135 / -7 on the old, mapping reader), and leaves no
    temporary file."""
    generator = torch.Generator().manual_seed(1)
    models = []
    for index in (1, 2):
        models.append(tmp_path / f"m{index}.safetensors")
        save_state_dict(models[-1], {f"layer{i}": torch.randn(1024, 1024, generator=generator) for i in range(16)})
    out = tmp_path / "out" / "merged.safetensors"
    out.parent.mkdir()
    rewriter = subprocess.Popen([sys.executable, "-c", REWRITER, str(models[1]), str(tmp_path / "stop"), str(4 * 4 * 2**20)])
    try:
        outcomes = []
        for _ in range(4):
            result = run_command(["merge", "--method", "uniform", "--models", *models, "--output", out, "--overwrite"],
                                 timeout=300)
            assert result.returncode in (0, 2), f"exit {result.returncode}: {result.stderr[-2000:]}"
            if result.returncode == 2:
                line = _one_line(result.returncode, result.stderr, str(models[1]))
                assert "while being read" in line or "truncated" in line, line  # mid-read, or cut when opened
            outcomes.append(result.returncode)
            assert not list(out.parent.glob(".merged*")), "a temporary file was left"
    finally:
        (tmp_path / "stop").touch()
        rewriter.wait(timeout=60)
    assert 2 in outcomes, "the input never changed under a merge: the test did not test anything"


# ========================================================================== convert: crafted module trees
CRAFTED_MODULE = "torch.nn.mima_crafted"  # a namespace the converter reads as a stand-in module class


def _crafted_checkpoint(path: Path, root: object) -> Path:
    buffer = io.BytesIO()
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 50_000))  # the pickler itself recurses through the tree
    try:
        pickle.Pickler(buffer, protocol=2).dump(root)
    finally:
        sys.setrecursionlimit(limit)
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("archive/version", "3\n")
        archive.writestr("archive/data.pkl", buffer.getvalue())
    return path


@pytest.fixture
def module_class():
    """A class that pickles as torch.nn.mima_crafted.Node (the unpickler gives it a stand-in)."""
    module = types.ModuleType(CRAFTED_MODULE)

    class Node:
        def __init__(self) -> None:
            self._parameters, self._buffers, self._modules = {}, {}, {}

    Node.__module__, Node.__qualname__ = CRAFTED_MODULE, "Node"
    module.Node = Node
    sys.modules[CRAFTED_MODULE] = module
    yield Node
    del sys.modules[CRAFTED_MODULE]


@pytest.mark.parametrize("shape", ["deep", "cycle", "deep-cycle"])
def test_convert_of_a_deep_or_cyclic_module_tree_is_one_line(tmp_path, module_class, capfd, shape):
    root = module_class()
    node = root
    depth = 1000 if shape != "cycle" else 1
    for _ in range(depth):
        child = module_class()
        node._modules["child"] = child
        node = child
    if shape != "deep":
        node._modules["back"] = root  # a module that contains its ancestor
    source = _crafted_checkpoint(tmp_path / "model.pt", root)
    code = main(["convert", str(source), str(tmp_path / "out.safetensors")])
    err = capfd.readouterr().err
    expected = "modules nest deeper than" if shape != "cycle" else "contains itself"
    _one_line(code, err, str(source), expected)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt"]


def test_convert_walks_a_shallow_crafted_tree_in_state_dict_order(tmp_path, module_class, capfd):
    """The iterative walk gives the keys torch's recursive state_dict gives, in its order; a child shared
    by two parents (not a cycle) is listed under both names, as torch lists it."""
    root, left, right, shared = (module_class() for _ in range(4))
    root._parameters["w"] = torch.zeros(1)
    root._modules.update(left=left, right=right)
    left._parameters["w"] = torch.ones(1)
    left._modules["shared"] = shared
    right._modules["shared"] = shared
    shared._buffers["b"] = torch.full((1,), 2.0)
    reference = torch.nn.Module()
    reference.register_parameter("w", torch.nn.Parameter(torch.zeros(1)))
    reference.left, reference.right = torch.nn.Module(), torch.nn.Module()
    reference.left.register_parameter("w", torch.nn.Parameter(torch.ones(1)))
    reference.left.shared = reference.right.shared = torch.nn.Module()
    reference.left.shared.register_buffer("b", torch.full((1,), 2.0))
    from mima.convert.pickle_reader import module_state_dict

    assert list(module_state_dict(root)) == list(reference.state_dict()) == ["w", "left.w", "left.shared.b", "right.shared.b"]


# ======================================================================= a write that the disk refuses
@pytest.mark.parametrize("limit", [4096, 200_000])
def test_a_merge_the_disk_refuses_is_one_line_and_leaves_nothing(tmp_path, limit):
    generator = torch.Generator().manual_seed(0)
    models = []
    for index in range(2):
        models.append(tmp_path / f"m{index}.safetensors")
        save_state_dict(models[-1], {f"w{i}": torch.randn(128, 128, generator=generator) for i in range(4)})  # 256 KB
    output = tmp_path / "out" / "merged.safetensors"
    result = run_command(["merge", "--method", "uniform", "--models", *models, "--output", output], file_size_limit=limit)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-3000:]
    assert "File too large" in lines[0] and "ulimit -f" in lines[0]
    leftovers = sorted(p.name for p in (tmp_path / "out").glob("*")) if (tmp_path / "out").exists() else []
    assert leftovers == []  # no output and no temporary file
