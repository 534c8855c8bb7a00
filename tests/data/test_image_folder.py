"""Custom tasks from folders of class folders: layouts, splits, names, config errors, and a run
that trains and evaluates two such tasks through a YAML config (`mima fit`, then `mima merge`)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml
from PIL import Image
from torch.utils.data import Subset

from mima.cli import main
from mima.data.datamodule import TaskSuiteDataModule
from mima.data.image_datasets import TEST_FRACTION
from mima.data.image_folder import DEFAULT_TEMPLATES, FolderTask, as_folder_task, folder_task_spec
from mima.data.registry import DEFAULT_TASKS
from mima.data.tasks import LoadOptions
from mima.core.errors import MimaError
from mima.pools import task_pool
from mima.models.clip import load_clip
from mima.models.heads import zero_shot_head
from mima.core.safetensors_io import load_state_dict
from tests.helpers import STRIPES, damaged_task, first_half, pattern_image, write_images

SHADES = ("bright", "dark", "medium")


def _shade(kind: str, rng: np.random.Generator, size: int = 32) -> Image.Image:
    level = {"dark": 40, "medium": 128, "bright": 215}[kind]
    return Image.fromarray(np.clip(level + rng.normal(0, 12, (size, size, 3)), 0, 255).astype(np.uint8))


def _labels(dataset) -> list[int]:
    return [int(dataset[i][1]) for i in range(len(dataset))]


# ----------------------------------------------------------------------------------- layouts
def test_split_layout_reads_train_val_test_folders(tmp_path):
    write_images(tmp_path / "train", STRIPES, 4, pattern_image, seed=0)
    write_images(tmp_path / "val", STRIPES, 2, pattern_image, seed=1)
    write_images(tmp_path / "test", STRIPES[:2], 3, pattern_image, seed=2)  # a split may lack a class
    spec = folder_task_spec(FolderTask(name="stripes", path=str(tmp_path)))
    assert spec.classnames == ("checkerboard", "horizontal stripes", "vertical stripes")
    assert spec.templates == DEFAULT_TEMPLATES
    data = spec.load(LoadOptions(image_size=12))
    assert (len(data.train), len(data.val), len(data.test)) == (12, 6, 6)
    assert _labels(data.test) == [0, 0, 0, 1, 1, 1] and _labels(data.val) == [0, 0, 1, 1, 2, 2]
    assert data.train[0][0].shape == (3, 12, 12)
    assert data.test.samples[3][0] == str(tmp_path / "test" / "horizontal_stripes" / "000.png")


def test_flat_layout_holds_out_test_then_carves_validation_with_fixed_seeds(tmp_path):
    write_images(tmp_path, SHADES, 20, _shade, seed=0)
    task = FolderTask(name="shades", path=str(tmp_path))
    first, again = (folder_task_spec(task).load(LoadOptions(image_size=8)) for _ in range(2))
    other = folder_task_spec(task).load(LoadOptions(image_size=8, split_seed=1))
    num_test = round(TEST_FRACTION * 60)
    assert (len(first.test), len(first.val), len(first.train)) == (num_test, 4, 60 - num_test - 4)
    # test and validation are index sets into the same 60 files: fixed, disjoint, and moved by the split seed
    assert isinstance(first.test, Subset) and isinstance(first.val, Subset)
    test_files = set(first.test.indices)
    train_files = {first.train.dataset.indices[i] for i in first.train.indices}
    val_files = {first.val.dataset.indices[i] for i in first.val.indices}
    assert len(test_files | train_files | val_files) == 60
    assert not (test_files & train_files) and not (test_files & val_files) and not (train_files & val_files)
    assert first.test.indices == again.test.indices and first.val.indices == again.val.indices
    assert other.test.indices != first.test.indices
    assert sorted(set(_labels(first.test))) == [0, 1, 2]


def test_classnames_file_and_templates_override_the_defaults(tmp_path):
    write_images(tmp_path / "data", SHADES, 4, _shade, seed=0)  # 12 images: test 2, val 1, train 9
    names = tmp_path / "names.txt"
    names.write_text("a bright square\n\na dark square\na grey square\n")
    spec = folder_task_spec(FolderTask("shades", str(tmp_path / "data"), classnames_file=str(names),
                                       templates=["a photo of {}.", "{}"]))
    assert spec.classnames == ("a bright square", "a dark square", "a grey square")
    assert spec.templates == ("a photo of {}.", "{}")
    names.write_text("bright\ndark\n")
    with pytest.raises(MimaError, match=r"names.txt has 2 names but .* has 3 class folders \(one name per line, in sorted"):
        folder_task_spec(FolderTask("shades", str(tmp_path / "data"), classnames_file=str(names)))
    with pytest.raises(MimaError, match=r"template 'a photo' has 0 replacement fields \(none\) where one plain '\{\}' is needed"):
        folder_task_spec(FolderTask("shades", str(tmp_path / "data"), templates=["a photo"]))


def test_folder_mistakes_are_one_line_errors(tmp_path):
    with pytest.raises(MimaError, match=r"custom_tasks 'x': path .*nope is not a folder \(expected .*/<class>/<images>"):
        folder_task_spec(FolderTask("x", str(tmp_path / "nope")))
    write_images(tmp_path / "one", ("only",), 2, lambda name, rng: _shade("dark", rng), seed=0)
    with pytest.raises(MimaError, match="has 1 class folder"):
        folder_task_spec(FolderTask("x", str(tmp_path / "one")))
    (tmp_path / "empty" / "a").mkdir(parents=True)
    (tmp_path / "empty" / "b").mkdir()
    with pytest.raises(MimaError, match="no image files"):
        folder_task_spec(FolderTask("x", str(tmp_path / "empty"))).load(LoadOptions(image_size=8))


# ----------------------------------------------------------------- tasks of the data module
def test_data_module_looks_tasks_up_in_the_suite_and_the_custom_tasks(tmp_path):
    write_images(tmp_path, SHADES, 10, _shade, seed=0)
    shades = {"name": "shades", "path": str(tmp_path)}  # as a YAML config gives it
    both = TaskSuiteDataModule(suite="digits", custom_tasks=[shades])
    assert both.task_names == [*DEFAULT_TASKS["digits"], "shades"]
    assert both.hparams.custom_tasks == [{**shades, "classnames_file": None, "templates": None, "bad_images": "error"}]
    assert TaskSuiteDataModule(suite="digits", tasks=["shades", "rot90"], custom_tasks=[shades]).task_names == ["shades", "rot90"]
    for suite in ("custom", None):
        assert TaskSuiteDataModule(suite=suite, custom_tasks=[FolderTask(**shades)]).task_names == ["shades"]
    assert "shades" in TaskSuiteDataModule(suite="digits", custom_tasks=[shades]).data_key

    with pytest.raises(MimaError, match="'rot90' is already a task of suite 'digits'; give the custom task another name"):
        TaskSuiteDataModule(suite="digits", custom_tasks=[{**shades, "name": "rot90"}])
    with pytest.raises(MimaError, match="the name 'shades' is used by two custom tasks"):
        TaskSuiteDataModule(suite="custom", custom_tasks=[shades, shades])
    with pytest.raises(MimaError, match=r"unknown task 'stripes' in suite 'digits' or the custom tasks \(known: upright, .*shades\)"):
        TaskSuiteDataModule(suite="digits", tasks=["stripes"], custom_tasks=[shades])
    with pytest.raises(MimaError, match="the task list is empty; name tasks of data.suite or add data.custom_tasks"):
        TaskSuiteDataModule(suite="custom")
    with pytest.raises(MimaError, match=r"data.custom_tasks\[1\]: name 'my shades' must be letters, digits"):
        TaskSuiteDataModule(suite="custom", custom_tasks=[shades, {**shades, "name": "my shades"}])
    with pytest.raises(MimaError, match=r"data.custom_tasks\[0\]: unknown key 'folder'"):
        TaskSuiteDataModule(suite="custom", custom_tasks=[{"name": "x", "folder": "y"}])


# -------------------------------------------------------------- train and evaluate via config
def _hand_accuracy(state: dict, test_folder: Path, classes, templates) -> float:
    """Top-1 accuracy counted one test image at a time, with the head rebuilt from the prompts."""
    clip = load_clip("embedded:tiny-digits")
    clip.model.visual.load_state_dict(state)
    head = zero_shot_head(clip.model, clip.tokenizer, [c.replace("_", " ") for c in classes], templates)
    correct = total = 0
    with torch.no_grad():
        for label, name in enumerate(classes):
            for file in sorted((test_folder / name).iterdir()):
                image = clip.preprocess(Image.open(file)).unsqueeze(0)
                logits = F.normalize(clip.model.visual(image), dim=-1) @ head.T
                correct += int(logits.argmax(dim=-1).item() == label)
                total += 1
    return correct / total


@pytest.mark.slow
def test_custom_tasks_train_and_evaluate_through_a_config(tmp_path, capsys):
    stripes, shades = tmp_path / "stripes", tmp_path / "shades"
    write_images(stripes / "train", STRIPES, 30, pattern_image, seed=0)
    write_images(stripes / "test", STRIPES, 12, pattern_image, seed=1)
    write_images(shades / "train", SHADES, 10, _shade, seed=2)
    write_images(shades / "test", SHADES, 4, _shade, seed=3)
    shade_templates = ["a {} square."]
    config = {
        "seed_everything": 0,
        "model": {"clip": "embedded:tiny-digits", "steps": 12, "iterations": 2, "lr": 1e-3, "warmup_steps": 2},
        "data": {"suite": "custom", "batch_size": 16, "seed": 3, "custom_tasks": [
            {"name": "stripes", "path": str(stripes)},
            {"name": "shades", "path": str(shades), "templates": shade_templates}]},
        "trainer": {"accelerator": "cpu", "devices": 1, "enable_progress_bar": False, "enable_model_summary": False,
                    "logger": False},
    }
    config_file = tmp_path / "fit.yaml"
    config_file.write_text(yaml.safe_dump(config))
    run = tmp_path / "run"
    assert main(["fit", "--config", str(config_file), "--out", str(run)]) == 0
    saved = yaml.safe_load((run / "config.yaml").read_text())["data"]
    assert [task["name"] for task in saved["custom_tasks"]] == ["stripes", "shades"]

    # the final task model, judged on the run's own config (mima.merging.context)
    context = task_pool(run)
    assert context.tasks == ["stripes", "shades"]
    tuned = load_state_dict(run / "final" / "stripes.safetensors")
    measured = context.evaluator("test").accuracy(tuned, ["stripes"])["stripes"]
    assert measured == pytest.approx(_hand_accuracy(tuned, stripes / "test", STRIPES, DEFAULT_TEMPLATES), abs=1e-6)
    pretrained = load_state_dict(run / "pretrained.safetensors")
    before = context.evaluator("test").accuracy(pretrained, ["stripes"])["stripes"]
    assert measured > max(before, 0.5), (before, measured)  # it learnt the patterns (chance is 1/3)

    # the merge of both task models, evaluated by `mima merge` on the run's tasks
    merged = tmp_path / "merged.safetensors"
    assert main(["merge", "--method", "uniform", "--models", str(run), "--output", str(merged)]) == 0
    report = json.loads(merged.with_name(merged.name + ".results.json").read_text())["test_accuracy"]
    state = load_state_dict(merged)
    assert report["stripes"] == pytest.approx(_hand_accuracy(state, stripes / "test", STRIPES, DEFAULT_TEMPLATES), abs=1e-6)
    assert report["shades"] == pytest.approx(_hand_accuracy(state, shades / "test", SHADES, shade_templates), abs=1e-6)
    assert 0.0 <= report["mean"] <= 1.0


def test_bad_images_skip_leaves_the_unreadable_files_out(tmp_path, capsys):
    task = damaged_task(tmp_path, per_class=12, damaged=3, suffix=".png", damage=first_half)
    data = folder_task_spec(FolderTask(name="stripes", path=str(task), bad_images="skip")).load(LoadOptions(image_size=16))
    assert "leaving out 3 of 36 image files" in capsys.readouterr().err
    # 33 readable training images: validation carves int(0.1 * 33) = 3 of them, training keeps 30
    assert (len(data.train), len(data.val), len(data.test)) == (30, 3, 6)
    with pytest.raises(MimaError, match="bad_images 'ignore' must be one of error, skip"):
        as_folder_task({"name": "stripes", "path": str(task), "bad_images": "ignore"})
    kept = {path for path, _ in data.train.dataset.samples}
    assert len(kept) == 33 and not any(path.endswith(f"00{i}.png") and STRIPES[0] in path for path in kept for i in range(3))
