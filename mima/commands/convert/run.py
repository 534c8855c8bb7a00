"""`mima convert`: a checkpoint -> a safetensors state dict, without running its code.

  mima convert CHECKPOINT.pt OUT.safetensors [--prefix model.visual.]
      a pickled module (task_vectors' and tall_masks' ImageEncoder) read with
      mima.convert.pickle_reader's restricted unpickler; the keys under --prefix (default
      `model.visual.`, the image tower) are written, prefix removed, as an image-encoder state
      dict like the ones `mima fit` writes.
  mima convert --from hf-clip HF_DIR_OR_FILE --output OUT.safetensors
  mima convert --to hf-clip ENCODER.safetensors --output DIR
      open_clip image encoders <-> transformers CLIP vision towers (mima.convert.hf_conversion
      reads and converts, mima.convert.hf_writer writes the transformers folder).
  mima convert --to open-clip ENCODER.safetensors --config RUN --output DIR
      the full CLIP (the run's text tower and logit scale, this image tower, the activation
      recorded) in open_clip's folder layout, with a model card (mima.convert.open_clip_writer).

This module checks the options (mima.commands.convert.options declares them), refuses outputs that are
inputs, exist (unless --overwrite) or lie in an input's run folder (mima.core.run_outputs) before any
reading, and writes the result.
"""

from __future__ import annotations

from pathlib import Path

from mima.convert.hf_conversion import HF_CONFIG, HF_WEIGHTS, convert_from_hf_clip, convert_to_hf_clip, hf_checkpoint_files
from mima.convert.hf_writer import write_hf_output
from mima.commands.convert.options import ConvertOptions
from mima.convert.pickle_reader import convert_checkpoint
from mima.core.errors import MimaError
from mima.core.files import refuse_input_as_output, refuse_overwrite
from mima.core.run_outputs import refuse_output_on_runs
from mima.core.safetensors_io import save_state_dict
from mima.convert.open_clip_export import convert_to_open_clip


def _output_of(options: ConvertOptions) -> Path:
    if options.output is not None and options.output_positional is not None:
        raise MimaError(f"give the output once: OUTPUT {options.output_positional} or --output {options.output}")
    output = options.output if options.output is not None else options.output_positional
    if output is None:
        raise MimaError("--output: required (the file to write)")
    return output


def _check_options(options) -> str:
    """'pickle', 'from-hf', 'to-hf' or 'to-open-clip', after refusing options that do not apply to it."""
    if options.source_format is not None and options.target_format is not None:
        raise MimaError("--from and --to: give one (--from hf-clip reads a transformers CLIP, --to hf-clip writes one)")
    if options.target_format == "open-clip":
        return _check_open_clip_options(options)
    if options.config is not None:
        raise MimaError("--config: applies to --to open-clip only (the run whose text tower completes the CLIP)")
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


def _check_open_clip_options(options) -> str:
    given = {"--arch": options.arch, "--activation": options.activation, "--projection-from": options.projection_from,
             "--prefix": options.prefix}
    for flag, value in given.items():
        if value is not None:
            raise MimaError(f"{flag}: does not apply to --to open-clip (the run's CLIP, --config, gives the architecture "
                            "and activation)")
    if options.config is None:
        raise MimaError("--to open-clip: needs --config, the `mima fit` run folder or config whose CLIP gives the text tower")
    return "to-open-clip"


def main(options: ConvertOptions) -> None:
    mode = _check_options(options)
    output, source = _output_of(options), options.source
    refuse_output_on_runs("--output", output, [source, options.config, options.projection_from])
    if mode == "to-open-clip":
        convert_to_open_clip(source, options.config, output, options.overwrite)
        return
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
