"""--checkpoint_every's forms, where each saves, resuming from them, and the kept moments on disk.

Jobs run as real `mima fit` processes (tests/distributed/test_distributed.py's helpers); the expected save steps
and moment generations are computed here from the MIMA schedule itself (tasks one after another,
K steps each, every phase), not from mima.core.plan.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from mima.core.errors import MimaError
from mima.training.save_schedule import SaveSchedule
from tests.helpers import FOUR, STEPS, TWO, assert_identical, finals, run_job, write_config


PHASES = 6  # K = STEPS / PHASES = 4: enough syncs for "2 phases" to save at some and skip others
K = STEPS // PHASES
SIX = {"iterations": PHASES}


@pytest.mark.parametrize("value, expected", [
    ("segment", ("segment", 0)), (None, ("segment", 0)), ("phase", ("phases", 1)), ("1 phase", ("phases", 1)),
    ("2 phases", ("phases", 2)), ("3phases", ("phases", 3)), ("12", ("steps", 12)), (7, ("steps", 7)),
    ("0", ("never", 0)), (0, ("never", 0)), ("90s", ("seconds", 90)), ("30min", ("seconds", 1800)),
    ("2h", ("seconds", 7200)), ("1.5h", ("seconds", 5400)), ("45 sec", ("seconds", 45)),
])
def test_every_accepted_form(value, expected):
    schedule = SaveSchedule.parse(value)
    assert (schedule.kind, schedule.amount) == expected


@pytest.mark.parametrize("value", ["weekly", "-3", "0 phases", "-2 phases", "2 weeks", "0s", "phases", "10 ms", "1e3s"])
def test_a_bad_value_is_one_line_naming_the_option_and_the_forms(value):
    with pytest.raises(MimaError) as error:
        SaveSchedule.parse(value)
    message = str(error.value)
    assert "\n" not in message and message.startswith("--checkpoint_every must be")
    for form in ("'segment'", "'phase'", "a number of steps", "'K phases'", "90s, 30min or 2h", "0 (never)"):
        assert form in message
    assert repr(value) in message


def sync_steps(tasks_of_process: int, phases: int = PHASES, k: int = K) -> list[int]:
    """The process steps (global_step after the step) at which each phase's sync has just run."""
    return [(phase + 1) * tasks_of_process * k for phase in range(phases)]


def state_writes(out: Path, rank: int) -> list[str]:
    return (out / f".state-writes-{rank}").read_text().split()


@pytest.mark.slow
def test_two_phases_saves_exactly_at_every_second_sync(tmp_path, small_clip, reference):
    """Three processes on four tasks: rank 0 owns two tasks (a phase is 2K of its steps), ranks 1 and 2 one
    each (K steps); each saves right after the syncs ending phases 2 and 4 (1-based), not after the last.
    The run also ends with the one-process run's task models (W = 3 does not divide T = 4), each sync
    records the three processes' waits, and a finished run keeps only the run-folder contract."""
    out = tmp_path / "run"
    config = write_config(tmp_path / "run.yaml", small_clip, FOUR, 3, [("RecordStateWrites", {})], model=SIX)
    result = run_job(config, out, "--checkpoint_every", "2 phases")
    assert result.returncode == 0, result.stderr[-3000:]
    for rank, tasks in ((0, 2), (1, 1), (2, 1)):
        syncs = sync_steps(tasks)
        expected = [f"phase-{phase + 1:04d}-step-{syncs[phase]:08d}.ckpt" for phase in range(PHASES - 1) if (phase + 1) % 2 == 0]
        assert state_writes(out, rank) == expected, rank
    assert expected == ["phase-0002-step-00000008.ckpt", "phase-0004-step-00000016.ckpt"]  # rank 2, by hand
    assert_identical(finals(out, FOUR), reference(1, FOUR, SIX))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == PHASES and all(len(r["wait_s"]) == 3 and min(r["wait_s"]) >= 0 for r in records)
    assert not (out / "checkpoints").exists()


@pytest.mark.slow
def test_a_time_interval_saves_at_the_same_syncs_on_every_process(tmp_path, small_clip, reference):
    """A wall-clock interval is decided by process 0 at the syncs: both processes save at the same syncs
    (which ones depends on the machine's speed) and nowhere else; an interval that never passes saves nothing.
    Each step sleeps 0.04 s, so the 40 steps before the last sync take at least 1.6 s and the 0.5 s interval
    passes at one sync or more however fast the machine (CI's once finished every sync within 0.5 s)."""
    out = tmp_path / "run"
    callbacks = [("RecordStateWrites", {}), ("SleepEachStep", {"seconds": 0.04})]
    config = write_config(tmp_path / "run.yaml", small_clip, FOUR, 2, callbacks, model=SIX)
    result = run_job(config, out, "--checkpoint_every", "0.5s")
    assert result.returncode == 0, result.stderr[-3000:]
    syncs = sync_steps(2)
    saved = [state_writes(out, rank) for rank in (0, 1)]
    assert saved[0] == saved[1] and saved[0]  # the same states (both ranks own two tasks: same steps)
    for name in saved[0]:
        step = int(name.split("step-")[1][:8])
        assert step in syncs[:-1] and name.startswith(f"phase-{syncs.index(step) + 1:04d}-")
    assert_identical(finals(out, FOUR), reference(1, FOUR, SIX))
    never = tmp_path / "never"  # one process: the interval is process 0's decision at any W
    one = write_config(tmp_path / "one.yaml", small_clip, FOUR, 1, [("RecordStateWrites", {})], model=SIX)
    assert run_job(one, never, "--checkpoint_every", "2h").returncode == 0
    assert (never / "final").is_dir() and not (never / ".state-writes-0").exists()


@pytest.mark.slow
def test_sigkill_twice_and_resume_with_two_phases_is_bit_identical(tmp_path, small_clip, reference):
    """Two processes with two tasks each (a phase is 8 of their steps): saves at steps 16 and 32 only. A
    kill in phase 4 resumes from step 16; that resumed run killed again in phase 5 resumes from step 32;
    the run ends as the uninterrupted one, each phase logged once."""
    out = tmp_path / "run"
    for kill_step, resumed_from in ((28, None), (36, 16), (None, 32)):
        callbacks = [("KillAtStep", {"step": kill_step})] if kill_step else []
        options = ("--ckpt_path", "last") if resumed_from else ()
        config = write_config(tmp_path / f"kill{kill_step}.yaml", small_clip, FOUR, 2, callbacks, model=SIX)
        for marker in out.glob(".settled-*"):  # KillAtStep's "my saves are on disk" files of the last kill
            marker.unlink()
        result = run_job(config, out, "--checkpoint_every", "2 phases", *options)
        assert result.returncode == (-signal.SIGKILL if kill_step else 0), result.stderr[-3000:]
        if resumed_from:
            assert f"at process step {resumed_from} of all 2 processes (" in result.stdout, result.stdout[-2000:]
    assert_identical(finals(out, FOUR), reference(1, FOUR, SIX))
    phases = [json.loads(line)["phase"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert phases == list(range(1, PHASES + 1))


def expected_generations(step: int, tasks: list[str], phases: int = PHASES, k: int = K) -> dict[str, int]:
    """The moments generation (phase) of each task of one process that owns `tasks`, as saved by the
    segment-end saves made before the step boundary `step`: a task's segment of phase p ends at process
    step (p * len(tasks) + slot + 1) * k and is saved there; the last phase has no moments to keep."""
    newest: dict[str, int] = {}
    for phase in range(phases - 1):
        for slot, task in enumerate(tasks):
            if (phase * len(tasks) + slot + 1) * k < step:
                newest[task] = phase
    return newest


def test_only_the_newest_generation_of_moments_stays_on_disk(tmp_path, small_clip, reference):
    """One process, two tasks, six phases, segment-end saves: after each save is on disk and tidied, each
    task has exactly one moments file, of the generation its newest segment end made."""
    out = tmp_path / "run"
    config = write_config(tmp_path / "run.yaml", small_clip, TWO, 1, [("RecordMomentsOnDisk", {})], model=SIX)
    result = run_job(config, out, "--keep_checkpoints", "true")
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (out / ".moments-on-disk").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, len(TWO) * STEPS + 1))  # every step boundary
    for record in records:
        wanted = expected_generations(record["step"], TWO)
        assert record["moments"] == sorted(f"phase-{phase:04d}/{task}.safetensors" for task, phase in wanted.items()), record
    assert records[-1]["moments"] == [f"phase-{PHASES - 2:04d}/{task}.safetensors" for task in sorted(TWO)]
    kept = sorted(str(p.relative_to(out / "checkpoints" / "moments")) for p in (out / "checkpoints" / "moments").rglob("*.safetensors"))
    assert kept == records[-1]["moments"]  # and so the run ends
    assert_identical(finals(out, TWO), reference(1, TWO, SIX))
