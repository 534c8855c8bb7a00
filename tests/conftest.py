"""Shared fixtures: a private cache, threads per worker, the job server, the small CLIP saved like a
downloaded checkpoint, the merge inputs and runs several test files use, and the collection order.
Plain functions and values the tests share live in tests/helpers.py."""

from __future__ import annotations

import os
from pathlib import Path

# before torch is loaded (open_clip loads it), as mima/__init__.py sets it for the commands: waiting
# OpenMP threads sleep, so a test process on a busy machine is not held up by threads spinning elsewhere
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import open_clip  # noqa: E402
import pytest
import torch
import yaml

from mima.config.trust import TRUST_ENV

# The test configs name the tests' own fault-injection callbacks (tests.helpers.KillAtStep, ...): code
# outside mima's list (mima.config.trust), trusted here for every job the tests start.
# tests/config/test_config_trust.py runs without it.
os.environ[TRUST_ENV] = "1"

from tests.helpers import (BATCHNORM_CLIP_CFG, JOB_SERVER, SMALL_CLIP_CFG, ClipTaskModels, fit_config,  # noqa: E402
                           job_environment, reference_runs, save_local_dir_clip, save_models, write_encoders)

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
    JOB_SERVER.environment = job_environment()
    yield
    JOB_SERVER.stop()


@pytest.fixture(scope="session")
def batchnorm_clip(tmp_path_factory) -> str:
    folder = save_local_dir_clip(tmp_path_factory.mktemp("batchnorm-clip"), BATCHNORM_CLIP_CFG, seed=11)
    return f"local-dir:{folder}"


@pytest.fixture(scope="session")
def small_clip(tmp_path_factory) -> str:
    """`local-dir:` name of a small random CLIP, loaded through open_clip's checkpoint path."""
    folder = save_local_dir_clip(tmp_path_factory.mktemp("small-clip"), SMALL_CLIP_CFG, seed=7)
    return f"local-dir:{folder}"


# ------------------------------------------------------------------ merge inputs (mima merge and the Python API)
@pytest.fixture(scope="module")
def encoders(tmp_path_factory, small_clip) -> dict[str, Path]:
    """theta_0 and two fine-tuned-like image encoders of the small CLIP, as safetensors files."""
    base = {k: v.clone() for k, v in open_clip.create_model(small_clip).visual.state_dict().items()}
    return write_encoders(tmp_path_factory.mktemp("encoders"), base, scale=0.01)


# ------------------------------------------------------------------ the small CLIP on two digits tasks
@pytest.fixture(scope="session")
def digits_pool(small_clip):
    """The task pool (mima.pools) of the small CLIP, without pretrained weights, on the digits tasks rot90
    and mirror."""
    from mima.pools import task_pool

    return task_pool({"model": {"clip": small_clip, "pretrained": None}, "data": {"suite": "digits", "tasks": ["rot90", "mirror"]}})


@pytest.fixture(scope="session")
def clip_task_models(tmp_path_factory, small_clip, digits_pool):
    """theta_0 of digits_pool's encoder and two perturbed copies standing in for task models, in memory
    and as files, with the pool's config (tests.helpers.ClipTaskModels). Tests only read them."""
    folder = tmp_path_factory.mktemp("clip-task-models")
    config = {"model": {"clip": small_clip, "pretrained": None}, "data": {"suite": "digits", "tasks": ["rot90", "mirror"]}}
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    base = {k: v.detach().clone() for k, v in digits_pool.encoder.state_dict().items()}
    models = []
    for seed in (1, 2):
        g = torch.Generator().manual_seed(seed)
        models.append({k: v + 0.05 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v for k, v in base.items()})
    base_path, paths = save_models(folder, base, models)
    return ClipTaskModels(folder / "config.yaml", base, models, base_path, paths)


# ------------------------------------------------------------------ finished runs to evaluate, merge, analyse
@pytest.fixture(scope="session")
def two_runs(tmp_path_factory, small_clip) -> list[Path]:
    """Two finished runs of the small CLIP on the digits tasks rot90 and mirror with S = 4, N = 1 and N = 2
    (folders N1 and N2), trained once per test process for every file that evaluates, merges, analyses
    or reports finished runs. Tests only read them; one that changes a run changes a copy."""
    from mima.commands.fit.run import run_fit

    folder = tmp_path_factory.mktemp("two-runs")
    return [run_fit(fit_config(folder / f"N{n}", small_clip, ["rot90", "mirror"], steps=4, iterations=n)).run_dir
            for n in (1, 2)]


@pytest.fixture(scope="session")
def reference(tmp_path_factory, small_clip):
    """Uninterrupted runs shared by every test file of the session (tests.helpers.reference_runs)."""
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
