"""Custom image folders and configs that would hang or crash the commands that read them: a FIFO
(or a link to one) named like an image, a class folder whose name is not UTF-8, and prompt templates
that str.format cannot fill with one class name. Each stops the command with one line naming the
culprit; none hangs and none reaches training."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from mima.core.errors import MimaError
from mima.data.image_folder import FolderTask, as_folder_task, folder_task_spec, read_layout, scan_splits
from mima.data.tasks import LoadOptions
from tests.helpers import assert_one_line, class_tree, cli, custom_task_fit_config, fit_config, run_command

CLASSES = ("circle", "square")


def _splits_config(tmp_path: Path, task: Path, **task_options) -> Path:
    """A `mima data splits` config of the custom task `task` alone."""
    config = tmp_path / "splits.yaml"
    data = {"suite": None, "custom_tasks": [{"name": "shapes", "path": str(task), **task_options}]}
    config.write_text(yaml.safe_dump({"model": {"clip": "embedded:tiny-digits"}, "data": data}))
    return config


def _task(tmp_path: Path) -> Path:
    task = tmp_path / "shapes"
    class_tree(task, CLASSES, per_class=10)
    return task


# -------------------------------------------------------------------------- files that are not files
@pytest.mark.parametrize("through_link", [False, True], ids=["fifo", "link-to-fifo"])
def test_a_fifo_named_like_an_image_is_refused_by_name_without_opening_it(tmp_path, through_link):
    task = _task(tmp_path)
    fifo = task / CLASSES[0] / "zz.png"
    if through_link:  # the pipe lives outside the task; the task holds a link to it
        os.mkfifo(tmp_path / "pipe")
        fifo.symlink_to(tmp_path / "pipe")
    else:
        os.mkfifo(fifo)
    out = tmp_path / "splits"
    # in a process of its own with a timeout: opening the FIFO would wait for a writer forever
    result = run_command(["data", "splits", "--config", _splits_config(tmp_path, task, bad_images="skip"),
                          "--out", out], timeout=120)
    line = assert_one_line(result.returncode, result.stderr, str(fifo), "is a FIFO (named pipe)", "not an image file")
    assert ("through a symbolic link" in line) == through_link
    assert not out.exists()


def test_a_fifo_as_classnames_file_is_refused_without_reading_it(tmp_path):
    task = _task(tmp_path)
    os.mkfifo(tmp_path / "names.txt")
    with pytest.raises(MimaError, match=r"^data.custom_tasks 'shapes': classnames_file .*names.txt: not a regular file$"):
        folder_task_spec(FolderTask("shapes", str(task), classnames_file=str(tmp_path / "names.txt")))


def test_files_that_are_not_images_by_name_are_left_alone(tmp_path):
    """Only names with an image extension are listed, so a pipe named otherwise changes nothing."""
    task = _task(tmp_path)
    os.mkfifo(task / CLASSES[0] / "notes.fifo")
    spec = folder_task_spec(FolderTask("shapes", str(task)))
    data = spec.load(LoadOptions(image_size=8))
    assert spec.classnames == CLASSES and (len(data.train), len(data.val), len(data.test)) == (15, 1, 4)


# -------------------------------------------------------------------------------- non-UTF-8 names
def test_a_class_folder_whose_name_is_not_utf8_is_one_line_with_its_bytes(tmp_path, capfd):
    task = _task(tmp_path)
    os.mkdir(os.fsencode(task) + b"/caf\xe9")  # Latin-1 "café": not valid UTF-8
    class_tree(Path(os.fsdecode(os.fsencode(task) + b"/caf\xe9")), [""], per_class=10)
    outcome = cli(["data", "splits", "--config", _splits_config(tmp_path, task), "--out", tmp_path / "splits"], capfd)
    line = assert_one_line(outcome.code, outcome.err, f"{task}: folder name b'caf\\xe9' is not valid UTF-8; rename it")
    assert "\udce9" not in line and not (tmp_path / "splits").exists()


# ------------------------------------------------------------------------------------- templates
BAD_TEMPLATES = {
    "a photo of a {x} {}.": "(KeyError: 'x')",
    "a photo of a {1} {}.": "(IndexError: Replacement index 1 out of range",
    "a photo of a { {}.": "(ValueError: unexpected '{' in field name)",
}


@pytest.mark.parametrize("template", list(BAD_TEMPLATES), ids=["name", "index", "lone-brace"])
def test_a_template_format_cannot_fill_stops_fit_before_training(tmp_path, small_clip, capfd, template):
    task = _task(tmp_path)
    config = custom_task_fit_config(tmp_path, small_clip, task, templates=["a photo of a {}.", template])
    outcome = cli(["fit", "--config", config, "--out", tmp_path / "run"], capfd)
    assert_one_line(outcome.code, outcome.err, f"data.custom_tasks 'stripes': template {template!r} cannot be filled",
                    BAD_TEMPLATES[template])
    assert not (tmp_path / "run").exists()  # no run folder: nothing was trained


@pytest.mark.parametrize(("templates", "problem"), [
    (["a photo of a {0}."], "has 1 replacement fields ({0}) where one plain '{}' is needed"),
    (["a photo of a {!r}."], "has 1 replacement fields ({!r}) where one plain '{}' is needed"),
    (["a photo."], "has 0 replacement fields (none) where one plain '{}' is needed"),
    (["a photo of a {} and a {}."], "cannot be filled with a class name (IndexError"),
    (["a photo of a {} }."], "cannot be filled with a class name (ValueError: Single '}'"),
    ("a photo of a {}.", "templates must be a list of strings"),
    ([], "templates is empty"),
], ids=["index-0", "conversion", "none", "two", "lone-close", "string", "empty"])
def test_templates_are_checked_as_the_config_is_read(templates, problem):
    with pytest.raises(MimaError) as error:
        as_folder_task({"name": "shapes", "path": "/nonexistent", "templates": templates})
    assert str(error.value).startswith("data.custom_tasks 'shapes': ") and problem in str(error.value)
    assert "\n" not in str(error.value)


def test_good_templates_give_the_prompts_heads_are_built_from(tmp_path):
    task = _task(tmp_path)
    templates = ["a photo of a {}.", "{{literal braces}} around {}"]
    spec = folder_task_spec(as_folder_task({"name": "shapes", "path": str(task), "templates": templates}))
    assert spec.templates == tuple(templates)
    assert [t.format(spec.classnames[1]) for t in spec.templates] == ["a photo of a square.", "{literal braces} around square"]


# ---------------------------------------------------------------------------- reserved names (issue 41)
@pytest.mark.parametrize("name", ["joint", "Joint", "mean"])
def test_a_custom_task_may_not_take_a_name_the_run_folder_or_the_results_use(tmp_path, small_clip, capfd, name):
    """final/joint.* is the joint baseline's (a task named so made the run look like one), "mean" the task
    average's column of the results: refused in one line before anything runs."""
    config = fit_config(tmp_path / "run", small_clip, None, steps=2, iterations=1)
    config["data"] = {"suite": None, "batch_size": 8, "custom_tasks": [
        {"name": "stripes", "path": str(_task(tmp_path))}, {"name": name, "path": str(_task(tmp_path / "other"))}]}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    for command in (["plan", "--config", tmp_path / "c.yaml"], ["fit", "--config", tmp_path / "c.yaml"]):
        outcome = cli(command, capfd)
        assert_one_line(outcome.code, outcome.err, f"data.custom_tasks[1]: name {name!r} is reserved")
    assert not (tmp_path / "run").exists()


# --------------------------------------------------- each image counted once (issue 41, item 3)
def _listed(task: Path) -> list[tuple[str, int]]:
    layout = read_layout(FolderTask(name="shapes", path=str(task)))
    return scan_splits(FolderTask(name="shapes", path=str(task)), layout)["train"]


def test_a_symlink_loop_inside_a_class_folder_lists_each_image_once(tmp_path):
    task = tmp_path / "shapes"
    class_tree(task, CLASSES, per_class=15)
    before = _listed(task)
    (task / "circle" / "loop").symlink_to(".")  # os.walk(followlinks=True) walked it 40 times deep
    (task / "square" / "deep").mkdir()
    (task / "square" / "deep" / "back").symlink_to("..")  # a longer loop, through a sub-folder
    after = _listed(task)
    assert len(after) == 30 and after == before  # the same files in the same order: split indices unchanged


def test_links_and_hard_links_to_a_listed_image_are_counted_once_and_said(tmp_path, capfd):
    task = tmp_path / "shapes"
    class_tree(task, CLASSES, per_class=15)
    before = _listed(task)
    os.link(task / "circle" / "000.png", task / "circle" / "zz-hard.png")
    (task / "square" / "zz-link.png").symlink_to(task / "square" / "001.png")
    capfd.readouterr()
    assert _listed(task) == before
    err = capfd.readouterr().err
    assert "2 paths lead to image files already listed (links or hard links) and are counted once" in err
    assert f"(first: {task / 'circle' / 'zz-hard.png'} is {task / 'circle' / '000.png'})" in err


def test_one_file_under_two_classes_is_refused_in_one_line(tmp_path, capfd):
    task = tmp_path / "shapes"
    class_tree(task, CLASSES, per_class=15)
    os.link(task / "circle" / "003.png", task / "square" / "zz.png")
    outcome = cli(["data", "splits", "--config", _splits_config(tmp_path, task), "--out", tmp_path / "splits"], capfd)
    assert_one_line(outcome.code, outcome.err, f"{task / 'square' / 'zz.png'} (class 'square') is the same file as "
                    f"{task / 'circle' / '003.png'} (class 'circle'); an image has one class")
    assert not (tmp_path / "splits").exists()


# ------------------------------------------ a changed folder between a stop and its resume (issue 41, item 3)
def test_a_resume_on_a_changed_task_folder_is_refused_unless_accepted(tmp_path, small_clip, capfd):
    task = _task(tmp_path)  # 2 classes x 10 images
    config = custom_task_fit_config(tmp_path, small_clip, task)
    out = tmp_path / "run"
    stopped = cli(["fit", "--config", config, "--out", out, "--trainer.callbacks+=tests.helpers.TouchStopAtStep",
                   "--trainer.callbacks.step=1"], capfd)
    assert stopped.code == 0 and "stopped by" in stopped.out, stopped.err
    recorded = json.loads((out / "data_listing.json").read_text())
    assert recorded["stripes"]["train"]["files"] == 20
    class_tree(task, CLASSES, per_class=3, start=900)  # 3 more images per class (new names)
    for name in CLASSES:
        for i in range(3):
            (task / name / f"{i:03d}.png").rename(task / name / f"new-{i:03d}.png")
    class_tree(task, CLASSES, per_class=13)  # the old names back, and 3 more: 26 in all
    before = sorted(p.name for p in out.rglob("*"))
    refused = cli(["fit", "--config", config, "--out", out, "--ckpt_path", "last"], capfd)
    assert_one_line(refused.code, refused.err, "task 'stripes' (train): 20 image files then, 32 now since the run started",
                    "--accept_data_change true")
    assert sorted(p.name for p in out.rglob("*")) == before  # nothing written
    accepted = cli(["fit", "--config", config, "--out", out, "--ckpt_path", "last", "--accept_data_change", "true"], capfd)
    assert accepted.code == 0, accepted.err
    assert "--accept_data_change: task 'stripes' (train): 20 image files then, 32 now" in accepted.out
    assert json.loads((out / "data_listing.json").read_text())["stripes"]["train"]["files"] == 32


def test_evaluating_a_run_on_a_changed_task_folder_is_refused(tmp_path, small_clip, capfd):
    task = _task(tmp_path)
    config = custom_task_fit_config(tmp_path, small_clip, task)
    out = tmp_path / "run"
    assert cli(["fit", "--config", config, "--out", out], capfd).code == 0
    (task / CLASSES[0] / "000.png").unlink()
    table = tmp_path / "table"
    refused = cli(["evaluate", out, "--out", table, "--merges", "uniform"], capfd)
    assert_one_line(refused.code, refused.err, f"{out}: task 'stripes' (train): 20 image files then, 19 now since the "
                    "run was trained")
    assert not (table / "results.json").exists()
