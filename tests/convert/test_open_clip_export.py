"""`mima merge --format open-clip` and `mima convert --to open-clip` (issue 39, item 2): a merged model
written as open_clip's folder (open_clip_config.json + open_clip_model.safetensors + README.md) loads
with open_clip.create_model_and_transforms("local-dir:DIR") alone, holds the merged image tower bit for
bit and the run's text tower, and classifies the test split as mima's evaluation of the merge does."""

from __future__ import annotations

import json
from pathlib import Path

import open_clip
import pytest
import torch
import torch.nn.functional as F
import yaml
from open_clip.transformer import QuickGELU

from mima.cli import main
from mima.config.run_config import load_run_config
from mima.core.safetensors_io import load_state_dict, read_metadata
from tests.helpers import assert_one_line, fit_config, write_encoders

TASKS = ["rot90", "mirror"]


def write_run_config(folder: Path, small_clip: str, **model) -> Path:
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(fit_config(folder / "run", small_clip, TASKS, steps=2, iterations=1, **model)))
    return path


def merge_args(encoders, config: Path, output: Path, *extra) -> list[str]:
    return ["merge", "--method", "task_arithmetic", "--lam", "0.5", "--base", str(encoders["base"]),
            "--models", str(encoders["m1"]), str(encoders["m2"]), "--config", str(config), "--output", str(output), *extra]


@pytest.fixture(scope="module")
def exported(tmp_path_factory, encoders, small_clip):
    """A task-arithmetic merge of the two test encoders on two digits tasks, written with --format open-clip."""
    folder = tmp_path_factory.mktemp("open-clip-export")
    config = write_run_config(folder, small_clip)
    output = folder / "merged-clip"
    main(merge_args(encoders, config, output, "--format", "open-clip"))
    return output, config


def open_clip_alone(folder: Path, config: Path):
    """The folder's CLIP as open_clip alone loads it, its zero-shot heads (each class: the mean of its
    normalised template embeddings, normalised, times exp(logit_scale)) and each task's test split
    through open_clip's evaluation transform."""
    model, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{folder}")
    tokenizer = open_clip.get_tokenizer(f"local-dir:{folder}")
    model.eval()
    data = load_run_config(config).datamodule()
    heads, tests = {}, {}
    with torch.no_grad():
        for spec in data.task_specs:
            rows = []
            for classname in spec.classnames:
                tokens = tokenizer([template.format(classname) for template in spec.templates])
                rows.append(F.normalize(F.normalize(model.encode_text(tokens), dim=-1).mean(dim=0), dim=-1))
            heads[spec.name] = torch.stack(rows) * model.logit_scale.exp()
            tests[spec.name] = data.task_data(spec.name, model.visual.image_size[0], preprocess).test
    return model, heads, tests


def zero_shot_logits(model, head: torch.Tensor, images: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return F.normalize(model.encode_image(images), dim=-1) @ head.T


def zero_shot_accuracy(folder: Path, config: Path) -> dict[str, float]:
    """Each task's test accuracy of the folder's CLIP with open_clip alone (correct / total in float32,
    as accuracies are counted everywhere: torchmetrics' micro accuracy)."""
    model, heads, tests = open_clip_alone(folder, config)
    accuracy = {}
    for task, test in tests.items():
        correct = total = 0
        for images, labels in torch.utils.data.DataLoader(test, batch_size=64):
            correct += int((zero_shot_logits(model, heads[task], images).argmax(dim=-1) == labels).sum())
            total += len(labels)
        accuracy[task] = float(torch.tensor(correct, dtype=torch.float32) / torch.tensor(total, dtype=torch.float32))
    return accuracy


def test_the_folder_loads_in_open_clip_with_the_merged_image_tower_and_the_runs_text_tower(exported, small_clip):
    output, _ = exported
    assert {p.name for p in output.iterdir()} == {
        "open_clip_config.json", "open_clip_model.safetensors", "README.md", "image_encoder.safetensors",
        "image_encoder.safetensors.results.json", "image_encoder.safetensors.results.md"}
    model, _, _ = open_clip.create_model_and_transforms(f"local-dir:{output}")
    merged = load_state_dict(output / "image_encoder.safetensors")
    visual = model.visual.state_dict()
    assert set(visual) == set(merged)
    for key, tensor in merged.items():
        assert visual[key].dtype == tensor.dtype and torch.equal(visual[key], tensor), key
    run_clip = open_clip.create_model(small_clip).state_dict()
    loaded = model.state_dict()
    text_keys = [key for key in run_clip if not key.startswith("visual.")]
    assert "logit_scale" in text_keys and set(loaded) == set(run_clip)
    for key in text_keys:
        assert torch.equal(loaded[key], run_clip[key]), key
    # the merge is task arithmetic: theta_0 + 0.5 * (tau_1 + tau_2), independently computed
    base, m1, m2 = (load_state_dict(exported_input) for exported_input in _inputs(output))
    for key in base:
        assert torch.allclose(merged[key], base[key] + 0.5 * ((m1[key] - base[key]) + (m2[key] - base[key])), atol=1e-6)


def _inputs(output: Path) -> list[str]:
    """theta_0 and the task models the merge recorded in its file."""
    metadata = read_metadata(output / "image_encoder.safetensors")
    return [metadata["base"], *metadata["models"]]


def test_zero_shot_accuracy_with_open_clip_alone_equals_mimas_evaluation_of_the_merge(exported):
    output, config = exported
    from mima.pools import task_pool

    mima_accuracy = task_pool(config).evaluator("test").accuracy(load_state_dict(output / "image_encoder.safetensors"))
    open_clip_accuracy = zero_shot_accuracy(output, config)
    assert set(open_clip_accuracy) == set(TASKS)
    assert open_clip_accuracy == mima_accuracy
    reported = json.loads((output / "image_encoder.safetensors.results.json").read_text())["test_accuracy"]
    assert {task: reported[task] for task in TASKS} == mima_accuracy


def test_open_clip_alone_gives_mimas_logits_image_by_image(exported):
    """The small random CLIP's accuracy is near chance, so the logits themselves are compared: the same
    preprocessed images, and open_clip's zero-shot logits equal to those mima evaluates the merge with."""
    output, config = exported
    from mima.pools import task_pool

    pool = task_pool(config)
    merged = load_state_dict(output / "image_encoder.safetensors")
    model, heads, tests = open_clip_alone(output, config)
    for task in TASKS:
        images, _ = next(iter(torch.utils.data.DataLoader(tests[task], batch_size=64)))
        mima_images, _ = next(iter(pool.loader(task, "test", 64)))
        assert torch.equal(images, mima_images)
        with torch.no_grad():
            expected = pool.logits(merged, task, mima_images)
        found = zero_shot_logits(model, heads[task], images)
        assert expected.std(dim=0).min() > 1e-3  # the logits differ from image to image: the comparison can fail
        torch.testing.assert_close(found, expected, rtol=1e-5, atol=1e-5)


def test_the_model_card_says_the_recipe_source_merge_and_evaluation(exported, encoders, small_clip):
    output, config = exported
    card = (output / "README.md").read_text()
    reported = json.loads((output / "image_encoder.safetensors.results.json").read_text())["test_accuracy"]
    assert card.startswith("---\nlibrary_name: open_clip\n")
    assert "--method task_arithmetic" in card and "--lam 0.5" in card and "--format open-clip" in card
    assert "- Method: `task_arithmetic`" in card and '"lam": 0.5' in card
    assert f"`{encoders['m1']}`" in card and f"theta_0 (base): `{encoders['base']}`" in card
    assert f"`{small_clip}`" in card and f"from `{config}`" in card and "GELU (recorded" in card
    for task in [*TASKS, "mean"]:
        assert f"| {task} | {100 * reported[task]:.1f} |" in card
    assert f'create_model_and_transforms("local-dir:{output}")' in card
    assert json.loads((output / "open_clip_config.json").read_text())["model_cfg"]["quick_gelu"] is False


def test_convert_to_open_clip_writes_the_same_clip_and_the_merges_table(exported, tmp_path, capsys):
    output, config = exported
    encoder = output / "image_encoder.safetensors"
    converted = tmp_path / "converted"
    main(["convert", "--to", "open-clip", str(encoder), "--config", str(config), "--output", str(converted)])
    assert f"-> {converted}" in capsys.readouterr().out
    assert sorted(p.name for p in converted.iterdir()) == ["README.md", "open_clip_config.json", "open_clip_model.safetensors"]
    a, b = load_state_dict(output / "open_clip_model.safetensors"), load_state_dict(converted / "open_clip_model.safetensors")
    assert set(a) == set(b) and all(torch.equal(a[key], b[key]) for key in a)
    assert (converted / "open_clip_config.json").read_text() == (output / "open_clip_config.json").read_text()
    card = (converted / "README.md").read_text()
    assert "mima convert --to open-clip" in card and "- Method: `task_arithmetic`" in card and "| mean |" in card


def test_the_activation_is_recorded_and_open_clip_builds_it(exported, tmp_path, small_clip):
    """A run with model.quick_gelu true: the folder says quick_gelu, and open_clip builds QuickGELU from it."""
    output, _ = exported
    config = write_run_config(tmp_path, small_clip, quick_gelu=True)
    converted = tmp_path / "quick"
    main(["convert", "--to", "open-clip", str(output / "image_encoder.safetensors"), "--config", str(config),
          "--output", str(converted)])
    assert json.loads((converted / "open_clip_config.json").read_text())["model_cfg"]["quick_gelu"] is True
    model, _, _ = open_clip.create_model_and_transforms(f"local-dir:{converted}")
    assert any(isinstance(module, QuickGELU) for module in model.modules())
    assert "QuickGELU (recorded in open_clip_config.json as `quick_gelu: true`)" in (converted / "README.md").read_text()


def test_an_existing_folder_is_replaced_only_with_overwrite(exported, tmp_path, capsys):
    output, config = exported
    encoder = output / "image_encoder.safetensors"
    target = tmp_path / "out"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    code = main(["convert", "--to", "open-clip", str(encoder), "--config", str(config), "--output", str(target)])
    assert_one_line(code, capsys.readouterr().err, "already exists", "--overwrite")
    assert [p.name for p in target.iterdir()] == ["keep.txt"]
    main(["convert", "--to", "open-clip", str(encoder), "--config", str(config), "--output", str(target), "--overwrite"])
    assert (target / "open_clip_model.safetensors").is_file() and (target / "keep.txt").read_text() == "mine"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging folder left behind


@pytest.mark.parametrize("extra, fragment", [
    ([], "needs --config"),
    (["--config", "CONFIG", "--arch", "ViT-B-32"], "--arch: does not apply to --to open-clip"),
])
def test_convert_option_mistakes_are_one_line(exported, tmp_path, capsys, extra, fragment):
    output, config = exported
    extra = [str(config) if part == "CONFIG" else part for part in extra]
    code = main(["convert", "--to", "open-clip", str(output / "image_encoder.safetensors"), "--output",
                 str(tmp_path / "x"), *extra])
    assert_one_line(code, capsys.readouterr().err, fragment)
    assert not (tmp_path / "x").exists()


def test_config_applies_to_open_clip_only(tmp_path, capsys):
    code = main(["convert", str(tmp_path / "a.pt"), str(tmp_path / "b.safetensors"), "--config", str(tmp_path / "c.yaml")])
    assert_one_line(code, capsys.readouterr().err, "--config: applies to --to open-clip only")


def test_an_encoder_of_another_model_is_one_line(exported, tmp_path, capsys):
    output, config = exported
    from mima.core.safetensors_io import save_state_dict

    state = load_state_dict(output / "image_encoder.safetensors")
    state["proj"] = torch.zeros(3, 3)
    save_state_dict(tmp_path / "other.safetensors", state)
    code = main(["convert", "--to", "open-clip", str(tmp_path / "other.safetensors"), "--config", str(config),
                 "--output", str(tmp_path / "x")])
    assert_one_line(code, capsys.readouterr().err, "'proj' has shape (3, 3)")
    assert not (tmp_path / "x").exists()


def test_merge_format_open_clip_needs_a_run(encoders, tmp_path, capsys):
    code = main(["merge", "--method", "task_arithmetic", "--base", str(encoders["base"]), "--models",
                 str(encoders["m1"]), str(encoders["m2"]), "--format", "open-clip", "--output", str(tmp_path / "x")])
    assert_one_line(code, capsys.readouterr().err, "--format open-clip: needs --config")
    assert not (tmp_path / "x").exists()


def test_a_per_task_merge_is_refused_before_it_runs(encoders, tmp_path, capsys, small_clip):
    config = write_run_config(tmp_path, small_clip)
    code = main(["merge", "--method", "tall", "--base", str(encoders["base"]), "--models", str(encoders["m1"]),
                 str(encoders["m2"]), "--config", str(config), "--format", "open-clip", "--output", str(tmp_path / "x")])
    assert_one_line(code, capsys.readouterr().err, "'tall' writes one model per task")
    assert not (tmp_path / "x").exists()


@pytest.mark.slow  # pretrains the embedded tiny-digits CLIP unless this session's cache has it
def test_a_merged_demo_model_gives_mimas_zero_shot_accuracy_with_open_clip_alone(tmp_path):
    """The acceptance check on the demo's model (embedded:tiny-digits, pretrained on the digits, so its
    zero-shot accuracy is far from chance): a merge of two perturbed copies of its image tower, exported
    with --format open-clip, classifies every task's test split as mima's evaluation says."""
    from mima.models.clip import load_clip

    paths = write_encoders(tmp_path, load_clip("embedded:tiny-digits").encoder.state_dict(), scale=0.002)
    config = write_run_config(tmp_path, "embedded:tiny-digits")
    output = tmp_path / "demo-clip"
    main(merge_args(paths, config, output, "--format", "open-clip"))
    reported = json.loads((output / "image_encoder.safetensors.results.json").read_text())["test_accuracy"]
    found = zero_shot_accuracy(output, config)
    assert found == {task: reported[task] for task in TASKS}
    assert min(found.values()) > 0.2  # well above chance (0.1): the accuracies compared are the model's own
