"""`model.quick_gelu`: the MLP activation is never guessed (issue 36, item 1).

OpenAI's CLIP weights were trained with QuickGELU, x * sigmoid(1.702 x); open_clip builds most
architectures with GELU. A weight file does not say which it needs: its tensors are the same for
both. These tests save a small open_clip architecture trained-with-QuickGELU to a file and load it
through the same path as a downloaded checkpoint (`load_clip(architecture, file)`).
"""

from __future__ import annotations

import json
from pathlib import Path

import open_clip
import pytest
import torch
import yaml

from mima.core.errors import MimaError
from mima.core.safetensors_io import save_state_dict
from mima.models.clip import load_clip, resolve_quick_gelu, weights_record_file, write_weights_record
from mima.commands.prefetch.fetch import copy_weights

from tests.helpers import assert_one_line, cli

ARCHITECTURE = "mima-test-tiny-vit"  # registered with open_clip below, like its own ViT-B-32.json
TINY_CFG = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 16, "patch_size": 4, "width": 32, "layers": 2, "head_width": 16, "mlp_ratio": 2},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 16, "heads": 2, "layers": 1},
}


@pytest.fixture(scope="module")
def quick_gelu_weights(tmp_path_factory) -> tuple[Path, torch.Tensor, torch.Tensor]:
    """A file of weights of a model built with QuickGELU (no record beside it), a batch of images
    and that model's image features for them."""
    folder = tmp_path_factory.mktemp("quick-gelu")
    (folder / "configs").mkdir()
    (folder / "configs" / f"{ARCHITECTURE}.json").write_text(json.dumps(TINY_CFG))
    open_clip.add_model_config(folder / "configs")
    torch.manual_seed(3)
    model = open_clip.CLIP(**TINY_CFG, quick_gelu=True).eval()
    weights = folder / "tiny-quickgelu.safetensors"
    save_state_dict(weights, model.state_dict())
    images = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        features = model.encode_image(images)
    return weights, images, features


def image_features(weights: Path, images: torch.Tensor, quick_gelu) -> torch.Tensor:
    loaded = load_clip(ARCHITECTURE, str(weights), quick_gelu=quick_gelu)
    with torch.no_grad():
        return loaded.model.encode_image(images)


def test_a_file_loads_with_identical_outputs_only_with_the_recorded_activation(quick_gelu_weights, tmp_path):
    weights, images, features = quick_gelu_weights
    copy = tmp_path / weights.name
    copy.write_bytes(weights.read_bytes())
    write_weights_record(copy, ARCHITECTURE, "test", quick_gelu=True)
    assert json.loads(weights_record_file(copy).read_text())["quick_gelu"] is True
    assert torch.equal(image_features(copy, images, "auto"), features)  # auto reads the record
    assert torch.equal(image_features(copy, images, True), features)
    gelu = image_features(copy, images, False)  # the same tensors, the wrong activation: another network
    assert not torch.allclose(gelu, features, atol=1e-4)
    # a record that says GELU is followed just as faithfully
    write_weights_record(copy, ARCHITECTURE, "test", quick_gelu=False)
    assert torch.equal(image_features(copy, images, "auto"), gelu)


def test_a_file_without_a_record_is_refused_in_one_line_naming_the_option(quick_gelu_weights):
    weights, images, features = quick_gelu_weights
    assert not weights_record_file(weights).exists()
    with pytest.raises(MimaError) as caught:
        load_clip(ARCHITECTURE, str(weights))
    message = str(caught.value)
    assert "\n" not in message and message.startswith("model.quick_gelu: auto cannot tell") and str(weights) in message
    assert torch.equal(image_features(weights, images, True), features)  # the option settles it


def test_a_damaged_record_is_one_line_naming_it(quick_gelu_weights, tmp_path):
    weights, _, _ = quick_gelu_weights
    copy = tmp_path / weights.name
    copy.write_bytes(weights.read_bytes())
    weights_record_file(copy).write_text(json.dumps({"quick_gelu": "yes"}))
    with pytest.raises(MimaError, match=f"{weights_record_file(copy)}: 'quick_gelu' must be true or false"):
        resolve_quick_gelu(ARCHITECTURE, str(copy))


def test_tags_folders_and_quickgelu_names_follow_their_own_configuration(tmp_path):
    assert resolve_quick_gelu("ViT-B-32", "openai") is True  # OpenAI's tag
    assert resolve_quick_gelu("ViT-B-32", "laion2b_s34b_b79k") is False
    assert resolve_quick_gelu("ViT-B-32", "openai", False) is False  # an explicit value wins
    assert resolve_quick_gelu("local-dir:/any", None) is None  # the folder's config decides
    assert resolve_quick_gelu("ViT-B-32", "none") is None  # random weights: the architecture's own
    unknown = tmp_path / "weights.pt"
    unknown.write_bytes(b"x")
    assert resolve_quick_gelu("ViT-B-32-quickgelu", str(unknown)) is True
    with pytest.raises(MimaError, match="model.quick_gelu: auto cannot tell"):
        resolve_quick_gelu("ViT-B-32", str(unknown))


def test_prefetch_copies_the_weights_with_their_activation_beside_them(quick_gelu_weights, tmp_path):
    weights, images, features = quick_gelu_weights
    copy = copy_weights(weights, tmp_path / "models", ARCHITECTURE, "test", quick_gelu=True)
    assert copy == tmp_path / "models" / f"{ARCHITECTURE}-test.safetensors"
    assert copy.read_bytes() == weights.read_bytes()
    assert json.loads(weights_record_file(copy).read_text()) == {
        "architecture": ARCHITECTURE, "pretrained": "test", "quick_gelu": True, "written_by": "mima prefetch"}
    assert torch.equal(image_features(copy, images, "auto"), features)
    assert copy_weights(weights, tmp_path / "models", ARCHITECTURE, "test", quick_gelu=True) == copy  # kept
    copy.write_bytes(b"something else")
    with pytest.raises(MimaError, match="--weights-dir: .* exists and is not a copy of"):
        copy_weights(weights, tmp_path / "models", ARCHITECTURE, "test", quick_gelu=True)


def test_mima_fit_and_merge_refuse_an_unknown_file_before_any_work(tmp_path, capfd, small_clip):
    """The same rule in the commands that build a model; the file is never read (it is not weights)."""
    unknown = tmp_path / "ViT-B-32-copy.pt"
    unknown.write_bytes(b"not weights")
    config = tmp_path / "fit.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"clip": "ViT-B-32", "pretrained": str(unknown), "steps": 2, "iterations": 1},
        "data": {"suite": "digits", "tasks": ["rot90", "mirror"], "batch_size": 4},
        "trainer": {"accelerator": "cpu"},
    }))
    outcome = cli(["fit", "--config", config, "--out", tmp_path / "run"], capfd)
    assert_one_line(outcome.code, outcome.err, "model.quick_gelu: auto cannot tell", str(unknown))
    assert not (tmp_path / "run").exists()
    files = []
    for name in ("base", "a", "b"):
        files.append(tmp_path / f"{name}.safetensors")
        save_state_dict(files[-1], {"w": torch.full((2, 2), float(len(files)))})
    outcome = cli(["merge", "--method", "task_arithmetic", "--models", *files[1:], "--base", files[0], "--config", config,
                   "--output", tmp_path / "merged.safetensors", "--select-on", "val"], capfd)
    assert_one_line(outcome.code, outcome.err, "model.quick_gelu: auto cannot tell")
    assert not (tmp_path / "merged.safetensors").exists()
