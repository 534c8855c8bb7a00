"""Merges on a device, and the file engine's reading ahead.

`mima merge --device cpu` writes the bytes the engine wrote before it had devices or read ahead
(hashes recorded from that code for the strategies whose arithmetic is entry by entry, which are the
same bytes on any CPU; the SVD-based ones against the pre-change operations written again in plain
torch); every entry point runs the same functions with an explicit CPU device; an absent device is
refused before any file is opened; reading ahead changes no byte and holds at most two groups; and,
on a machine with CUDA, every data-free and per-task strategy on the GPU equals the CPU within 1e-5.
"""

from __future__ import annotations

import hashlib
import math
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from mima.cli import main
from mima.core.safetensors_io import load_state_dict, save_state_dict
from mima.core.tensor_files import SafetensorsReader
from mima.merging import MERGE_METHODS, get_method

# A small open_clip-like image tower: CART's matrices (attn/mlp weights), other 2-D tensors (Iso-C's and
# TSV's too), a 4-D convolution, half-precision vectors, and an integer buffer that every merge copies.
SHAPES: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "conv1.weight": ((8, 3, 2, 2), torch.float32),
    "class_embedding": ((8,), torch.float32),
    "positional_embedding": ((5, 8), torch.float32),
    "transformer.resblocks.0.ln_1.weight": ((8,), torch.bfloat16),
    "transformer.resblocks.0.attn.in_proj_weight": ((24, 8), torch.float32),
    "transformer.resblocks.0.attn.in_proj_bias": ((24,), torch.float32),
    "transformer.resblocks.0.attn.out_proj.weight": ((8, 8), torch.float32),
    "transformer.resblocks.0.mlp.c_fc.weight": ((32, 8), torch.float32),
    "transformer.resblocks.0.mlp.c_proj.weight": ((8, 32), torch.float32),
    "transformer.resblocks.1.mlp.c_fc.weight": ((32, 8), torch.float32),
    "transformer.resblocks.1.mlp.c_fc.bias": ((32,), torch.float16),
    "proj": ((8, 4), torch.float32),
    "num_batches_tracked": ((), torch.int64),
}

# The merged tensors' hashes (content_hash) that `mima merge` wrote for write_inputs' files, with each
# method's defaults, before devices and reading ahead (commit db3a254's code, recorded 2026-11-27).
# Their arithmetic is entry by entry, so these bytes are the same on every CPU and thread count.
BEFORE = {
    "uniform": "7e64ab1480396fd99981b9fa1268e43b5c501773d7c48cb395b8e828d2ee7c52",
    "task_arithmetic": "013f4d3728d8ec5b33b1267390458049559e936ea1b9aaf9a9bd369eddbcff52",
    "ties": "80479f37496c8bef01445426bd4c8e69a69b0cb089dc0cfc01bd4d290059020a",
    "dare_ties": "fe3c6c2facc03fe9d4e717255a374bb14c8129e8efbc8e52b9e2a24645312f76",
    "dare_task_arithmetic": "3519297ce1f7b3c664586e8086a61591848d2ad4bc2be6c3b925384e48089fee",
    "consensus": "627ff593fd0c27b66e6742c7ab244ffd67f5841942235698d23ef0ea51b9b416",
    "magmax": "a04d8a5f72b137673e20b44782d855101d8a681c266cebc8f356601a4ef86b6c",
    "breadcrumbs": "7a5f0a845bf90c3409bcd5fb0b7450dfecc8ec9eff5c856bf44c227c75deae8d",
    "della": "562d00a2a5e82de0b01eac724c46ecc70c14a32a61f5bbf70abdf70169b3e8d6",
}
DATA_FREE = sorted(name for name, method in MERGE_METHODS.items() if not method.needs_data and not method.per_task)
PER_TASK = sorted(name for name, method in MERGE_METHODS.items() if method.per_task)
CUDA = torch.cuda.is_available()


def spread(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Values in [-1, 1) from integer arithmetic alone: the same bytes on every machine and torch version."""
    index = torch.arange(math.prod(shape), dtype=torch.int64)
    mixed = (index * 2654435761 + seed * 97531 + 12345) % 2**32
    mixed = ((mixed ^ (mixed >> 15)) * 2246822519) % 2**32
    mixed = mixed ^ (mixed >> 13)
    return (mixed.double() / 2**31 - 1.0).float().reshape(shape)


def make_models(tasks: int = 3, shapes=SHAPES) -> tuple[dict, list[dict]]:
    """theta_0 and `tasks` models at theta_0 + 0.1 * spread, in each tensor's dtype."""
    base = {key: (spread(shape, 1000 + i).to(dtype) if dtype.is_floating_point else torch.tensor(7))
            for i, (key, (shape, dtype)) in enumerate(shapes.items())}
    models = [{key: (value.float() + 0.1 * spread(value.shape, 10 * t + i)).to(value.dtype)
               if value.is_floating_point() else value.clone() for i, (key, value) in enumerate(base.items())}
              for t in range(tasks)]
    return base, models


def write_inputs(folder: Path, tasks: int = 3) -> tuple[Path, list[Path]]:
    base, models = make_models(tasks)
    paths = [folder / "base.safetensors"] + [folder / f"task{t}.safetensors" for t in range(tasks)]
    for path, state in zip(paths, [base, *models]):
        save_state_dict(path, state)
    return paths[0], paths[1:]


def content_hash(path: Path) -> str:
    """sha256 of a safetensors file's tensors (names, dtypes, shapes and bytes, in file order), not of its
    metadata, which names the input files."""
    digest = hashlib.sha256()
    with SafetensorsReader(path) as reader:
        for key in reader:
            tensor = reader[key]
            digest.update(f"{key} {tensor.dtype} {tuple(tensor.shape)}\n".encode())
            digest.update(tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> tuple[Path, list[Path]]:
    return write_inputs(tmp_path_factory.mktemp("device-inputs"))


def merge_file(method: str, inputs, output: Path, *extra: str) -> Path:
    base, models = inputs
    code = main(["merge", "--method", method, "--base", str(base), "--models", *map(str, models),
                 "--output", str(output), *extra])
    assert code == 0
    return output


def assert_same(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and a[key].device == b[key].device, key
        assert torch.equal(a[key], b[key]), key


# ------------------------------------------------------------------ the CPU: the bytes of before
@pytest.mark.parametrize("method", sorted(BEFORE))
def test_device_cpu_writes_the_bytes_written_before_devices(method, inputs, tmp_path):
    output = merge_file(method, inputs, tmp_path / "merged.safetensors", "--device", "cpu")
    assert content_hash(output) == BEFORE[method]
    if not CUDA:  # the default, auto, is the CPU here
        assert content_hash(merge_file(method, inputs, tmp_path / "auto.safetensors")) == BEFORE[method]


def old_svd(matrix: torch.Tensor):
    return torch.linalg.svd(matrix.float(), full_matrices=False)


def old_mean(models: list[dict], key: str) -> torch.Tensor:
    first = models[0][key]
    total = torch.zeros(first.shape, dtype=torch.promote_types(first.dtype, torch.float32))
    total += first
    for model in models[1:]:
        total += model[key]
    return (total / len(models)).to(first.dtype)


def old_scaled(anchor: torch.Tensor, direction: torch.Tensor, lam: float) -> torch.Tensor:
    return (anchor.to(direction.dtype) + lam * direction).to(anchor.dtype)


def before_cart(base, models, lam=1.0, rank_ratio=0.08) -> dict:
    """CART as the code before the change ran it, operation for operation (defaults: rank 8% of min(m, n))."""
    merged = {}
    for key, first in models[0].items():
        if not first.is_floating_point():
            merged[key] = first.clone()
            continue
        average = old_mean(models, key)
        if first.ndim != 2 or not (("attn" in key or "mlp" in key) and "ln" not in key and "bias" not in key):
            merged[key] = average.clone()
            continue
        rank = min(min(average.shape), max(1, math.floor(rank_ratio * min(average.shape) + 1e-9)))
        total = torch.zeros(average.shape, dtype=torch.float32)
        for model in models:
            u, s, vh = old_svd(model[key].float() - average.float())
            total += (u[:, :rank] * s[:rank]) @ vh[:rank]
        merged[key] = old_scaled(average, total, lam)
    return merged


def before_svd_merge(base, models, matrix_merge, lam=1.0) -> dict:
    """theta_0 + lam * (matrix_merge(taus) on 2-D tensors but the text projection, mean tau elsewhere)."""
    merged = {}
    for key, anchor in base.items():
        if not anchor.is_floating_point():
            merged[key] = anchor.clone()
            continue
        taus = [model[key].float() - anchor.float() for model in models]
        direction = matrix_merge(taus) if anchor.ndim == 2 else torch.stack(taus).mean(dim=0)
        merged[key] = old_scaled(anchor, direction, lam)
    return merged


def before_iso_c(taus: list[torch.Tensor]) -> torch.Tensor:
    u, s, vh = old_svd(torch.stack(taus).sum(dim=0))
    return (u * s.mean()) @ vh


def before_polar(matrix: torch.Tensor) -> torch.Tensor:
    u, _, vh = old_svd(matrix)
    return u @ vh


def before_tsv(taus: list[torch.Tensor]) -> torch.Tensor:
    parts = [old_svd(tau) for tau in taus]
    k = int(parts[0][1].numel() / len(taus))
    u_blocks, s_blocks, v_blocks = (torch.zeros_like(parts[0][0]), torch.zeros_like(parts[0][1]),
                                    torch.zeros_like(parts[0][2]))
    for index, (u, s, vh) in enumerate(parts):
        u_blocks[:, index * k:(index + 1) * k] = u[:, :k]
        s_blocks[index * k:(index + 1) * k] = s[:k]
        v_blocks[index * k:(index + 1) * k, :] = vh[:k, :]
    return before_polar(u_blocks) @ torch.diag(s_blocks) @ before_polar(v_blocks)


BEFORE_SVD = {
    "cart": lambda base, models: before_cart(base, models),
    "iso_c": lambda base, models: before_svd_merge(base, models, before_iso_c),
    "tsv": lambda base, models: before_svd_merge(base, models, before_tsv),
}


@pytest.mark.parametrize("method", sorted(BEFORE_SVD))
def test_device_cpu_is_the_svd_merges_operations_of_before_bit_for_bit(method, inputs, tmp_path):
    """The SVD's rounding follows the CPU and its thread count, so these are compared on this machine
    with the operations the code before the change ran, written again in plain torch."""
    base, models = make_models()
    expected = BEFORE_SVD[method](base, models)
    assert_same(load_state_dict(merge_file(method, inputs, tmp_path / "merged.safetensors", "--device", "cpu")), expected)


# ------------------------------------------------------------ the same functions, an explicit device
@pytest.mark.parametrize("method", DATA_FREE + PER_TASK)
def test_an_explicit_cpu_device_runs_the_same_functions_to_the_same_bytes(method):
    from mima.merging.common import DeviceView, FiniteView

    base, models = make_models()
    strategy = get_method(method)
    cpu = torch.device("cpu")
    checked = strategy.check(models, base, device=cpu)  # what the strategy reads: moved to the device on read
    assert isinstance(checked.models[0], FiniteView) and isinstance(checked.models[0].model, DeviceView)
    plain = strategy(models, base)
    assert_same(strategy(models, base, device=cpu), plain)
    assert_same(strategy.on("cpu")(models, base), plain)
    if not strategy.per_task:
        assert_same(dict(strategy.stream(models, base, device=cpu)), plain)


# The strategies whose arithmetic never looks at a value (no threshold, norm or mask moved to the CPU),
# so that they run on the meta device, which holds shapes and no data. The others are checked on a GPU.
SHAPE_ONLY = ["breadcrumbs", "cart", "cart_indexing", "consensus", "dare_task_arithmetic", "della", "iso_c", "iso_cts",
              "lines", "magmax", "svc", "task_arithmetic", "tsv", "uniform"]


@pytest.mark.parametrize("method", SHAPE_ONLY)
def test_strategies_compute_on_the_device_their_inputs_are_read_onto(method):
    """On the meta device: a tensor a strategy made on the CPU instead (a torch.zeros without device)
    would either refuse to meet the moved inputs or leave a CPU tensor in the result."""
    base, models = make_models()
    strategy = get_method(method)
    checked = strategy.check(models, base, allow_non_finite=True, device=torch.device("meta"))
    if strategy.per_task:
        result = strategy.index_fn(checked.models, checked.base, **checked.values)
    else:
        result = dict(strategy.run(checked.models, checked.base, checked.values))
    expected = strategy(models, base)
    assert sorted(result) == sorted(expected)
    for key, tensor in result.items():
        assert tensor.device.type == "meta", key
        assert (tensor.shape, tensor.dtype) == (expected[key].shape, expected[key].dtype), key


@pytest.mark.parametrize("method", ["cart", "ties", "iso_c"])
def test_sweeps_and_selection_on_a_device_give_the_undeviced_directions(method):
    from mima.merging.selection import select_on_validation

    base, models = make_models()
    strategy = get_method(method)
    settings = {"rank_ratio": (0.25, 0.5)} if method == "cart" else {}
    for (s1, a1, d1), (s2, a2, d2) in zip(strategy.sweep(models, base, settings),
                                          strategy.sweep(models, base, settings, device=torch.device("cpu")), strict=True):
        assert s1 == s2
        assert_same(a1, a2)
        assert_same(d1, d2)
    score = lambda merged: -float(sum(t.float().square().sum() for t in merged.values()))  # noqa: E731
    chosen = select_on_validation(strategy.on(torch.device("cpu")), models, base, score)
    assert_same(chosen.merged, select_on_validation(strategy, models, base, score).merged)


def test_cart_indexing_stores_the_svd_factors_as_they_always_were():
    """The index holds U_r S_r and V_r exactly as the SVD gives them (the CPU's bytes of before devices)."""
    base, models = make_models()
    index = get_method("cart_indexing")(models, base)
    lefts = [key for key in index if key.endswith("/left")]
    assert lefts
    for key in lefts:
        task, name = int(key.split("/")[0][len("task"):]), key.split("/")[1]
        u, s, vh = old_svd(models[task][name].float() - index["avg/" + name].float())
        rank = index[key].shape[1]
        assert torch.equal(index[key], (u[:, :rank] * s[:rank]).contiguous()), key
        assert torch.equal(index[key[:-len("left")] + "right"], vh[:rank].contiguous()), key


# --------------------------------------------------------------------------- an absent device
def absent_devices() -> list[str]:
    count = torch.cuda.device_count() if CUDA else 0
    return [f"cuda:{count}", f"cuda:{count + 3}"] + ([] if CUDA else ["cuda"])


@pytest.mark.parametrize("device", absent_devices())
def test_an_absent_device_is_one_line_before_any_file_is_opened(device, tmp_path, capsys):
    output = tmp_path / "merged.safetensors"
    missing = [str(tmp_path / "nothing-here.safetensors"), str(tmp_path / "nor-here.safetensors")]
    code = main(["merge", "--method", "task_arithmetic", "--base", missing[0], "--models", *missing,
                 "--output", str(output), "--device", device])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"mima merge: error: --device {device}: "), err[0]
    assert "nothing-here" not in err[0]  # the inputs (missing here) were never opened
    assert not output.exists() and list(tmp_path.iterdir()) == []


def test_merge_device_resolves_the_spellings():
    from mima.core.errors import MimaError
    from mima.merging.engine import merge_device

    assert merge_device("cpu") == torch.device("cpu") and merge_device("CPU") == torch.device("cpu")
    assert merge_device("auto") == (torch.device("cuda", 0) if CUDA else torch.device("cpu"))
    with pytest.raises(MimaError, match=r"^--merge-device gpu: expected auto, cpu, cuda or cuda:N$"):
        merge_device("gpu", "--merge-device")


def test_a_misspelt_device_is_an_argument_error_before_torch_loads(tmp_path):
    wrapper = ("import sys\nfrom mima.cli import main\ncode = main(sys.argv[1:])\n"
               "print('TORCH', 'torch' in sys.modules)\nsys.exit(code)\n")
    done = subprocess.run([sys.executable, "-c", wrapper, "merge", "--method", "uniform", "--models", "a", "b",
                           "--output", str(tmp_path / "o"), "--device", "gpu"], capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.strip() == ("mima merge: error: argument --device: expected auto, cpu, cuda or cuda:N, got 'gpu' "
                                   "(see mima merge --help)")
    assert done.stdout.strip() == "TORCH False"


# ----------------------------------------------------------------------------- reading ahead
@pytest.mark.parametrize("method", ["task_arithmetic", "ties", "lines", "cart", "tsv", "model_stock"])
def test_reading_ahead_writes_the_bytes_of_direct_reads(method, inputs, tmp_path):
    from mima.merging.engine import merge_to_file, open_inputs

    base, models = inputs
    outputs = []
    for prefetch in (True, False):
        outputs.append(tmp_path / f"prefetch-{prefetch}.safetensors")
        with open_inputs(models, base, prefetch=prefetch) as opened:
            assert opened.prefetching is prefetch
            merge_to_file(get_method(method), opened, outputs[-1], {}, {"method": method})
    assert outputs[0].read_bytes() == outputs[1].read_bytes()


class RecordingSource(dict):
    """A dict of tensors that records which thread read which key (a real mapping, read as the
    prefetcher reads a file's reader)."""

    def __init__(self, tensors: dict) -> None:
        super().__init__(tensors)
        self.reads: list[tuple[str, str]] = []

    def __getitem__(self, key: str) -> torch.Tensor:
        self.reads.append((key, threading.current_thread().name))
        return super().__getitem__(key).clone()  # each read its own tensor, as SafetensorsReader gives


def test_the_prefetcher_reads_the_next_group_in_the_background_and_holds_two_groups_at_most():
    from mima.core.tensor_files import GroupPrefetcher

    base, models = make_models(tasks=3)
    order = list(base)
    sources = [RecordingSource(state) for state in (base, *models)]
    generator = torch.Generator().manual_seed(0)
    requests = [(source, key) for key in order for source in range(4)]  # a streamed merge's order
    requests += [(1, key) for key in order] + [(0, order[3]), (2, order[3]), (2, order[3])]  # a pass, a jump, a repeat
    draws = torch.randint(4 * len(order), (40,), generator=generator).tolist()
    requests += [(draw % 4, order[draw // 4]) for draw in draws]  # anything at all
    with GroupPrefetcher(sources, order, inspect=lambda tensor: float(tensor.float().sum())) as prefetcher:
        for source, key in requests:
            tensor, verdict = prefetcher.read_inspected(source, key)
            expected = [base, *models][source][key]
            assert torch.equal(tensor, expected) and tensor.data_ptr() != expected.data_ptr()
            assert verdict is None or verdict == float(expected.float().sum())
            assert len(prefetcher.served) + len(prefetcher.ahead) <= 2 * len(sources)
    background = [key for source in sources for key, thread in source.reads if thread.startswith("mima-prefetch")]
    in_order = {key for key, thread in sources[2].reads[: len(order)] if thread.startswith("mima-prefetch")}
    assert set(order[1:]) <= in_order  # during the streamed pass, every key after the first was read ahead
    assert len(background) >= 3 * len(order)


# ------------------------------------------------------------------ entry-wise strategies' threads
@pytest.mark.parametrize("method", sorted(name for name, m in MERGE_METHODS.items() if m.entrywise))
def test_entrywise_strategies_give_the_same_bytes_on_one_thread_or_two(method):
    """The file engine computes these on one core fewer while it reads ahead (MergeMethod.entrywise):
    their result must not depend on the thread count (tensors large enough for torch to split)."""
    shapes = {"blocks.0.mlp.weight": ((384, 256), torch.float32), "blocks.1.mlp.weight": ((384, 256), torch.float32),
              "blocks.0.ln.weight": ((256,), torch.bfloat16), "count": ((), torch.int64)}
    base, models = make_models(tasks=3, shapes=shapes)
    saved = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append(get_method(method)(models, base))
    finally:
        torch.set_num_threads(saved)
    assert_same(*results)


# --------------------------------------------------------------------------------- on a GPU
def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    difference = (got.double() - expected.double()).norm()
    return float(difference / expected.double().norm()) if float(expected.double().norm()) > 0 else float(difference)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device (the GPU machine runs it)")
@pytest.mark.parametrize("method", DATA_FREE + PER_TASK)
def test_the_gpu_equals_the_cpu_within_1e_5(method):
    base, models = make_models(tasks=4)
    strategy = get_method(method)
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True  # as evaluation sets it: the merge must not use TF32
    try:
        on_gpu = strategy(models, base, device=torch.device("cuda"))
        assert torch.backends.cuda.matmul.allow_tf32  # switched off for the merge only
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    on_cpu = strategy(models, base, device=torch.device("cpu"))
    if strategy.per_task:  # an index's SVD factors may differ by a pair's sign: compare the task models
        on_gpu = {f"{t}/{k}": v for t in range(len(models)) for k, v in strategy.reconstruct(on_gpu, t).items()}
        on_cpu = {f"{t}/{k}": v for t in range(len(models)) for k, v in strategy.reconstruct(on_cpu, t).items()}
    assert list(on_gpu) == list(on_cpu)
    for key in on_cpu:
        assert on_gpu[key].device.type == "cpu" and on_gpu[key].dtype == on_cpu[key].dtype, key
        if not on_cpu[key].is_floating_point():
            assert torch.equal(on_gpu[key], on_cpu[key]), key
        else:
            assert relative_error(on_gpu[key], on_cpu[key]) <= 1e-5, (key, relative_error(on_gpu[key], on_cpu[key]))


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device (the GPU machine runs it)")
@pytest.mark.parametrize("method", ["task_arithmetic", "ties", "cart", "tsv", "iso_c"])
def test_mima_merge_on_the_gpu_writes_the_cpu_file_within_1e_5(method, inputs, tmp_path):
    on_gpu = load_state_dict(merge_file(method, inputs, tmp_path / "gpu.safetensors", "--device", "cuda"))
    on_cpu = load_state_dict(merge_file(method, inputs, tmp_path / "cpu.safetensors", "--device", "cpu"))
    for key in on_cpu:
        assert relative_error(on_gpu[key], on_cpu[key]) <= 1e-5, key
