"""How close `mima plan` comes to what `mima fit` then does: bytes written, peak host memory, peak disk.

For each W asked for, runs `mima plan --json` and then the same `mima fit` (processes started as
torchrun starts them, so each one measures itself) and compares:
  * bytes written into the run folder, measured from the operating system's side: every process
    records, through a Python audit hook, the size of each file at the moment it is renamed or linked
    into place (every atomic write of mima: checkpoints, final/, metrics.jsonl, config.yaml, ...) and,
    at exit, the size of every file it opened for writing and did not rename (logs written in place),
    less what an earlier rename of the same file already counted. Files outside the run folder (the
    embedded model's cache, the heads' cache) are left out, as is socket traffic;
  * peak host memory: each process's peak RSS (getrusage ru_maxrss) against the plan's host memory
    per process (the largest process);
  * peak disk: the run folder polled every 20 ms (benchmarks/checkpoint_io.py's poller).

    python benchmarks/plan_accuracy.py [--config configs/demo.yaml] [--devices 1 2 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
import tempfile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkpoint_io import DiskPoller, free_port, process_environment  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

# One `mima fit` process that records the files it writes and its peak RSS (see the module docstring).
WRAPPER = r"""
import json, os, resource, sys
run_dir = os.path.abspath(sys.argv[2])
renamed, opened = {}, set()
def hook(event, args):
    if event in ("os.rename", "os.link"):
        target = os.path.abspath(os.fsdecode(args[1]))
        if target.startswith(run_dir + os.sep):
            try:
                renamed.setdefault(target, []).append(os.stat(args[0]).st_size)
            except OSError:
                pass
    elif event == "open" and isinstance(args[0], (str, bytes)):
        path, mode, flags = os.path.abspath(os.fsdecode(args[0])), args[1], args[2]
        writes = any(c in mode for c in "wax+") if isinstance(mode, str) else bool(flags & (os.O_WRONLY | os.O_RDWR))
        if writes and path.startswith(run_dir + os.sep) and not os.path.basename(path).startswith("."):
            opened.add(path)
sys.addaudithook(hook)
from mima.cli import main
code = main(sys.argv[3:])
written = sum(sum(sizes) for sizes in renamed.values())
for path in opened:
    if os.path.isfile(path):  # written in place: its growth after the last rename (if any)
        written += max(0, os.path.getsize(path) - (renamed.get(path) or [0])[-1])
json.dump({"code": code, "bytes": written, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024},
          open(sys.argv[1], "w"))
"""


def plan(config: Path, devices: int, checkpoint_every: str) -> dict:
    command = [sys.executable, "-m", "mima", "plan", "--config", str(config), "--trainer.devices", str(devices),
               "--checkpoint_every", checkpoint_every, "--json"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"mima plan failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout)


def fit(config: Path, devices: int, checkpoint_every: str, out: Path) -> dict:
    args = ["fit", "--config", str(config), "--out", str(out), "--trainer.devices", str(devices),
            "--trainer.enable_progress_bar", "false", "--checkpoint_every", checkpoint_every]
    port, processes, reports = free_port(), [], []
    for rank in range(devices):
        report = out.with_name(f"{out.name}-rank{rank}.json")
        env = process_environment(rank, devices, port, "plan-accuracy")
        processes.append(subprocess.Popen([sys.executable, "-c", WRAPPER, str(report), str(out), *args], cwd=REPO,
                                          env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        reports.append(report)
    poller = DiskPoller(out)
    poller.start()
    try:
        for process in processes:
            _, stderr = process.communicate()
            if process.returncode:
                raise SystemExit(f"mima fit failed:\n{stderr[-3000:]}")
    finally:
        poller.stop()
    results = [json.loads(report.read_text()) for report in reports]
    return {"bytes": sum(r["bytes"] for r in results), "peak_rss": max(r["peak_rss"] for r in results),
            "peak_disk": poller.peaks()["peak_disk"]}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "demo.yaml")
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--checkpoint-every", default="segment")
    parser.add_argument("--json", type=Path, help="also write the table as JSON here")
    options = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="plan-accuracy-") as scratch:
        for devices in options.devices:
            predicted = plan(options.config.resolve(), devices, options.checkpoint_every)
            measured = fit(options.config.resolve(), devices, options.checkpoint_every, Path(scratch) / f"w{devices}")
            rows.append({"devices": devices, "predicted_bytes": predicted["bytes_written"], "measured_bytes": measured["bytes"],
                         "predicted_host": predicted["host_memory_per_process"], "measured_peak_rss": measured["peak_rss"],
                         "predicted_peak_disk": predicted["peak_disk_bytes"], "measured_peak_disk": measured["peak_disk"]})
    print(f"{options.config.name}, checkpoint_every {options.checkpoint_every}")
    print("| W | bytes written: plan | measured | plan / measured | host memory: plan | peak RSS | plan / measured "
          "| peak disk: plan | polled | plan / polled |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        print(f"| {row['devices']} | {row['predicted_bytes'] / 1e6:.3f} MB | {row['measured_bytes'] / 1e6:.3f} MB | "
              f"{row['predicted_bytes'] / row['measured_bytes']:.4f} | {row['predicted_host'] / 2**20:.0f} MiB | "
              f"{row['measured_peak_rss'] / 2**20:.0f} MiB | {row['predicted_host'] / row['measured_peak_rss']:.3f} | "
              f"{row['predicted_peak_disk'] / 1e6:.2f} MB | {row['measured_peak_disk'] / 1e6:.2f} MB | "
              f"{row['predicted_peak_disk'] / max(1, row['measured_peak_disk']):.2f} |")
    if options.json:
        options.json.write_text(json.dumps(rows, indent=1))
    return {"rows": rows}


if __name__ == "__main__":
    main()
