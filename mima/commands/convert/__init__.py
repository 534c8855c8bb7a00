"""Turn a pickled module checkpoint (task_vectors style) into a safetensors state dict, without
running code from the file; or convert between open_clip image encoders and Hugging Face transformers
CLIP vision towers (--from hf-clip, --to hf-clip) by renaming tensors (no transformers needed); or
write a merged or fine-tuned image encoder with its run's text tower as a full open_clip CLIP folder
with a model card (--to open-clip), which open_clip.create_model_and_transforms("local-dir:DIR") loads.
"""
# `mima convert`: pickled checkpoints to safetensors, open_clip <-> transformers CLIP (mima.commands.convert.run runs it).

from __future__ import annotations

import argparse
from collections.abc import Sequence

from mima.commands.common import OneLineParser, frozen_options
from mima.commands.convert.options import ConvertOptions
from mima.commands.convert.options import add_arguments as add_convert_arguments


def parse(argv: Sequence[str]) -> ConvertOptions:
    parser = OneLineParser(
        prog="mima convert",
        description=__doc__,
        epilog="examples:\n  mima convert finetuned.pt finetuned.safetensors\n"
        "  mima convert --from hf-clip clip-vit-base-patch32/ --output base.safetensors\n"
        "  mima convert --from hf-clip clip-vit-base-patch32_svhn/ --projection-from clip-vit-base-patch32/ --output svhn.safetensors\n"
        "  mima convert --to hf-clip merged.safetensors --activation quick_gelu --output merged-hf/\n"
        "  mima convert --to open-clip merged.safetensors --config runs/x --output merged-open-clip/",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_convert_arguments(parser)
    return frozen_options(ConvertOptions, parser.parse_args(argv))


def main(argv: Sequence[str]) -> None:
    options = parse(argv)
    from mima.commands.convert.run import main as run_convert

    run_convert(options)
