"""Building open_clip models from a name + pretrained tag, a local file, or a local folder.

Accepted sources (`name` / `pretrained`):
  ViT-B-32 / openai                an open_clip architecture and tag (downloaded into open_clip's cache
                                   on first use, or beforehand by `mima prefetch`)
  ViT-B-32 / /path/weights.pt      an architecture and a local checkpoint file
  ViT-B-32 / none                  an architecture with random weights (offline smoke tests)
  local-dir:/path/folder           a folder with open_clip_config.json and weights (the HF-hub layout)
  embedded:tiny-digits             mima's own tiny CLIP, pretrained on first use and cached
Small test models are written as local-dir folders and loaded the same way as downloaded ones.

The MLP activation is never guessed (`model.quick_gelu`, see `resolve_quick_gelu`): OpenAI's CLIP
weights were trained with QuickGELU, open_clip builds most architectures with GELU, and a model
built with the wrong one loads without complaint and is silently a different network.

A tag's weights are looked up in the local cache first, on disk only. A machine without network
(HF_HUB_OFFLINE=1 or MIMA_OFFLINE=1) that lacks them fails at once with one line naming
`mima prefetch`, as does a failed download; this runs in MimaModule.__init__, before any process
group exists, so every process reports it instead of a collective hanging on a dead peer.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Union

import open_clip
from open_clip.transform import PreprocessCfg, image_transform_v2
from safetensors import SafetensorError
import torch
from torch import nn

from mima.core.cache_dir import cache_dir_or_default  # where the embedded model and zero-shot heads are cached
from mima.core.errors import MimaError
from mima.core.bounded_json import read_json
from mima.core.files import write_json_atomic

EMBEDDED_PREFIX = "embedded:"
LOCAL_DIR_PREFIX = "local-dir:"
RANDOM_WEIGHTS = ("none", "random")
QUICK_GELU_OPTION = "model.quick_gelu"
QuickGelu = Union[bool, Literal["auto"]]
# Written beside a weight file by `mima prefetch` (WEIGHTS + this suffix): the architecture, the tag
# and the activation the weights were trained with, so that a copied file still says which it needs.
WEIGHTS_RECORD_SUFFIX = ".open_clip.json"
QUICKGELU_NAME_SUFFIX = "-quickgelu"  # open_clip's architectures built with QuickGELU (ViT-B-32-quickgelu, ...)
# Set to 1/true/yes/on, either one means "no network here": a missing weight file fails at once.
OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "MIMA_OFFLINE")


@dataclass
class LoadedClip:
    """A CLIP model with its tokenizer; `source` names where it came from (for messages and caches)."""

    model: nn.Module
    tokenizer: object
    source: str

    @property
    def encoder(self) -> nn.Module:
        return self.model.visual

    @property
    def preprocess(self) -> Callable:
        """open_clip's evaluation transform (PIL image -> normalised tensor): resize the shorter side,
        centre crop, normalise; deterministic. Used for validation, test, zero-shot evaluation and the
        images linear probes are fitted on (task_vectors' `val_preprocess`)."""
        return image_transform_v2(PreprocessCfg(**self.model.visual.preprocess_cfg), is_train=False)

    @property
    def preprocess_train(self) -> Callable:
        """open_clip's training transform (PIL image -> normalised tensor): RandomResizedCrop to the
        input size with scale (0.9, 1.0) (area fraction of the source image; aspect ratio 3/4 to 4/3;
        bicubic), then normalise; random. task_vectors fine-tunes on exactly this transform: its
        `ImageEncoder` keeps the `train_preprocess` of `open_clip.create_model_and_transforms`, and
        `finetune.py` builds the training set with `model.train_preprocess`."""
        return image_transform_v2(PreprocessCfg(**self.model.visual.preprocess_cfg), is_train=True)

    @property
    def image_size(self) -> int:
        size = getattr(self.model.visual, "image_size", 224)
        return int(size[0] if isinstance(size, (tuple, list)) else size)


def effective_pretrained(name: str, pretrained: str | None) -> str | None:
    """model.pretrained as it applies to model.clip `name`: None where the source carries its own
    weights (embedded and local-folder models: the tag is ignored) or where random weights are asked for."""
    if name.startswith((EMBEDDED_PREFIX, LOCAL_DIR_PREFIX)) or (pretrained or "").lower() in RANDOM_WEIGHTS:
        return None
    return pretrained


def load_clip(name: str, pretrained: str | None = None, cache_dir: str | Path | None = None,
              quick_gelu: QuickGelu = "auto") -> LoadedClip:
    """Load an open_clip CLIP (see the module docstring for accepted sources); `quick_gelu` is the
    run's `model.quick_gelu` (resolve_quick_gelu)."""
    cache = cache_dir_or_default(cache_dir)
    pretrained = effective_pretrained(name, pretrained)
    activation = resolve_quick_gelu(name, pretrained, quick_gelu)
    if name.startswith(EMBEDDED_PREFIX):
        from mima.models.embedded import ensure_embedded_model

        folder = ensure_embedded_model(name[len(EMBEDDED_PREFIX) :], cache)
        return _create(f"{LOCAL_DIR_PREFIX}{folder}", None, source=name, quick_gelu=activation)
    if name.startswith(LOCAL_DIR_PREFIX):
        folder = Path(name[len(LOCAL_DIR_PREFIX) :])
        if not (folder / "open_clip_config.json").is_file():
            raise MimaError(f"model.clip: {folder} has no open_clip_config.json (expected an open_clip model folder)")
        return _create(name, None, source=name, quick_gelu=activation)
    check_architecture(name)
    if pretrained and not os.path.isfile(pretrained):
        path, _ = fetch_pretrained(name, pretrained)  # in the cache now, or a one-line MimaError naming `mima prefetch`
        # The tag, not the file: open_clip takes the tag's preprocessing settings from its pretrained
        # config. With the file cached the hub need not be asked for a newer revision; on a compute
        # node without network that request would only wait for its timeout.
        with _hub_offline():
            return _create(name, pretrained, source=f"{name}:{pretrained}", weights=path, quick_gelu=activation)
    return _create(name, pretrained, source=f"{name}:{pretrained}", quick_gelu=activation)


def check_architecture(name: str) -> None:
    """A one-line MimaError unless `name` is one of open_clip's architectures."""
    if name not in open_clip.list_models():
        raise MimaError(
            f"model.clip: unknown open_clip architecture '{name}' "
            f"(use e.g. ViT-B-32, local-dir:PATH or embedded:tiny-digits)"
        )


def resolve_quick_gelu(name: str, pretrained: str | None, setting: QuickGelu = "auto") -> bool | None:
    """Whether the model is built with QuickGELU: `setting` when it is true or false; with "auto",
    what the weights say. None: the model's own configuration decides (a local-dir or embedded
    folder's open_clip_config.json, or random weights of an architecture).

    "auto" for an architecture with
      - a pretrained tag: the tag's pretrained config (OpenAI's tags say QuickGELU);
      - a weight file: the record `mima prefetch` wrote beside it (WEIGHTS_RECORD_SUFFIX), or a
        `-quickgelu` architecture name; otherwise nothing says, and the run is refused in one line
        naming model.quick_gelu (a file's tensors are the same for both activations).
    """
    if setting is True or setting is False:
        return setting
    if setting != "auto":
        raise MimaError(f"{QUICK_GELU_OPTION}: '{setting}', expected auto, true or false")
    if name.startswith((EMBEDDED_PREFIX, LOCAL_DIR_PREFIX)) or not pretrained or pretrained.lower() in RANDOM_WEIGHTS:
        return None
    if not os.path.isfile(pretrained):
        # open_clip 3 records the tag's activation in its pretrained config, but builds ViT-B-32 with
        # GELU and only warns of the mismatch: it has to be asked for
        check_architecture(name)
        check_pretrained_tag(name, pretrained)
        return bool(open_clip.get_pretrained_cfg(name, pretrained).get("quick_gelu", False))
    recorded = read_weights_record(Path(pretrained))
    if recorded is not None:
        return recorded
    if name.endswith(QUICKGELU_NAME_SUFFIX):
        return True
    raise MimaError(
        f"{QUICK_GELU_OPTION}: auto cannot tell which activation {pretrained} was trained with (no "
        f"{Path(pretrained).name}{WEIGHTS_RECORD_SUFFIX} beside it, as `mima prefetch --weights-dir` writes, and "
        f"'{name}' is not a {QUICKGELU_NAME_SUFFIX} architecture); set --{QUICK_GELU_OPTION} true for OpenAI's CLIP "
        "weights, false for open_clip's LAION / DataComp ones"
    )


def weights_record_file(weights: Path) -> Path:
    """Where the record of a weight file's architecture, tag and activation lives: beside it."""
    return weights.with_name(weights.name + WEIGHTS_RECORD_SUFFIX)


def read_weights_record(weights: Path) -> bool | None:
    """The QuickGELU flag recorded beside a weight file, None when there is no record; a record that
    is not what `write_weights_record` writes is one line naming it."""
    record_file = weights_record_file(weights)
    if not record_file.is_file():
        return None
    record = read_json(record_file)
    value = record.get("quick_gelu")
    if not isinstance(value, bool):
        raise MimaError(f"{record_file}: 'quick_gelu' must be true or false, found {value!r}")
    return value


def write_weights_record(weights: Path, name: str, tag: str, quick_gelu: bool) -> Path:
    """Record beside `weights` which architecture and tag they are and the activation they need."""
    record_file = weights_record_file(weights)
    write_json_atomic(record_file, {"architecture": name, "pretrained": tag, "quick_gelu": quick_gelu,
                                    "written_by": "mima prefetch"})
    return record_file


def check_pretrained_tag(name: str, tag: str) -> None:
    """A one-line MimaError unless `tag` is one of open_clip's pretrained tags of architecture `name`."""
    tags = open_clip.list_pretrained_tags_by_model(name)
    if tag not in tags:
        raise MimaError(
            f"model.pretrained: '{tag}' is neither a file nor a known tag of {name} (tags: {', '.join(tags) or 'none'})"
        )


def offline() -> bool:
    """True when the environment says this machine has no network (see OFFLINE_VARIABLES)."""
    return any(os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on") for name in OFFLINE_VARIABLES)


def cached_pretrained_file(name: str, tag: str) -> str | None:
    """The file open_clip would load for `name` + pretrained `tag` if it is already in open_clip's
    download cache, else None. Looks at the disk only, in the order of
    `open_clip.pretrained.download_pretrained`: the tag's HF-hub repository when it has one (the
    safetensors alternative before the named file), else the file of its URL under ~/.cache/clip."""
    from open_clip.constants import HF_WEIGHTS_NAME
    from open_clip.pretrained import get_pretrained_cfg, has_hf_hub

    cfg = get_pretrained_cfg(name, tag)
    if "file" in cfg:
        return cfg["file"] if os.path.isfile(cfg["file"]) else None
    hub, url = cfg.get("hf_hub", ""), cfg.get("url", "")
    if hub and has_hf_hub():
        from huggingface_hub import try_to_load_from_cache

        repo_id, filename = os.path.split(hub)  # "org/model/" names the default file, "org/model/file" a file
        filename = filename or HF_WEIGHTS_NAME
        for candidate in (*safetensors_alternatives(filename), filename):
            found = try_to_load_from_cache(repo_id, candidate)
            if isinstance(found, str):  # not None, nor the marker of a file known to be absent
                return found
        return None
    if url:
        path = Path("~/.cache/clip").expanduser() / os.path.basename(url)
        return str(path) if path.is_file() else None
    return None


def safetensors_alternatives(filename: str) -> tuple[str, ...]:
    """The safetensors files open_clip tries, before `filename` itself, in a tag's HF-hub repository:
    open_clip_model.safetensors for its default open_clip_pytorch_model.bin, NAME.safetensors for
    any other NAME.bin or NAME.pth. open_clip keeps this rule private (download_pretrained_from_hf
    follows it), so it is stated here."""
    from open_clip.constants import HF_SAFE_WEIGHTS_NAME, HF_WEIGHTS_NAME

    if filename == HF_WEIGHTS_NAME:
        return (HF_SAFE_WEIGHTS_NAME,)
    if filename.endswith((".bin", ".pth")):
        return (os.path.splitext(filename)[0] + ".safetensors",)
    return ()


def hub_cache_location(name: str, tag: str) -> str:
    """Where the weights of `name` + `tag` are looked for (for messages)."""
    from open_clip.pretrained import get_pretrained_cfg, has_hf_hub

    if get_pretrained_cfg(name, tag).get("hf_hub") and has_hf_hub():
        from huggingface_hub import constants

        return constants.HF_HUB_CACHE
    return str(Path("~/.cache/clip").expanduser())


def fetch_pretrained(name: str, tag: str) -> tuple[str, bool]:
    """The local weight file of `name` + pretrained `tag`, and whether it was already cached.
    Downloads it into open_clip's usual cache when missing, unless the machine is offline; a
    failure is one MimaError line that names `mima prefetch`."""
    cached = cached_pretrained_file(name, tag)
    if cached is not None:
        return cached, True
    where = f"the weights of {name} ({tag}) are not in the local cache ({hub_cache_location(name, tag)})"
    advice = "run `mima prefetch --config <your config>` on a machine with internet (e.g. the login node)"
    if offline():
        raise MimaError(f"model.pretrained: {where} and this machine is offline; {advice}")
    from open_clip.pretrained import download_pretrained, get_pretrained_cfg

    try:
        path = download_pretrained(get_pretrained_cfg(name, tag))
    except Exception as exc:  # urllib, huggingface_hub and checksum errors alike: no (working) network
        reason = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise MimaError(f"model.pretrained: {where} and the download failed ({reason}); {advice}") from None
    return path, False


@contextmanager
def _hub_offline() -> Iterator[None]:
    """huggingface_hub's offline mode for the block: cached files only, no request. The hub reads
    its flag at every request (constants.is_offline_mode), so setting it here is enough."""
    try:
        from huggingface_hub import constants
    except ImportError:  # open_clip then uses URLs only
        yield
        return
    before = constants.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = before


def _create(name: str, pretrained: str | None, source: str, weights: str | None = None,
            quick_gelu: bool | None = None) -> LoadedClip:
    # None leaves the architecture's (or the folder's) own setting. True through open_clip's own
    # switch; False as a model keyword, which open_clip applies to the model config last.
    activation = {} if quick_gelu is None else {"force_quick_gelu": True} if quick_gelu else {"quick_gelu": False}
    try:
        model = open_clip.create_model(name, pretrained=pretrained, **activation)
    except (RuntimeError, pickle.UnpicklingError, SafetensorError) as exc:
        # open_clip raises RuntimeError for failed downloads and for weights that do not fit; a damaged
        # weight file (say, a cache copied over incompletely) fails in torch's unpickler or in safetensors.
        where = f" from {weights}" if weights else ""
        raise MimaError(f"model '{source}': could not be loaded{where} ({str(exc).splitlines()[0]})") from None
    tokenizer = open_clip.get_tokenizer(name)
    model.eval()
    return LoadedClip(model=model, tokenizer=tokenizer, source=source)


def text_tower_fingerprint(model: nn.Module) -> str:
    """A hash of the modules (activations included: QuickGELU or GELU) and of every weight outside
    the image tower: zero-shot heads depend on nothing else."""
    digest = hashlib.sha256(repr(model).encode())
    for key, tensor in sorted(model.state_dict().items()):
        if key.startswith("visual."):
            continue
        digest.update(key.encode())
        data = tensor.detach().to("cpu").contiguous()
        digest.update(data.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
