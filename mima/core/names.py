"""Names and numbers that several layers share, written once: the models a results row can name
besides the merges, the z-value of every 95 % interval, the files read as images, the evaluation's
batch size. A core module (it imports nothing), so that run folders, data, evaluation, analyses and
commands all take them from here.
"""

from __future__ import annotations

# ----------------------------------------------------------------- the models of a results row
# A row of results.json / results.csv names its model: one of these, or a merge method's name.
ZERO_SHOT = "zero_shot"  # theta_0, the pretrained encoder, on every task
FINE_TUNED = "fine_tuned"  # each task's own fine-tuned model on its task (the reference of relative accuracy)
# the joint multi-task baseline's one model: model.mode `joint`, final/joint.safetensors and its results row
JOINT = "joint"

# ----------------------------------------------------------------- statistics
Z95 = 1.959963984540054  # the standard normal's 97.5 % quantile: the half-width of a two-sided 95 % interval

# ----------------------------------------------------------------- image files
# The file names read as images (in any case): what `mima data prepare` extracts from an archive and
# what an image folder task lists (mima.data.image_folder), so that a prepared folder is read whole.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")

# ----------------------------------------------------------------- evaluation
EVAL_BATCH_SIZE = 512  # images per forward pass of `mima evaluate` (mima.evaluation.accuracy)
