"""`mima convert --from hf-clip` / `--to hf-clip`: transformers CLIP vision towers <-> open_clip encoders.

The reference is transformers itself: a randomly initialised CLIPVisionModelWithProjection (or
CLIPModel, or CLIPVisionModel as FusionBench publishes its task models) embeds images, and the
open_clip tower built by `open_clip.create_model` and loaded (strict) with the converted tensors
must embed them alike. Nothing is downloaded: every model here is built from a config.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from collections import OrderedDict
from pathlib import Path

import open_clip
import pytest
import torch
from safetensors.torch import save_file

from mima.cli import main
from mima.core.errors import MimaError
from mima.core.safetensors_io import load_state_dict, read_metadata, save_state_dict
from mima.models.hf_clip import hf_to_open_clip, open_clip_architecture, open_clip_to_hf
from tests.ci_mode import require

TINY_ARCH = "mima-test-tiny-vit"  # registered with open_clip by the `tiny_arch` fixture
TINY_VISION = {"image_size": 32, "layers": 2, "width": 64, "patch_size": 8, "head_width": 16, "mlp_ratio": 4.0}
TINY_TEXT = {"context_length": 8, "vocab_size": 64, "width": 32, "heads": 2, "layers": 1}
TINY_EMBED = 16
# the same tower in transformers' words
TINY_HF = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 256,
           "patch_size": 8, "image_size": 32}
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def transformers():
    require(None if importlib.util.find_spec("transformers") else
            "transformers is not installed (pip install -e '.[test]' installs it)")
    import transformers as module

    module.logging.set_verbosity_error()
    return module


@pytest.fixture(scope="module")
def tiny_arch(tmp_path_factory):
    """A tiny open_clip architecture, registered under TINY_ARCH, so that --arch can name it."""
    path = tmp_path_factory.mktemp("open-clip-config") / f"{TINY_ARCH}.json"
    path.write_text(json.dumps({"embed_dim": TINY_EMBED, "vision_cfg": TINY_VISION, "text_cfg": TINY_TEXT}))
    open_clip.add_model_config(path)
    yield TINY_ARCH


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def perturb(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Move every parameter off its initial value (LayerNorms start at exactly 1 and 0, biases at 0),
    so that a swapped or dropped tensor changes the embeddings."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.add_(0.1 * torch.randn(parameter.shape, generator=generator))
    return module.eval()


def tiny_open_clip(quick_gelu: bool) -> torch.nn.Module:
    """open_clip's own model of the tiny tower (the text tower is tiny too), random weights."""
    return open_clip.create_model("ViT-B-32", pretrained=None, force_quick_gelu=quick_gelu, embed_dim=TINY_EMBED,
                                  vision_cfg=TINY_VISION, text_cfg=TINY_TEXT).eval()


def images(size: int, count: int = 3) -> torch.Tensor:
    return torch.randn(count, 3, size, size, generator=torch.Generator().manual_seed(5))


def hf_embeddings(vision_model, projection, pixels: torch.Tensor) -> torch.Tensor:
    """transformers' own forward: class token after post_layernorm (pooler_output), then the projection."""
    with torch.no_grad():
        return projection(vision_model(pixel_values=pixels).pooler_output)


def open_clip_embeddings(model, state: dict, pixels: torch.Tensor) -> torch.Tensor:
    model.visual.load_state_dict(state, strict=True)
    with torch.no_grad():
        return model.encode_image(pixels)


def run_cli(args: list[str], capsys) -> tuple[int, str, str]:
    capsys.readouterr()  # drop what came before (transformers' progress bars)
    code = main(["convert", *[str(arg) for arg in args]])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# ---------------------------------------------------------------------------- HF -> open_clip
@pytest.mark.parametrize("activation", ["quick_gelu", "gelu"])
def test_converted_tower_embeds_like_the_transformers_tower(transformers, activation):
    config = transformers.CLIPVisionConfig(**TINY_HF, projection_dim=TINY_EMBED, hidden_act=activation)
    torch.manual_seed(0)
    hf = perturb(transformers.CLIPVisionModelWithProjection(config), seed=1)
    expected = hf_embeddings(hf.vision_model, hf.visual_projection, images(32))

    state = hf_to_open_clip(hf.state_dict(), "random HF tower")
    matching = open_clip_embeddings(tiny_open_clip(quick_gelu=activation == "quick_gelu"), state, images(32))
    assert (matching - expected).abs().max().item() <= TOLERANCE
    # the comparison can fail: the same tensors under the other activation embed differently
    other = open_clip_embeddings(tiny_open_clip(quick_gelu=activation != "quick_gelu"), state, images(32))
    assert (other - expected).abs().max().item() > 1e-3


def test_true_vit_b32_folder_through_the_command_line(transformers, tmp_path, capsys):
    """CLIPVisionConfig's defaults are openai/clip-vit-base-patch32's tower (ViT-B/32, QuickGELU)."""
    torch.manual_seed(0)
    hf = transformers.CLIPVisionModelWithProjection(transformers.CLIPVisionConfig()).eval()
    hf.save_pretrained(tmp_path / "hf")
    expected = hf_embeddings(hf.vision_model, hf.visual_projection, images(224, count=1))

    code, out, err = run_cli(["--from", "hf-clip", tmp_path / "hf", "--output", tmp_path / "b32.safetensors"], capsys)
    assert code == 0, err
    assert "open_clip ViT-B-32, quick_gelu" in out
    assert read_metadata(tmp_path / "b32.safetensors")["open_clip_arch"] == "ViT-B-32"
    # open_clip's ViT-B-32 image tower as it is; only its text tower, unused here, is shrunk (for time)
    model = open_clip.create_model("ViT-B-32", pretrained=None, force_quick_gelu=True, text_cfg=TINY_TEXT).eval()
    state = load_state_dict(tmp_path / "b32.safetensors")
    assert set(state) == set(model.visual.state_dict())
    embedded = open_clip_embeddings(model, state, images(224, count=1))
    assert (embedded - expected).abs().max().item() <= TOLERANCE


def save_as_transformers_4(vision_model, config_json: dict, folder: Path) -> Path:
    """A CLIPVisionModel folder as transformers 4 wrote FusionBench's task models: keys under
    vision_model., and the position_ids buffer that versions before 4.31 saved."""
    folder.mkdir(parents=True)
    state = {f"vision_model.{key}": value.contiguous() for key, value in vision_model.state_dict().items()}
    positions = state["vision_model.embeddings.position_embedding.weight"].shape[0]
    state["vision_model.embeddings.position_ids"] = torch.arange(positions).unsqueeze(0)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config_json))
    return folder


@pytest.mark.parametrize("layout", ["transformers-4", "transformers-5"])
def test_fusionbench_task_model_takes_the_pretrained_projection(transformers, tiny_arch, tmp_path, capsys, layout):
    clip_config = transformers.CLIPConfig(
        text_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                     "vocab_size": 64, "max_position_embeddings": 8, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 1},
        vision_config=TINY_HF, projection_dim=TINY_EMBED)
    torch.manual_seed(0)
    pretrained = perturb(transformers.CLIPModel(clip_config), seed=2)
    pretrained.save_pretrained(tmp_path / "pretrained")
    task = perturb(transformers.CLIPVisionModel(transformers.CLIPVisionConfig(**TINY_HF)), seed=3)
    if layout == "transformers-5":
        task.save_pretrained(tmp_path / "task")
    else:
        config_json = {"architectures": ["CLIPVisionModel"], "model_type": "clip_vision_model", **TINY_HF}
        save_as_transformers_4(task.vision_model if hasattr(task, "vision_model") else task, config_json, tmp_path / "task")

    # FusionBench's task models carry no projection: asked for, not invented
    code, _, err = run_cli(["--from", "hf-clip", tmp_path / "task", "--arch", tiny_arch, "-o", tmp_path / "t.safetensors"], capsys)
    assert code == 2 and "--projection-from" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "t.safetensors").exists()

    code, _, err = run_cli(["--from", "hf-clip", tmp_path / "task", "--arch", tiny_arch, "--projection-from",
                            tmp_path / "pretrained", "-o", tmp_path / "t.safetensors"], capsys)
    assert code == 0, err
    state = load_state_dict(tmp_path / "t.safetensors")
    assert torch.equal(state["proj"], pretrained.visual_projection.weight.detach().t())
    expected = hf_embeddings(task, pretrained.visual_projection, images(32))
    assert (open_clip_embeddings(tiny_open_clip(True), state, images(32)) - expected).abs().max().item() <= TOLERANCE

    # the pretrained CLIPModel itself: its text tower is left out
    code, _, err = run_cli(["--from", "hf-clip", tmp_path / "pretrained", "--arch", tiny_arch, "-o", tmp_path / "base.safetensors"], capsys)
    assert code == 0, err
    base = load_state_dict(tmp_path / "base.safetensors")
    expected = hf_embeddings(pretrained.vision_model, pretrained.visual_projection, images(32))
    assert (open_clip_embeddings(tiny_open_clip(True), base, images(32)) - expected).abs().max().item() <= TOLERANCE


# ---------------------------------------------------------------------------- open_clip -> HF
def test_round_trip_through_transformers_gives_back_the_same_bits(transformers, tiny_arch, tmp_path, capsys):
    torch.manual_seed(0)
    model = perturb(tiny_open_clip(quick_gelu=True), seed=4)
    original = {key: value.clone() for key, value in model.visual.state_dict().items()}
    save_state_dict(tmp_path / "encoder.safetensors", original)

    code, out, err = run_cli(["--to", "hf-clip", tmp_path / "encoder.safetensors", "--arch", tiny_arch,
                              "--activation", "quick_gelu", "--output", tmp_path / "hf"], capsys)
    assert code == 0, err
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json", "model.safetensors"]
    hf = transformers.CLIPVisionModelWithProjection.from_pretrained(tmp_path / "hf").eval()
    assert hf.config.num_attention_heads == 4 and hf.config.hidden_act == "quick_gelu"
    expected = open_clip_embeddings(model, original, images(32))
    assert (hf_embeddings(hf.vision_model, hf.visual_projection, images(32)) - expected).abs().max().item() <= TOLERANCE

    code, _, err = run_cli(["--from", "hf-clip", tmp_path / "hf", "--output", tmp_path / "back.safetensors", "--arch", tiny_arch], capsys)
    assert code == 0, err
    back = load_state_dict(tmp_path / "back.safetensors")
    assert set(back) == set(original)
    assert all(back[k].dtype == original[k].dtype and torch.equal(back[k], original[k]) for k in original)

    # a bare weights file both ways (the architecture then comes from --arch alone)
    code, _, err = run_cli(["--to", "hf-clip", tmp_path / "encoder.safetensors", "--arch", tiny_arch,
                            "--activation", "quick_gelu", "--output", tmp_path / "bare.safetensors"], capsys)
    assert code == 0, err
    code, _, err = run_cli(["--from", "hf-clip", tmp_path / "bare.safetensors", "--arch", tiny_arch,
                            "--output", tmp_path / "bare-back.safetensors"], capsys)
    assert code == 0, err
    bare_back = load_state_dict(tmp_path / "bare-back.safetensors")
    assert all(torch.equal(bare_back[k], original[k]) for k in original) and set(bare_back) == set(original)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_mapping_round_trips_both_ways_bit_for_bit(dtype):
    torch.manual_seed(0)
    visual = perturb(tiny_open_clip(quick_gelu=True), seed=6).visual.to(dtype)
    original = visual.state_dict()
    hf = open_clip_to_hf(original, "tower")
    assert hf["vision_model.pre_layrnorm.weight"] is not None and hf["visual_projection.weight"].shape == (TINY_EMBED, 64)
    # the q, k, v rows are the first, second and third thirds of in_proj (MultiheadAttention's layout)
    fused = original["transformer.resblocks.1.attn.in_proj_weight"]
    assert torch.equal(hf["vision_model.encoder.layers.1.self_attn.k_proj.weight"], fused[64:128])
    back = hf_to_open_clip(hf, "tower")
    assert set(back) == set(original) and all(torch.equal(back[k], original[k]) and back[k].dtype == dtype for k in original)
    again = open_clip_to_hf(back, "tower")
    assert set(again) == set(hf) and all(torch.equal(again[k], hf[k]) for k in hf)


def test_architecture_table_matches_openai_clip_towers():
    """Hand-copied from the config.json files of openai/clip-vit-base-patch32, -patch16 and
    clip-vit-large-patch14(-336): width, layers, heads, patch, image, MLP, projection."""
    published = {
        "ViT-B-32": (768, 12, 12, 32, 224, 3072, 512), "ViT-B-16": (768, 12, 12, 16, 224, 3072, 512),
        "ViT-L-14": (1024, 24, 16, 14, 224, 4096, 768), "ViT-L-14-336": (1024, 24, 16, 14, 336, 4096, 768),
    }
    for name, numbers in published.items():
        g = open_clip_architecture(name).geometry
        assert (g.width, g.layers, g.heads, g.patch_size, g.image_size, g.mlp_width, g.embed_dim) == numbers
    assert open_clip_architecture("ViT-B-32-quickgelu").quick_gelu and not open_clip_architecture("ViT-B-32").quick_gelu
    with pytest.raises(MimaError, match="not a plain CLIP ViT"):
        open_clip_architecture("RN50")


def _as_sharded(folder: Path) -> None:
    """model.safetensors split in two shards with an index, as save_pretrained writes large models."""
    state = load_state_dict(folder / "model.safetensors")
    keys = sorted(state)
    shards = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    for name, names in shards.items():
        save_file({k: state[k] for k in names}, str(folder / name), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: name for name, names in shards.items() for k in names}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / "model.safetensors").unlink()


def _as_pickle(folder: Path) -> None:
    """pytorch_model.bin, as older hub snapshots (openai/clip-vit-*) hold; read with the restricted unpickler."""
    state = OrderedDict(load_state_dict(folder / "model.safetensors"))
    state._metadata = OrderedDict({"": {"version": 1}})  # as nn.Module.state_dict() returns it
    torch.save(state, folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()


@pytest.mark.parametrize("layout", ["sharded", "pytorch_model.bin"])
def test_other_save_pretrained_layouts_convert_alike(layout, tiny_hf_folder, tiny_arch, tmp_path, capsys):
    code, _, err = run_cli(["--from", "hf-clip", tiny_hf_folder, "--arch", tiny_arch, "-o", tmp_path / "a.safetensors"], capsys)
    assert code == 0, err
    shutil.copytree(tiny_hf_folder, tmp_path / "model")
    (_as_sharded if layout == "sharded" else _as_pickle)(tmp_path / "model")
    code, _, err = run_cli(["--from", "hf-clip", tmp_path / "model", "--arch", tiny_arch, "-o", tmp_path / "b.safetensors"], capsys)
    assert code == 0, err
    first, second = load_state_dict(tmp_path / "a.safetensors"), load_state_dict(tmp_path / "b.safetensors")
    assert set(first) == set(second) and all(torch.equal(first[k], second[k]) for k in first)


# ---------------------------------------------------------------------------------- bad input
@pytest.fixture(scope="module")
def tiny_hf_folder(transformers, tmp_path_factory) -> Path:
    torch.manual_seed(0)
    config = transformers.CLIPVisionConfig(**TINY_HF, projection_dim=TINY_EMBED)
    folder = tmp_path_factory.mktemp("tiny-hf") / "model"
    perturb(transformers.CLIPVisionModelWithProjection(config), seed=7).save_pretrained(folder)
    return folder


def _edit_weights(folder: Path, change) -> None:
    state = load_state_dict(folder / "model.safetensors")
    change(state)
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _edit_config(folder: Path, **values) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(values)
    (folder / "config.json").write_text(json.dumps(config))


LAYER = "vision_model.encoder.layers"
TINY = ["--arch", TINY_ARCH]  # "<hf>" below stands for the undamaged tiny folder
BAD_INPUTS = {
    # name: (how the copied folder is damaged (None: an open_clip file instead), arguments, what the one error line says)
    "no config.json": (lambda f: (f / "config.json").unlink(), TINY, "has no config.json"),
    "no weights": (lambda f: (f / "model.safetensors").unlink(), TINY, "has no model.safetensors"),
    "damaged weights": (lambda f: (f / "model.safetensors").write_bytes(b"\x08" * 64), TINY, "not a readable safetensors file"),
    "missing tensor": (lambda f: _edit_weights(f, lambda s: s.pop(f"{LAYER}.1.self_attn.k_proj.bias")), TINY,
                       f"has no tensor '{LAYER}.1.self_attn.k_proj.bias'"),
    "missing block": (lambda f: _edit_weights(f, lambda s: [s.pop(k) for k in list(s) if k.startswith(f"{LAYER}.0.")]), TINY,
                      f"has no '{LAYER}.0.*' tensors but has block 1"),
    "unexpected tensor": (lambda f: _edit_weights(f, lambda s: s.update({f"{LAYER}.0.self_attn.q_norm.weight": torch.ones(16)})),
                          TINY, f"unexpected tensor '{LAYER}.0.self_attn.q_norm.weight'"),
    "misshapen tensor": (lambda f: _edit_weights(f, lambda s: s.update({f"{LAYER}.1.mlp.fc2.weight": torch.zeros(64, 128)})),
                         TINY, f"'{LAYER}.1.mlp.fc2.weight' has shape (64, 128), expected (64, 256)"),
    "config of another model": (lambda f: _edit_config(f, hidden_size=128), TINY, "hidden_size is 128 but the weights have 64"),
    "heads that do not divide": (lambda f: _edit_config(f, num_attention_heads=5), TINY, "num_attention_heads 5 does not divide"),
    "activation open_clip lacks": (lambda f: _edit_config(f, hidden_act="gelu_new"), TINY, "hidden_act is 'gelu_new'"),
    "not a CLIP": (lambda f: _edit_config(f, model_type="siglip_vision_model"), TINY, "model_type is 'siglip_vision_model'"),
    "config not an object": (lambda f: (f / "config.json").write_text("[1, 2]"), TINY, "config.json: expected a JSON object, found list"),
    "vision_config not an object": (lambda f: _edit_config(f, model_type="clip", vision_config="ViT-B-32"), TINY,
                                    "vision_config is a JSON str, expected an object"),
    "a size given as text": (lambda f: _edit_config(f, hidden_size="64"), TINY, "hidden_size is '64', expected a number"),
    "a size given as true": (lambda f: _edit_config(f, num_hidden_layers=True), TINY, "num_hidden_layers is True, expected a number"),
    "config nested 100,000 deep": (lambda f: (f / "config.json").write_text("[" * 100_000 + "]" * 100_000), TINY,
                                   "config.json: not valid JSON (nested too deeply"),
    "an open_clip file": (None, TINY, "is an open_clip state dict, not a transformers CLIP checkpoint"),
    "shape of no known architecture": (lambda f: None, [], "is none of ViT-B-32, ViT-B-16, ViT-L-14"),
    "wrong --arch": (lambda f: None, ["--arch", "ViT-B-32"], "--arch ViT-B-32: it has width 768"),
    "unknown --arch": (lambda f: None, ["--arch", "ViT-Q-99"], "unknown open_clip architecture 'ViT-Q-99'"),
    "--activation against config": (lambda f: None, [*TINY, "--activation", "gelu"], "says hidden_act 'quick_gelu'"),
    "--projection-from a tower that has one": (lambda f: None, [*TINY, "--projection-from", "<hf>"],
                                               "has its own 'visual_projection.weight'"),
    "--prefix with hf-clip": (lambda f: None, [*TINY, "--prefix", "x."], "--prefix: applies to pickled checkpoints only"),
    "--from and --to": (lambda f: None, [*TINY, "--to", "hf-clip"], "--from and --to: give one"),
    "shard outside the folder": (lambda f: (_as_sharded(f), _edit_index(f, "../elsewhere.safetensors")), TINY,
                                 "shard '../elsewhere.safetensors'"),
    "shard without its tensor": (lambda f: (_as_sharded(f), _edit_index(f, "model-00002-of-00002.safetensors")), TINY,
                                 "is not in its shard model-00002-of-00002.safetensors"),
}


def _edit_index(folder: Path, shard: str) -> None:
    """Point the first tensor of the index at another shard file."""
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    first = sorted(index["weight_map"])[0]  # kept in the first shard
    index["weight_map"][first] = shard
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_line_and_writes_nothing(case, tiny_hf_folder, tiny_arch, tmp_path, capsys):
    damage, arguments, message = BAD_INPUTS[case]
    source = tmp_path / "model"
    if damage is None:  # an open_clip encoder where a transformers checkpoint belongs
        source = tmp_path / "encoder.safetensors"
        save_state_dict(source, tiny_open_clip(True).visual.state_dict())
    else:
        shutil.copytree(tiny_hf_folder, source)
        damage(source)
    arguments = [str(tiny_hf_folder) if argument == "<hf>" else argument for argument in arguments]
    output = tmp_path / "out.safetensors"
    code, out, err = run_cli(["--from", "hf-clip", source, "--output", output, *arguments], capsys)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith("mima convert: error: ")
    assert message in err
    assert not output.exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_to_hf_clip_asks_for_the_activation_and_checks_the_source(tiny_arch, tmp_path, capsys):
    save_state_dict(tmp_path / "encoder.safetensors", tiny_open_clip(True).visual.state_dict())
    code, _, err = run_cli(["--to", "hf-clip", tmp_path / "encoder.safetensors", "--arch", tiny_arch, "-o", tmp_path / "hf"], capsys)
    assert code == 2 and "--activation: name the activation" in err and not (tmp_path / "hf").exists()
    state = tiny_open_clip(True).visual.state_dict()
    state.pop("transformer.resblocks.1.attn.in_proj_bias")
    save_state_dict(tmp_path / "broken.safetensors", state)
    code, _, err = run_cli(["--to", "hf-clip", tmp_path / "broken.safetensors", "--arch", tiny_arch,
                            "--activation", "gelu", "-o", tmp_path / "hf"], capsys)
    assert code == 2 and "has no tensor 'transformer.resblocks.1.attn.in_proj_bias'" in err
    assert not (tmp_path / "hf").exists() and len(err.strip().splitlines()) == 1


def test_an_input_is_never_overwritten(tiny_hf_folder, tiny_arch, tmp_path, capsys):
    source = tmp_path / "model"
    shutil.copytree(tiny_hf_folder, source)
    weights = (source / "model.safetensors").read_bytes()
    code, _, err = run_cli(["--from", "hf-clip", source, "--arch", tiny_arch, "--output", source / "model.safetensors",
                            "--overwrite"], capsys)
    assert code == 2 and "is the input" in err
    assert (source / "model.safetensors").read_bytes() == weights

    (tmp_path / "taken.safetensors").write_bytes(b"keep me")
    code, _, err = run_cli(["--from", "hf-clip", source, "--arch", tiny_arch, "--output", tmp_path / "taken.safetensors"], capsys)
    assert code == 2 and "already exists" in err and (tmp_path / "taken.safetensors").read_bytes() == b"keep me"

    save_state_dict(tmp_path / "encoder.safetensors", tiny_open_clip(True).visual.state_dict())
    encoder = (tmp_path / "encoder.safetensors").read_bytes()
    code, _, err = run_cli(["--to", "hf-clip", tmp_path / "encoder.safetensors", "--arch", tiny_arch, "--activation",
                            "gelu", "--output", tmp_path / "encoder.safetensors", "--overwrite"], capsys)
    assert code == 2 and "is the input" in err and (tmp_path / "encoder.safetensors").read_bytes() == encoder


def test_hf_options_do_not_apply_to_pickles(tmp_path, capsys):
    code, _, err = run_cli([tmp_path / "x.pt", tmp_path / "x.safetensors", "--arch", "ViT-B-32"], capsys)
    assert code == 2 and "--arch: applies to --from hf-clip and --to hf-clip only" in err
