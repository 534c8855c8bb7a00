"""What several test files share, as plain functions and values (the fixtures are in tests/conftest.py;
no test file imports another test file or the conftest: tests/architecture/test_architecture.py checks
it): the small CLIP and a quick run's config, jobs in this process or in processes of their own, bounds
on work (calls, bytes read), merge inputs in memory and as files, the fault injection that `mima fit`
subprocesses load by class path (`tests.helpers.KillAtStep`), and a file size limit for any subprocess.

The distributed tests start each job in its own process group, so killing the group kills every
process of the job at once, as a node failure or `scancel` would.
"""

from __future__ import annotations

import contextlib
import csv
import functools
import hashlib
import importlib.util
import io
import json
import errno
import os
import resource
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import open_clip
import torch
import yaml
from lightning.pytorch.callbacks import Callback
from PIL import Image
from torch import nn
from torch.func import functional_call

from mima.core.safetensors_io import load_state_dict, save_state_dict
from mima.core.subsets import first_examples
from mima.data import clip_text
from mima.data.clip_tasks import SUN397_FOLDERS

REPO = Path(__file__).resolve().parents[1]


# ============================================================================ bounds on work, not on time
class WorkBoundExceeded(AssertionError):
    """The code under test did more work than the test allows."""


@contextlib.contextmanager
def calls_at_most(limit: int):
    """Fail, at once and without finishing the work, when the block makes more than `limit` Python
    function calls (this thread): a bound on work that a loaded machine cannot miss, as it can a time bound."""
    calls = 0

    def count(frame, event, arg) -> None:
        nonlocal calls
        if event == "call":
            calls += 1
            if calls > limit:
                raise WorkBoundExceeded(f"more than {limit} Python function calls")

    with contextlib.ExitStack() as restore:
        restore.callback(sys.setprofile, sys.getprofile())  # the profiler before this block, whatever ends it
        sys.setprofile(count)
        yield


def bytes_read() -> int:
    """The bytes this process has read so far through read system calls, files and pipes alike (Linux:
    rchar of /proc/self/io)."""
    with open("/proc/self/io") as counters:
        return next(int(line.split()[1]) for line in counters if line.startswith("rchar:"))


@contextlib.contextmanager
def reads_at_most(limit: int):
    """Fail when the process reads more than `limit` bytes during the block (reading /proc/self/io itself
    costs a few hundred)."""
    before = bytes_read()
    yield
    read = bytes_read() - before
    if read > limit:
        raise WorkBoundExceeded(f"read {read} bytes, more than {limit}")


# ============================================================= the small CLIP and a quick run's config
# A small CLIP with the digits suite's 16x16 input. The text tower keeps open_clip's BPE vocabulary
# (so the real tokenizer works) but is otherwise tiny.
SMALL_CLIP_CFG = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 16, "patch_size": 4, "width": 32, "layers": 2, "head_width": 16, "mlp_ratio": 2},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
}


def save_local_dir_clip(folder: Path, cfg: dict, seed: int) -> Path:
    """Write an open_clip model folder (open_clip_config.json + open_clip_model.safetensors)."""
    torch.manual_seed(seed)
    model = open_clip.CLIP(**cfg)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "open_clip_config.json").write_text(json.dumps({"model_cfg": cfg, "preprocess_cfg": {}}))
    save_state_dict(folder / "open_clip_model.safetensors", model.state_dict())
    return folder


# The same text tower with a timm image tower that has BatchNorm (running statistics are buffers).
BATCHNORM_CLIP_CFG = {
    "embed_dim": 32,
    "vision_cfg": {"timm_model_name": "resnet10t", "timm_model_pretrained": False,
                   "timm_pool": "avg", "timm_proj": "linear", "image_size": 16},
    "text_cfg": SMALL_CLIP_CFG["text_cfg"],
}


def fit_config(out: Path, clip: str, tasks: list[str], steps: int, iterations: int, **model) -> dict:
    """A `mima fit` config dict for quick CPU runs of the small CLIP on digits tasks."""
    return {
        "seed_everything": 0,
        "model": {"clip": clip, "steps": steps, "iterations": iterations, "lr": 1e-3, "warmup_steps": 2, **model},
        "data": {"suite": "digits", "tasks": tasks, "batch_size": 16, "seed": 3},
        "trainer": {
            "accelerator": "cpu",
            "devices": 1,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "logger": False,
        },
        "out": str(out),
    }


# ====================================================== benchmarks/study.py on tiny grids
STUDY_TASKS = ("rot90", "mirror")  # the tiny studies' task family: two digits tasks


def load_study():
    """benchmarks/study.py as a module (benchmarks/ is no package; loading it puts benchmarks/ on
    sys.path, so its study_claims and study_gap import as it does)."""
    spec = importlib.util.spec_from_file_location("study", REPO / "benchmarks" / "study.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["study"] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def tiny_study_base(clip: str) -> dict:
    """The base `mima fit` config of a tiny study: `clip` on STUDY_TASKS at S = 4 (the grid sets the
    tasks' count, N, the seeds and the operator)."""
    base = fit_config(Path("unused"), clip, list(STUDY_TASKS), steps=4, iterations=1)
    base.pop("out")
    return base


def final_bytes(run: Path) -> dict[str, bytes]:
    """A run folder's final/ files by name."""
    return {path.name: path.read_bytes() for path in sorted((run / "final").glob("*.safetensors"))}


# ====================================================== `mima fit` jobs in subprocesses (real processes, gloo)
TWO = ["rot90", "mirror"]
FOUR = ["rot90", "rot180", "rot270", "mirror"]
STEPS, ITERATIONS = 24, 3  # K = 8


# The rendezvous and collective timeout of the test jobs: long enough that four processes meet on a
# 2-core machine running other jobs (at 60 s, a 4-process rendezvous timed out at load 6); tests of a
# dead process pass a shorter one, which the job must fail within.
JOB_COLLECTIVE_TIMEOUT_S = 300


def write_config(path: Path, clip: str, tasks: list[str], devices: int, callbacks=(), strategy=None,
                 model: dict | None = None, collective_timeout: int = JOB_COLLECTIVE_TIMEOUT_S) -> Path:
    config = {
        "seed_everything": 0,
        "threads_per_process": 1,
        "collective_timeout": collective_timeout,
        "model": {"clip": clip, "steps": STEPS, "iterations": ITERATIONS, "lr": 1e-3, "warmup_steps": 2, **(model or {})},
        "data": {"suite": "digits", "tasks": tasks, "batch_size": 16, "seed": 3},
        "trainer": {
            "accelerator": "cpu",
            "devices": devices,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "logger": False,
            "callbacks": [{"class_path": f"tests.helpers.{name}", "init_args": args} for name, args in callbacks],
        },
    }
    if strategy:
        config["trainer"]["strategy"] = {"class_path": f"tests.helpers.{strategy[0]}", "init_args": strategy[1]}
    path.write_text(yaml.safe_dump(config))
    return path


LAUNCHER_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK",
                      "PL_GLOBAL_SEED", "PL_SEED_WORKERS")


def job_environment() -> dict[str, str]:
    """This process's environment without what a launcher (or an earlier in-process fit) set."""
    return {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES} | {"PYTHONUNBUFFERED": "1"}


# Fault injections that leave the test process intact: a one-process job using only these runs in
# this process (below). The others kill or signal their own process, so their jobs get one of their own.
IN_PROCESS_CALLBACKS = {"TouchStopAtStep", "RecordStateWrites", "RecordMomentsOnDisk"}


def run_job(config: Path, out: Path, *extra: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """`mima fit --config CONFIG --out OUT EXTRA...`, as the job a user starts.

    A one-process job runs `mima.cli.main` in this process: the same code after the interpreter has
    started, without the 5 s of importing torch, Lightning and open_clip again. A job of several
    processes (or with a fault that kills its process) gets processes of its own, in its own process
    group: the first a fork of tests/job_server.py (the same `mima.cli.main`, imports done), the others
    started by Lightning as `sys.executable -m mima.__main__`, which in such a job is tests/rank_starter.py
    standing in for a fork of the same imports. In an environment other than the session's it
    runs `python -m mima fit`. tests/commands/test_cli_startup.py and the SLURM tests cover the command's own
    start-up."""
    argv = ["fit", "--config", str(config), "--out", str(out), *extra]
    if _one_process_job(config, extra):
        return _run_in_this_process(argv)
    return run_command(argv, timeout=timeout)


def run_command(argv: list[str], timeout: float = 600, file_size_limit: int | None = None) -> subprocess.CompletedProcess:
    """`python -m mima ARGV` as processes of its own, in its own process group, to the end: stdout and
    stderr captured, returncode as subprocess gives it (-9 for SIGKILL). With `file_size_limit`, it may
    write no file beyond that many bytes (RLIMIT_FSIZE), so a write fails as a full disk's would. Its
    first process is a fork of tests/job_server.py when this process's environment is the session's."""
    argv = [str(arg) for arg in argv]
    environment = job_environment()
    if JOB_SERVER.serves(environment):
        return JOB_SERVER.run(argv, environment, timeout, file_size_limit)
    limit = None if file_size_limit is None else functools.partial(_limit_file_size, file_size_limit)
    if file_size_limit is not None:  # a .pyc written under the limit is cut short silently (tests/job_server.py)
        environment = {**environment, "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run([sys.executable, "-m", "mima", *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, start_new_session=True, env=environment, preexec_fn=limit)


def _limit_file_size(limit_bytes: int) -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))


def _one_process_job(config: Path, extra: tuple[str, ...]) -> bool:
    trainer = (yaml.safe_load(config.read_text()) or {}).get("trainer") or {}
    options = dict(zip(extra[::2], extra[1::2]))
    devices = int(options.get("--trainer.devices", trainer.get("devices", 1)))
    nodes = int(options.get("--trainer.num_nodes", trainer.get("num_nodes", 1)))
    callbacks = {entry["class_path"].rsplit(".", 1)[-1] for entry in trainer.get("callbacks") or []}
    return devices == 1 and nodes == 1 and not trainer.get("strategy") and callbacks <= IN_PROCESS_CALLBACKS


def _run_in_this_process(argv: list[str]) -> subprocess.CompletedProcess:
    from mima.cli import main

    stdout, stderr = io.StringIO(), io.StringIO()
    saved_environment, saved_threads = dict(os.environ), torch.get_num_threads()
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                code = main(argv)
            except SystemExit as exit_:  # argument errors exit like the command would
                code = exit_.code if isinstance(exit_.code, int) else 1
    finally:
        # what the fit set for its one-process "launch" (MASTER_PORT, PL_GLOBAL_SEED, ...) goes with it
        os.environ.clear()
        os.environ.update(saved_environment)
        torch.set_num_threads(saved_threads)  # threads_per_process applies to the job, not to later tests
    return subprocess.CompletedProcess(["mima", *argv], code or 0, stdout.getvalue(), stderr.getvalue())


class JobServer:
    """This test process's end of tests/job_server.py: a job's first process is a fork of a process that
    has already imported torch and Lightning, instead of a new interpreter. tests/conftest.py sets the
    environment it serves at the start of the session; it starts on the first job."""

    def __init__(self) -> None:
        self.process: subprocess.Popen | None = None
        self.environment: dict[str, str] | None = None  # None: not serving (run_job starts subprocesses)
        self.lock = threading.Lock()  # one request on the socket at a time

    def serves(self, environment: dict[str, str]) -> bool:
        """Whether it runs jobs in this environment (the session's, less pytest's per-test variable);
        started now if need be."""
        if self.environment is None or _import_relevant(environment) != _import_relevant(self.environment):
            return False
        with self.lock:
            if self.process is None or self.process.poll() is not None:
                self._start()
        return True

    def _start(self) -> None:
        ours, theirs = socket.socketpair()
        self.log = tempfile.TemporaryFile()
        self.process = subprocess.Popen([sys.executable, "-m", "tests.job_server", str(theirs.fileno())], cwd=REPO,
                                        env=self.environment, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                                        stdout=self.log, stderr=self.log)
        theirs.close()
        self.connection = ours

    def stop(self) -> None:
        """Its jobs have ended with their tests; closing the socket ends it."""
        if self.process is not None:
            self.connection.close()
            self.process.wait(timeout=30)
            self.process = None

    def run(self, argv: list[str], environment: dict[str, str], timeout: float,
            file_size_limit: int | None = None) -> subprocess.CompletedProcess:
        """As subprocess.run(..., capture_output=True, start_new_session=True, timeout=timeout): returns once
        the job's first process has ended and every process of the job has closed stdout and stderr."""
        out, err, status = os.pipe(), os.pipe(), os.pipe()
        request = json.dumps({"argv": argv, "env": environment, "cwd": str(REPO), "file_size_limit": file_size_limit}).encode()
        with self.lock:
            socket.send_fds(self.connection, [request], [out[1], err[1], status[1]])
        for write_end in (out[1], err[1], status[1]):
            os.close(write_end)
        read = {out[0]: bytearray(), err[0]: bytearray(), status[0]: bytearray()}
        deadline, pid, killed = time.monotonic() + timeout, None, False
        with selectors.DefaultSelector() as selector:
            for fd in read:
                selector.register(fd, selectors.EVENT_READ)
            while selector.get_map():
                if time.monotonic() > deadline and not killed:
                    if pid is None:  # the server never forked the job (it is stuck): nothing of ours to stop
                        self.process.kill()
                        raise subprocess.TimeoutExpired(["mima", *argv], timeout)
                    os.killpg(pid, signal.SIGKILL)
                    killed = True
                for key, _ in selector.select(timeout=1.0):
                    chunk = os.read(key.fd, 1 << 16)
                    read[key.fd] += chunk
                    if not chunk:
                        selector.unregister(key.fd)
                        os.close(key.fd)
                lines = bytes(read[status[0]]).decode().split()
                pid = int(lines[1]) if len(lines) >= 2 else pid
        stdout, stderr = bytes(read[out[0]]).decode(), bytes(read[err[0]]).decode()
        lines = bytes(read[status[0]]).decode().split()
        if killed:
            raise subprocess.TimeoutExpired(["mima", *argv], timeout, stdout, stderr)
        if len(lines) != 4:
            self.log.seek(0)
            raise RuntimeError(f"tests/job_server.py ended without the job's exit status (status {lines}); its log:\n"
                               + self.log.read().decode()[-3000:])
        completed = subprocess.CompletedProcess(["mima", *argv], int(lines[3]), stdout, stderr)
        completed.pid = pid  # the job's first process: its process group's id (tests/distributed/test_job_server.py)
        return completed


def group_ended(pgid: int, within_s: float) -> bool:
    """Whether every process of process group `pgid` has ended, waiting up to `within_s` seconds."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)


JOB_SERVER = JobServer()


# Variables that do not tell two environments apart for a job: pytest's name of the running test, and
# those a job sets to the same value itself, whatever it started with (os.environ.setdefault): scikit-learn
# on import, mima before it builds a LightningCLI parser. An earlier in-process command leaves them set.
NOT_THE_JOB_S_CHOICE = ("PYTEST_CURRENT_TEST", "KMP_DUPLICATE_LIB_OK", "KMP_INIT_AT_FORK", "JSONARGPARSE_DEPRECATION_WARNINGS")


# The switches the tracker tests set: wandb (which the job server imports, through timm) reads its
# variables when a run starts (wandb.env's getters take the environment then), and mlflow is not
# imported by the server (it checks so), so a tracker test's jobs are served too.
TRACKER_SWITCHES = ("WANDB_MODE", "WANDB_SILENT", "MLFLOW_ALLOW_FILE_STORE", "MLFLOW_HTTP_REQUEST_MAX_RETRIES",
                    "MLFLOW_HTTP_REQUEST_TIMEOUT")


def _import_relevant(environment: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in environment.items() if k not in NOT_THE_JOB_S_CHOICE and k not in TRACKER_SWITCHES}


def finals(out: Path, tasks: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    return {task: load_state_dict(out / "final" / f"{task}.safetensors") for task in tasks}


def assert_identical(a: dict, b: dict) -> None:
    for task in a:
        for key in a[task]:
            assert torch.equal(a[task][key], b[task][key]), (task, key)


def assert_trained(task_models: dict[str, dict[str, torch.Tensor]], theta_0: dict[str, torch.Tensor],
                   at_least: float) -> None:
    """Every task model moved more than `at_least` (largest entry) from theta_0: a comparison of two
    runs' task models is then not equal merely because neither trained."""
    for task, state in task_models.items():
        assert set(state) == set(theta_0), task
        moved = max(float((state[k].double() - theta_0[k].double()).abs().max()) for k in state)
        assert moved > at_least, f"task {task} moved only {moved:.2e} from theta_0 (at most {at_least:.0e} counts as not trained)"


def logged_losses(file: Path) -> list[tuple[int, str, float]]:
    """(step, task, loss) of every train/loss value in a metrics.csv, in file order."""
    with file.open() as handle:
        return [(int(row["step"]), key[len("train/loss/"):], float(value)) for row in csv.DictReader(handle)
                for key, value in row.items() if key.startswith("train/loss/") and value]


class FailingReplace:
    """os.replace that fails (EBUSY, as a busy mount point's rename) at its `fail_at`-th use (0: never),
    counting every use in `calls`."""

    def __init__(self, fail_at: int) -> None:
        self.fail_at, self.calls, self.real = fail_at, 0, os.replace

    def __call__(self, source, destination) -> None:
        self.calls += 1
        if self.calls == self.fail_at:
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), str(destination))
        self.real(source, destination)


# ================================================== the command line in this process: outcome, unchanged files
@dataclass
class Outcome:
    code: int
    out: str
    err: str


def cli(argv, capfd) -> Outcome:
    """`mima ARGV` in this process; stdout and stderr at the file-descriptor level (capfd), so that
    output written below Python's sys.stderr is seen too."""
    from mima.cli import main

    capfd.readouterr()
    code = main([str(arg) for arg in argv])
    captured = capfd.readouterr()
    return Outcome(code, captured.out, captured.err)


def assert_one_line(code: int, err: str, *fragments: str, status: int = 2) -> str:
    """Exit `status`, exactly one line on stderr holding every fragment, and no traceback."""
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert code == status and len(lines) == 1, (code, err)
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def tree(*folders: Path) -> dict[str, str]:
    """Every entry under `folders` (hidden ones included): sha256 of files, link targets, folders."""
    found = {}
    for folder in folders:
        for root, dirs, files in os.walk(folder):
            for name in dirs + files:
                path = Path(root) / name
                if path.is_symlink():
                    found[str(path)] = f"link -> {os.readlink(path)}"
                elif path.is_dir():
                    found[str(path)] = "folder"
                else:
                    found[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


@contextlib.contextmanager
def unchanged(*folders: Path):
    """Nothing under `folders` is created, changed or removed by the block (no output, no temporary file)."""
    before = tree(*folders)
    yield
    after = tree(*folders)
    assert after == before, {
        "created": sorted(set(after) - set(before)),
        "removed": sorted(set(before) - set(after)),
        "changed": sorted(k for k in set(before) & set(after) if before[k] != after[k]),
    }


def temporaries(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.name.endswith(".tmp") or ".tmp." in p.name)


def copy_run(run: Path, target: Path) -> Path:
    shutil.copytree(run, target, symlinks=True)
    return target


def small_fit_argv(folder: Path, small_clip: str, **changes) -> list[str]:
    """`mima fit` of the small CLIP on two digits tasks (S = 6, N = 2) into folder/run; `changes` are
    further `--key value` options."""
    config = fit_config(folder / "run", small_clip, ["rot90", "mirror"], steps=6, iterations=2)
    argv = ["fit", "--model.clip", small_clip, "--out", config["out"], "--trainer.accelerator", "cpu",
            "--trainer.enable_progress_bar", "false", "--model.steps", "6", "--model.iterations", "2"]
    for key, value in changes.items():
        argv += [f"--{key}", value]
    return argv


FIT_OPTIONS = {"model.steps": "4", "model.iterations": "2", "data.tasks": "[rot90, mirror]", "trainer.logger": "false"}


def fit_argv(small_clip, run: Path, **changes) -> list[str]:
    """The quick fit of small_fit_argv shortened to S = 4, N = 2 (8 process steps), in `run`."""
    return small_fit_argv(run.parent, small_clip, **{**FIT_OPTIONS, "out": str(run), **changes})


# =========================================================================== a process holding a run lock
LOCK_HOLDER = """
import sys, time
from mima.core.run_lock import RunLock
lock = RunLock(sys.argv[1], "test holder", heartbeat_s=0.2).acquire()
print("held", flush=True)
sys.stdin.readline()  # hold until told (or killed)
lock.release()
"""


def lock_holder(folder: Path) -> subprocess.Popen:
    """A process that holds `folder`'s run lock until a line arrives on its stdin (or it is killed)."""
    job = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, str(folder)], cwd=REPO, stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True)
    assert job.stdout.readline().strip() == "held"
    return job


# ============================================================================== image files and folders
STRIPES = ("checkerboard", "horizontal_stripes", "vertical_stripes")  # sorted, as the folders are read


def pattern_image(kind: str, rng: np.random.Generator, size: int = 32) -> Image.Image:
    """Stripes or a checkerboard (4-pixel bars, random phase and colours, pixel noise): learnable
    from the pixels, but never seen in the embedded model's digit pretraining."""
    y, x = np.mgrid[0:size, 0:size] + rng.integers(0, 8)
    bars = {"horizontal_stripes": y // 4 % 2, "vertical_stripes": x // 4 % 2, "checkerboard": (x // 4 + y // 4) % 2}[kind]
    bars = bars[..., None]
    pixels = bars * rng.uniform(150, 255, 3) + (1 - bars) * rng.uniform(0, 90, 3) + rng.normal(0, 10, (size, size, 3))
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def write_images(folder: Path, classes, count: int, draw, seed: int) -> None:
    """`count` PNGs per class, folder/<class>/NNN.png, drawn by `draw(class, rng)`."""
    rng = np.random.default_rng(seed)
    for name in classes:
        (folder / name).mkdir(parents=True, exist_ok=True)
        for i in range(count):
            draw(name, rng).save(folder / name / f"{i:03d}.png")


def damaged_task(tmp_path: Path, per_class: int, damaged: int, suffix: str, damage) -> Path:
    """A stripes task (split layout) whose first `damaged` training images of the first class are
    saved as `suffix` and then damaged by `damage(bytes) -> bytes`."""
    task = tmp_path / "stripes"
    write_images(task / "train", STRIPES, per_class, pattern_image, seed=0)
    write_images(task / "test", STRIPES, 2, pattern_image, seed=1)
    for png in sorted((task / "train" / STRIPES[0]).glob("*.png"))[:damaged]:
        with Image.open(png) as image:
            image.load()
        png.unlink()
        path = png.with_suffix(suffix)
        image.save(path)
        path.write_bytes(damage(path.read_bytes()))
    return task


def custom_task_fit_config(tmp_path: Path, small_clip: str, task: Path, workers: int = 0, **task_options) -> Path:
    """A `mima fit` config file (tmp_path/c.yaml) training the small CLIP on the custom task `task` alone."""
    config = fit_config(tmp_path / "run", small_clip, None, steps=2, iterations=1)
    config["data"] = {"suite": None, "custom_tasks": [{"name": "stripes", "path": str(task), **task_options}],
                      "batch_size": 8, "num_workers": workers}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    return tmp_path / "c.yaml"


def garbage_png(data: bytes) -> bytes:
    return b"\x89PNG\r\n\x1a\n" + bytes(range(200))


def first_half(data: bytes) -> bytes:
    return data[: len(data) // 2]


def cut_jpeg_scan(data: bytes) -> bytes:
    """Headers intact, the entropy-coded scan cut in half: PIL opens and verifies it, decoding fails."""
    scan = data.index(b"\xff\xda")  # start-of-scan marker
    return data[: scan + (len(data) - scan) // 2]


def tiny_image(path: Path, seed: int, size: int = 6, mode: str = "RGB") -> None:
    """A tiny image whose pixels depend on `seed` (so files differ)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    Image.fromarray(pixels).convert(mode).save(path)


def dark_and_light_pngs(root: Path, seed: int, per_class: int, smallest: int, noise: float,
                        modes: tuple[str, ...] = ("RGB",)) -> None:
    """Two classes of PNGs, root/dark and root/light (mean brightness 60 and 180, Gaussian noise of std
    `noise`), of mixed sizes and aspect ratios (each side from `smallest` to 39 pixels); the i-th image
    of a class in mode modes[i % len(modes)]."""
    rng = np.random.default_rng(seed)
    for label, name in enumerate(("dark", "light")):
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            height, width = int(rng.integers(smallest, 40)), int(rng.integers(smallest, 40))
            pixels = np.clip(60 + 120 * label + rng.normal(0, noise, (height, width, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(pixels).convert(modes[i % len(modes)]).save(root / name / f"{i:02d}.png")


def class_tree(folder: Path, classes, per_class: int, ext: str = "png", start: int = 0) -> None:
    for c, name in enumerate(classes):
        for i in range(per_class):
            tiny_image(folder / name / f"{i:03d}.{ext}", seed=start + 1000 * c + i)


# the clip suite's folder-read benchmark tasks, written small in the layout each expects: each writes
# under `root` and returns its split sizes and one (file, class name) probe
def fake_dtd(root: Path) -> dict:
    class_tree(root / "dtd" / "train", clip_text.DTD, 2)
    class_tree(root / "dtd" / "val", clip_text.DTD, 1, start=500)
    return {"train": 2 * 47, "test": 47, "probe": ("dtd/val/zigzagged/000.png", "zigzagged")}


def fake_eurosat(root: Path) -> dict:
    for split, count in (("train", 3), ("val", 1), ("test", 2)):
        class_tree(root / "EuroSAT_splits" / split, clip_text.EUROSAT_FOLDERS, count, ext="jpg", start=len(split))
    return {"train": 30, "val": 10, "test": 20, "probe": ("EuroSAT_splits/test/SeaLake/001.jpg", "lake or sea")}


def fake_sun397(root: Path) -> dict:
    class_tree(root / "sun397" / "train", SUN397_FOLDERS, 1, ext="jpg")
    class_tree(root / "sun397" / "val", SUN397_FOLDERS, 1, ext="jpg", start=7)
    return {"train": 397, "test": 397, "probe": ("sun397/val/y_youth_hostel/000.jpg", "youth hostel")}


def fake_resisc45(root: Path) -> dict:
    folder = root / "resisc45"
    for c, name in enumerate(clip_text.RESISC45_FOLDERS):
        for i in range(1, 4):
            tiny_image(folder / "NWPU-RESISC45" / name / f"{name}_{i:03d}.jpg", seed=10 * c + i)
    names = {split: [f"{n}_{i:03d}.jpg" for n in clip_text.RESISC45_FOLDERS for i in ids]
             for split, ids in (("train", (1, 2)), ("val", ()), ("test", (3,)))}
    for split, files in names.items():
        (folder / f"resisc45-{split}.txt").write_text("\n".join(files) + "\n")
    return {"train": 90, "test": 45, "probe": ("resisc45/NWPU-RESISC45/sea_ice/sea_ice_003.jpg", "sea ice")}


FOLDER_TASKS = {"DTD": fake_dtd, "EuroSAT": fake_eurosat, "SUN397": fake_sun397, "RESISC45": fake_resisc45}


def idx_file(path: Path, array: np.ndarray) -> None:
    """An MNIST-format idx file (uint8): magic 0x0803 for images, 0x0801 for labels."""
    path.parent.mkdir(parents=True, exist_ok=True)
    magic = 0x800 + array.ndim
    path.write_bytes(struct.pack(">I", magic) + struct.pack(f">{array.ndim}I", *array.shape) + array.astype(np.uint8).tobytes())


def fake_mnist(root: Path, train: int = 60, test: int = 20) -> None:
    rng = np.random.default_rng(0)
    for split, n in (("train", train), ("t10k", test)):
        idx_file(root / "MNIST" / "raw" / f"{split}-images-idx3-ubyte", rng.integers(0, 256, (n, 28, 28)))
        idx_file(root / "MNIST" / "raw" / f"{split}-labels-idx1-ubyte", np.arange(n) % 10)


# ========================================================================= merge inputs as files
def write_encoders(folder: Path, base: dict, scale: float) -> dict[str, Path]:
    """`base` and two models base + scale x N(0, 1) noise (seeds 1, 2) as safetensors files in `folder`."""
    paths = {"base": folder / "base.safetensors"}
    save_state_dict(paths["base"], base)
    for index in (1, 2):
        generator = torch.Generator().manual_seed(index)
        paths[f"m{index}"] = folder / f"m{index}.safetensors"
        save_state_dict(paths[f"m{index}"], {k: v + scale * torch.randn(v.shape, generator=generator) for k, v in base.items()})
    return paths


def merge_argv(method: str, encoders, output: Path, *extra, models=("m1", "m2"), base: bool = True) -> list:
    """`mima merge` arguments; `models` names entries of `encoders` (or gives paths)."""
    return (["merge", "--method", method] + (["--base", encoders["base"]] if base else [])
            + ["--models", *[encoders[m] if isinstance(m, str) else m for m in models], "--output", output, *extra])


POISONED_KEY = "transformer.resblocks.0.mlp.c_fc.weight"  # a matrix that CART, TSV and Iso-C decompose


def poisoned(encoders, folder: Path, value: float) -> tuple[Path, str]:
    """A copy of m2 with one entry of an MLP weight matrix set to `value`."""
    state = load_state_dict(encoders["m2"])
    key = POISONED_KEY
    state[key].view(-1)[3] = value
    path = folder / "poisoned.safetensors"
    save_state_dict(path, state)
    return path, key


# ============================================================================== merge inputs in memory
MLP_MATRIX = "transformer.resblocks.0.mlp.c_fc.weight"


def perturbed_models(count: int, seed: int = 0, shapes=((MLP_MATRIX, (12, 8)), ("ln.weight", (8,)), ("proj", (8, 4)))):
    """theta_0 (random tensors of `shapes` and an integer tensor, `counter` = 7) and `count` copies with
    N(0, 0.25) noise added to every floating tensor."""
    g = torch.Generator().manual_seed(seed)
    base = {key: torch.randn(shape, generator=g) for key, shape in shapes}
    base["counter"] = torch.tensor(7)
    models = [
        {k: (v + 0.5 * torch.randn(v.shape, generator=g)) if v.is_floating_point() else v.clone() for k, v in base.items()}
        for _ in range(count)
    ]
    return base, models


# The tensors of the per-matrix strategies' tests: a matrix, a wider one, a bias and a convolution kernel
WIDE_MATRIX = "transformer.resblocks.1.mlp.c_proj.weight"
MLP_BIAS = "transformer.resblocks.0.mlp.c_fc.bias"
CONV_KERNEL = "conv1.weight"
MATRICES_AND_OTHERS = ((MLP_MATRIX, (12, 8)), (WIDE_MATRIX, (5, 9)), (MLP_BIAS, (12,)), (CONV_KERNEL, (2, 3, 2, 2)))


def matrix_models(count: int, seed: int = 0, shapes=MATRICES_AND_OTHERS):
    """theta_0 (with an integer tensor) and `count` perturbed copies: two matrices, a bias, a kernel."""
    return perturbed_models(count, seed, shapes)


def merged_from_files(folder: Path, method: str, flags: list[str], seed: int = 12) -> tuple[dict, list[dict], dict]:
    """`mima merge --method METHOD FLAGS` over matrix_models(3, seed) saved as files in `folder`:
    (theta_0, the models, the merge it wrote), its exit status 0 and every key kept (the integer
    counter as it was) checked."""
    base, models = matrix_models(3, seed)
    base_path, paths = save_models(folder, base, models)
    out = folder / f"{method}.safetensors"
    assert merge_files(method, base_path, paths, out, *flags) == 0
    written = load_state_dict(out)
    assert sorted(written) == sorted(base) and int(written["counter"]) == 7
    return base, models, written


def task_vectors(base: dict, models: list[dict], key: str) -> list[np.ndarray]:
    """Each model's task vector of tensor `key`, subtracted in float64."""
    return [m[key].double().numpy() - base[key].double().numpy() for m in models]


def clip_like_models(count: int, seed: int = 0, scale: float = 1.0):
    """theta_0 with open_clip's names (an attention and an MLP weight, a bias, the positional embedding,
    the projection, an integer `counter` = 3) and `count` copies with N(0, scale^2) noise on every
    floating tensor."""
    g = torch.Generator().manual_seed(seed)
    base = {
        "transformer.resblocks.0.attn.in_proj_weight": torch.randn(12, 4, generator=g),
        "transformer.resblocks.0.mlp.c_fc.weight": torch.randn(8, 4, generator=g),
        "transformer.resblocks.0.mlp.c_fc.bias": torch.randn(8, generator=g),
        "positional_embedding": torch.randn(5, 4, generator=g),
        "proj": torch.randn(4, 3, generator=g),
        "counter": torch.tensor(3),
    }
    models = []
    for _ in range(count):
        models.append({k: (v + scale * torch.randn(v.shape, generator=g)) if v.is_floating_point() else v.clone()
                       for k, v in base.items()})
    return base, models


# open_clip-like names: three residual blocks, tensors before and after them, a 4-D patch
# embedding, a 0-D tensor (and, in block_models, an integer counter)
BLOCK_SHAPES = {
    "conv1.weight": (4, 3, 2, 2),
    "class_embedding": (4,),
    "transformer.resblocks.0.attn.in_proj_weight": (12, 4),
    "transformer.resblocks.0.ln_1.weight": (4,),
    "transformer.resblocks.1.mlp.c_fc.weight": (8, 4),
    "transformer.resblocks.1.mlp.c_fc.bias": (8,),
    "transformer.resblocks.2.mlp.c_proj.weight": (4, 8),
    "ln_post.weight": (4,),
    "proj": (4, 3),
    "logit_bias": (),
}


def block_models(count: int, seed: int):
    """theta_0 of BLOCK_SHAPES (and `counter` = 7) and `count` copies with N(0, 0.25) noise."""
    g = torch.Generator().manual_seed(seed)
    base = {key: torch.randn(shape, generator=g) for key, shape in BLOCK_SHAPES.items()}
    base["counter"] = torch.tensor(7)
    models = [{k: v + 0.5 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v.clone() for k, v in base.items()}
              for _ in range(count)]
    return base, models


def block_task_vectors(base: dict, models: list[dict]) -> dict[str, np.ndarray]:
    """[T, ...] task vectors of every BLOCK_SHAPES tensor, subtracted in float32 as the strategies do, then widened."""
    return {key: np.stack([(m[key] - base[key]).numpy() for m in models]).astype(np.float64) for key in BLOCK_SHAPES}


def save_models(folder: Path, base: dict, models: list[dict]) -> tuple[Path, list[Path]]:
    """theta_0 and the models as safetensors files in `folder` (base.safetensors, m0.safetensors, ...)."""
    save_state_dict(folder / "base.safetensors", base)
    paths = []
    for index, model in enumerate(models):
        paths.append(folder / f"m{index}.safetensors")
        save_state_dict(paths[-1], model)
    return folder / "base.safetensors", paths


def merge_files(method: str, base_path: Path, paths: list[Path], out: Path, *flags: str) -> int:
    """`mima merge --method METHOD --base BASE --models PATHS --output OUT FLAGS`, in this process: its exit status."""
    from mima.cli import main

    return main(["merge", "--method", method, "--base", str(base_path), "--models", *map(str, paths), "--output", str(out),
                 *flags])


def assert_streamed_merge_matches(folder: Path, method: str, formula) -> None:
    """`method` at its defaults, merged file to file by the streaming engine from safetensors copies of
    perturbed_models(3, seed=10) in `folder`, writes every key in its dtype, keeps the integer counter, and
    equals `formula(base, models)` (numpy arrays by key) within 1e-5."""
    from mima.merging import get_method
    from mima.merging.engine import merge_to_file, open_inputs

    base, models = perturbed_models(3, seed=10)
    base_path, paths = save_models(folder, base, models)
    with open_inputs(paths, base_path) as inputs:
        merge_to_file(get_method(method), inputs, folder / "out.safetensors", {}, {"method": method})
    streamed = load_state_dict(folder / "out.safetensors")
    assert set(streamed) == set(base)  # every key
    for key, expected in formula(base, models).items():
        assert streamed[key].dtype == base[key].dtype
        np.testing.assert_allclose(streamed[key].numpy(), expected, rtol=1e-5, atol=1e-5, err_msg=key)
    assert int(streamed["counter"]) == 7


@dataclass(frozen=True)
class ClipTaskModels:
    """theta_0 of the small CLIP's image encoder and two perturbed copies standing in for fine-tuned task
    models (N(0, 0.05^2) noise, seeds 1 and 2), in memory and as safetensors files, with the config of the
    two digits tasks they are for (tests/conftest.py's `clip_task_models`)."""

    config: Path
    base: dict[str, torch.Tensor]
    models: list[dict[str, torch.Tensor]]
    base_path: Path
    paths: list[Path]


def random_splits(g: torch.Generator, inputs: int, classes: int, train: int, test: int = 24) -> dict[str, tuple]:
    """A task's train and test splits of random inputs and labels, for TinyPool."""
    return {
        "train": (torch.randn(train, inputs, generator=g), torch.randint(0, classes, (train,), generator=g)),
        "test": (torch.randn(test, inputs, generator=g), torch.randint(0, classes, (test,), generator=g)),
    }


def state_of(module: nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of the module's state dict."""
    return {key: value.detach().clone() for key, value in module.state_dict().items()}


def numpy_ties(taus: dict[str, np.ndarray], k: float) -> dict[str, np.ndarray]:
    """The official TIES written again: global top-k% trim (|tau| >= the kth smallest, kth = n - int(n k / 100)),
    sign of the trimmed sum (zero: the model-wide majority), mean of the agreeing non-zero entries."""
    flat = [np.concatenate([taus[key][t].ravel() for key in taus]) for t in range(len(next(iter(taus.values()))))]
    kth = flat[0].size - int(flat[0].size * k / 100)
    thresholds = [np.sort(np.abs(f))[kth - 1] for f in flat]
    trimmed = {key: np.stack([v[t] * (np.abs(v[t]) >= thresholds[t]) for t in range(len(v))]) for key, v in taus.items()}
    majority = np.sign(sum(np.sign(v.sum(0)).sum() for v in trimmed.values()))
    merged = {}
    for key, v in trimmed.items():
        sign = np.sign(v.sum(0))
        sign[sign == 0] = majority
        agree = np.where(sign > 0, v > 0, v < 0)
        merged[key] = (v * agree).sum(0) / np.maximum((v * agree != 0).sum(0), 1)
    return merged


class TinyPool:
    """tasks, heads, encoder and data splits held as tensors; logits = encoder(images) @ head^T."""

    def __init__(self, encoder: nn.Module, heads: dict[str, torch.Tensor], data: dict[str, dict[str, tuple]], seed: int = 0):
        self.encoder, self.heads, self.data, self.seed = encoder, heads, data, seed
        self.tasks = list(heads)
        self.drawn: Counter = Counter()  # (task, split) -> batches handed out

    def loader(self, task, split, batch_size, shuffle=False, seed=None):
        images, labels = self.data[task][split]
        generator = torch.Generator().manual_seed(self.seed if seed is None else seed)
        order = torch.randperm(len(labels), generator=generator) if shuffle else torch.arange(len(labels))

        def batches():
            for start in range(0, len(labels), batch_size):
                index = order[start : start + batch_size]
                self.drawn[(task, split)] += 1
                yield images[index], labels[index]

        return batches()

    def examples(self, task, split, count, batch_size=32, seed=None):
        return first_examples(self.loader(task, split, batch_size, shuffle=True, seed=seed), count)

    def logits(self, weights, task, images):
        return functional_call(self.encoder, dict(weights), (images,)) @ self.heads[task].T


# ============================================= fault injection, loaded by `mima fit` subprocesses by class path
class KillAtStep(Callback):
    """SIGKILL at the end of optimiser step `step` (before MIMA's sync and the checkpoint of that step
    run): the whole job (`group=True`) or only this rank's process.

    Checkpoints are written in the background, so a kill one step after a save would race the
    writer. With `group=True` every rank therefore first waits, at its own step `step`, until its
    earlier saves are on disk and says so with a file; the killing rank waits for all of them. (Ranks
    are not in lockstep between syncs, but each reaches step `step` before the next sync.) With
    `wait_for_others=False` the killing rank does not wait: for ranks that start past `step`."""

    def __init__(self, step: int, rank: int = 0, group: bool = True, wait_for_others: bool = True) -> None:
        self.step, self.rank, self.group, self.wait_for_others = step, rank, group, wait_for_others

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step != self.step:
            return
        if self.group:
            checkpoint = trainer.checkpoint_callback
            if checkpoint is not None and getattr(checkpoint, "writer", None) is not None:
                checkpoint.writer.flush()
            settled = Path(trainer.default_root_dir) / f".settled-{trainer.global_rank}"
            settled.touch()
        if trainer.global_rank != self.rank:
            return
        if self.group:
            deadline = time.monotonic() + (120 if self.wait_for_others else 0)
            while time.monotonic() < deadline and not all(
                (Path(trainer.default_root_dir) / f".settled-{rank}").exists() for rank in range(trainer.world_size)
            ):
                time.sleep(0.05)
            os.killpg(os.getpgrp(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)


class SignalAtStep(Callback):
    """Send `signum` to this rank's own process at step `step`, as SLURM's warning signal would."""

    def __init__(self, step: int, rank: int = 0, signum: int = int(signal.SIGUSR1)) -> None:
        self.step, self.rank, self.signum = step, rank, signum

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            os.kill(os.getpid(), self.signum)


class KillDuringStateWrite(Callback):
    """Kills the whole job while the background writer is in the middle of this rank's `save`-th state
    file: half of its bytes are in the temporary file, the rename has not happened."""

    def __init__(self, save: int = 2, rank: int = 0) -> None:
        self.save, self.rank = save, rank

    def on_train_start(self, trainer, pl_module) -> None:
        if trainer.global_rank != self.rank:
            return
        checkpoint = trainer.checkpoint_callback
        original, count = checkpoint._write, [0]

        def write(path, job, done=None):
            if path.suffix == ".ckpt":
                count[0] += 1
                if count[0] == self.save:
                    def half_then_die(temporary, job=job):
                        job(temporary)
                        data = temporary.read_bytes()
                        temporary.write_bytes(data[: len(data) // 2])
                        os.killpg(os.getpgrp(), signal.SIGKILL)
                    return original(path, half_then_die, done)
            return original(path, job, done)

        checkpoint._write = write


class RecordProcessCommand(Callback):
    """Each rank writes its process's command line (/proc/self/cmdline, arguments joined by spaces) to
    RUN/.command-RANK at the start of training: which program the rank's process is."""

    def on_train_start(self, trainer, pl_module) -> None:
        arguments = Path("/proc/self/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
        (Path(trainer.default_root_dir) / f".command-{trainer.global_rank}").write_bytes(b" ".join(arguments))


class TouchStopAtStep(Callback):
    """`touch RUN/STOP` at step `step` of rank `rank`, as a user asking a job to stop would."""

    def __init__(self, step: int, rank: int = 0) -> None:
        self.step, self.rank = step, rank

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            (Path(trainer.default_root_dir) / "STOP").touch()


class PoisonAtStep(Callback):
    """At the start of process step `step` of rank `rank`: one encoder weight becomes NaN, so that the
    step's loss is NaN (as a run that diverged would have it). `iterations`: only in a run of that N
    (one run of a sweep or study diverges, the others not)."""

    def __init__(self, step: int, rank: int = 0, iterations: int | None = None) -> None:
        self.step, self.rank, self.iterations = step, rank, iterations

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.iterations is not None and pl_module.hparams.iterations != self.iterations:
            return
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            with torch.no_grad():
                next(pl_module.encoder.parameters()).view(-1)[0] = float("nan")


class RaiseAtStep(Callback):
    """A Python error at the end of step `step` (a bug or a bad batch found mid-run)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError(f"raised by tests.helpers.RaiseAtStep at step {self.step}")


class WaitForFileAtStep(Callback):
    """Wait at the end of step `step` until `path` exists (a job held mid-run while a test does something
    beside it), at most `timeout` seconds."""

    def __init__(self, step: int, path: str, timeout: float = 300.0) -> None:
        self.step, self.path, self.timeout = step, Path(path), timeout

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step != self.step:
            return
        deadline = time.monotonic() + self.timeout
        while not self.path.exists() and time.monotonic() < deadline:
            time.sleep(0.05)


class RecordStateWrites(Callback):
    """Appends the name of every state file this rank queues to RUN/.state-writes-<rank> (one a line),
    so a test sees every save, also those that later ones made obsolete and removed."""

    def on_train_start(self, trainer, pl_module) -> None:
        checkpoint = trainer.checkpoint_callback
        original = checkpoint._write
        record = Path(trainer.default_root_dir) / f".state-writes-{trainer.global_rank}"

        def write(path, job, done=None):
            if path.suffix == ".ckpt":
                with record.open("a") as stream:
                    stream.write(path.name + "\n")
            return original(path, job, done)

        checkpoint._write = write


class RecordMomentsOnDisk(Callback):
    """After every step of rank `rank`: wait until its checkpoint files are on disk, let the checkpoint
    tidy up now, and append {"step", "moments": [phase-PPPP/<task>.safetensors, ...]} to RUN/.moments-on-disk
    (as a user listing checkpoints/moments right after each save would find it, once it is tidied)."""

    def __init__(self, rank: int = 0) -> None:
        self.rank = rank

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_rank != self.rank:
            return
        checkpoint = trainer.checkpoint_callback
        checkpoint.flush()
        checkpoint.tidy(trainer, force=True)
        checkpoint.flush()
        run = Path(trainer.default_root_dir)
        moments = sorted(str(p.relative_to(run / "checkpoints" / "moments"))
                         for p in (run / "checkpoints" / "moments").glob("phase-*/*.safetensors"))
        with (run / ".moments-on-disk").open("a") as stream:
            stream.write(json.dumps({"step": trainer.global_step, "moments": moments}) + "\n")


class SleepEachStep(Callback):
    """A slow step: sleep `seconds` at the end of every optimiser step of this process (a public hook,
    trainer.callbacks, so the step time mima measures includes it). With `sync_timeout`, the syncs'
    base timeout (--collective_timeout's part in StopAgreement) becomes that many seconds once training
    starts; the process group's rendezvous keeps --collective_timeout, since on a loaded machine a few
    seconds are not enough for the processes to meet."""

    def __init__(self, seconds: float, sync_timeout: float | None = None) -> None:
        self.seconds, self.sync_timeout = seconds, sync_timeout

    def on_train_start(self, trainer, pl_module) -> None:
        if self.sync_timeout is not None:
            trainer.strategy.stop.timeout_s = self.sync_timeout

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        time.sleep(self.seconds)


# ============================================= uninterrupted reference runs (the session fixture's body)
# (devices, tasks, model options) -> the reference run's folder
REFERENCE_RUNS: dict[tuple, Path] = {}


def reference_runs(tmp_path_factory, small_clip):
    """The `reference` fixture (tests/conftest.py, session-scoped): uninterrupted runs, computed once per
    test session and (devices, tasks, model options), whichever test file asks first."""
    cache: dict = {}
    root = tmp_path_factory.mktemp("reference")
    REFERENCE_RUNS.clear()

    def get(devices: int, tasks: list[str], model: dict | None = None):
        key = (devices, tuple(tasks), tuple(sorted((model or {}).items())))
        if key not in cache:
            name = f"w{devices}-{len(tasks)}-{len(cache)}"
            out = root / name
            result = run_job(write_config(root / f"{name}.yaml", small_clip, tasks, devices, model=model), out)
            assert result.returncode == 0, result.stderr[-3000:]
            cache[key] = finals(out, tasks)
            REFERENCE_RUNS[key] = out
        return cache[key]

    return get


class ShouldStopAtStep(Callback):
    """Ask Lightning to end training after step `step` (as a user's early-stopping callback would),
    without a stop request of mima's."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            trainer.should_stop = True


def assert_killed_and_resumed_ends_as(tmp_path: Path, clip: str, tasks: list[str], model: dict, expected: dict,
                                      step: int = 20) -> None:
    """A W = 2 run of `model`'s options, SIGKILLed at `step` and resumed with --ckpt_path last, ends with
    the task models `expected`."""
    out = tmp_path / "killed"
    killed = run_job(write_config(tmp_path / "kill.yaml", clip, tasks, 2, [("KillAtStep", {"step": step})], model=model), out)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    resumed = run_job(write_config(tmp_path / "resume.yaml", clip, tasks, 2, model=model), out, "--ckpt_path", "last")
    assert resumed.returncode == 0 and "resuming from" in resumed.stdout, resumed.stderr[-3000:]
    assert_identical(finals(out, tasks), expected)



def assert_merge_flags_refused(tmp_path: Path, capsys, flags: list[str], fragment: str) -> None:
    """`mima merge FLAGS` over two small block models: exit 2, one stderr line holding `fragment`, no output."""
    from mima.cli import main

    base, models = block_models(2, seed=10)
    base_path, paths = save_models(tmp_path, base, models)
    out = tmp_path / "out.safetensors"
    code = main(["merge", *flags, "--base", str(base_path), "--models", *map(str, paths), "--output", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and fragment in err[0], err
    assert not out.exists()
