"""`mima convert`: a pickled model checkpoint -> a safetensors state dict, without running its code.

task_vectors and tall_masks save whole modules (`torch.save(image_encoder)`): loading them with
`torch.load` imports and runs whatever the pickle names, and breaks when the classes have moved
between versions. This converter reads the torch zip archive itself with a restricted unpickler:

  * classes and functions from model namespaces (torch.nn, open_clip, task_vectors' src.modeling,
    timm, torchvision transforms) become inert stand-ins that only record their state; nothing
    from those packages is imported or called;
  * tensors are rebuilt from the archive's storages with torch's own tensor-rebuilding helpers,
    after checking that each view lies inside its storage and holds no more elements than it (a
    crafted offset or a zero stride must not make torch read or allocate what the file never held);
  * a storage is read only if its entry is stored uncompressed with the size its record declares,
    as torch.save writes it; a compressed data.pkl may inflate to at most 64 MiB (a zip bomb of a
    few hundred KB is refused before it is inflated, naming the entry);
  * any other global (os.system, builtins.eval, subprocess, ...) stops the conversion with an
    error naming it, before anything is called.

The module tree is then walked for parameters and persistent buffers, and the keys under
`--prefix` (default `model.visual.`, task_vectors' ImageEncoder) are written, prefix removed, as
an image-encoder state dict like the ones `mima fit` writes.

`--from hf-clip` and `--to hf-clip` convert between open_clip image encoders and Hugging Face
`transformers` CLIP vision towers (how FusionBench publishes its task models, e.g.
tanganke/clip-vit-base-patch32_<task>). This is a pure renaming of tensors (the table is in
mima.models.hf_clip): it reads safetensors files and config.json, or a pytorch_model.bin through
the same restricted unpickler, and never imports `transformers` nor runs code from the checkpoint.
`transformers` is needed only to use an exported folder (and by the tests that build a random
model to compare against): `pip install 'mima[hf]'`.
"""

from __future__ import annotations

import argparse
import collections
import io
import math
import os
import pickle
import shutil
import tempfile
import warnings
import zipfile
import zlib
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from mima.core.errors import MimaError
from mima.core.files import atomic_path, read_json, refuse_input_as_output, refuse_overwrite
from mima.core.safetensors_io import load_state_dict, save_state_dict
from mima.models.hf_clip import (
    ACTIVATIONS,
    HF_PROJECTION,
    HFVisionConfig,
    OpenClipArchitecture,
    check_hf_config,
    choose_architecture,
    hf_config_dict,
    hf_geometry,
    hf_to_open_clip,
    open_clip_geometry,
    open_clip_to_hf,
    parse_hf_config,
)

STAND_IN_NAMESPACES = ("torch.nn.", "open_clip.", "src.", "modeling", "timm.", "torchvision.transforms.")
STORAGE_DTYPES = {
    "FloatStorage": torch.float32, "DoubleStorage": torch.float64, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8, "BoolStorage": torch.bool,
}
# What a compressed archive entry may inflate to (see read_entry); torch.save's entries are stored.
INFLATE_BUDGET = 64 * 1024 * 1024
DTYPE_NAMES = {"float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool"}


class StandIn:
    """Takes the place of a class named in the pickle: records state, never runs anything."""

    def __init__(self, *args, **kwargs) -> None:
        self.__dict__["_stand_in_args"] = args

    def __setstate__(self, state) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (dict state, slot state)
            state = {**(state[0] or {}), **(state[1] or {})}
        if isinstance(state, dict):
            self.__dict__.update(state)

    def __call__(self, *args, **kwargs):
        raise MimaError("a stand-in for code named in the checkpoint was asked to run; refusing")


def _rebuild_parameter(data, requires_grad, backward_hooks, *rest):
    return data  # the parameter's tensor is all we need


def _reconstructor(cls, base, state):
    if isinstance(cls, type) and issubclass(cls, StandIn):
        return cls.__new__(cls)
    raise pickle.UnpicklingError(f"cannot reconstruct {cls!r}")


class _StorageType:
    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype


class RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, archive: zipfile.ZipFile, prefix: str, source: Path) -> None:
        super().__init__(io.BytesIO(data))
        self.archive, self.prefix, self.source = archive, prefix, source
        self.storages: dict[object, torch.storage.TypedStorage] = {}
        self.stand_ins: dict[tuple[str, str], type] = {}

    def find_class(self, module: str, name: str):
        # Protocol-2 pickles (torch.save's default) use Python 2's module names.
        module = {"__builtin__": "builtins", "copy_reg": "copyreg"}.get(module, module)
        allowed = {
            ("torch._utils", "_rebuild_tensor_v2"): self._rebuild_tensor,
            ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
            ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
            ("collections", "OrderedDict"): collections.OrderedDict,
            ("builtins", "set"): set,
            ("builtins", "frozenset"): frozenset,
            ("torch", "Size"): torch.Size,
            ("torch", "device"): torch.device,
            ("copyreg", "_reconstructor"): _reconstructor,
        }
        if (module, name) in allowed:
            return allowed[(module, name)]
        if module == "torch" and name in STORAGE_DTYPES:
            return _StorageType(STORAGE_DTYPES[name])
        if module == "torch" and name in DTYPE_NAMES:
            return getattr(torch, name)
        if module.startswith(STAND_IN_NAMESPACES) or module in ("modeling", "src"):
            key = (module, name)
            if key not in self.stand_ins:
                self.stand_ins[key] = type(name, (StandIn,), {"__module__": f"mima.convert.stand_in.{module}"})
            return self.stand_ins[key]
        raise MimaError(
            f"{self.source}: refused: the pickle references {module}.{name}, which is not a model class or a "
            "tensor; nothing from the file was run"
        )

    def _rebuild_tensor(self, storage, storage_offset, size, stride, *rest):
        """torch's own rebuild, after checking that the view stays inside its storage: a truncated or
        crafted file must not make torch read memory the file never held."""
        if not (isinstance(storage_offset, int) and all(isinstance(v, int) for v in (*size, *stride))):
            raise MimaError(f"{self.source}: a tensor record with a non-integer offset, shape or stride")
        if storage_offset < 0 or any(v < 0 for v in (*size, *stride)) or len(size) != len(stride):
            raise MimaError(f"{self.source}: a tensor record with a negative offset, shape or stride")
        last = storage_offset + sum((n - 1) * step for n, step in zip(size, stride)) if all(size) else -1
        with warnings.catch_warnings():  # torch's pickles hold TypedStorages; asking their size warns of its deprecation
            warnings.filterwarnings("ignore", message="TypedStorage is deprecated", category=UserWarning)
            elements = storage.size()
        if last >= elements:
            raise MimaError(
                f"{self.source}: a tensor of shape {tuple(size)} needs {last + 1} elements of its storage, which "
                f"holds {elements} (the file is truncated or crafted)"
            )
        count = math.prod(size)
        if count > elements:
            # a view that repeats its storage (a zero stride): made contiguous for the output it would
            # take count elements of memory, which a file of a few bytes could make terabytes
            raise MimaError(
                f"{self.source}: a tensor of shape {tuple(size)} has {count} elements but its storage holds "
                f"{elements} (a view that repeats its storage); not converted"
            )
        return torch._utils._rebuild_tensor_v2(storage, storage_offset, size, stride, *rest)

    def persistent_load(self, saved_id):
        kind, storage_type, key, _location, numel = saved_id
        if kind != "storage" or not isinstance(storage_type, _StorageType):
            raise MimaError(f"{self.source}: unexpected storage record {saved_id!r}")
        if key in self.storages:  # tensors sharing a storage share it here too (as torch.load does)
            return self.storages[key]
        member = f"{self.prefix}data/{key}"
        try:
            info = self.archive.getinfo(member)
        except KeyError:
            raise MimaError(f"{self.source}: storage {key} is missing from the archive") from None
        expected = int(numel) * torch.tensor([], dtype=storage_type.dtype).element_size()
        # torch.save stores storages uncompressed and whole; anything else is not its file (and a
        # compressed entry could inflate to any size), so the size is checked before reading
        if info.compress_type != zipfile.ZIP_STORED or info.file_size != expected:
            raise MimaError(
                f"{self.source}: storage {key} (entry '{member}') is {info.file_size} bytes"
                f"{' compressed' if info.compress_type != zipfile.ZIP_STORED else ''}, its record says {expected} "
                "(not a file torch.save wrote, or damaged)"
            )
        raw = read_entry(self.archive, info, self.source)
        untyped = torch.UntypedStorage.from_buffer(raw, dtype=torch.uint8) if raw else torch.UntypedStorage(0)
        self.storages[key] = torch.storage.TypedStorage(wrap_storage=untyped, dtype=storage_type.dtype, _internal=True)
        return self.storages[key]


def read_entry(archive: zipfile.ZipFile, info: zipfile.ZipInfo, source: Path) -> bytes:
    """An archive entry's bytes, within the inflation budget.

    A stored entry is at most the file's own size. A compressed one could inflate to any size (a
    zip bomb: a few hundred KB that inflate to gigabytes), so it is read only if the size it
    declares is within INFLATE_BUDGET; zipfile stops at the declared size (and then fails its
    CRC check) if the entry inflates to more."""
    if info.compress_type != zipfile.ZIP_STORED and info.file_size > INFLATE_BUDGET:
        raise MimaError(
            f"{source}: entry '{info.filename}' inflates to {info.file_size} bytes, past the budget of "
            f"{INFLATE_BUDGET} bytes for a compressed entry (torch.save compresses nothing; a zip bomb?)"
        )
    return archive.read(info)


def load_restricted(path: Path) -> object:
    """Unpickle a torch zip checkpoint with the restricted unpickler."""
    if not path.is_file():
        raise MimaError(f"{path}: no such file")
    if not zipfile.is_zipfile(path):
        raise MimaError(f"{path}: not a torch zip checkpoint (the legacy pre-1.6 format is not supported)")
    with zipfile.ZipFile(path) as archive:
        pickles = [name for name in archive.namelist() if name.endswith("data.pkl")]
        if len(pickles) != 1:
            raise MimaError(f"{path}: not a torch checkpoint (no single data.pkl in the archive)")
        prefix = pickles[0][: -len("data.pkl")]
        try:
            program = read_entry(archive, archive.getinfo(pickles[0]), path)
            return RestrictedUnpickler(program, archive, prefix, path).load()
        except MimaError:
            raise
        except (pickle.UnpicklingError, EOFError, KeyError, ValueError, TypeError, zipfile.BadZipFile, zlib.error) as exc:
            raise MimaError(f"{path}: could not be read as a model checkpoint ({' '.join(str(exc).split())})") from None


def module_state_dict(obj: object, prefix: str = "") -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers of a (stand-in) module tree, or the tensors of a dict."""
    if isinstance(obj, dict):
        if "state_dict" in obj and isinstance(obj["state_dict"], dict):
            obj = obj["state_dict"]
        if all(isinstance(v, torch.Tensor) for v in obj.values()):
            return {f"{prefix}{k}": v for k, v in obj.items()}
    state: dict[str, torch.Tensor] = {}
    attributes = getattr(obj, "__dict__", {})
    non_persistent = attributes.get("_non_persistent_buffers_set", set()) or set()
    for name, tensor in (attributes.get("_parameters") or {}).items():
        if tensor is not None:
            state[f"{prefix}{name}"] = tensor
    for name, tensor in (attributes.get("_buffers") or {}).items():
        if tensor is not None and name not in non_persistent:
            state[f"{prefix}{name}"] = tensor
    for name, child in (attributes.get("_modules") or {}).items():
        if child is not None:
            state.update(module_state_dict(child, f"{prefix}{name}."))
    return state


def convert_checkpoint(source: Path, prefix: str = "model.visual.") -> dict[str, torch.Tensor]:
    state = module_state_dict(load_restricted(source))
    if not state:
        raise MimaError(f"{source}: holds no module parameters or tensor state dict")
    if not prefix:
        return {key: value.contiguous() for key, value in state.items()}
    selected = {key[len(prefix):]: value.contiguous() for key, value in state.items() if key.startswith(prefix)}
    if not selected:
        heads = sorted({key.split(".")[0] + "." for key in state})
        raise MimaError(f"{source}: no key starts with --prefix '{prefix}' (top-level names: {', '.join(heads)})")
    return selected


# ------------------------------------------------------------------ transformers CLIP (hf-clip)
HF_CONFIG = "config.json"
HF_WEIGHTS = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"
HF_PICKLED_WEIGHTS = "pytorch_model.bin"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth")


@dataclass
class HFCheckpoint:
    """A transformers CLIP checkpoint as read: its tensors, its config (None for a bare weights file)
    and the files it was read from (so that none of them is ever chosen as an output)."""

    state: dict[str, torch.Tensor]
    config: HFVisionConfig | None
    files: list[Path]


def read_tensor_file(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, or of a pickled state dict (pytorch_model.bin) read with
    the restricted unpickler above."""
    if not path.is_file():
        raise MimaError(f"{path}: no such file")
    if path.suffix in PICKLE_SUFFIXES:
        state = module_state_dict(load_restricted(path))
        if not state:
            raise MimaError(f"{path}: holds no tensor state dict")
        return state
    return load_state_dict(path)


def _index_shards(index_path: Path) -> dict[str, Path]:
    """key -> shard file of a sharded checkpoint's index; shard names must stay inside the folder."""
    weight_map = read_json(index_path).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise MimaError(f"{index_path}: has no 'weight_map' of tensor names to files")
    shards = {}
    for key, name in weight_map.items():
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            raise MimaError(f"{index_path}: shard {name!r} of '{key}' is not a file name in the same folder")
        shards[key] = index_path.parent / name
    return shards


def hf_checkpoint_files(source: Path) -> tuple[Path | None, list[Path]]:
    """config.json (None for a bare file) and the weight files that `read_hf_checkpoint` reads."""
    if source.is_file():
        return None, [source]
    if not source.is_dir():
        raise MimaError(f"{source}: no such file or folder")
    config = source / HF_CONFIG
    if not config.is_file():
        raise MimaError(f"{source}: has no {HF_CONFIG} (expected a folder written by save_pretrained; "
                        "for a bare weights file give the file itself)")
    if (source / HF_WEIGHTS).is_file():
        return config, [source / HF_WEIGHTS]
    if (source / HF_INDEX).is_file():
        return config, [source / HF_INDEX, *sorted(set(_index_shards(source / HF_INDEX).values()))]
    if (source / HF_PICKLED_WEIGHTS).is_file():
        return config, [source / HF_PICKLED_WEIGHTS]
    raise MimaError(f"{source}: has no {HF_WEIGHTS}, {HF_INDEX} or {HF_PICKLED_WEIGHTS} (no weights in the folder)")


def read_hf_checkpoint(source: Path) -> HFCheckpoint:
    """A save_pretrained folder (config.json with model.safetensors, a sharded model.safetensors
    index, or pytorch_model.bin) or a bare weights file."""
    config_path, files = hf_checkpoint_files(source)
    config = parse_hf_config(read_json(config_path), str(config_path)) if config_path is not None else None
    if files[0].name == HF_INDEX:  # each tensor from the shard the index names, as transformers reads it
        shard_of = _index_shards(files[0])
        shards = {shard: read_tensor_file(shard) for shard in files[1:]}
        state = {}
        for key, shard in shard_of.items():
            if key not in shards[shard]:
                raise MimaError(f"{files[0]}: '{key}' is not in its shard {shard.name}")
            state[key] = shards[shard][key]
    else:
        state = read_tensor_file(files[0])
    return HFCheckpoint(state, config, ([config_path] if config_path else []) + files)


def read_projection(path: Path) -> torch.Tensor:
    """The image projection (open_clip layout, width x embed_dim) of the pretrained CLIP: from a
    transformers checkpoint (visual_projection.weight, transposed) or an open_clip state dict (proj,
    or visual.proj of a whole CLIP)."""
    state = read_hf_checkpoint(path).state if path.is_dir() else read_tensor_file(path)
    if HF_PROJECTION in state:
        return state[HF_PROJECTION].t().contiguous()
    for key in ("proj", "visual.proj"):
        if key in state:
            return state[key]
    raise MimaError(f"{path}: has no '{HF_PROJECTION}' nor 'proj' (expected the pretrained CLIP: a transformers "
                    "CLIPModel or CLIPVisionModelWithProjection, or an open_clip image-encoder state dict)")


@dataclass
class HFConversion:
    state: dict[str, torch.Tensor]
    architecture: OpenClipArchitecture
    activation: str | None  # None: a bare file, nothing says (OpenAI's weights use quick_gelu)
    inputs: list[Path]


def convert_from_hf_clip(source: Path, arch: str | None = None, projection_from: Path | None = None,
                         activation: str | None = None) -> HFConversion:
    """open_clip's `model.visual.state_dict()` from a transformers CLIP checkpoint (see the module
    docstring); the architecture is `arch`, checked against the weights, or the known one they fit."""
    checkpoint = read_hf_checkpoint(source)
    geometry = hf_geometry(checkpoint.state, str(source))
    if checkpoint.config is not None:
        geometry = check_hf_config(checkpoint.config, geometry, str(source / HF_CONFIG))
        if activation is not None and activation != checkpoint.config.hidden_act:
            raise MimaError(f"--activation {activation}: {source / HF_CONFIG} says hidden_act '{checkpoint.config.hidden_act}'")
        activation = checkpoint.config.hidden_act
    projection = read_projection(projection_from) if projection_from is not None else None
    state = hf_to_open_clip(checkpoint.state, str(source), projection)
    converted = open_clip_geometry(state, str(source))  # embed_dim known now, also for a borrowed projection
    architecture = choose_architecture(replace(converted, heads=geometry.heads), str(source), arch)
    if activation is None and architecture.quick_gelu:
        activation = "quick_gelu"
    inputs = checkpoint.files + ([projection_from] if projection_from is not None else [])
    return HFConversion(state, architecture, activation, inputs)


def read_open_clip_state(source: Path) -> dict[str, torch.Tensor]:
    """An open_clip image-encoder state dict (keys of `model.visual.state_dict()`), or the image
    tower of a whole open_clip CLIP (keys under visual.)."""
    if source.suffix in PICKLE_SUFFIXES:
        raise MimaError(f"{source}: a pickled checkpoint; turn it into safetensors first (mima convert {source} OUT.safetensors)")
    state = load_state_dict(source)
    if "class_embedding" not in state and "visual.class_embedding" in state:
        state = {key[len("visual."):]: value for key, value in state.items() if key.startswith("visual.")}
    return state


def convert_to_hf_clip(source: Path, arch: str | None = None, activation: str | None = None) -> tuple[dict, dict, OpenClipArchitecture]:
    """(state dict, config.json) of a transformers CLIPVisionModelWithProjection from an open_clip
    image encoder; the head count comes from the architecture, the activation from --activation."""
    state = read_open_clip_state(source)
    architecture = choose_architecture(open_clip_geometry(state, str(source)), str(source), arch)
    if activation is None:
        if not architecture.quick_gelu:
            raise MimaError("--activation: name the activation the weights were trained with: quick_gelu (OpenAI's CLIP "
                            "weights, FusionBench's task models) or gelu (open_clip's LAION and DataComp weights)")
        activation = "quick_gelu"
    return open_clip_to_hf(state, str(source)), hf_config_dict(architecture.geometry, activation), architecture


def _save_hf_weights(path: Path, state: dict[str, torch.Tensor], provenance: dict[str, str]) -> None:
    """safetensors as transformers reads it: its loader requires the header's `format` to be 'pt'
    (plain strings, not the JSON-encoded values of save_state_dict)."""
    from safetensors.torch import save_file

    tensors = {key: value.detach().to("cpu").contiguous() for key, value in state.items()}
    save_file(tensors, str(path), metadata={"format": "pt", **provenance})


def write_hf_output(output: Path, state: dict, config: dict, provenance: dict[str, str], overwrite: bool) -> list[Path]:
    """A .safetensors output gets the weights alone; any other name is a folder like save_pretrained's
    (config.json + model.safetensors). A new folder appears whole (written beside it, then renamed);
    into an existing one, each file is replaced atomically, the weights before the config."""
    if output.suffix == ".safetensors":
        with atomic_path(output, overwrite=overwrite) as tmp:
            _save_hf_weights(tmp, state, provenance)
        return [output]
    import json

    files = [output / HF_WEIGHTS, output / HF_CONFIG]
    config_text = json.dumps(config, indent=2) + "\n"
    if output.exists() and not output.is_dir():
        raise MimaError(f"--output {output}: is a file; give a folder name (or a .safetensors file name for the weights alone)")
    if output.is_dir():
        if not overwrite:
            refuse_overwrite(files)
        with atomic_path(files[0]) as tmp:
            _save_hf_weights(tmp, state, provenance)
        with atomic_path(files[1]) as tmp:
            tmp.write_text(config_text)
        return files
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.", suffix=".tmp", dir=output.parent))
    except OSError as exc:
        raise MimaError(f"--output {output}: cannot be written ({exc.strerror or exc})") from None
    try:
        _save_hf_weights(staging / HF_WEIGHTS, state, provenance)
        (staging / HF_CONFIG).write_text(config_text)
        os.chmod(staging, 0o777 & ~_umask())  # mkdtemp makes 0700; give the folder the usual permissions
        os.rename(staging, output)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return files


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


# ------------------------------------------------------------------------------ command
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", type=Path,
                        help="the checkpoint: a pickled .pt (default), a transformers CLIP folder or weights file "
                        "(--from hf-clip), or an open_clip image-encoder .safetensors (--to hf-clip)")
    parser.add_argument("output_positional", nargs="?", type=Path, metavar="OUTPUT", help="the file to write (or --output)")
    parser.add_argument("--output", "-o", type=Path,
                        help="the file to write; with --to hf-clip a folder (config.json + model.safetensors) unless "
                        "it ends in .safetensors")
    parser.add_argument("--from", dest="source_format", choices=("pickle", "hf-clip"), default=None,
                        help="pickle: a pickled module checkpoint (the default); hf-clip: a transformers CLIPModel, "
                        "CLIPVisionModelWithProjection or CLIPVisionModel (a save_pretrained folder or its weights file)")
    parser.add_argument("--to", dest="target_format", choices=("hf-clip",), default=None,
                        help="hf-clip: write a transformers CLIPVisionModelWithProjection from an open_clip image encoder")
    parser.add_argument("--prefix", default=None,
                        help="pickle only: keep the keys under this prefix, without it (default: model.visual., an "
                        "ImageEncoder's image tower); '' keeps every key")
    parser.add_argument("--arch", default=None,
                        help="hf-clip: the open_clip architecture (default: the one of ViT-B-32, ViT-B-16, ViT-L-14, "
                        "ViT-L-14-336 whose shapes the weights have); checked against the weights")
    parser.add_argument("--projection-from", type=Path, default=None,
                        help="--from hf-clip of a CLIPVisionModel (no visual_projection, as FusionBench's task models): "
                        "the pretrained CLIP whose projection to use (a transformers folder or file, or an open_clip "
                        ".safetensors)")
    parser.add_argument("--activation", choices=ACTIVATIONS, default=None,
                        help="hf-clip: the MLP activation the weights were trained with (quick_gelu for OpenAI's CLIP "
                        "and FusionBench's models); needed by --to hf-clip unless --arch is a -quickgelu one; "
                        "--from hf-clip takes it from config.json")
    parser.add_argument("--overwrite", action="store_true", help="replace the output if it exists (never an input)")


def _output_of(options) -> Path:
    if options.output is not None and options.output_positional is not None:
        raise MimaError(f"give the output once: OUTPUT {options.output_positional} or --output {options.output}")
    output = options.output if options.output is not None else options.output_positional
    if output is None:
        raise MimaError("--output: required (the file to write)")
    return output


def _check_options(options) -> str:
    """'pickle', 'from-hf' or 'to-hf', after refusing options that do not apply to it."""
    if options.source_format is not None and options.target_format is not None:
        raise MimaError("--from and --to: give one (--from hf-clip reads a transformers CLIP, --to hf-clip writes one)")
    mode = "to-hf" if options.target_format else "from-hf" if options.source_format == "hf-clip" else "pickle"
    hf_only = {"--arch": options.arch, "--activation": options.activation, "--projection-from": options.projection_from}
    if mode == "pickle":
        for flag, value in hf_only.items():
            if value is not None:
                raise MimaError(f"{flag}: applies to --from hf-clip and --to hf-clip only")
    elif options.prefix is not None:
        raise MimaError("--prefix: applies to pickled checkpoints only, not hf-clip")
    if mode == "to-hf" and options.projection_from is not None:
        raise MimaError("--projection-from: applies to --from hf-clip only (an open_clip encoder keeps its proj)")
    return mode


def main(options) -> None:
    mode = _check_options(options)
    output, source = _output_of(options), options.source
    if mode == "pickle":
        prefix = "model.visual." if options.prefix is None else options.prefix
        if not options.overwrite:
            refuse_overwrite([output])
        refuse_input_as_output(output, [source])
        state = convert_checkpoint(source, prefix)
        save_state_dict(output, state, metadata={"converted_from": str(source), "prefix": prefix}, overwrite=options.overwrite)
        print(f"mima convert: {len(state)} tensors from {source} -> {output}")
    elif mode == "from-hf":
        if not options.overwrite:
            refuse_overwrite([output])
        config_file, weight_files = hf_checkpoint_files(source)
        projection = [options.projection_from] if options.projection_from is not None else []
        refuse_input_as_output(output, [*([config_file] if config_file else []), *weight_files, *projection])
        result = convert_from_hf_clip(source, options.arch, options.projection_from, options.activation)
        refuse_input_as_output(output, result.inputs)  # the shards of a sharded --projection-from too
        metadata = {"converted_from": str(source), "format": "hf-clip", "open_clip_arch": result.architecture.name,
                    "hidden_act": result.activation, "projection_from": str(options.projection_from) if options.projection_from else None}
        save_state_dict(output, result.state, metadata=metadata, overwrite=options.overwrite)
        activation = result.activation or "activation not recorded (OpenAI's weights: quick_gelu)"
        print(f"mima convert: {len(result.state)} tensors from {source} (transformers CLIP) -> {output} "
              f"(open_clip {result.architecture.name}, {activation})")
    else:
        targets = [output] if output.suffix == ".safetensors" else [output / HF_WEIGHTS, output / HF_CONFIG]
        if output.suffix != ".safetensors" and output.exists() and not output.is_dir():
            raise MimaError(f"--output {output}: is a file; give a folder name (or a .safetensors file name for the weights alone)")
        if not options.overwrite:
            refuse_overwrite(targets)
        for target in targets:
            refuse_input_as_output(target, [source])
        state, config, architecture = convert_to_hf_clip(source, options.arch, options.activation)
        provenance = {"converted_from": str(source), "open_clip_arch": architecture.name}
        write_hf_output(output, state, config, provenance, options.overwrite)
        print(f"mima convert: {len(state)} tensors from {source} (open_clip {architecture.name}) -> {output} "
              f"(transformers CLIPVisionModelWithProjection, {config['hidden_act']})")
