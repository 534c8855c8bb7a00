"""The embedded tiny CLIP: deterministic pretraining, loaded like a downloaded checkpoint, above chance."""

import copy
from pathlib import Path

import pytest
import torch
import yaml

from mima.data import digits
from mima.demo import demo_config
from mima.evaluation.accuracy import TaskEvaluator
from mima.models import embedded
from mima.models.clip import load_clip
from mima.models.heads import zero_shot_head

REPO = Path(__file__).resolve().parents[1]


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
