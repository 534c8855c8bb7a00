"""Hostile files and broken runs (issue 14): every case of the issue driven through the `mima` command line.

Each case checks, for the command a careless or hostile user would run:
  * the exit status (2 for a user's mistake, 130 for SIGINT, 0 where the command has nothing to do);
  * one line on stderr naming the culprit (the file, the key or the option), and no traceback;
  * that nothing was written or changed: every file under the folders involved is hashed before and
    after, so a changed input, a new output or a leftover temporary file all show as a difference.
The `mima convert` cases run in one fresh interpreter that also reports each case's peak resident
memory (VmHWM, reset between cases through /proc/self/clear_refs) against a valid conversion's.

The case numbers (1-7) are those of the issue's "Why"; ids name each case.
"""

from __future__ import annotations

import collections
import contextlib
import io
import json
import os
import pickle
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import textwrap
import time
import zipfile
from pathlib import Path

import pytest
import torch
import yaml

from mima.cli import main
from mima.core.safetensors_io import load_state_dict, save_state_dict
from tests.helpers import (FailingReplace, STRIPES, assert_one_line, cli, copy_run, custom_task_fit_config, cut_jpeg_scan,
                           damaged_task, first_half, fit_argv, fit_config, garbage_png, merge_argv, poisoned, temporaries, tree,
                           unchanged)

REPOSITORY = Path(__file__).resolve().parents[2]
MiB = 1 << 20
MEMORY_BOUND = 300 * MiB  # a hostile convert may peak at most this far above a valid one


# (the shared checks, `cli`, `assert_one_line`, `unchanged`, `temporaries`: tests/helpers.py)
# (the merge inputs are shared: the `encoders` fixture in tests/conftest.py, `merge_argv` and `poisoned` in tests/helpers.py)


# ============================================================= 1. mima convert: crafted checkpoints
class _Storage:
    """A storage record of a torch zip checkpoint: entry data/<key>, `numel` float32 elements."""

    def __init__(self, key: str, numel: int) -> None:
        self.key, self.numel = key, numel


class _Tensor:
    """A tensor as torch.save pickles it: torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...)."""

    def __init__(self, storage: _Storage, offset: int, size: tuple, stride: tuple) -> None:
        self.args = (storage, offset, size, stride, False, collections.OrderedDict())

    def __reduce__(self):
        return torch._utils._rebuild_tensor_v2, self.args


class _TorchPickler(pickle.Pickler):
    """Writes storages as torch.save does: a persistent id ('storage', torch.FloatStorage, key, 'cpu', numel)."""

    def persistent_id(self, obj):
        if isinstance(obj, _Storage):
            return ("storage", torch.FloatStorage, obj.key, "cpu", obj.numel)
        return None


class _RunsCode:
    """A pickle that calls os.system when loaded (GLOBAL posix.system + REDUCE)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _pickled(obj) -> bytes:
    buffer = io.BytesIO()
    _TorchPickler(buffer, protocol=2).dump(obj)
    return buffer.getvalue()


def _zero_stream(size: int):
    chunk = bytes(MiB)
    for _ in range(size // MiB):
        yield chunk


def torch_zip(path: Path, obj, storages: dict[str, bytes], deflated_zeros: dict[str, tuple[bytes, int]] | None = None) -> Path:
    """A torch zip checkpoint: archive/data.pkl (the pickle of `obj`), archive/data/<key> (stored, as
    torch.save writes them) and, for `deflated_zeros` {entry: (head, zero bytes)}, compressed entries
    of `head` followed by that many zero bytes (a zip bomb: a few hundred KB on disk)."""
    deflated_zeros = deflated_zeros or {}
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("archive/version", "3\n")
        archive.writestr("archive/byteorder", "little")
        if "archive/data.pkl" not in deflated_zeros:
            archive.writestr("archive/data.pkl", _pickled(obj))
        for key, data in storages.items():
            archive.writestr(f"archive/data/{key}", data)
        for name, (head, zeros) in deflated_zeros.items():
            info = zipfile.ZipInfo(name)
            info.compress_type = zipfile.ZIP_DEFLATED
            with archive.open(info, "w", force_zip64=True) as entry:
                entry.write(head)
                for chunk in _zero_stream(zeros):
                    entry.write(chunk)
    return path


def _state(tensor) -> dict:
    return {"state_dict": collections.OrderedDict([("model.visual.w", tensor)])}


FLOATS = struct.pack("<16f", *range(16))  # the valid storage: 16 float32 values 0..15
BOMB = 384 * MiB  # what the bombs inflate to: past any budget, and far past MEMORY_BOUND


def _craft(case: str, folder: Path) -> tuple[Path, list[str]]:
    """Write case `case`'s checkpoint into `folder`; return it and the fragments its error must hold."""
    source = folder / "model.pt"
    if case == "floor-valid":
        torch_zip(source, _state(_Tensor(_Storage("0", 16), 0, (4, 4), (4, 1))), {"0": FLOATS})
        return source, []
    if case == "1a-storage-too-small":  # a 4-element storage read as 1000 elements
        torch_zip(source, _state(_Tensor(_Storage("0", 4), 0, (1000,), (1,))), {"0": FLOATS[:16]})
        return source, ["needs 1000 elements of its storage, which holds 4"]
    if case == "1a-storage-entry-cut-short":  # the record says 16 floats, the archive holds 10 bytes
        torch_zip(source, _state(_Tensor(_Storage("0", 16), 0, (16,), (1,))), {"0": FLOATS[:10]})
        return source, ["storage 0", "archive/data/0", "10 bytes", "its record says 64"]
    if case == "1b-huge-storage-offset":  # ~1 KB on disk; the view starts 4 GiB into a 16-byte storage
        torch_zip(source, _state(_Tensor(_Storage("0", 4), 2**30, (4,), (1,))), {"0": FLOATS[:16]})
        return source, [f"needs {2**30 + 4} elements of its storage, which holds 4"]
    if case == "1b-huge-storage-record":  # the record claims 4 GiB, the entry holds 16 bytes
        torch_zip(source, _state(_Tensor(_Storage("0", 2**30), 0, (4,), (1,))), {"0": FLOATS[:16]})
        return source, ["storage 0", "its record says 4294967296"]
    if case == "1b-zero-stride-view":  # 2**28 elements repeating a 4-element storage: 1 GiB once contiguous
        torch_zip(source, _state(_Tensor(_Storage("0", 4), 0, (2**28,), (0,))), {"0": FLOATS[:16]})
        return source, [f"has {2**28} elements but its storage holds 4"]
    if case == "1b-many-views-of-one-storage":  # valid: 64 tensors viewing slices of one 8 MiB storage
        numel, views = 2 * MiB, 64
        step = numel // views
        tensors = {f"model.visual.w{i}": _Tensor(_Storage("0", numel), i * step, (step,), (1,)) for i in range(views)}
        torch_zip(source, {"state_dict": collections.OrderedDict(tensors)},
                  {"0": torch.arange(numel, dtype=torch.float32).numpy().tobytes()})
        return source, []
    if case == "1c-compressed-storage-bomb":  # a consistent record; the entry is deflated zeros
        numel = BOMB // 4
        torch_zip(source, _state(_Tensor(_Storage("0", numel), 0, (numel,), (1,))), {},
                  deflated_zeros={"archive/data/0": (b"", BOMB)})
        return source, ["archive/data/0", "compressed"]
    if case == "1c-compressed-pickle-bomb":  # a valid pickle, then zeros: data.pkl inflates to 384 MiB
        head = _pickled(_state(_Tensor(_Storage("0", 16), 0, (16,), (1,))))
        torch_zip(source, None, {"0": FLOATS}, deflated_zeros={"archive/data.pkl": (head, BOMB)})
        return source, ["archive/data.pkl", "inflates to", "budget"]
    if case == "1-pickle-runs-os-system":
        marker = folder / "code-ran"
        torch_zip(source, {"state_dict": {"model.visual.w": _Tensor(_Storage("0", 16), 0, (16,), (1,))},
                           "payload": _RunsCode(marker)}, {"0": FLOATS})
        return source, ["refused", "system", "nothing from the file was run"]
    raise ValueError(case)


CONVERT_CASES = ["1a-storage-too-small", "1a-storage-entry-cut-short", "1b-huge-storage-offset", "1b-huge-storage-record",
                 "1b-zero-stride-view", "1c-compressed-storage-bomb", "1c-compressed-pickle-bomb", "1-pickle-runs-os-system"]

# Runs `mima convert` once per case in this one fresh interpreter: stderr of each case to its own
# file, the peak resident memory of each case (VmHWM, reset before each) and its exit status.
CONVERT_DRIVER = textwrap.dedent("""
    import gc, json, os, sys, traceback
    from mima.cli import main

    def peak_kib():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1])

    cases, results = json.load(open(sys.argv[1])), {}
    for case in cases:
        gc.collect()
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")  # the high-water mark restarts from the current resident size
        sys.stderr.flush()
        saved, err = os.dup(2), os.open(case["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(err, 2)
        try:
            code = main(case["argv"])
        except BaseException:
            traceback.print_exc()
            code = "exception"
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(err)
        results[case["id"]] = {"code": code, "peak_kib": peak_kib()}
    json.dump(results, open(sys.argv[2], "w"))
""")


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[str, dict]:
    """Every convert case (after the valid one that sets the memory floor) in one fresh interpreter;
    per case: its folder, the expected fragments, the folder's files before and after, the outcome."""
    root = tmp_path_factory.mktemp("convert")
    cases, crafted = [], {}
    for case in ["floor-valid", *CONVERT_CASES, "1b-many-views-of-one-storage"]:
        folder = root / case
        folder.mkdir()
        source, fragments = _craft(case, folder)
        cases.append({"id": case, "argv": ["convert", str(source), str(folder / "out.safetensors")],
                      "stderr": str(root / f"{case}.stderr")})
        crafted[case] = {"folder": folder, "source": source, "fragments": fragments, "before": tree(folder)}
    (root / "cases.json").write_text(json.dumps(cases))
    # glibc returns every freed block of 128 KiB or more to the system at once, so that memory freed by
    # one case cannot be handed out again to a later one without showing in that one's peak
    environment = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}
    subprocess.run([sys.executable, "-c", CONVERT_DRIVER, str(root / "cases.json"), str(root / "results.json")],
                   cwd=REPOSITORY, env=environment, check=True, timeout=300)
    results = json.loads((root / "results.json").read_text())
    for case, entry in crafted.items():
        entry.update(results[case], err=(root / f"{case}.stderr").read_text(), after=tree(entry["folder"]))
    return crafted


def test_1_the_crafting_is_faithful_and_the_valid_checkpoint_converts(converted):
    """The hand-made archive is one torch itself loads; mima converts it to the same 16 values."""
    valid = converted["floor-valid"]
    assert valid["code"] == 0, valid["err"]
    by_torch = torch.load(valid["source"], weights_only=True)["state_dict"]["model.visual.w"]
    expected = torch.arange(16, dtype=torch.float32).reshape(4, 4)
    assert torch.equal(by_torch, expected)
    assert torch.equal(load_state_dict(valid["folder"] / "out.safetensors")["w"], expected)


@pytest.mark.parametrize("case", CONVERT_CASES)
def test_1_convert_refuses_crafted_checkpoints_without_memory_or_code(converted, case):
    entry, floor = converted[case], converted["floor-valid"]
    assert_one_line(entry["code"], entry["err"], str(entry["source"]), *entry["fragments"])
    assert entry["after"] == entry["before"]  # no output, no temporary file, no marker of code run
    assert not (entry["folder"] / "code-ran").exists()
    peak_above_floor = (entry["peak_kib"] - floor["peak_kib"]) * 1024
    assert peak_above_floor < MEMORY_BOUND, f"{case}: peak {peak_above_floor / MiB:.0f} MiB above a valid convert"
    if case.startswith("1b"):
        assert entry["source"].stat().st_size < 2048  # the ~1 KB file of the issue


def test_1_tensors_viewing_one_storage_read_it_once(converted):
    """64 tensors over slices of one 8 MiB storage: the storage is read once (as torch.load does), not
    once per tensor (64 x 8 MiB), and each tensor gets its own slice."""
    entry, floor = converted["1b-many-views-of-one-storage"], converted["floor-valid"]
    assert entry["code"] == 0 and "Traceback" not in entry["err"], entry["err"]
    out = load_state_dict(entry["folder"] / "out.safetensors")
    values = torch.arange(2 * MiB, dtype=torch.float32)
    assert len(out) == 64 and all(torch.equal(out[f"w{i}"], values[i * 32768:(i + 1) * 32768]) for i in range(64))
    assert (entry["peak_kib"] - floor["peak_kib"]) * 1024 < MEMORY_BOUND


# 2. mima merge: crafted safetensors headers: tests/core/test_tensor_files.py (the reader against the safetensors
# library, every header of the issue)


# =================================================================== 3. outputs never alias inputs
@pytest.mark.parametrize("alias", ["3-output-is-a-model", "3-output-is-the-base", "3-output-is-a-symlink-to-a-model",
                                   "3-output-is-a-hard-link-to-a-model", "3-output-is-a-model-of-the-run"])
def test_3_merge_never_replaces_an_input_even_with_overwrite(encoders, finished_run, tmp_path, capfd, alias):
    models = ("m1", "m2")
    if alias == "3-output-is-a-model":
        output = encoders["m1"]
    elif alias == "3-output-is-the-base":
        output = encoders["base"]
    elif alias == "3-output-is-a-symlink-to-a-model":
        output = tmp_path / "link.safetensors"
        output.symlink_to(encoders["m2"])
    elif alias == "3-output-is-a-hard-link-to-a-model":
        output = tmp_path / "hard.safetensors"
        os.link(encoders["m2"], output)
    else:  # a run folder's final task model, through the run folder
        run = copy_run(finished_run, tmp_path / "run")
        models, output = (run,), run / "final" / "mirror.safetensors"
    with unchanged(tmp_path, encoders["base"].parent):
        result = cli(merge_argv("task_arithmetic", encoders, output, "--overwrite", models=models,
                                base=alias != "3-output-is-a-model-of-the-run"), capfd)
    # a run's own file: refused as such first (mima.core.run_outputs), before the inputs are compared
    said = "would write over final/ of the run folder" if alias == "3-output-is-a-model-of-the-run" else "is the input"
    assert_one_line(result.code, result.err, f"--output {output}: {said}")


# os.replace calls of a merge with results: the three files written into the staging folder, the publish
# journal, three files moved aside and three placed
MERGE_RENAMES = 3 + 1 + 3 + 3


def _set_of(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.mark.parametrize("rename", range(1, MERGE_RENAMES + 1))
def test_3_merge_with_results_replaces_model_and_results_as_one_set(finished_run, tmp_path, capfd, monkeypatch, rename):
    """`mima merge --overwrite` on a run folder: the merged model, OUTPUT.results.json and .md are one
    set (issue 41, item 2). A rename that fails (EBUSY) at any of the six steps of placing it (three
    files moved aside, three placed), or at any rename before it (the staged files, the journal), leaves
    the earlier merge's three files as they were."""
    output = tmp_path / "out" / "merged.safetensors"
    first = cli(["merge", "--method", "task_arithmetic", "--lam", "0.3", "--models", finished_run, "--output", output], capfd)
    assert first.code == 0, first.err
    earlier = _set_of(output.parent)
    assert sorted(earlier) == ["merged.safetensors", "merged.safetensors.results.json", "merged.safetensors.results.md"]
    replace = FailingReplace(rename)
    monkeypatch.setattr(os, "replace", replace)
    failed = cli(["merge", "--method", "task_arithmetic", "--lam", "0.6", "--models", finished_run, "--output", output,
                  "--overwrite"], capfd)
    replace.calls, replace.fail_at = 0, 0  # the same renames again, none failing: counted
    assert failed.code != 0 and len(failed.err.strip().splitlines()) == 1, failed.err
    named = failed.err.split("error: ", 1)[1].split(":", 1)[0]  # the one path the line names: the user's
    assert Path(named) in (output.parent, output, *(output.with_name(output.name + f".results.{kind}") for kind in ("json", "md")))
    assert sorted(p.name for p in output.parent.iterdir()) == sorted(earlier)  # no staging folder or journal left
    assert _set_of(output.parent) == earlier
    again = cli(["merge", "--method", "task_arithmetic", "--lam", "0.6", "--models", finished_run, "--output", output,
                 "--overwrite"], capfd)
    monkeypatch.undo()
    assert again.code == 0, again.err
    replaced = _set_of(output.parent)
    assert set(replaced) == set(earlier) and all(replaced[name] != earlier[name] for name in earlier)
    assert json.loads(replaced["merged.safetensors.results.json"])["hparams"]["lam"] == 0.6
    assert replace.calls == MERGE_RENAMES  # every rename of the publish was among those failed above


def test_3_a_staged_set_left_by_a_killed_merge_is_removed_by_the_next_merge(finished_run, tmp_path, capfd):
    output = tmp_path / "out" / "merged.safetensors"
    stale = output.parent / ".merged.safetensors.999999999.x1y2.tmp"  # no process has that pid (above pid_max)
    (stale / "half").mkdir(parents=True)
    (stale / "merged.safetensors").write_bytes(b"half written")
    done = cli(["merge", "--method", "task_arithmetic", "--lam", "0.3", "--models", finished_run, "--output", output], capfd)
    assert done.code == 0, done.err
    assert not stale.exists() and f"removed {stale}" in done.err
    assert sorted(p.name for p in output.parent.iterdir()) == [
        "merged.safetensors", "merged.safetensors.results.json", "merged.safetensors.results.md"]


def test_3_convert_never_replaces_its_source(converted, tmp_path, capfd):
    source = tmp_path / "model.pt"
    shutil.copy(converted["floor-valid"]["source"], source)
    with unchanged(tmp_path):
        result = cli(["convert", source, source, "--overwrite"], capfd)
    assert_one_line(result.code, result.err, f"--output {source}: is the input")


# ---------------------------------------------------------------------- runs of `mima fit`
@pytest.fixture(scope="module")
def kept_run(tmp_path_factory, small_clip) -> Path:
    """One finished run that kept its checkpoints: states at process steps 2, 4 and 6."""
    run = tmp_path_factory.mktemp("fit") / "run"
    assert main(fit_argv(small_clip, run, keep_checkpoints="true")) == 0
    states = sorted((run / "checkpoints" / "ranks" / "rank-00000").glob("*.ckpt"))
    assert [p.name for p in states] == ["phase-0000-step-00000002.ckpt", "phase-0001-step-00000004.ckpt",
                                        "phase-0001-step-00000006.ckpt"]
    return run


@pytest.fixture(scope="module")
def finished_run(kept_run, tmp_path_factory) -> Path:
    """The same run as `mima fit` leaves it by default (no checkpoints/)."""
    run = copy_run(kept_run, tmp_path_factory.mktemp("finished") / "run")
    shutil.rmtree(run / "checkpoints")
    return run


@pytest.mark.parametrize("mistake, fragments", [
    ({"model.stepz": "4"}, ["config:", "stepz"]),
    ({"model.iterations": "3"}, ["model.iterations=3 does not divide model.steps=4"]),
], ids=["3-overwrite-with-a-misspelt-key", "3-overwrite-with-a-bad-value"])
def test_3_fit_overwrite_with_a_config_mistake_keeps_the_old_run(finished_run, small_clip, tmp_path, capfd, mistake, fragments):
    run = copy_run(finished_run, tmp_path / "run")
    with unchanged(tmp_path):
        result = cli(fit_argv(small_clip, run, overwrite="true", **mistake), capfd)
    assert_one_line(result.code, result.err, *fragments)


# ========================================================================================= 4. resume
@pytest.mark.parametrize("damage", ["4-truncated-newest-state", "4-garbage-newest-state"])
def test_4_a_damaged_newest_state_falls_back_to_the_previous_one(kept_run, small_clip, tmp_path, capfd, damage):
    """The run was stopped before its end (no final/ yet) and its newest state is damaged: the resume
    names the skipped file, starts from the state before it, and ends with the uninterrupted run's models."""
    run = copy_run(kept_run, tmp_path / "run")
    shutil.rmtree(run / "final")
    newest = run / "checkpoints" / "ranks" / "rank-00000" / "phase-0001-step-00000006.ckpt"
    data = newest.read_bytes()
    newest.write_bytes(data[: len(data) // 2] if damage == "4-truncated-newest-state" else os.urandom(len(data)))
    result = cli(fit_argv(small_clip, run, ckpt_path="last"), capfd)
    assert result.code == 0, result.err
    assert "Traceback" not in result.out + result.err
    lines = result.out.splitlines()
    skipped = next(i for i, line in enumerate(lines) if line.startswith(f"mima fit: skipping {newest} (unreadable"))
    assert re.match(r"mima fit: resuming from the state of phase \d at process step 4 \(", lines[skipped + 1]), lines
    for task in ("rot90", "mirror"):
        resumed, uninterrupted = load_state_dict(run / "final" / f"{task}.safetensors"), load_state_dict(kept_run / "final" / f"{task}.safetensors")
        assert all(torch.equal(resumed[key], uninterrupted[key]) for key in uninterrupted), task
    assert not temporaries(run)


def test_4_resuming_a_finished_run_says_so_and_changes_nothing(finished_run, small_clip, tmp_path, capfd):
    run = copy_run(finished_run, tmp_path / "run")
    with unchanged(tmp_path):
        result = cli(fit_argv(small_clip, run, ckpt_path="last"), capfd)
    assert result.code == 0 and "Traceback" not in result.err, result.err
    assert f"mima fit: {run} has finished (final/ holds every task model); nothing to resume" in result.out


def test_4_ckpt_path_of_another_run_is_refused(kept_run, small_clip, tmp_path, capfd):
    other = copy_run(kept_run, tmp_path / "other")
    with unchanged(tmp_path):
        result = cli(fit_argv(small_clip, tmp_path / "new", ckpt_path=str(other)), capfd)
    assert_one_line(result.code, result.err, f"--ckpt_path {other}: a run resumes in its own folder")


# ============================================================================ 5. one line, not a traceback
@contextlib.contextmanager
def read_only_folder():
    """A world-readable staging folder with a read-only `out/` inside. Root writes anywhere, so as root
    the block runs with the effective user id of `nobody` (taken back afterwards)."""
    staging = Path(tempfile.mkdtemp(prefix="mima-read-only-"))
    try:
        staging.chmod(0o755)
        (staging / "out").mkdir(mode=0o555)
        (staging / "out").chmod(0o555)
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@contextlib.contextmanager
def as_unprivileged():
    if os.geteuid() != 0:
        yield
        return
    os.seteuid(65534)  # nobody: folder permissions apply again
    try:
        yield
    finally:
        os.seteuid(0)


@pytest.mark.parametrize("command", ["5-merge-into-a-read-only-folder", "5-convert-into-a-read-only-folder"])
def test_5_a_read_only_output_folder_is_one_line(encoders, converted, capfd, command):
    with read_only_folder() as staging:
        if command.startswith("5-merge"):
            inputs = {name: shutil.copy(path, staging / path.name) for name, path in encoders.items()}
            argv = merge_argv("task_arithmetic", {k: Path(v) for k, v in inputs.items()}, staging / "out" / "m.safetensors")
        else:
            source = Path(shutil.copy(converted["floor-valid"]["source"], staging / "model.pt"))
            argv = ["convert", source, staging / "out" / "m.safetensors"]
        for path in staging.iterdir():
            if path.is_file():
                path.chmod(0o644)
        with unchanged(staging), as_unprivileged():
            result = cli(argv, capfd)
        assert_one_line(result.code, result.err, str(staging / "out" / "m.safetensors"), "cannot be written")


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]], ids=["", "overwrite"])
@pytest.mark.parametrize("command", ["5-merge-output-is-a-folder", "5-convert-output-is-a-folder"])
def test_5_a_folder_as_output_is_one_line(encoders, converted, tmp_path, capfd, command, overwrite):
    folder = tmp_path / "out.safetensors"
    folder.mkdir()
    if command.startswith("5-merge"):
        argv = merge_argv("task_arithmetic", encoders, folder, *overwrite)
    else:
        argv = ["convert", converted["floor-valid"]["source"], folder, *overwrite]
    with unchanged(tmp_path, encoders["base"].parent):
        result = cli(argv, capfd)
    assert_one_line(result.code, result.err, f"{folder}: is a folder")


@pytest.mark.parametrize("argv, fragments", [
    (["merge", "cart", "--matrix-keys", "("], ["--matrix-keys must be a regular expression, got '('"]),
    (["merge", "tsv", "--matrix-keys", "[a-"], ["--matrix-keys must be a regular expression"]),
    (["analyze", "rank-sweep", "--no-accuracy", "--matrix-keys", "("], ["--matrix-keys '('", "not a regular expression"]),
    (["merge", "tall", "--mask-lam", "0.1", "0.2", "0.3"], ["mask_lam: 3 values for 2 tasks"]),
    (["merge", "consensus", "--mask-lam", "0.1", "0.2", "0.3"], ["mask_lam: 3 values for 2 tasks"]),
], ids=["5-bad-matrix-keys-regex-cart", "5-bad-matrix-keys-regex-tsv", "5-bad-matrix-keys-regex-rank-sweep",
        "5-three-mask-lam-values-for-two-models-tall", "5-three-mask-lam-values-for-two-models-consensus"])
def test_5_option_mistakes_are_one_line(encoders, tmp_path, capfd, argv, fragments):
    if argv[0] == "merge":
        full = merge_argv(argv[1], encoders, tmp_path / "out.safetensors", *argv[2:])
    else:
        full = [*argv[:2], encoders["m1"], encoders["m2"], "--base", encoders["base"], "--out", tmp_path / "out", *argv[2:]]
    with unchanged(tmp_path, encoders["base"].parent):
        result = cli(full, capfd)
    assert_one_line(result.code, result.err, *fragments)


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("method", ["uniform", "task_arithmetic", "ties", "cart", "tsv"],
                         ids=["6-uniform", "6-task-arithmetic", "6-ties", "5-cart", "5-tsv"])
def test_5_6_non_finite_weights_are_named_by_file_and_key(encoders, tmp_path, capfd, method, value):
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    path, key = poisoned(encoders, inputs, value)
    with unchanged(tmp_path, encoders["base"].parent):
        result = cli(merge_argv(method, encoders, tmp_path / "out.safetensors", models=("m1", path)), capfd)
    assert_one_line(result.code, result.err, f"{path}: tensor '{key}' holds NaN or Inf", "--allow-non-finite")


def test_6_allow_non_finite_merges_them_as_they_are(encoders, tmp_path, capfd):
    """With --allow-non-finite the uniform merge keeps the NaN where it was and averages the rest."""
    path, key = poisoned(encoders, tmp_path, float("nan"))
    out = tmp_path / "out.safetensors"
    result = cli(merge_argv("uniform", encoders, out, "--allow-non-finite", models=("m1", path), base=False), capfd)
    assert result.code == 0, result.err
    merged, first, second = load_state_dict(out), load_state_dict(encoders["m1"]), load_state_dict(path)
    flat = merged[key].view(-1)
    assert torch.isnan(flat[3]) and int(torch.isnan(merged[key]).sum()) == 1
    by_hand = [(a + b) / 2 for a, b in zip(first[key].view(-1).tolist(), second[key].view(-1).tolist())]
    assert flat[4:].tolist() == pytest.approx(by_hand[4:], abs=1e-7) and flat[:3].tolist() == pytest.approx(by_hand[:3], abs=1e-7)


@pytest.mark.parametrize("method", ["cart", "tsv", "iso_cts"])
def test_6_allow_non_finite_into_an_svd_is_still_one_line(encoders, tmp_path, capfd, method):
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    path, key = poisoned(encoders, inputs, float("nan"))
    with unchanged(tmp_path, encoders["base"].parent):
        result = cli(merge_argv(method, encoders, tmp_path / "out.safetensors", "--allow-non-finite", models=("m1", path)), capfd)
    assert_one_line(result.code, result.err, f"{method}: tensor '{key}' holds NaN or Inf values", "--allow-non-finite",
                    "its SVD cannot take them")


# --------------------------------------------------------------- run folders: damaged, or not folders
def _damage(run: Path, what: str) -> None:
    if what == "final-json":
        (run / "final" / "rot90.json").write_text("{not json")
    elif what == "final-json-list":
        (run / "final" / "rot90.json").write_text("[1, 2]")
    elif what == "config-yaml":
        (run / "config.yaml").write_text("model: [\n")
    elif what == "metrics-jsonl":
        (run / "metrics.jsonl").write_text("{bad\n")
    elif what == "binary-config-yaml":
        (run / "config.yaml").write_bytes(bytes(range(128, 256)))
    elif what == "binary-metrics-jsonl":
        (run / "metrics.jsonl").write_bytes(bytes(range(128, 256)))


RUN_FOLDER_CASES = {
    # id: (damage, argv with {run} and {out}, fragments)
    "5-evaluate-malformed-final-json": ("final-json", ["evaluate", "{run}", "--out", "{out}"], ["rot90.json: not valid JSON"]),
    "5-evaluate-final-json-a-list": ("final-json-list", ["evaluate", "{run}", "--out", "{out}"], ["rot90.json: expected a JSON object"]),
    "5-evaluate-malformed-config-yaml": ("config-yaml", ["evaluate", "{run}", "--out", "{out}"], ["config.yaml: not valid YAML"]),
    "5-report-malformed-config-yaml": ("config-yaml", ["report", "{run}", "--out", "{out}"], ["config.yaml: not valid YAML"]),
    "5-report-malformed-metrics-jsonl": ("metrics-jsonl", ["report", "{run}", "--out", "{out}"], ["metrics.jsonl: line 1 is not valid JSON"]),
    "5-analyze-cosine-malformed-metrics-jsonl": ("metrics-jsonl", ["analyze", "cosine", "{run}", "--out", "{out}"],
                                                 ["metrics.jsonl: line 1 is not valid JSON"]),
    "5-analyze-cosine-malformed-config-yaml": ("config-yaml", ["analyze", "cosine", "{run}", "--out", "{out}"],
                                               ["config.yaml: not valid YAML"]),
    "5-analyze-rank-sweep-malformed-final-json": ("final-json", ["analyze", "rank-sweep", "{run}", "--no-accuracy", "--out", "{out}"],
                                                  ["rot90.json: not valid JSON"]),
    "5-analyze-landscape-malformed-config-yaml": ("config-yaml", ["analyze", "landscape", "{run}", "--tasks", "rot90", "mirror",
                                                                  "--out", "{out}"], ["config.yaml: not valid YAML"]),
    "5-analyze-gradients-malformed-config-yaml": ("config-yaml", ["analyze", "gradients", "{run}", "--out", "{out}"],
                                                  ["config.yaml: not valid YAML"]),
    "5-evaluate-binary-config-yaml": ("binary-config-yaml", ["evaluate", "{run}", "--out", "{out}"],
                                      ["config.yaml: not valid YAML (not a text file)"]),
    "5-analyze-cosine-binary-metrics-jsonl": ("binary-metrics-jsonl", ["analyze", "cosine", "{run}", "--out", "{out}"],
                                              ["metrics.jsonl: not JSON lines (not a text file)"]),
    "5-evaluate-file-for-run-folder": (None, ["evaluate", "{run}/final/rot90.safetensors", "--out", "{out}"],
                                       ["rot90.safetensors: a file, not a run folder"]),
    "5-report-file-for-run-folder": (None, ["report", "{run}/config.yaml", "--out", "{out}"], ["config.yaml: a file, not"]),
    "5-analyze-cosine-file-for-run-folder": (None, ["analyze", "cosine", "{run}/metrics.jsonl", "--out", "{out}"],
                                             ["metrics.jsonl: ", "folder"]),
    "5-analyze-gradients-text-file-for-run-folder": (None, ["analyze", "gradients", "{run}/metrics.jsonl", "--out", "{out}"],
                                                     ["RUN ", "metrics.jsonl: not valid YAML"]),
    "5-analyze-gradients-binary-file-for-run-folder": (None, ["analyze", "gradients", "{run}/final/rot90.safetensors", "--out", "{out}"],
                                                       ["RUN ", "rot90.safetensors: not"]),
    "5-merge-binary-file-as-config": (None, ["merge", "--method", "uniform", "--models", "{run}", "--config", "{run}/pretrained.safetensors",
                                             "--output", "{out}.safetensors"], ["--config ", "pretrained.safetensors: not"]),
    "7-evaluate-missing-run-folder": (None, ["evaluate", "{run}/nonexistent", "--out", "{out}"], ["nonexistent: no such run folder"]),
    "7-analyze-gradients-missing-run-folder": (None, ["analyze", "gradients", "{run}/nonexistent", "--out", "{out}"],
                                               ["nonexistent: no such run folder"]),
    "7-analyze-landscape-without-config-leaves-no-out": (None, ["analyze", "landscape", "{run}/final/rot90.safetensors",
                                                                "{run}/final/mirror.safetensors", "--base", "{run}/pretrained.safetensors",
                                                                "--tasks", "rot90", "mirror", "--out", "{out}"], ["--config"]),
    "7-analyze-ctl-other-tasks-leaves-no-out": (None, ["analyze", "ctl", "{run}/final/rot90.safetensors", "{run}/final/mirror.safetensors",
                                                       "--config", "{run}", "--tasks", "rot90", "upsidedown", "--out", "{out}"],
                                                ["--tasks upsidedown"]),
}


@pytest.mark.parametrize("case", list(RUN_FOLDER_CASES))
def test_5_7_damaged_or_wrong_run_folders_are_one_line_and_leave_no_out(finished_run, tmp_path, capfd, case):
    damage, argv, fragments = RUN_FOLDER_CASES[case]
    run = copy_run(finished_run, tmp_path / "run")
    if damage:
        _damage(run, damage)
    out = tmp_path / "new" / "out"  # neither it nor its parent exists: a failed command creates neither
    with unchanged(tmp_path):
        result = cli([arg.format(run=run, out=out) for arg in argv], capfd)
    line = assert_one_line(result.code, result.err, *fragments)
    if argv[0] in ("evaluate", "report") or argv[1] in ("cosine", "gradients"):
        assert "--config" not in line  # these commands have no --config to blame


def test_5_analyze_landscape_into_the_run_folder_leaves_no_empty_analysis_folder(finished_run, tmp_path, capfd):
    run = copy_run(finished_run, tmp_path / "run")
    _damage(run, "config-yaml")
    with unchanged(tmp_path):
        result = cli(["analyze", "landscape", run, "--tasks", "rot90", "mirror"], capfd)
    assert_one_line(result.code, result.err, "config.yaml: not valid YAML")


# ================================================================================ 6. silent nonsense
@pytest.mark.parametrize("method, extra, models, fragments", [
    ("task_arithmetic", ["--lam", "1e308"], ("m1", "m2"), ["overflows to Inf or NaN", "--lam"]),
    ("consensus", ["--min-tasks", "3"], ("m1", "m2"), ["min_tasks (--min-tasks) must be at most the 2 models given, got 3"]),
    ("uniform", [], ("m1",), ["--models", "at least 2 task models, got 1"]),
    ("cart", ["--matrix-keys", "^nothing$"], ("m1", "m2"), ["matrix_keys (--matrix-keys) '^nothing$' matches no 2-D floating tensor"]),
    ("tsv", ["--matrix-keys", "^nothing$"], ("m1", "m2"), ["matrix_keys (--matrix-keys) '^nothing$' matches no 2-D floating tensor"]),
    ("iso_c", ["--matrix-keys", "^nothing$"], ("m1", "m2"), ["matrix_keys (--matrix-keys) '^nothing$' matches no 2-D floating tensor"]),
    ("iso_cts", ["--matrix-keys", "^nothing$"], ("m1", "m2"), ["matrix_keys (--matrix-keys) '^nothing$' matches no 2-D floating tensor"]),
    ("wudi", ["--matrix-keys", "^nothing$"], ("m1", "m2"), ["matrix_keys (--matrix-keys) '^nothing$' matches no 2-D floating tensor"]),
], ids=["6-lam-1e308", "6-min-tasks-above-models", "6-single-model", "6-matrix-keys-match-nothing-cart",
        "6-matrix-keys-match-nothing-tsv", "6-matrix-keys-match-nothing-iso-c", "6-matrix-keys-match-nothing-iso-cts",
        "6-matrix-keys-match-nothing-wudi"])
def test_6_nonsense_hyperparameters_are_errors(encoders, tmp_path, capfd, method, extra, models, fragments):
    with unchanged(tmp_path, encoders["base"].parent):
        result = cli(merge_argv(method, encoders, tmp_path / "out.safetensors", *extra, models=models,
                                base=method != "uniform"), capfd)
    assert_one_line(result.code, result.err, *fragments)


@pytest.mark.parametrize("merge", ["adamerging", "fisher", "regmean"], ids=["6-evaluate-adamerging", "6-evaluate-fisher", "6-evaluate-regmean"])
def test_6_evaluate_refuses_data_dependent_merges_at_once(finished_run, tmp_path, capfd, merge):
    run = copy_run(finished_run, tmp_path / "run")
    with unchanged(tmp_path):  # refused before anything is evaluated or written
        result = cli(["evaluate", run, "--out", tmp_path / "table", "--merges", "uniform", merge], capfd)
    assert_one_line(result.code, result.err, f"--merges: '{merge}' learns from task data", f"mima merge --method {merge}")


def test_6_evaluate_help_says_data_free(capfd):
    with pytest.raises(SystemExit) as done:
        main(["evaluate", "--help"])
    assert done.value.code == 0 and "data-free merge strategies" in " ".join(capfd.readouterr().out.split())


# ================================================================================ 7. leftovers
@pytest.fixture(scope="module")
def big_inputs(tmp_path_factory) -> dict[str, Path]:
    """theta_0 and two task models of 24 tensors of 1024 x 1024 (96 MB each): a TIES merge of them
    writes its output for about 2 s (quiet machine), long enough to be signalled while it does."""
    folder = tmp_path_factory.mktemp("big")
    generator = torch.Generator().manual_seed(0)
    base = {f"layer{i}.weight": torch.randn(1024, 1024, generator=generator) for i in range(24)}
    paths = {"base": folder / "base.safetensors"}
    save_state_dict(paths["base"], base)
    for index in (1, 2):
        paths[f"m{index}"] = folder / f"m{index}.safetensors"
        save_state_dict(paths[f"m{index}"], {k: v + 0.01 * torch.randn(v.shape, generator=generator) for k, v in base.items()})
    return paths


def _signalled_merge(big_inputs, out: Path, signum: int) -> subprocess.CompletedProcess:
    """`mima merge` in its own process, sent `signum` once its temporary output file exists."""
    command = [sys.executable, "-m", "mima", *map(str, merge_argv("ties", big_inputs, out))]
    # SIGINT at its default, as in a terminal: a job started in the background by a non-interactive shell
    # (CI scripts often are) inherits SIGINT ignored, and Python then never raises KeyboardInterrupt
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPOSITORY,
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    pattern = f".{out.name}.*.tmp"
    while not list(out.parent.glob(pattern)) and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert job.poll() is None, "the merge ended before its output was being written"
    job.send_signal(signum)
    stdout, stderr = job.communicate(timeout=120)
    return subprocess.CompletedProcess(command, job.returncode, stdout, stderr)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["7-sigterm", "7-sigint"])
def test_7_sigterm_and_sigint_leave_no_temporary_file(big_inputs, tmp_path, signum):
    with unchanged(tmp_path, big_inputs["base"].parent):
        result = _signalled_merge(big_inputs, tmp_path / "merged.safetensors", signum)
    word = "terminated" if signum == signal.SIGTERM else "interrupted"
    assert_one_line(result.returncode, result.stderr, f"mima merge: {word}", status=128 + signum)


def test_7_after_sigkill_the_next_merge_removes_the_stale_temporary_file(big_inputs, encoders, tmp_path, capfd):
    out = tmp_path / "merged.safetensors"
    result = _signalled_merge(big_inputs, out, signal.SIGKILL)
    leftovers = list(tmp_path.glob(".merged.safetensors.*.tmp"))
    assert result.returncode == -signal.SIGKILL and len(leftovers) == 1 and not out.exists()
    again = cli(merge_argv("uniform", encoders, out, base=False), capfd)  # small models, the same output
    assert again.code == 0, again.err
    assert again.err.strip() == f"mima: removed {leftovers[0]}, left by an interrupted earlier write of {out.name}"
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]
    first, second, merged = (load_state_dict(p) for p in (encoders["m1"], encoders["m2"], out))
    assert all(torch.allclose(merged[k], (first[k] + second[k]) / 2, atol=1e-7, rtol=0) for k in first)


# ==================================================== 5, 7: custom image-folder tasks (`data.custom_tasks`)
def _mima_lines(stderr: str) -> str:
    """The lines mima printed, without Lightning's banner (GPU available: ..., which `fit` prints first)."""
    assert "Traceback" not in stderr, stderr
    return "\n".join(line for line in stderr.strip().splitlines() if line.startswith(("mima", "data.custom_tasks")))


def test_7_a_custom_task_without_images_stops_fit_before_anything_is_written(tmp_path, small_clip, capfd):
    for name in ("circle", "square"):
        (tmp_path / "empty" / name).mkdir(parents=True)
    config = fit_config(tmp_path / "run", small_clip, None, steps=2, iterations=1)
    config["data"] = {"suite": None, "custom_tasks": [{"name": "empty", "path": str(tmp_path / "empty")}], "batch_size": 4}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    with unchanged(tmp_path):  # no run folder: a corrected retry is not told the folder holds a run
        result = cli(["fit", "--config", tmp_path / "c.yaml"], capfd)
    assert_one_line(result.code, result.err, "task 'empty' (train): no image files")


@pytest.mark.parametrize("damage", [garbage_png, first_half], ids=["5-garbage-png", "5-truncated-png"])
def test_5_an_unreadable_image_stops_fit_before_anything_is_written(tmp_path, small_clip, capfd, damage):
    task = damaged_task(tmp_path, per_class=4, damaged=4, suffix=".png", damage=damage)
    config = custom_task_fit_config(tmp_path, small_clip, task)
    first_bad = sorted((task / "train" / STRIPES[0]).iterdir())[0]
    with unchanged(tmp_path):
        result = cli(["fit", "--config", config], capfd)
    assert_one_line(result.code, _mima_lines(result.err), "4 of 12 image files cannot be opened",
                    f"(first: {first_bad}:", "bad_images: skip")


def test_5_too_few_readable_images_for_the_splits_stops_fit_before_anything_is_written(tmp_path, small_clip, capfd):
    task = damaged_task(tmp_path, per_class=4, damaged=3, suffix=".png", damage=first_half)
    config = custom_task_fit_config(tmp_path, small_clip, task, bad_images="skip")
    with unchanged(tmp_path):
        result = cli(["fit", "--config", config], capfd)
    lines = _mima_lines(result.err).splitlines()
    assert "leaving out 3 of 12 image files" in lines[0]  # the skip is said, then the split sizes stop it
    assert_one_line(result.code, lines[1], "9 readable training images",
                    "leave the val split empty (splits: train 9, val 0, test 6)")


@pytest.mark.parametrize("workers", [0, 1], ids=["5-decode-fails-in-process", "5-decode-fails-in-a-worker"])
def test_5_an_image_that_fails_to_decode_mid_training_is_one_line_naming_it(tmp_path, small_clip, capfd, workers):
    # a JPEG cut inside its scan data passes PIL's verify (it checks no JPEG data) and fails only when decoded
    task = damaged_task(tmp_path, per_class=4, damaged=4, suffix=".jpg", damage=cut_jpeg_scan)
    result = cli(["fit", "--config", custom_task_fit_config(tmp_path, small_clip, task, workers=workers)], capfd)
    assert_one_line(result.code, _mima_lines(result.err), f"{task / 'train' / STRIPES[0]}", "not a readable image")
