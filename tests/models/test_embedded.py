"""The embedded tiny CLIP: deterministic pretraining, loaded like a downloaded checkpoint, above chance."""

import copy
from pathlib import Path

import pytest
import torch
import yaml

from mima.data import digits
from mima.commands.demo.run import demo_config
from mima.evaluation.accuracy import TaskEvaluator
from mima.models import embedded
from mima.models.clip import load_clip
from mima.models.heads import zero_shot_head

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_pretraining_is_deterministic_from_the_seed():
    recipe = copy.deepcopy(embedded.TINY_DIGITS_RECIPE)
    recipe["steps"] = 15
    first, _ = embedded.pretrain_tiny_digits(recipe, progress=False)
    second, _ = embedded.pretrain_tiny_digits(recipe, progress=False)
    recipe["seed"] = 1
    other, _ = embedded.pretrain_tiny_digits(recipe, progress=False)
    a, b, c = first.state_dict(), second.state_dict(), other.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


@pytest.mark.slow
def test_pretraining_gives_the_same_bytes_on_1_2_and_4_threads():
    """The thread count moves the weights (reductions split across threads round differently), so the
    embedded model is pretrained on a fixed count whatever the caller's: the README's demo table is
    what every machine prints."""
    recipe = copy.deepcopy(embedded.TINY_DIGITS_RECIPE)
    recipe["steps"] = 10
    previous = torch.get_num_threads()
    try:
        built = {}
        for threads in (1, 2, 4):
            torch.set_num_threads(threads)
            built[threads] = embedded.build_embedded(recipe, embedded.pretrain_tiny_digits)[0].state_dict()
            assert torch.get_num_threads() == threads  # the caller's count is back
        torch.set_num_threads(1)
        one_thread = embedded.pretrain_tiny_digits(recipe, progress=False)[0].state_dict()  # not fixed
    finally:
        torch.set_num_threads(previous)
    assert embedded.CACHE_BUILD_THREADS == 2
    assert not all(torch.equal(one_thread[key], built[2][key]) for key in one_thread)  # what the fixed count is for
    for threads in (1, 4):
        assert all(torch.equal(built[threads][key], built[2][key]) for key in built[2]), threads


@pytest.mark.slow
def test_embedded_model_is_cached_loads_through_open_clip_and_beats_chance(private_cache):
    clip = load_clip("embedded:tiny-digits")
    folders = list((private_cache / "embedded").glob("tiny-digits-*"))
    assert len(folders) == 1 and (folders[0] / "open_clip_config.json").is_file()
    reloaded = load_clip(f"local-dir:{folders[0]}")  # the same path a downloaded checkpoint takes
    for key, value in clip.model.state_dict().items():
        assert torch.equal(value, reloaded.model.state_dict()[key])

    head = zero_shot_head(clip.model, clip.tokenizer, digits.CLASSNAMES, digits.TEMPLATES)
    tests = {name: spec.load(digits.LoadOptions(image_size=16)).test for name, spec in digits.TASKS.items()}
    accuracy = TaskEvaluator(clip.encoder, {n: head for n in tests}, tests).accuracy(clip.encoder.state_dict())
    assert accuracy["upright"] > 0.85  # the pretraining domain
    # Chance is 10%; with 539 test digits two binomial standard deviations above it is 12.6%.
    for task in digits.DEFAULT_TASKS:
        assert accuracy[task] > 0.126, (task, accuracy[task])


def test_splits_are_disjoint_and_follow_the_validation_rule():
    splits = digits.split_indices(split_seed=0)
    sets = {name: set(idx.tolist()) for name, idx in splits.items()}
    assert not (sets["train"] & sets["val"]) and not (sets["train"] & sets["test"]) and not (sets["val"] & sets["test"])
    assert sum(map(len, sets.values())) == 1797
    assert len(sets["val"]) == int(0.1 * (len(sets["train"]) + len(sets["val"])))


def test_the_demo_runs_configs_demo_yaml_and_scales_the_warmup_with_steps():
    shipped = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    config = demo_config()
    for section in ("model", "data"):
        for key, value in shipped[section].items():  # every value written in the file reaches the runs
            assert config[section][key] == value, (section, key)
    assert config["trainer"] == shipped["trainer"] and config["threads_per_process"] == shipped["threads_per_process"]
    scaled = demo_config(steps=160, lr_schedule="cosine")["model"]
    assert (scaled["steps"], scaled["warmup_steps"], scaled["lr_schedule"]) == (160, 16, "cosine")


def _slow_builder(recipe: dict, progress: bool):
    """Counts its calls in a file (one line a build), then takes long enough for the others to arrive."""
    import time

    with open(recipe["log"], "a") as log:
        log.write("built\n")
    time.sleep(1.0)
    torch.manual_seed(0)
    return torch.nn.Linear(2, 2), {"seconds": 1.0}


def _ensure_in_child(cache: str, queue) -> None:
    queue.put(str(embedded.ensure_embedded_model("slow-fake", Path(cache), progress=False)))


def test_jobs_starting_together_on_one_cache_build_an_embedded_model_once(tmp_path, monkeypatch):
    """Three processes ask for a model that is not cached yet at the same moment: one builds it (the
    others wait on the cache's lock), all three get the same complete folder."""
    import multiprocessing

    log = tmp_path / "builds.log"
    recipe = {"model_cfg": {"note": "a stand-in"}, "log": str(log)}
    monkeypatch.setitem(embedded.EMBEDDED_MODELS, "slow-fake", (lambda: recipe, _slow_builder))
    context = multiprocessing.get_context("fork")  # the children inherit the stand-in registry entry
    queue = context.Queue()
    children = [context.Process(target=_ensure_in_child, args=(str(tmp_path / "cache"), queue)) for _ in range(3)]
    for child in children:
        child.start()
    folders = {queue.get(timeout=60) for _ in children}
    for child in children:
        child.join(timeout=60)
        assert child.exitcode == 0
    assert log.read_text().splitlines() == ["built"]
    (folder,) = folders
    assert sorted(p.name for p in Path(folder).iterdir()) == ["open_clip_config.json", "open_clip_model.safetensors",
                                                               "pretraining.json"]
