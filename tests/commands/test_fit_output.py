"""What `mima fit` prints (issue 40, item 7): its own lines, not Lightning's banners; plain progress
lines when the output is not a terminal, one per task segment; a last summary that says where the
run is and how each task ended; a note on a warm-up longer than its span; a "did you mean" for a
mistyped option. The numbers on the lines are compared with the run's own files."""

from __future__ import annotations

import csv
import json
import re
from types import SimpleNamespace

import yaml

from mima.core.plan import PhasePlan
from mima.training.progress import MimaLogLines
from tests.helpers import TWO, assert_one_line, cli, fit_config

LIGHTNING_NOTES = ("GPU available", "TPU available", "HPU available", "Tip:", "litlogger", "Initializing distributed",
                   "distributed_backend", "All distributed processes registered", "Total FLOPs", "Trainable params",
                   "`Trainer.fit` stopped", "max_epochs=1")
STEPS, ITERATIONS = 8, 2  # K = 4


def _config(tmp_path, small_clip, **model) -> tuple:
    out = tmp_path / "run"
    config = fit_config(out, small_clip, TWO, STEPS, ITERATIONS, **model)
    for key in ("enable_progress_bar", "enable_model_summary", "logger"):  # mima fit's defaults
        del config["trainer"][key]
    path = tmp_path / "fit.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, out


def test_fit_prints_its_own_lines_one_per_segment_and_a_summary_of_the_run(tmp_path, small_clip, capfd):
    path, out = _config(tmp_path, small_clip)
    result = cli(["fit", "--config", path], capfd)
    assert result.code == 0, result.err
    printed = result.out + result.err
    assert not [note for note in LIGHTNING_NOTES if note in printed], printed
    assert "\r" not in printed and "\x1b" not in printed  # no redrawn bar in a file or a pipe

    # one line per task segment, in plan order (one process: every task, K = S / N steps each)
    lines = re.findall(r"mima fit: phase (\d+)/(\d+), (\w+) (\d+)/(\d+) steps; process step (\d+)/(\d+) \(\d+ %\), "
                       r"loss (\S+), [\d.]+ steps/s", result.out)
    k = STEPS // ITERATIONS
    expected = [(str(phase), str(ITERATIONS), task, str(k), str(k), str((phase - 1) * len(TWO) * k + (slot + 1) * k),
                 str(STEPS * len(TWO))) for phase in range(1, ITERATIONS + 1) for slot, task in enumerate(TWO)]
    assert [line[:7] for line in lines] == expected, result.out
    # the loss shown is the segment's last step's, as the run's CSV log holds it
    with (out / "logs" / "metrics.csv").open() as stream:
        logged = {int(row["step"]): row for row in csv.DictReader(stream)}
    for line in lines:
        step, task = int(line[5]) - 1, line[2]
        assert line[7] == f"{float(logged[step][f'train/loss/{task}']):.4g}"

    summary = result.out[result.out.index("mima fit: finished in"):]
    assert f"the run is in {out}" in summary
    assert f"final/: {', '.join(f'{task}.safetensors' for task in TWO)}" in summary
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["phase"] == ITERATIONS
    assert f"mean loss over phase {ITERATIONS}: " + ", ".join(f"{t} {last['loss'][t]:.4g}" for t in TWO) in summary
    assert f"mima merge --method ties --models {out}" in summary


def test_a_warm_up_longer_than_the_run_is_said_in_one_note_by_fit_and_plan(tmp_path, small_clip, capfd):
    path, out = _config(tmp_path, small_clip, warmup_steps=3 * STEPS)
    note = f"note: model.warmup_steps={3 * STEPS} is longer than model.steps (S, the shortest task's) = {STEPS} steps"
    planned = cli(["plan", "--config", path], capfd)
    assert planned.code == 0 and planned.out.count(note) == 1, planned.out
    fitted = cli(["fit", "--config", path], capfd)
    assert fitted.code == 0 and fitted.out.count(note) == 1, fitted.out
    # within its span: no note
    path.write_text(yaml.safe_dump({**yaml.safe_load(path.read_text()), "model": {
        **yaml.safe_load(path.read_text())["model"], "warmup_steps": STEPS}}))
    assert "warmup_steps" not in cli(["plan", "--config", path], capfd).out


def test_a_mistyped_fit_option_is_one_line_with_the_nearest_option(tmp_path, small_clip, capfd):
    path, out = _config(tmp_path, small_clip)
    result = cli(["fit", "--config", path, "--modle.iterations", "4"], capfd)
    assert_one_line(result.code, result.err, "--modle.iterations", "did you mean --model.iterations?")
    assert not out.exists()
    far = cli(["fit", "--config", path, "--zzzzzz", "4"], capfd)
    assert_one_line(far.code, far.err, "--zzzzzz")
    assert "did you mean" not in far.err


def test_log_lines_come_at_segment_ends_and_at_most_once_per_interval_between():
    """A clock that moves 10 s per step, an interval of 25 s, one process with two tasks of K = 4."""
    plan = PhasePlan(tasks=("a", "b"), local_tasks=(0, 1), total_steps=8, iterations=2)
    now = [0.0]
    printed: list[str] = []
    stream = SimpleNamespace(write=printed.append, flush=lambda: None)
    bar = MimaLogLines(interval_s=25.0, clock=lambda: now[0], stream=stream)
    trainer = SimpleNamespace(global_step=0, estimated_stepping_batches=plan.local_steps)
    module = SimpleNamespace(plan=plan)
    bar.on_train_start(trainer, module)
    for step in range(1, plan.local_steps + 1):
        now[0] += 10.0
        trainer.global_step = step
        bar.on_train_batch_end(trainer, module, None, None, step - 1)
        bar.on_train_batch_end(trainer, module, None, None, step - 1)  # a second batch of one step: no line
    steps = [int(m) for m in re.findall(r"process step (\d+)/", "".join(printed))]
    # segment ends at 4, 8, 12, 16; in between a line once 25 s have passed since the last one (step 3:
    # 30 s after the start; 7: 30 s after step 4; ...)
    assert steps == [3, 4, 7, 8, 11, 12, 15, 16]
    assert "process step 16/16 (100 %)" in printed[-2] and "0.1 steps/s" in printed[-2]
