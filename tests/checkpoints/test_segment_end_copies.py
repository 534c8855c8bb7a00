"""The segment-end path copies states into reused host buffers, and a process with one task keeps
its moments in the optimiser (issue "First contact with a GPU cluster", item 5).

At a segment end the sync callback keeps the task's end weights and (optimizer_state: keep) its
AdamW moments in host memory, then readies the optimiser for the next segment. Allocating host
tensors there at every segment end means pageable memory on a GPU (a staged, synchronous copy);
loading a one-task process's own moments back means copying 2 encoder sizes out and in again for
nothing. A short one-process `mima fit` runs with a probe that profiles the two steps of that path
(MimaSyncCallback._end_segment and _prepare_optimizer) with torch.profiler's memory events, and
counts the optimiser's `load_state_dict` calls by wrapping the real optimiser's method.

The reused buffers are written by the checkpoint writer's thread as they are: a buffer must not be
refilled before that write is done. A run whose writer is held back past the next segment end
checks the bytes of every moments file against the optimiser's moments of its phase; smaller tests
check HostBuffers' wait for its reader, HostArena's carving, and (on a CUDA machine) the pinned copies.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from safetensors import safe_open
from safetensors.torch import save_file
from torch.profiler import ProfilerActivity, profile

from mima.core.safetensors_io import load_state_dict
from mima.training.background_writer import BackgroundWriter
from mima.training.checkpoint_format import state_writer
from mima.training.phase_state import HostArena, HostBuffers
from mima.training.sync import MimaSyncCallback
from mima.commands.fit.run import run_fit
from tests.helpers import assert_trained, fit_config

PATH_STEPS = ("_end_segment", "_prepare_optimizer")


class SegmentEndProbe(Callback):
    """Profiles every call of the sync callback's PATH_STEPS during training and writes one record per
    call to `path` (JSON): the phase of the step that ended, the host bytes allocated (torch.profiler's
    memory events of the calling thread), the number of aten operators run, the optimiser's
    `load_state_dict` calls made, and whether the optimiser's state tensors are the same objects after."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.records: list[dict] = []
        self.loads = 0
        self.host = None  # the sync callback's host buffers
        self.allocations: dict[str, int] = {}  # host buffer tensors allocated: before the first step, at the end

    def on_train_start(self, trainer, pl_module) -> None:
        sync = next(callback for callback in trainer.callbacks if isinstance(callback, MimaSyncCallback))
        self.host = sync.phase_view().host
        optimizer = trainer.optimizers[0]
        load = optimizer.load_state_dict

        def counted_load(state_dict) -> None:
            self.loads += 1
            load(state_dict)

        optimizer.load_state_dict = counted_load  # the real method, called through
        for name in PATH_STEPS:
            setattr(sync, name, self._profiled(name, getattr(sync, name), trainer, pl_module))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.allocations.setdefault("first_step", self.host.allocations)

    def on_train_end(self, trainer, pl_module) -> None:
        self.allocations["end"] = self.host.allocations
        self.allocations["parameters"] = len(list(pl_module.encoder.parameters()))
        Path(self.path).write_text(json.dumps({"records": self.records, "allocations": self.allocations}))

    def _profiled(self, name: str, method, trainer, pl_module):
        def run(*args, **kwargs):
            position = pl_module.plan.position(trainer.global_step - 1)
            loads, before = self.loads, _state_tensors(trainer.optimizers[0])
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
                method(*args, **kwargs)
            events = profiler.events()
            self.records.append({
                "step": name, "phase": position.phase, "slot": position.slot,
                "host_bytes": sum(max(event.self_cpu_memory_usage, 0) for event in events),
                "operators": sum(event.name.startswith("aten::") for event in events),
                "loads": self.loads - loads,
                "same_tensors": before == _state_tensors(trainer.optimizers[0]),
            })

        return run


def _state_tensors(optimizer: torch.optim.Optimizer) -> list[int]:
    """Identities of the optimiser's state tensors (those it would update in place)."""
    return [id(value) for moments in optimizer.state.values() for value in moments.values() if torch.is_tensor(value)]


def probed_fit(folder: Path, clip: str, tasks: list[str], steps: int, iterations: int) -> tuple[Path, list[dict], dict]:
    """A one-process `mima fit` (optimizer_state: keep, checkpoints at every segment end) with the probe."""
    records_file = folder / "records.json"
    config = fit_config(folder / "run", clip, tasks, steps=steps, iterations=iterations)
    config["trainer"]["callbacks"] = [{"class_path": "tests.checkpoints.test_segment_end_copies.SegmentEndProbe",
                                       "init_args": {"path": str(records_file)}}]
    run_dir = run_fit(config).run_dir
    probed = json.loads(records_file.read_text())
    return run_dir, probed["records"], probed["allocations"]


def test_host_buffers_are_reserved_before_the_first_step_and_no_segment_end_allocates(tmp_path, small_clip):
    # two tasks on one process: slot 0's segment end is not a phase end, and the optimiser moves
    # from one task's moments to the other's at every segment start
    run_dir, records, allocations = probed_fit(tmp_path, small_clip, ["rot90", "mirror"], steps=8, iterations=4)
    ends = [r for r in records if r["step"] == "_end_segment"]
    prepares = [r for r in records if r["step"] == "_prepare_optimizer"]
    assert [(r["phase"], r["slot"]) for r in ends] == [(p, s) for p in range(4) for s in range(2)]
    assert len(prepares) == 8
    # before the first step: per task slot, one buffer entry per encoder tensor (its end weights) and
    # AdamW's step, exp_avg and exp_avg_sq per parameter (its kept moments); none allocated after it
    keys = len(load_state_dict(run_dir / "pretrained.safetensors"))
    assert allocations["first_step"] == 2 * (keys + 3 * allocations["parameters"]), allocations
    assert allocations["end"] == allocations["first_step"], allocations
    # every segment end, the first phase's and the last's too, copies into them on the training
    # thread without allocating host memory (the last phase's final files are written by the
    # background writer, whose copy is not on this thread)
    assert all(r["host_bytes"] == 0 for r in ends), ends
    # the other task's moments go into the optimiser's own tensors, not through load_state_dict
    assert all(r["loads"] == 0 for r in records if r["phase"] > 0), records
    # (the first segment end leaves the next task fresh moments, the last sync none: both clear the state)
    assert all(r["same_tensors"] for r in prepares[1:-1]), prepares


def test_a_one_task_process_keeps_its_moments_in_the_optimiser(tmp_path, small_clip):
    steps, iterations = 8, 4
    run_dir, records, _ = probed_fit(tmp_path / "phases", small_clip, ["rot90"], steps=steps, iterations=iterations)
    prepares = [r for r in records if r["step"] == "_prepare_optimizer"]
    assert [r["phase"] for r in prepares] == list(range(iterations))
    # between its segments nothing is loaded, copied or even looked at by a tensor operator; after the
    # last one the optimiser's moments are dropped (nothing follows)
    for record in prepares:
        assert record["loads"] == 0 and record["operators"] == 0, record
    assert all(record["same_tensors"] for record in prepares[:-1]), prepares
    ends = [r for r in records if r["step"] == "_end_segment"]
    assert all(r["host_bytes"] == 0 for r in ends if 0 < r["phase"] < iterations - 1), ends
    # one task averaged with itself and its moments kept: N phases are one fine-tune of S steps, the
    # same bytes as the N = 1 run (which has no segment end before the last step)
    once = run_fit(fit_config(tmp_path / "once" / "run", small_clip, ["rot90"], steps=steps, iterations=1)).run_dir
    phased = load_state_dict(run_dir / "final" / "rot90.safetensors")
    single = load_state_dict(once / "final" / "rot90.safetensors")
    assert_trained({"rot90": single}, load_state_dict(once / "pretrained.safetensors"), at_least=1e-3)
    assert phased.keys() == single.keys()
    for key in single:
        assert torch.equal(phased[key], single[key]), key


# ------------------------------------------------------------------ the buffers and the checkpoint writer
class SlowMomentsWrites(Callback):
    """Holds every moments file the checkpoint writer writes back by `seconds` (past the next segment
    end, where the same host buffer is filled again) and keeps a copy of the bytes it wrote in
    `folder`/written-<phase folder>.safetensors; saves the optimiser's moments at every segment end
    before the last phase to `folder`/expected-<phase>.safetensors."""

    def __init__(self, folder: str, seconds: float) -> None:
        self.folder, self.seconds = Path(folder), seconds

    def on_train_start(self, trainer, pl_module) -> None:
        checkpoint = trainer.checkpoint_callback
        write = checkpoint._write

        def slow_moments(path: Path, job, done=None) -> None:
            if path.parent.parent.name != "moments":
                return write(path, job, done)

            def late(temporary: Path) -> None:
                time.sleep(self.seconds)
                job(temporary)
                shutil.copyfile(temporary, self.folder / f"written-{path.parent.name}.safetensors")

            return write(path, late, done)

        checkpoint._write = slow_moments

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        plan, step = pl_module.plan, trainer.global_step - 1
        phase = plan.position(step).phase
        if plan.ends_segment(step) and phase < plan.iterations - 1:
            state = trainer.optimizers[0].state_dict()["state"]
            copies = {f"{param}.{name}": value.clone() for param, moments in state.items() for name, value in moments.items()}
            save_file(copies, str(self.folder / f"expected-phase-{phase:04d}.safetensors"))


def test_a_buffer_is_not_refilled_before_the_checkpoint_writer_has_written_it(tmp_path, small_clip):
    # one task: each segment end refills the same moments buffer, 2 steps after the previous one was
    # handed to the writer, which takes 0.5 s per moments file here
    iterations = 4
    config = fit_config(tmp_path / "run", small_clip, ["rot90"], steps=8, iterations=iterations)
    config["trainer"]["callbacks"] = [{"class_path": "tests.checkpoints.test_segment_end_copies.SlowMomentsWrites",
                                       "init_args": {"folder": str(tmp_path), "seconds": 0.5}}]
    run_fit(config)
    for phase in range(iterations - 1):
        written = load_state_dict(tmp_path / f"written-phase-{phase:04d}.safetensors")
        expected = load_state_dict(tmp_path / f"expected-phase-{phase:04d}.safetensors")
        assert written.keys() == expected.keys() and len(expected) > 0
        for key, value in expected.items():
            assert torch.equal(written[key], value), (phase, key)
    # the moments moved from phase to phase, so equal bytes are not a stale buffer's
    first, second = (load_state_dict(tmp_path / f"expected-phase-{p:04d}.safetensors") for p in (0, 1))
    assert any(not torch.equal(first[key], second[key]) for key in first if key.endswith("exp_avg"))


def test_a_refill_waits_for_the_reader_that_holds_the_buffer(tmp_path):
    host, writer = HostBuffers(), BackgroundWriter()
    gate = threading.Event()
    first = host.fill(("segment", 0), {"w": torch.full((4, 3), 1.0), "b": torch.arange(3.0)})
    write = state_writer(first, ready=host.ready())
    writer.submit(tmp_path / "first.safetensors", lambda temporary: (gate.wait(), write(temporary)))
    written = writer.submitted
    host.hold(("segment", 0), lambda: writer.wait_for_job(written))
    second = {"w": torch.full((4, 3), 2.0), "b": -torch.arange(3.0)}
    refill = threading.Thread(target=host.fill, args=(("segment", 0), second))
    refill.start()
    refill.join(timeout=0.5)
    assert refill.is_alive()  # waiting for the write
    assert torch.equal(first["w"], torch.full((4, 3), 1.0))
    gate.set()
    refill.join(timeout=30)
    writer.close()
    assert torch.equal(load_state_dict(tmp_path / "first.safetensors")["w"], torch.full((4, 3), 1.0))
    again = host.buffers[("segment", 0)]
    assert again["w"] is first["w"] and torch.equal(again["w"], torch.full((4, 3), 2.0))  # the same memory, refilled
    assert torch.equal(again["b"], -torch.arange(3.0)) and host.allocations == 2


def test_an_arena_carves_one_power_of_two_block_into_aligned_tensors():
    tensors = [torch.randn(300, 7), torch.randn(5).double(), torch.tensor(3.0), torch.randint(0, 9, (4, 4)),
               torch.zeros(0), torch.randn(2, 2).bfloat16()]
    arena, wanted = HostArena(pinned=False), HostArena.space_for(tensors)
    carved = []
    for tensor in tensors:
        copy = arena.tensor(tensor.shape, tensor.dtype, wanted)
        wanted -= HostArena.space_for([tensor])
        carved.append(copy.copy_(tensor))
    # 8400, 40, 4, 128, 0 and 8 bytes, each started on a multiple of 512: 10752 bytes, in a block of 2^14
    assert arena.blocks == 1 and arena.block.numel() == 16384
    offsets = [copy.data_ptr() - arena.block.data_ptr() for copy in carved if copy.numel()]  # (an empty one has none)
    assert all(offset % 512 == 0 for offset in offsets) and offsets == sorted(offsets)
    for tensor, copy in zip(tensors, carved):
        assert copy.shape == tensor.shape and copy.dtype == tensor.dtype and torch.equal(copy, tensor)
    assert arena.tensor(torch.Size([3000]), torch.float32).numel() == 3000 and arena.blocks == 2  # no room left
    # a large buffer takes blocks of at most `largest_block`: ten tensors of 1000 bytes (1024 apart),
    # four to a block of 4096, then the last two in a block of 2048
    arena = HostArena(pinned=False, largest_block=4096)
    tensors = [torch.full((250,), float(index)) for index in range(10)]
    wanted, carved = HostArena.space_for(tensors), []
    for tensor in tensors:
        carved.append(arena.tensor(tensor.shape, tensor.dtype, wanted).copy_(tensor))
        wanted -= HostArena.space_for([tensor])
    assert (arena.blocks, arena.reserved) == (3, 4096 + 4096 + 2048)
    assert all(torch.equal(copy, tensor) for copy, tensor in zip(carved, tensors))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="page-locked memory and asynchronous copies need CUDA")
def test_copies_from_a_gpu_go_into_reused_page_locked_memory():
    host = HostBuffers()
    device = torch.device("cuda")
    state = {f"layer{i}": torch.randn(512, 300 + i, device=device) for i in range(6)}
    kept = host.fill(("segment", 0), state)
    host.wait()
    assert all(value.is_pinned() for value in kept.values()) and host.page_locked.blocks == 1
    for key, value in state.items():
        assert torch.equal(kept[key], value.cpu())
    pointers = {key: value.data_ptr() for key, value in kept.items()}
    state = {key: value * 2 for key, value in state.items()}
    again = host.fill(("segment", 0), state)
    host.ready()()  # as the checkpoint writer's thread waits
    assert {key: value.data_ptr() for key, value in again.items()} == pointers and host.allocations == len(state)
    for key, value in state.items():
        assert torch.equal(again[key], value.cpu())


def test_final_models_are_written_by_the_background_writer_and_on_disk_when_the_fit_returns(tmp_path, small_clip,
                                                                                            monkeypatch):
    """The last phase's segment ends queue final/<task>.safetensors on the process's background writer
    (the one its checkpoints use, saving here at every segment end): the training thread does not
    serialise or fsync them, the fit returns once they are on disk, and the checkpoint that refers to
    a final file does not write one of its own (which would lack the metadata)."""
    from mima.core.run_folder import RunFolder

    writes: list[tuple[str, str]] = []  # (task, thread name)
    write_final = RunFolder.write_final

    def recorded(self, task, weights, metadata):  # the real method, called through
        writes.append((task, threading.current_thread().name))
        write_final(self, task, weights, metadata)

    monkeypatch.setattr(RunFolder, "write_final", recorded)
    tasks = ["rot90", "mirror"]
    run_dir = run_fit(fit_config(tmp_path / "run", small_clip, tasks, steps=4, iterations=2)).run_dir
    assert sorted(task for task, _ in writes) == sorted(tasks)
    assert all(thread == "mima-checkpoint-writer" for _, thread in writes), writes
    assert threading.main_thread().name not in {thread for _, thread in writes}
    for task in tasks:
        with safe_open(str(run_dir / "final" / f"{task}.safetensors"), framework="pt") as handle:
            metadata = json.loads(handle.metadata()["mima"])
        assert metadata["task"] == task and metadata["N"] == 2
        assert json.loads((run_dir / "final" / f"{task}.json").read_text())["task"] == task
