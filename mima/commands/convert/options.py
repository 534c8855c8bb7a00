"""`mima convert`'s options. Imports nothing heavy, so that the help and argument errors answer before
torch is loaded; mima.commands.convert.run checks and runs them."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

# The MLP activations of open_clip's ViT, as mima.models.hf_clip.ACTIVATIONS names them (that module
# imports torch; tests/commands/test_cli_startup.py checks both lists agree).
ACTIVATIONS = ("quick_gelu", "gelu")


@dataclass(frozen=True)
class ConvertOptions:
    """The parsed options (the fields are add_arguments' destinations)."""

    source: Path
    output_positional: Path | None  # OUTPUT, or --output
    output: Path | None
    source_format: str | None  # --from: "pickle" or "hf-clip"; None: pickle
    target_format: str | None  # --to: "hf-clip" or "open-clip"
    prefix: str | None  # pickle only; None: model.visual.
    arch: str | None  # hf-clip: the open_clip architecture; None: from the weights' shapes
    projection_from: Path | None
    activation: str | None  # one of ACTIVATIONS
    overwrite: bool
    config: Path | None = None  # --to open-clip: the run whose text tower completes the CLIP


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", type=Path,
                        help="the checkpoint: a pickled .pt (default), a transformers CLIP folder or weights file "
                        "(--from hf-clip), or an open_clip image-encoder .safetensors (--to hf-clip)")
    parser.add_argument("output_positional", nargs="?", type=Path, metavar="OUTPUT", help="the file to write (or --output)")
    parser.add_argument("--output", "-o", type=Path,
                        help="the file to write; with --to hf-clip a folder (config.json + model.safetensors) unless "
                        "it ends in .safetensors; with --to open-clip a folder (open_clip_config.json + "
                        "open_clip_model.safetensors + README.md)")
    parser.add_argument("--from", dest="source_format", choices=("pickle", "hf-clip"), default=None,
                        help="pickle: a pickled module checkpoint (the default); hf-clip: a transformers CLIPModel, "
                        "CLIPVisionModelWithProjection or CLIPVisionModel (a save_pretrained folder or its weights file)")
    parser.add_argument("--to", dest="target_format", choices=("hf-clip", "open-clip"), default=None,
                        help="hf-clip: write a transformers CLIPVisionModelWithProjection from an open_clip image encoder; "
                        "open-clip: write the full CLIP (the run's text tower with this image encoder) as a folder that "
                        "open_clip.create_model_and_transforms('local-dir:DIR') loads, with a model card")
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
    parser.add_argument("--config", type=Path, default=None,
                        help="--to open-clip: the `mima fit` run folder or config whose CLIP gives the text tower, logit "
                        "scale and activation (the encoder's results table, ENCODER.results.json, goes into the card)")
    parser.add_argument("--overwrite", action="store_true", help="replace the output if it exists (never an input)")
