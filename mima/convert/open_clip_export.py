"""A merged or fine-tuned image encoder as a full open_clip CLIP folder that loads anywhere:

  mima convert --to open-clip ENCODER.safetensors --config RUN --output DIR   (convert_to_open_clip)
  mima merge --format open-clip --models RUN ... --output DIR                 (write_merged_open_clip,
                                                                               which mima.services.merge calls)

DIR gets open_clip_config.json + open_clip_model.safetensors (the run's text tower and logit scale,
this image tower, the activation recorded: mima.convert.open_clip_writer) and README.md, the model
card (mima.convert.model_card); `mima merge --format open-clip` also leaves the merged image encoder
and its results table there (image_encoder.safetensors, .results.json, .results.md). The folder
appears whole or not at all, and an existing one is replaced only with --overwrite.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from mima.convert.model_card import CardFacts, model_card
from mima.convert.open_clip_writer import (
    OPEN_CLIP_FILES,
    OpenClipExport,
    open_clip_export,
    refuse_existing_folder,
    write_open_clip_files,
    write_open_clip_folder,
)
from mima.core.bounded_json import read_json
from mima.core.files import refuse_input_as_output
from mima.core.safetensors_io import load_state_dict, read_metadata

MERGED_ENCODER = "image_encoder.safetensors"  # what `mima merge --format open-clip` leaves beside the CLIP


def encoder_results(encoder: Path) -> dict:
    """The results `mima merge --config` wrote beside a merged file (ENCODER.results.json), or {}."""
    results = encoder.with_name(encoder.name + ".results.json")
    return read_json(results) if results.is_file() else {}


def encoder_provenance(encoder: Path) -> dict:
    """The metadata mima wrote into the file (a merge's method, hyperparameters, models, base), or {}
    for a file whose header is not mima's JSON-encoded record."""
    try:
        return read_metadata(encoder)
    except ValueError:
        return {}


def card_facts(command: Sequence[str], config: Path, encoder: Path, shown_as: Path, export: OpenClipExport,
               title: str) -> CardFacts:
    """What the card of `export` says; `encoder` is read for its record and results, named `shown_as`."""
    results = encoder_results(encoder)
    return CardFacts(title=title, command=command, config=str(config), encoder=str(shown_as), clip=export.clip,
                     pretrained=export.pretrained, quick_gelu=export.quick_gelu, merge=encoder_provenance(encoder),
                     test_accuracy=dict(results.get("test_accuracy") or {}), selected_on=results.get("selected_on"))


def done_line(command: str, export: OpenClipExport, output: Path) -> str:
    activation = "quick_gelu" if export.quick_gelu else "gelu"
    return (f"mima {command}: open_clip model ({len(export.state)} tensors, {activation}) -> {output}; load it with "
            f"open_clip.create_model_and_transforms('local-dir:{output}')")


def convert_to_open_clip(source: Path, config: Path, output: Path, overwrite: bool) -> None:
    """`mima convert --to open-clip`: the encoder file with the run's text tower, as an open_clip folder."""
    refuse_existing_folder(output, overwrite)
    for name in OPEN_CLIP_FILES:
        refuse_input_as_output(output / name, [source])
    export = open_clip_export(load_state_dict(source), config, str(source))
    command = ["mima", "convert", "--to", "open-clip", str(source), "--config", str(config), "--output", str(output)]
    card = model_card(card_facts(command, config, source, source, export, output.name), output)
    write_open_clip_folder(output, export, card, overwrite)
    print(done_line("convert", export, output))


def write_merged_open_clip(staging: Path, config: Path, command: Sequence[str], output: Path) -> OpenClipExport:
    """The full CLIP around the merged encoder that `staging` (the folder that becomes `output`) holds as
    MERGED_ENCODER, with its results, and its card (`command`: the merge's command line, the recipe),
    written into `staging`."""
    encoder, shown_as = staging / MERGED_ENCODER, output / MERGED_ENCODER
    export = open_clip_export(load_state_dict(encoder), config, str(shown_as))
    card = model_card(card_facts(command, config, encoder, shown_as, export, output.name), output)
    write_open_clip_files(staging, export, card)
    return export
