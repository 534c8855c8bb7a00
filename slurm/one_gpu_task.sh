#!/usr/bin/env bash
# Runs one srun task's command (`mima fit ...`) so that Lightning accepts a process that sees only
# its own GPU. launch.sh puts it in front of `mima fit` when MIMA_ONE_GPU_PER_TASK=1; see
# gpus_per_task.sbatch for when that is needed.
#
# Why (lightning 2.6, read in the installed source): under SLURM, Lightning wants
# `--trainer.devices` = --ntasks-per-node (SLURMEnvironment.validate_settings raises otherwise),
# checks that every requested device index exists in the process (fabric/utilities/device_parser.py,
# _parse_gpu_ids -> _sanitize_gpu_ids: "You requested gpu: [0, 1, ...] But your machine only has:
# [0]"), and gives each process the device parallel_devices[local rank] with the local rank taken
# from SLURM_LOCALID (DDPStrategy.root_device). A task bound to one GPU (CUDA_VISIBLE_DEVICES has
# one entry) fails the check, and local rank k > 0 would then ask for cuda:k, which it does not have.
# When the task sees exactly one GPU and shares the node with other tasks, this script
#   - sets TORCHELASTIC_RUN_ID: _parse_gpu_ids skips the check when torch.distributed reports a
#     torchelastic launch and the process sees one GPU (its own provision for launchers that give
#     each process one GPU). mima still uses SLURMEnvironment (mima.training.trainer builds the
#     strategy with it), so ranks, world size, MASTER_ADDR/PORT and requeueing still come from SLURM;
#   - sets SLURM_LOCALID=0 for this process only: every process then takes cuda:0, its own GPU.
#     Global ranks come from SLURM_PROCID and node ranks from SLURM_NODEID, which stay as they are.
#     Lightning's other uses of the local rank are per-node conveniences that mima does not rely on
#     (prepare_data on local rank 0 — mima's data module has none —, Trainer.print, profiler names).
# Otherwise (all the node's GPUs visible, or one process per node) it changes nothing.
set -euo pipefail
IFS=',' read -r -a visible <<< "${CUDA_VISIBLE_DEVICES:-}"
tasks_here="${SLURM_NTASKS_PER_NODE:-1}"
if (( ${#visible[@]} == 1 && tasks_here > 1 )); then
  export TORCHELASTIC_RUN_ID="${SLURM_JOB_ID:-mima}"
  export SLURM_LOCALID=0
fi
exec "$@"
