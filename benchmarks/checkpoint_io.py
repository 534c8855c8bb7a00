"""What checkpointing costs: bytes written and wall time of one `mima fit`, against a floor.

Runs the demo config (configs/demo.yaml: T = 4 tasks, S = 320) at N = 8 with W = 1 and W = 2
processes, each with `--checkpoint_every segment` (the default), `phase`, and 0 (never), and
reports for each run:
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
  * wall time of the whole command (start-up included, the same in every setting), median of the
    repeats, the settings alternating, and the ratio to the same W without checkpoints.
Processes are started as torchrun would start them (TORCHELASTIC_* variables), so each one's own
counters are read; nothing of mima is mocked.

    python benchmarks/checkpoint_io.py [--iterations 8] [--devices 1 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
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
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if devices > 1:
            env.update(TORCHELASTIC_RUN_ID="checkpoint-io", RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0",
                       ROLE_RANK=str(rank), WORLD_SIZE=str(devices), LOCAL_WORLD_SIZE=str(devices),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        processes.append(subprocess.Popen([sys.executable, "-c", WRAPPER, str(report), *args], cwd=REPO, env=env,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        reports.append(report)
    for process in processes:
        _, stderr = process.communicate()
        if process.returncode:
            raise SystemExit(f"mima fit failed:\n{stderr[-3000:]}")
    results = [json.loads(report.read_text()) for report in reports]
    return {"bytes": sum(r["wchar"] for r in results), "seconds": max(r["seconds"] for r in results)}


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
    options = parser.parse_args()
    settings = ("segment", "phase", "0")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        run_fit(root / "warm-up", 1, options.iterations, "0", options.optimizer_state)  # caches the embedded model
        print(f"configs/demo.yaml, N = {options.iterations}, optimizer_state {options.optimizer_state}; "
              f"{options.repeats} repeats, settings alternating")
        for devices in options.devices:
            runs: dict[str, list[dict]] = {every: [] for every in settings}
            for repeat in range(options.repeats):
                for every in settings:
                    out = root / f"w{devices}-{every}-{repeat}"
                    runs[every].append(run_fit(out, devices, options.iterations, every, options.optimizer_state))
            floor = floor_bytes(root / f"w{devices}-segment-0", 4, options.iterations, options.optimizer_state)
            baseline = statistics.median(r["seconds"] for r in runs["0"])
            print(f"\nW = {devices}: floor {floor['floor'] / 1e6:.2f} MB = " + " + ".join(
                f"{name} {value / 1e6:.2f}" for name, value in floor.items() if name != "floor"))
            print(f"{'checkpoint_every':>17} {'written MB':>11} {'/ floor':>8} {'wall s':>8} {'/ off':>7}")
            for every in settings:
                written = statistics.median(r["bytes"] for r in runs[every])
                seconds = statistics.median(r["seconds"] for r in runs[every])
                print(f"{every:>17} {written / 1e6:>11.2f} {written / floor['floor']:>8.2f} {seconds:>8.1f} "
                      f"{seconds / baseline:>7.3f}")


if __name__ == "__main__":
    main()
