"""Reading a pickled torch checkpoint without running its code: a restricted unpickler.

task_vectors and tall_masks save whole modules (`torch.save(image_encoder)`): loading them with
`torch.load` imports and runs whatever the pickle names, and breaks when the classes have moved
between versions. This module reads the torch zip archive itself with a restricted unpickler:

  * classes and functions from model namespaces (torch.nn, open_clip, task_vectors' src.modeling,
    timm, torchvision transforms) become inert stand-ins that only record their state; nothing
    from those packages is imported or called;
  * tensors are rebuilt as views of the archive's storages, after checking that each view lies
    inside its storage and holds no more elements than it (a crafted offset or a zero stride must
    not make torch read or allocate what the file never held);
  * a storage is read only if its entry is stored uncompressed with the size its record declares,
    as torch.save writes it; a compressed data.pkl may inflate to at most 64 MiB (a zip bomb of a
    few hundred KB is refused before it is inflated, naming the entry);
  * `getattr` only names a member of a stand-in class (how Python 3.11.0-3.11.4 pickle an enum);
  * any other global (os.system, builtins.eval, subprocess, ...) stops the conversion with an
    error naming it, before anything is called.

The module tree is then walked for parameters and persistent buffers (`module_state_dict`), and
`convert_checkpoint` keeps the keys under a prefix, prefix removed.
"""

from __future__ import annotations

import collections
import io
import math
import pickle
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from mima.core.errors import MimaError

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


@dataclass(frozen=True)
class ArchiveStorage:
    """One storage of the archive: its bytes and the element type its record names. Tensors that
    share a storage in the file are views of the same `data` here too (as torch.load makes them)."""

    data: torch.UntypedStorage
    dtype: torch.dtype

    @property
    def elements(self) -> int:
        return self.data.nbytes() // self.dtype.itemsize


class RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, archive: zipfile.ZipFile, prefix: str, source: Path) -> None:
        super().__init__(io.BytesIO(data))
        self.archive, self.prefix, self.source = archive, prefix, source
        self.storages: dict[object, ArchiveStorage] = {}
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
            ("builtins", "getattr"): self._stand_in_member,
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

    def _stand_in_member(self, owner, name):
        """`getattr(owner, name)` as a pickle asks for it, allowed only for a member of a stand-in
        class: Python 3.11.0 to 3.11.4 pickle an enum member (torchvision's InterpolationMode.BICUBIC
        in open_clip's transforms) as `getattr(InterpolationMode, "BICUBIC")`. The member becomes an
        empty stand-in instance; getattr on anything else is refused before it runs."""
        if isinstance(owner, type) and issubclass(owner, StandIn) and isinstance(name, str):
            member = owner.__new__(owner)
            member.__dict__["_stand_in_member"] = name
            return member
        raise MimaError(
            f"{self.source}: refused: the pickle asks for getattr({getattr(owner, '__name__', type(owner).__name__)}, "
            f"{name!r}), which is not a member of a model class; nothing from the file was run"
        )

    def _rebuild_tensor(self, storage, storage_offset, size, stride, *flags):
        """The tensor torch.save recorded, as a view of its storage, after checking that the view
        stays inside the storage: a truncated or crafted file must not make torch read memory the
        file never held. The `flags` torch restores besides the view (requires_grad, backward hooks,
        conj/neg bits) are dropped: only the values are converted, and the outputs are detached."""
        if not isinstance(storage, ArchiveStorage):
            raise MimaError(f"{self.source}: a tensor record whose storage is {type(storage).__name__}, not an archive entry")
        if not (isinstance(storage_offset, int) and all(isinstance(v, int) for v in (*size, *stride))):
            raise MimaError(f"{self.source}: a tensor record with a non-integer offset, shape or stride")
        if storage_offset < 0 or any(v < 0 for v in (*size, *stride)) or len(size) != len(stride):
            raise MimaError(f"{self.source}: a tensor record with a negative offset, shape or stride")
        last = storage_offset + sum((n - 1) * step for n, step in zip(size, stride)) if all(size) else -1
        elements = storage.elements
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
        # what torch.load does with the record, through public calls: an empty tensor of the dtype
        # set to the view (offset, shape and stride in elements) of the shared storage
        return torch.empty((0,), dtype=storage.dtype).set_(storage.data, storage_offset, size, stride)

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
        expected = int(numel) * storage_type.dtype.itemsize
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
        self.storages[key] = ArchiveStorage(untyped, storage_type.dtype)
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


# How deep a module tree may nest (open_clip's ViT-L/14 is 6 levels deep) and how many modules it may
# hold: a crafted pickle can nest far deeper, or make a child its own ancestor.
MAX_MODULE_DEPTH = 100
MAX_MODULES = 1_000_000


def module_state_dict(obj: object, prefix: str = "", source: object = "checkpoint") -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers of a (stand-in) module tree, or the tensors of a dict.

    The children are walked with an explicit stack, in the order torch's `state_dict` visits them
    (a module's parameters, its buffers, then each child's), with a depth limit and a check that no
    module is its own ancestor: a crafted tree is one line (naming `source`), never a RecursionError."""
    if isinstance(obj, dict):
        if "state_dict" in obj and isinstance(obj["state_dict"], dict):
            obj = obj["state_dict"]
        if all(isinstance(v, torch.Tensor) for v in obj.values()):
            return {f"{prefix}{k}": v for k, v in obj.items()}
    state: dict[str, torch.Tensor] = {}
    # (module, its key prefix, the ids of its ancestors and itself)
    stack: list[tuple[object, str, frozenset[int]]] = [(obj, prefix, frozenset((id(obj),)))]
    visited = 0
    while stack:
        module, at, path = stack.pop()
        visited += 1
        if visited > MAX_MODULES:
            raise MimaError(f"{source}: the module tree holds more than {MAX_MODULES} modules; not a model checkpoint")
        attributes = getattr(module, "__dict__", {})
        if not isinstance(attributes, dict):
            continue
        non_persistent = attributes.get("_non_persistent_buffers_set", set()) or set()
        for name, tensor in _named(attributes.get("_parameters")):
            if tensor is not None:
                state[f"{at}{name}"] = tensor
        for name, tensor in _named(attributes.get("_buffers")):
            if tensor is not None and name not in non_persistent:
                state[f"{at}{name}"] = tensor
        children = [(name, child) for name, child in _named(attributes.get("_modules")) if child is not None]
        if children and len(path) > MAX_MODULE_DEPTH:
            raise MimaError(f"{source}: modules nest deeper than {MAX_MODULE_DEPTH} levels (at '{at}'); not a model checkpoint")
        for name, child in reversed(children):  # popped in their order
            if id(child) in path:
                raise MimaError(f"{source}: module '{at}{name}' contains itself (a cycle in the module tree); not a model checkpoint")
            stack.append((child, f"{at}{name}.", path | {id(child)}))
    return state


def _named(entries: object) -> list[tuple[str, object]]:
    """The (name, value) pairs of a module's _parameters, _buffers or _modules (a dict in a real module)."""
    if not isinstance(entries, dict):
        return []
    return [(str(name), value) for name, value in entries.items()]


def convert_checkpoint(source: Path, prefix: str = "model.visual.") -> dict[str, torch.Tensor]:
    state = module_state_dict(load_restricted(source), source=source)
    if not state:
        raise MimaError(f"{source}: holds no module parameters or tensor state dict")
    if not prefix:
        return {key: value.contiguous() for key, value in state.items()}
    selected = {key[len(prefix):]: value.contiguous() for key, value in state.items() if key.startswith(prefix)}
    if not selected:
        heads = sorted({key.split(".")[0] + "." for key in state})
        raise MimaError(f"{source}: no key starts with --prefix '{prefix}' (top-level names: {', '.join(heads)})")
    return selected


