"""`mima prefetch` and the offline check of open_clip weights (issue 13, item 6). No network is used:
the hub cache is a temporary folder, filled (where a test needs a cached file) in huggingface_hub's
own layout, and every run that could reach the network is marked offline."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import huggingface_hub
import pytest
import yaml
from huggingface_hub import constants as hub_constants
from huggingface_hub.file_download import repo_folder_name

from mima.cli import main
from mima.core.errors import MimaError
from mima.models.clip import cached_pretrained_file, fetch_pretrained, load_clip, safetensors_alternatives
from mima.commands.prefetch.fetch import prefetch
from mima.config.run_config import load_run_config

REPO_ROOT = Path(__file__).resolve().parents[2]
OPENAI_B32_REPO = "timm/vit_base_patch32_clip_224.openai"  # open_clip's hf_hub of ViT-B-32 / openai
REVISION = "0123456789abcdef0123456789abcdef01234567"


def cache_file(hub_cache: Path, repo_id: str, filename: str, content: bytes = b"not real weights") -> Path:
    """Put `filename` into the hub cache exactly where `hf_hub_download` leaves a download:
    models--org--name/snapshots/<commit>/<file>, with refs/main naming the commit."""
    repo = hub_cache / repo_folder_name(repo_id=repo_id, repo_type="model")
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(REVISION)
    path = repo / "snapshots" / REVISION / filename
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    return path


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """An empty huggingface_hub cache for this process (the hub reads HF_HOME only at import, so
    its constant is pointed here) and a machine marked offline: nothing may reach the network."""
    cache = tmp_path / "hf" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("MIMA_OFFLINE", "1")
    return cache


def write_config(path: Path, model: dict, data: dict) -> Path:
    config = {
        "seed_everything": 0,
        "model": {"steps": 2, "iterations": 1, **model},
        "data": {"batch_size": 4, **data},
        "trainer": {"accelerator": "cpu"},
    }
    path.write_text(yaml.safe_dump(config))
    return path


# ------------------------------------------------------------------ the compute node: `mima fit`
@pytest.mark.parametrize("offline_variable", ["HF_HUB_OFFLINE", "MIMA_OFFLINE"])
def test_fit_offline_without_cached_weights_fails_at_once_naming_prefetch(tmp_path, offline_variable):
    """What a compute node sees: a fresh process, HF_HOME on an empty folder, no network. The run
    stops while the model is built (before the run folder, the Trainer or any process group)."""
    config = write_config(tmp_path / "b32.yaml", {"clip": "ViT-B-32", "pretrained": "openai"},
                          {"suite": "digits", "tasks": ["rot90"]})
    out = tmp_path / "run"
    env = {key: value for key, value in os.environ.items()
           if key not in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "MIMA_OFFLINE")}
    env.update({"HF_HOME": str(tmp_path / "hf"), offline_variable: "1"})
    result = subprocess.run([sys.executable, "-m", "mima", "fit", "--config", str(config), "--out", str(out)],
                            capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=300)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1, result.stderr  # nothing but the error: no download attempts or retries logged
    assert lines[0].startswith("mima fit: error: model.pretrained: the weights of ViT-B-32 (openai) are not in the local cache")
    assert "offline" in lines[0] and "mima prefetch --config" in lines[0]
    assert str(tmp_path / "hf" / "hub") in lines[0]  # the cache it looked in
    assert not out.exists() or not any(out.iterdir())


# ---------------------------------------------------------------------------- the cache probe
def test_the_probe_finds_what_hf_hub_download_would_load_and_nothing_in_an_empty_cache(hub_cache):
    assert cached_pretrained_file("ViT-B-32", "openai") is None
    weights = cache_file(hub_cache, OPENAI_B32_REPO, "open_clip_pytorch_model.bin")
    assert cached_pretrained_file("ViT-B-32", "openai") == str(weights)
    # the same path huggingface_hub itself resolves from its cache (local_files_only: no request)
    assert huggingface_hub.hf_hub_download(OPENAI_B32_REPO, "open_clip_pytorch_model.bin", local_files_only=True) == str(weights)
    # open_clip prefers the safetensors alternative when both are there
    safe = cache_file(hub_cache, OPENAI_B32_REPO, "open_clip_model.safetensors")
    assert cached_pretrained_file("ViT-B-32", "openai") == str(safe)
    assert fetch_pretrained("ViT-B-32", "openai") == (str(safe), True)  # offline, and no error: it is cached


def test_the_probe_ignores_the_hubs_marker_of_an_absent_file(hub_cache):
    """A `.no_exist` entry (the hub remembers that a repository lacks the safetensors file) is not a file."""
    weights = cache_file(hub_cache, OPENAI_B32_REPO, "open_clip_pytorch_model.bin")
    marker = weights.parents[2] / ".no_exist" / REVISION / "open_clip_model.safetensors"
    marker.parent.mkdir(parents=True)
    marker.touch()
    assert cached_pretrained_file("ViT-B-32", "openai") == str(weights)


def test_a_tag_whose_hf_hub_names_a_file_is_probed_under_that_name(hub_cache):
    from open_clip.pretrained import get_pretrained_cfg

    repo_id, filename = os.path.split(get_pretrained_cfg("ViTamin-XL-384", "datacomp1b")["hf_hub"])
    assert filename  # "org/model/pytorch_model.bin"
    assert cached_pretrained_file("ViTamin-XL-384", "datacomp1b") is None
    weights = cache_file(hub_cache, repo_id, filename)
    assert cached_pretrained_file("ViTamin-XL-384", "datacomp1b") == str(weights)


def test_the_safetensors_alternatives_are_open_clips():
    """What open_clip tries before a hub file: its own safetensors name for its default file, the
    same stem for any other .bin or .pth, nothing for other files."""
    assert safetensors_alternatives("open_clip_pytorch_model.bin") == ("open_clip_model.safetensors",)
    assert safetensors_alternatives("pytorch_model.bin") == ("pytorch_model.safetensors",)
    assert safetensors_alternatives("epoch_32.pth") == ("epoch_32.safetensors",)
    assert safetensors_alternatives("open_clip_model.safetensors") == ()


def test_without_huggingface_hub_the_url_file_under_dot_cache_clip_counts(tmp_path, monkeypatch):
    """open_clip falls back to the tag's URL, saved as ~/.cache/clip/<basename>, when the hub is missing."""
    import open_clip.pretrained

    monkeypatch.setattr(open_clip.pretrained, "has_hf_hub", lambda necessary=False: False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cached_pretrained_file("ViT-B-32", "openai") is None
    url = open_clip.pretrained.get_pretrained_cfg("ViT-B-32", "openai")["url"]
    path = tmp_path / ".cache" / "clip" / os.path.basename(url)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"x")
    assert cached_pretrained_file("ViT-B-32", "openai") == str(path)


def test_fetch_offline_with_an_empty_cache_is_one_line_naming_prefetch(hub_cache):
    with pytest.raises(MimaError) as caught:
        fetch_pretrained("ViT-B-32", "openai")
    message = str(caught.value)
    assert "\n" not in message and "mima prefetch --config" in message and str(hub_cache) in message


# open_clip 3.x builds ViT-B-32 with GELU and only warns that the openai tag was trained with QuickGELU
@pytest.mark.filterwarnings("ignore:QuickGELU mismatch")
def test_a_cached_file_is_loaded_offline_by_its_tag_and_a_damaged_one_is_one_line(hub_cache):
    """Offline, with the file in the cache, open_clip gets the tag and reads that very file (here a
    damaged one, so the test needs no real weights): the error names it, not the network."""
    damaged = cache_file(hub_cache, OPENAI_B32_REPO, "open_clip_pytorch_model.bin")
    hub_offline_before = hub_constants.HF_HUB_OFFLINE
    with pytest.raises(MimaError) as caught:
        load_clip("ViT-B-32", "openai")
    message = str(caught.value)
    assert message.startswith(f"model 'ViT-B-32:openai': could not be loaded from {damaged} (")
    assert "\n" not in message and "offline" not in message
    assert hub_constants.HF_HUB_OFFLINE == hub_offline_before  # the hub's offline switch is restored


# ---------------------------------------------------------------- the login node: `mima prefetch`
def test_prefetch_of_a_local_model_and_bundled_tasks_has_nothing_to_fetch(tmp_path, small_clip, hub_cache, capsys):
    config = write_config(tmp_path / "local.yaml", {"clip": small_clip}, {"suite": "digits", "tasks": ["rot90", "mirror"]})
    assert main(["prefetch", "--config", str(config)]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    assert captured.out.splitlines() == [
        f"mima prefetch: model {small_clip}: a local folder (no download)",
        "mima prefetch: data rot90: bundled or generated locally (no download)",
        "mima prefetch: data mirror: bundled or generated locally (no download)",
    ]
    # the function itself, on the file or on a loaded configuration: the same lines, returned
    assert prefetch(config, say=lambda line: None) == prefetch(load_run_config(config), say=lambda line: None) == [
        line.removeprefix("mima prefetch: ") for line in captured.out.splitlines()
    ]


def test_prefetch_reports_cached_weights_without_building_the_model(tmp_path, hub_cache, capsys):
    """The cached file is not a real checkpoint: prefetch only checks that it is there."""
    weights = cache_file(hub_cache, OPENAI_B32_REPO, "open_clip_model.safetensors")
    config = write_config(tmp_path / "b32.yaml", {"clip": "ViT-B-32", "pretrained": "openai"},
                          {"suite": "digits", "tasks": ["rot90"]})
    assert main(["prefetch", "--config", str(config)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"mima prefetch: model ViT-B-32 (openai): already in the cache: {weights}"


def test_prefetch_offline_names_every_missing_item_on_one_line(tmp_path, hub_cache, capsys):
    """On a machine without network prefetch only checks: a weight file missing from the cache, a task
    torchvision could download and a task that needs a manual download are all named, on one line."""
    root = tmp_path / "data"
    config = write_config(tmp_path / "clip.yaml", {"clip": "ViT-B-32", "pretrained": "openai"},
                          {"suite": "clip", "tasks": ["MNIST", "DTD"], "root": str(root)})
    assert main(["prefetch", "--config", str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    model, data = err[0].split(" | ")
    assert model.startswith("mima prefetch: error: model.pretrained: the weights of ViT-B-32 (openai) are not in the local cache")
    assert data == (f"data.root: 2 tasks are missing under {root}: MNIST (offline), DTD (manual download); "
                    f"`mima data check --root {root}` lists what each needs and where to get it")
    assert not root.exists()  # nothing was downloaded or created


def test_prefetch_of_one_task_to_download_by_hand_gives_the_message_of_mima_fit(tmp_path, small_clip, hub_cache, capsys):
    root = tmp_path / "data"
    config = write_config(tmp_path / "dtd.yaml", {"clip": small_clip}, {"suite": "clip", "tasks": ["DTD"], "root": str(root)})
    assert main(["prefetch", "--config", str(config)]) == 2
    captured = capsys.readouterr()
    assert captured.out.splitlines() == [f"mima prefetch: model {small_clip}: a local folder (no download)"]
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"mima prefetch: error: data.root: task DTD not found under {root}; expected: dtd/train/")


def test_prefetch_of_a_clip_suite_config_without_a_data_root_names_the_option(tmp_path, small_clip, hub_cache, capsys):
    config = write_config(tmp_path / "noroot.yaml", {"clip": small_clip}, {"suite": "clip", "tasks": ["MNIST"]})
    assert main(["prefetch", "--config", str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "data.root: task MNIST is read from disk" in err[0] and "--data.root DIR" in err[0]


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["prefetch", "--config", "no/such/config.yaml"], "--config no/such/config.yaml: no such file or run folder"),
        (["prefetch"], "the following arguments are required: --config"),
        (["prefetch", "--config", "x.yaml", "--bogus"], "unrecognized option --bogus"),
    ],
)
def test_prefetch_usage_errors_are_one_line(argv, fragment, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mima prefetch: error: ") and fragment in err[0], err


def test_prefetch_with_a_bad_tag_is_one_line(tmp_path, hub_cache, capsys):
    config = write_config(tmp_path / "bad.yaml", {"clip": "ViT-B-32", "pretrained": "nosuchtag"},
                          {"suite": "digits", "tasks": ["rot90"]})
    assert main(["prefetch", "--config", str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'nosuchtag' is neither a file nor a known tag of ViT-B-32" in err[0]


def test_prefetch_weights_dir_copies_the_tags_file_with_its_activation_recorded(tmp_path, hub_cache, capsys):
    """--weights-dir: the cached file copied byte for byte, with the tag's activation (OpenAI's: QuickGELU)
    recorded beside it, which `model.quick_gelu: auto` reads when a config names the copy."""
    from mima.models.clip import resolve_quick_gelu, weights_record_file

    weights = cache_file(hub_cache, OPENAI_B32_REPO, "open_clip_model.safetensors", content=b"cached bytes")
    config = write_config(tmp_path / "b32.yaml", {"clip": "ViT-B-32", "pretrained": "openai"},
                          {"suite": "digits", "tasks": ["rot90"]})
    assert main(["prefetch", "--config", str(config), "--weights-dir", str(tmp_path / "models")]) == 0
    copy = tmp_path / "models" / "ViT-B-32-openai.safetensors"
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (f"mima prefetch: model ViT-B-32 (openai): already in the cache: {weights}; copied to {copy} "
                      f"(QuickGELU, recorded in {weights_record_file(copy).name})")
    assert copy.read_bytes() == b"cached bytes"
    assert resolve_quick_gelu("ViT-B-32", str(copy)) is True
    # a config naming the copy is checked the same way, and a file nothing describes is refused
    named = write_config(tmp_path / "copy.yaml", {"clip": "ViT-B-32", "pretrained": str(copy)},
                         {"suite": "digits", "tasks": ["rot90"]})
    assert main(["prefetch", "--config", str(named)]) == 0
    assert capsys.readouterr().out.splitlines()[0] == (
        f"mima prefetch: model ViT-B-32: the local file {copy} (no download; QuickGELU)")
    weights_record_file(copy).unlink()
    assert main(["prefetch", "--config", str(named)]) == 2
    assert "model.quick_gelu: auto cannot tell" in capsys.readouterr().err
