"""A merged or fine-tuned image encoder as a full open_clip CLIP folder that loads anywhere:

  mima convert --to open-clip ENCODER.safetensors --config RUN --output DIR
  mima merge --format open-clip --models RUN ... --output DIR

DIR gets open_clip_config.json + open_clip_model.safetensors (the run's text tower and logit scale,
this image tower, the activation recorded: mima.convert.open_clip_writer) and README.md, the model
card (mima.convert.model_card); `mima merge --format open-clip` also leaves the merged image encoder
and its results table there (image_encoder.safetensors, .results.json, .results.md). The folder
appears whole or not at all, and an existing one is replaced only with --overwrite.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from mima.commands.merge.options import MergeOptions
from mima.convert.model_card import CardFacts, model_card
from mima.convert.open_clip_writer import (
    OPEN_CLIP_FILES,
    OpenClipExport,
    open_clip_export,
    refuse_existing_folder,
    write_open_clip_files,
    write_open_clip_folder,
)
from mima.core.errors import MimaError
from mima.core.files import atomic_folder, read_json, refuse_input_as_output
from mima.core.safetensors_io import load_state_dict, read_metadata
from mima.merging import get_method
from mima.merging.catalogue import HYPERPARAMETERS
from mima.merging.registry import PerTaskMerge
from mima.merging.engine import expand_models

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


def merge_command(options: MergeOptions) -> list[str]:
    """The `mima merge` command line of `options`, for the card's recipe."""
    command = ["mima", "merge", "--method", options.method]
    command += ["--base", str(options.base)] if options.base is not None else []
    command += ["--models", *map(str, options.models)]
    command += ["--config", str(options.config)] if options.config is not None else []
    command += ["--select-on", options.select_on] if options.select_on else []
    for name, value in options.hyperparameters.items():
        values = value if isinstance(value, (list, tuple)) else [value]
        command += [HYPERPARAMETERS[name].flag if name in HYPERPARAMETERS else "--" + name.replace("_", "-"),
                    *map(str, values)]
    return command + ["--format", "open-clip", "--output", str(options.output)]


def merge_to_open_clip(options: MergeOptions, run_merge: Callable[[MergeOptions], None]) -> None:
    """`mima merge --format open-clip`: `run_merge` writes the merged encoder and its results into the
    staging folder of `options.output`, then the full CLIP and the card join them there."""
    output = options.output
    if isinstance(get_method(options.method), PerTaskMerge):
        raise MimaError(f"--format open-clip: merge method '{options.method}' writes one model per task (an index), "
                        "not one image encoder; merge to a .safetensors file")
    model_paths, run_tasks, run_base = expand_models(options.models)
    config = options.config or (options.models[0] if run_tasks is not None else None)
    if config is None:
        raise MimaError("--format open-clip: needs --config or a run folder in --models (the run whose CLIP gives the "
                        "text tower)")
    refuse_existing_folder(output, options.overwrite)
    base = options.base if options.base is not None else run_base
    inputs = [*model_paths, *([base] if base is not None else [])]
    for name in (*OPEN_CLIP_FILES, MERGED_ENCODER):
        refuse_input_as_output(output / name, inputs)
    said = io.StringIO()
    with atomic_folder(output, overwrite=options.overwrite) as staging:
        encoder = staging / MERGED_ENCODER
        with contextlib.redirect_stdout(said):
            run_merge(replace(options, output=encoder, format="safetensors", overwrite=False))
        export = open_clip_export(load_state_dict(encoder), config, str(output / MERGED_ENCODER))
        card = model_card(card_facts(merge_command(options), config, encoder, output / MERGED_ENCODER, export,
                                     output.name), output)
        write_open_clip_files(staging, export, card)
    print(said.getvalue().replace(str(staging), str(output)), end="")  # the merge's lines, naming the folder
    print(done_line("merge", export, output))
