"""Shared fixtures: a small open_clip CLIP saved like a downloaded checkpoint, and a private cache."""

from __future__ import annotations

import json
import os
from pathlib import Path

# before torch is loaded (open_clip loads it), as mima/__init__.py sets it for the commands: waiting
# OpenMP threads sleep, so a test process on a busy machine is not held up by threads spinning elsewhere
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import open_clip  # noqa: E402
import pytest
import torch

from mima.config.trust import TRUST_ENV
from mima.core.safetensors_io import load_state_dict, save_state_dict

# The test configs name the tests' own fault-injection callbacks (tests.helpers.KillAtStep, ...): code
# outside mima's list (mima.config.trust), trusted here for every job the tests start.
# tests/test_config_trust.py runs without it.
os.environ[TRUST_ENV] = "1"

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


@pytest.fixture(scope="session", autouse=True)
def private_cache(tmp_path_factory) -> Path:
    """Every test session pretrains/caches into its own folder: no state leaks in from ~/.cache.

    Under pytest-xdist each worker has its own cache, except for the embedded models: their folder is
    one per test run, shared by the workers (a link), so the tiny CLIP is pretrained once per run, by
    whichever worker needs it first (mima.models.embedded locks the build)."""
    cache = tmp_path_factory.mktemp("mima-cache")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = tmp_path_factory.getbasetemp().parent / "mima-embedded"  # the run's folder above the workers'
        shared.mkdir(exist_ok=True)
        (cache / "embedded").symlink_to(shared, target_is_directory=True)
    patcher = pytest.MonkeyPatch()
    patcher.setenv("MIMA_CACHE_DIR", str(cache))
    yield cache
    patcher.undo()


@pytest.fixture(scope="session", autouse=True)
def threads_per_worker():
    """With pytest-xdist, each worker computes with its share of the cores (1 thread each for -n 2 on 2
    cores), and so do the processes its tests start (OMP_NUM_THREADS). torch's default is every core
    per process: two workers at 2 threads each on 2 cores made OpenMP threads spin-wait for descheduled
    peers: a matmul loop took 2.2x its CPU time beside one busy core, and the whole suite (-n 2 on 2 cores)
    took 1656 CPU-seconds with torch's default and 1449 with one thread per worker, all else equal."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers < 1:
        yield
        return
    threads = max(1, (os.cpu_count() or 1) // workers)
    saved = torch.get_num_threads()
    patcher = pytest.MonkeyPatch()
    patcher.setenv("OMP_NUM_THREADS", str(threads))
    torch.set_num_threads(threads)
    yield
    torch.set_num_threads(saved)
    patcher.undo()


@pytest.fixture(scope="session", autouse=True)
def job_server(private_cache, threads_per_worker):
    """tests/helpers.py's run_job starts a multi-process job's first process as a fork of a process that
    has imported torch and Lightning once (tests/job_server.py), for jobs in this session's environment."""
    from tests.helpers import JOB_SERVER, job_environment

    JOB_SERVER.environment = job_environment()
    yield
    JOB_SERVER.stop()


# The same text tower with a timm image tower that has BatchNorm (running statistics are buffers).
BATCHNORM_CLIP_CFG = {
    "embed_dim": 32,
    "vision_cfg": {"timm_model_name": "resnet10t", "timm_model_pretrained": False,
                   "timm_pool": "avg", "timm_proj": "linear", "image_size": 16},
    "text_cfg": SMALL_CLIP_CFG["text_cfg"],
}


@pytest.fixture(scope="session")
def batchnorm_clip(tmp_path_factory) -> str:
    folder = save_local_dir_clip(tmp_path_factory.mktemp("batchnorm-clip"), BATCHNORM_CLIP_CFG, seed=11)
    return f"local-dir:{folder}"


@pytest.fixture(scope="session")
def small_clip(tmp_path_factory) -> str:
    """`local-dir:` name of a small random CLIP, loaded through open_clip's checkpoint path."""
    folder = save_local_dir_clip(tmp_path_factory.mktemp("small-clip"), SMALL_CLIP_CFG, seed=7)
    return f"local-dir:{folder}"


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


# ------------------------------------------------------------------ merge inputs (mima merge and the Python API)
@pytest.fixture(scope="module")
def encoders(tmp_path_factory, small_clip) -> dict[str, Path]:
    """theta_0 and two fine-tuned-like image encoders of the small CLIP, as safetensors files."""
    base = {k: v.clone() for k, v in open_clip.create_model(small_clip).visual.state_dict().items()}
    return write_encoders(tmp_path_factory.mktemp("encoders"), base, scale=0.01)


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


@pytest.fixture(scope="session")
def reference(tmp_path_factory, small_clip):
    """Uninterrupted runs shared by every test file of the session (tests.helpers.reference_runs)."""
    from tests.helpers import reference_runs  # here: tests.helpers imports this module

    return reference_runs(tmp_path_factory, small_clip)


# The files that take longest, longest first (seconds of one pytest process on the 2-core machine,
# measured 2026-11-27, the files of issue 47 added 2026-11-28; docs/testing.md). They are collected first, and with `--dist loadfile
# --no-loadscope-reorder` (pyproject.toml) pytest-xdist hands files to its workers in collection
# order: longest first, so that no long file starts last while the other worker sits idle.
LONGEST_FILES = (
    "test_distributed.py", "test_slurm.py", "test_trackers.py", "test_demo.py", "test_task_budgets.py",
    "test_checkpoint_schedule.py", "test_batch_tasks.py",
    "test_embedded.py", "test_resource_plan.py", "test_gpu_suite.py", "test_accumulation.py", "test_evaluate_cells.py",
    "test_clip_configs.py", "test_disk_refusals.py", "test_run_lock.py", "test_image_folder.py", "test_data_cache.py",
    "test_evaluate_cache.py", "test_joint.py", "test_offline_suite.py",
)


def pytest_collection_modifyitems(config, items):
    """The longest files first (LONGEST_FILES; a stable sort keeps the order inside each file).

    Tests marked `heavy` (paper-scale, over 10 minutes on 2 cores) run only when the -m expression
    names them (`pytest -m heavy`). Not done with `-m 'not heavy'` in addopts: a `-m "not slow"` on the
    command line replaces that expression, and would run them."""
    rank = {name: index for index, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
    if "heavy" in (config.getoption("markexpr") or ""):
        return
    heavy = [item for item in items if item.get_closest_marker("heavy") is not None]
    if heavy:
        config.hook.pytest_deselected(items=heavy)
        items[:] = [item for item in items if item.get_closest_marker("heavy") is None]
