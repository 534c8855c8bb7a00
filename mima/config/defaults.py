"""Defaults that more than one command states, written once. Imports nothing heavy: the command-line
parsers read them before torch loads.

"auto" values are settled by the run's plan (mima.training.plan_choices), which `mima plan` prints
and `mima fit` prints at start; each can be given explicitly instead.
"""

from __future__ import annotations

AUTO = "auto"

# --checkpoint_every: "auto" saves by time on a GPU (a ViT-L/14 process state with its AdamW moments
# is several GB, so saving at every segment end would keep the disk busy for the whole run) and at
# every segment end on the CPU (small models, and the tests' bit-exact resume points)
CHECKPOINT_EVERY_DEFAULT = AUTO
CHECKPOINT_EVERY_ON_GPU = "30min"
CHECKPOINT_EVERY_ON_CPU = "segment"

# --collective_timeout: seconds a collective (and a sync's agreement) may wait for the other processes
# before the run fails, so a dead process cannot hang it (as Lightning's DDP default)
COLLECTIVE_TIMEOUT_S = 1800

# trainer.devices and trainer.num_nodes where a config gives none: one process on one node (`mima fit`
# sets the devices, Lightning's own default being "auto"; the nodes are Lightning's default)
DEVICES_DEFAULT = 1
NUM_NODES_DEFAULT = 1
