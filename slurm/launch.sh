#!/usr/bin/env bash
# Shared by every sbatch script in this folder: activate the environment, choose the run folder,
# and start one `mima fit` process per task slot with srun. Always passes `--ckpt_path last`, so a
# requeued job (preempted, or stopped at the time limit after SIGUSR1) resumes where it saved.
#
# Variables (set them in the sbatch script or export them before sbatch):
#   MIMA_CONFIG        the mima fit config (required)
#   MIMA_ENV_ACTIVATE  a command that makes `mima` available, e.g. "source ~/mima/.venv/bin/activate"
#   MIMA_ACCELERATOR   gpu (default) or cpu
#   MIMA_RUNS          where run folders go (default: runs); the folder is named by the job id,
#                      which SLURM keeps across requeues
#   MIMA_RUN_NAME      the run folder's name (default: $SLURM_JOB_ID, or <array job>_<array task>)
# Extra arguments are passed on to `mima fit` (e.g. --model.iterations 8).
set -euo pipefail
: "${MIMA_CONFIG:?set MIMA_CONFIG to the mima fit config}"
if [[ -n "${MIMA_ENV_ACTIVATE:-}" ]]; then
  eval "${MIMA_ENV_ACTIVATE}"
fi
if [[ -n "${SLURM_ARRAY_JOB_ID:-}" ]]; then
  default_name="${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}"
else
  default_name="${SLURM_JOB_ID}"
fi
run_dir="${MIMA_RUNS:-runs}/${MIMA_RUN_NAME:-${default_name}}"
tasks_per_node="${SLURM_NTASKS_PER_NODE:-1}"
echo "mima: job ${SLURM_JOB_ID} (restart ${SLURM_RESTART_COUNT:-0}) on ${SLURM_JOB_NODELIST}: ${SLURM_NNODES} node(s) x ${tasks_per_node} process(es) -> ${run_dir}"
# Since Slurm 22.05 srun no longer inherits sbatch's --cpus-per-task: without it every process would
# get one core however many the job asked for (and the data workers would share it).
cpus_per_task=()
if [[ -n "${SLURM_CPUS_PER_TASK:-}" ]]; then
  cpus_per_task=(--cpus-per-task="${SLURM_CPUS_PER_TASK}")
fi
# --kill-on-bad-exit: if one process dies, SLURM ends the others instead of letting them wait.
srun --kill-on-bad-exit=1 "${cpus_per_task[@]}" mima fit \
  --config "${MIMA_CONFIG}" \
  --trainer.accelerator "${MIMA_ACCELERATOR:-gpu}" \
  --trainer.devices "${tasks_per_node}" \
  --trainer.num_nodes "${SLURM_NNODES}" \
  --out "${run_dir}" \
  --ckpt_path last \
  "$@"
