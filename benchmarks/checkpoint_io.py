"""What checkpointing costs: bytes written, wall time, stall and disk use of one `mima fit`, against a floor.

Runs the demo config (configs/demo.yaml: T = 4 tasks, S = 320) at N = 8 with W = 1 and W = 2
processes, each with every `--checkpoint_every` setting asked for (default: `segment`, `phase`,
`2 phases`, a wall-clock interval `30s` and 0 = never), and reports for each run:
  * bytes written: every process's `wchar` from /proc/self/io at exit (all bytes handed to write()
    and its relatives: checkpoints, the run folder's files, logs), summed over processes;
  * the floor: what a run that survives a crash at any segment end cannot avoid writing, computed
    from sizes independently of mima's checkpoint code:
        each task's end weights once per phase       T * N * E   (the last phase's are final/)
      + the phase averages that later phases start from (N - 1) * E
      + with optimizer_state keep, each task's AdamW moments at its segment ends of the phases that
        have a later one: T * (N - 1) * M   (M = 2 x the trainable parameters' bytes)
      + the rest of the run-folder contract (pretrained.safetensors, config.yaml, metrics.jsonl,
        final/*.json, logs) as found on disk after the run
    where E is the size of pretrained.safetensors;
  * the stall: seconds the training threads spent in checkpoint code (saving, waiting for the
    writer, tidying), the largest over processes, as `mima fit` prints it at the end;
  * disk use, polled every 20 ms while the run goes on: the peak bytes under checkpoints/, the peak
    bytes of kept moments and the most generations (phases) of one task's moments seen at once,
    with how long any task had more than one (a new generation is written before the old goes);
  * wall time of the whole command (start-up included, the same in every setting), median of the
    repeats, the settings alternating, and the ratio to the same W without checkpoints.
Processes are started as torchrun would start them (TORCHELASTIC_* variables), so each one's own
counters are read; nothing of mima is mocked.

    python benchmarks/checkpoint_io.py [--iterations 8] [--devices 1 2] [--repeats 3]
                                       [--settings segment "2 phases" 30s 0]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "demo.yaml"

# Runs one `mima fit` process and records its write counters and wall time.
WRAPPER = """
import json, sys, time
started = time.monotonic()
from mima.cli import main
code = main(sys.argv[2:])
io = dict(line.split(": ") for line in open("/proc/self/io").read().splitlines())
json.dump({"code": code, "wchar": int(io["wchar"]), "seconds": time.monotonic() - started}, open(sys.argv[1], "w"))
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def process_environment(rank: int, devices: int, port: int, run_id: str) -> dict[str, str]:
    """The environment of process `rank` of a `mima fit` on `devices` processes, as torchrun sets it."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if devices > 1:
        env.update(TORCHELASTIC_RUN_ID=run_id, RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0",
                   ROLE_RANK=str(rank), WORLD_SIZE=str(devices), LOCAL_WORLD_SIZE=str(devices),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return env


def run_fit(out: Path, devices: int, iterations: int, every: str, optimizer_state: str) -> dict:
    """One `mima fit` with `devices` processes; returns the summed bytes, the slowest process's
    wall time and the run folder."""
    args = ["fit", "--config", str(CONFIG), "--out", str(out), "--model.iterations", str(iterations),
            "--model.optimizer_state", optimizer_state, "--trainer.devices", str(devices),
            "--trainer.enable_progress_bar", "false", "--checkpoint_every", every]
    port = free_port()
    processes, reports = [], []
    for rank in range(devices):
        report = out.with_name(f"{out.name}-rank{rank}.json")
        env = process_environment(rank, devices, port, "checkpoint-io")
        processes.append(subprocess.Popen([sys.executable, "-c", WRAPPER, str(report), *args], cwd=REPO, env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        reports.append(report)
    poller = DiskPoller(out / "checkpoints")
    poller.start()
    stall = float("nan")
    try:
        for rank, process in enumerate(processes):
            stdout, stderr = process.communicate()
            if process.returncode:
                raise SystemExit(f"mima fit failed:\n{stderr[-3000:]}")
            if rank == 0:
                stall = printed_stall(stdout)
    finally:
        poller.stop()
    results = [json.loads(report.read_text()) for report in reports]
    return {"bytes": sum(r["wchar"] for r in results), "seconds": max(r["seconds"] for r in results),
            "stall": stall, **poller.peaks()}


STALL = re.compile(r"checkpoints held up training for ([0-9.]+) s")


def printed_stall(stdout: str) -> float:
    """The stall `mima fit` prints at the end (nan where it printed none: no checkpoints)."""
    found = STALL.search(stdout)
    return float(found.group(1)) if found else float("nan")


class DiskPoller(threading.Thread):
    """Polls a checkpoints folder: peak total bytes, peak moments bytes, most generations of one task."""

    MOMENTS = re.compile(r"^phase-(\d+)$")

    def __init__(self, folder: Path, every_s: float = 0.02) -> None:
        super().__init__(daemon=True)
        self.folder, self.every_s = folder, every_s
        self.done = threading.Event()
        self.peak_bytes = self.peak_moments = self.most_generations = 0
        self.seconds_with_two = 0.0
        self.most_now = 0

    def run(self) -> None:
        while not self.done.is_set():
            started = time.monotonic()
            self.poll()
            self.done.wait(self.every_s)
            if self.most_now > 1:
                self.seconds_with_two += time.monotonic() - started

    def poll(self) -> None:
        total, moments, generations = 0, 0, {}
        try:
            paths = list(self.folder.rglob("*"))
        except OSError:  # a folder removed while we walked it: look again next time
            return
        for path in paths:
            try:
                size = path.stat().st_size if path.is_file() else 0
            except OSError:  # removed while we looked
                continue
            total += size
            phase = self.MOMENTS.match(path.parent.name)
            if phase and path.parent.parent.name == "moments" and path.suffix == ".safetensors":
                moments += size
                generations.setdefault(path.stem, set()).add(int(phase.group(1)))
        self.most_now = max((len(phases) for phases in generations.values()), default=0)
        self.peak_bytes = max(self.peak_bytes, total)
        self.peak_moments = max(self.peak_moments, moments)
        self.most_generations = max(self.most_generations, self.most_now)

    def stop(self) -> None:
        self.done.set()
        self.join()

    def peaks(self) -> dict:
        return {"peak_disk": self.peak_bytes, "peak_moments": self.peak_moments,
                "generations": self.most_generations, "two_s": self.seconds_with_two}


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def floor_bytes(run: Path, tasks: int, iterations: int, optimizer_state: str) -> dict[str, int]:
    from mima.core.safetensors_io import load_state_dict
    from mima.models.clip import load_clip

    encoder_file = run / "pretrained.safetensors"
    encoder = encoder_file.stat().st_size
    trainable = sum(p.numel() * p.element_size() for p in load_clip("embedded:tiny-digits", None).encoder.parameters())
    assert set(load_state_dict(encoder_file))  # the file is a readable state dict
    contract = encoder + sum(p.stat().st_size for p in (run / "final").glob("*.json"))
    contract += sum(p.stat().st_size for p in (run / "config.yaml", run / "metrics.jsonl") if p.exists())
    contract += folder_bytes(run / "logs") if (run / "logs").exists() else 0
    parts = {
        "segment ends": tasks * iterations * encoder,
        "averages": (iterations - 1) * encoder,
        "moments": tasks * (iterations - 1) * 2 * trainable if optimizer_state == "keep" else 0,
        "contract": contract,
    }
    parts["floor"] = sum(parts.values())
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--optimizer-state", choices=("keep", "reset"), default="keep")
    parser.add_argument("--settings", nargs="+", default=["segment", "phase", "2 phases", "30s", "0"],
                        help="--checkpoint_every values to compare (keep 0: the ratios are to it)")
    options = parser.parse_args()
    settings = options.settings
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        run_fit(root / "warm-up", 1, options.iterations, "0", options.optimizer_state)  # caches the embedded model
        print(f"configs/demo.yaml, N = {options.iterations}, optimizer_state {options.optimizer_state}; "
              f"{options.repeats} repeats, settings alternating")
        for devices in options.devices:
            runs: dict[str, list[dict]] = {every: [] for every in settings}
            for repeat in range(options.repeats):
                for every in settings:
                    out = root / f"w{devices}-{every.replace(' ', '_')}-{repeat}"
                    runs[every].append(run_fit(out, devices, options.iterations, every, options.optimizer_state))
                    print(json.dumps({"devices": devices, "every": every, **runs[every][-1]}), flush=True)
            floor = floor_bytes(root / f"w{devices}-{settings[0].replace(' ', '_')}-0", 4, options.iterations,
                                options.optimizer_state)
            baseline = statistics.median(r["seconds"] for r in runs["0"]) if "0" in runs else float("nan")
            print(f"\nW = {devices}: floor {floor['floor'] / 1e6:.2f} MB = " + " + ".join(
                f"{name} {value / 1e6:.2f}" for name, value in floor.items() if name != "floor"))
            print(f"{'checkpoint_every':>17} {'written MB':>11} {'/ floor':>8} {'wall s':>8} {'/ off':>7} {'stall s':>8} "
                  f"{'peak disk MB':>13} {'peak moments MB':>16} {'generations':>12} {'>1 gen s':>9}")
            for every in settings:
                def median(key: str) -> float:
                    return statistics.median(r[key] for r in runs[every])
                print(f"{every:>17} {median('bytes') / 1e6:>11.2f} {median('bytes') / floor['floor']:>8.2f} "
                      f"{median('seconds'):>8.1f} {median('seconds') / baseline:>7.3f} {median('stall'):>8.2f} "
                      f"{max(r['peak_disk'] for r in runs[every]) / 1e6:>13.2f} "
                      f"{max(r['peak_moments'] for r in runs[every]) / 1e6:>16.2f} "
                      f"{max(r['generations'] for r in runs[every]):>12} {median('two_s'):>9.2f}")


if __name__ == "__main__":
    main()
