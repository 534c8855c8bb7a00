"""`mima convert` of pickled checkpoints (task_vectors' ImageEncoder pickles): the image encoder read
without task_vectors installed, and what is not weights (other callables, getattr on anything but a
stand-in model class, storages that do not hold their tensors) refused in one line without running it."""

from __future__ import annotations

import collections
import os
import sys
import types

import open_clip
import pytest
import torch
from torch import nn

from mima.cli import main
from mima.convert.pickle_reader import convert_checkpoint
from mima.core.errors import MimaError
from mima.core.safetensors_io import load_state_dict


def _fake_task_vectors_module(monkeypatch):
    """task_vectors' src.modeling.ImageEncoder, defined here (the converter must not import it)."""
    modeling = types.ModuleType("src.modeling")

    class ImageEncoder(nn.Module):
        def __init__(self, clip: str) -> None:
            super().__init__()
            self.model, self.train_preprocess, self.val_preprocess = open_clip.create_model_and_transforms(clip)
            delattr(self.model, "transformer")

    ImageEncoder.__module__, ImageEncoder.__qualname__ = "src.modeling", "ImageEncoder"
    modeling.ImageEncoder = ImageEncoder
    monkeypatch.setitem(sys.modules, "src", types.ModuleType("src"))
    monkeypatch.setitem(sys.modules, "src.modeling", modeling)
    return ImageEncoder


def test_convert_a_pickled_image_encoder(tmp_path, small_clip, monkeypatch, capsys):
    encoder = _fake_task_vectors_module(monkeypatch)(small_clip)
    torch.save(encoder, tmp_path / "finetuned.pt")
    monkeypatch.delitem(sys.modules, "src.modeling")  # as on a machine without task_vectors installed
    assert main(["convert", str(tmp_path / "finetuned.pt"), str(tmp_path / "out.safetensors")]) == 0
    converted = load_state_dict(tmp_path / "out.safetensors")
    reference = encoder.model.visual.state_dict()
    assert set(converted) == set(reference) and all(torch.equal(converted[k], reference[k]) for k in reference)
    whole = convert_checkpoint(tmp_path / "finetuned.pt", prefix="")
    assert "model.logit_scale" in whole and "model.visual.proj" in whole


class _Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_convert_refuses_other_callables_without_running_them(tmp_path, capsys):
    marker = tmp_path / "ran"
    torch.save({"state_dict": {"w": torch.zeros(2)}, "extra": _Payload(str(marker))}, tmp_path / "evil.pt")
    code = main(["convert", str(tmp_path / "evil.pt"), str(tmp_path / "out.safetensors")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "refused" in err[0] and "system" in err[0]
    assert not marker.exists() and not (tmp_path / "out.safetensors").exists()
    with pytest.raises(MimaError, match="not a torch zip checkpoint"):
        (tmp_path / "plain.pt").write_bytes(b"not a zip")
        convert_checkpoint(tmp_path / "plain.pt")


class _MemberByGetattr:
    """Pickles as `getattr(owner, name)`, the way Python 3.11.0-3.11.4 pickle an enum member."""

    def __init__(self, owner, name: str) -> None:
        self.owner, self.name = owner, name

    def __reduce__(self):
        return (getattr, (self.owner, self.name))


def test_convert_reads_an_enum_member_pickled_by_getattr_and_refuses_other_getattrs(tmp_path, capsys):
    from torchvision.transforms import InterpolationMode

    weights = {"visual.proj": torch.randn(4, 3)}
    torch.save({"state_dict": weights, "mode": _MemberByGetattr(InterpolationMode, "BICUBIC")}, tmp_path / "enum.pt")
    converted = convert_checkpoint(tmp_path / "enum.pt", prefix="")
    assert torch.equal(converted["visual.proj"], weights["visual.proj"])
    # getattr on anything that is not a stand-in model class is refused before it runs
    torch.save({"state_dict": weights, "call": _MemberByGetattr(collections.OrderedDict, "fromkeys")}, tmp_path / "bad.pt")
    assert main(["convert", str(tmp_path / "bad.pt"), str(tmp_path / "out.safetensors")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "getattr(OrderedDict, 'fromkeys')" in err[0] and "bad.pt" in err[0]
    assert not (tmp_path / "out.safetensors").exists()


def _rewrite_archive(source, target, change) -> None:
    """Copy a torch zip checkpoint member by member, letting `change(name, data)` return
    (new data, compression) for each member."""
    import zipfile

    with zipfile.ZipFile(source) as old, zipfile.ZipFile(target, "w") as new:
        for info in old.infolist():
            data, compression = change(info.filename, old.read(info.filename))
            new.writestr(info.filename, data, compress_type=compression)


@pytest.mark.parametrize("damage, fragment", [("truncated-storage", "its record says 256"),
                                              ("compressed-storage", "compressed"),
                                              ("shrunk-record", "needs 64 elements of its storage, which holds 8")])
def test_convert_refuses_storages_that_do_not_hold_their_tensors(tmp_path, capsys, damage, fragment):
    import pickletools
    import zipfile

    weights = {"w": torch.arange(64, dtype=torch.float32).reshape(8, 8), "b": torch.ones(8)}
    torch.save({"state_dict": weights}, tmp_path / "good.pt")

    def change(name, data):
        if damage == "truncated-storage" and "/data/" in name and len(data) == 256:
            return data[:100], zipfile.ZIP_STORED  # the 8x8 tensor's storage, cut short
        if damage == "compressed-storage" and "/data/" in name:
            return data, zipfile.ZIP_DEFLATED
        return data, zipfile.ZIP_STORED

    _rewrite_archive(tmp_path / "good.pt", tmp_path / "bad.pt", change)
    if damage == "shrunk-record":
        # a consistent archive whose storage is too small for the view that the pickle asks for:
        # the storage of 8 elements is read as an 8x8 tensor (more elements than it holds)
        torch.save({"state_dict": {"w": torch.ones(8)}}, tmp_path / "small.pt")
        with zipfile.ZipFile(tmp_path / "small.pt") as archive:
            pickle_name = next(n for n in archive.namelist() if n.endswith("data.pkl"))
            program = archive.read(pickle_name)
        # torch.Size([8]) and stride (1,) in the pickle become (8, 8) and (8, 1)
        ops = [op for op in pickletools.genops(program)]
        assert any(arg == 8 for _, arg, _ in ops)
        patched = program.replace(b"K\x08\x85q", b"K\x08K\x08\x86q", 1).replace(b"K\x01\x85q", b"K\x08K\x01\x86q", 1)
        assert patched != program
        _rewrite_archive(tmp_path / "small.pt", tmp_path / "bad.pt",
                         lambda name, data: (patched if name == pickle_name else data, zipfile.ZIP_STORED))
    out = tmp_path / "out.safetensors"
    code = main(["convert", str(tmp_path / "bad.pt"), str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and str(tmp_path / "bad.pt") in err[0] and fragment in err[0], err
    assert not out.exists()
