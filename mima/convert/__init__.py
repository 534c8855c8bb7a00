"""`mima convert`: checkpoints from other tools -> mima's safetensors state dicts, and back.

  pickle_reader   pickled torch checkpoints (whole modules), read without running their code
  hf_conversion   transformers CLIP checkpoints <-> open_clip image encoders (read and renamed)
  hf_writer       a transformers CLIP folder (or weights file) written from an open_clip encoder
  open_clip_writer  a full open_clip CLIP folder (the run's text tower, this image tower) that
                  open_clip.create_model_and_transforms("local-dir:DIR") loads
  model_card      that folder's README.md: recipe, sources, merge, evaluation table
  command         the command: options, output checks, which of the above runs

The tensor-name table between the two CLIP layouts is mima.models.hf_clip's.
"""
