#!/usr/bin/env bash
# Shared by every sbatch script in this folder: activate the environment, name the run folder, and
# start one `mima fit` process per task slot with srun. Always passes `--ckpt_path last`: a job that
# is requeued (preempted, or stopped at the time limit after SIGUSR1) or submitted again with sbatch
# (a new job id) resumes the newest consistent checkpoint of its run folder, starts fresh if there is
# none, and exits 0 at once if the run has finished ("nothing to resume").
#
# Variables (set them in the sbatch script or export them before sbatch):
#   MIMA_CONFIG        the mima fit config (required)
#   MIMA_ENV_ACTIVATE  a command that makes `mima` available, e.g. "source ~/mima/.venv/bin/activate"
#   MIMA_ACCELERATOR   gpu (default) or cpu
#   MIMA_RUNS          where run folders go (default: runs, under the job's working directory). Use
#                      storage that every node sees and that outlives the job, with room for the
#                      checkpoints, e.g. MIMA_RUNS=/scratch/$USER/mima-runs
#   MIMA_RUN_NAME      the run folder's name under MIMA_RUNS (default: {config}-N{iterations}-seed{seed},
#                      which `mima fit` fills in with the config file's name, model.iterations and
#                      seed_everything). The name, not the job id, identifies the run: the same config
#                      and arguments submitted again continue the same run. Never run two jobs with
#                      one name at the same time; give a variant (another lr, ...) a name of its own.
#   MIMA_CACHE_DIR     mima's own cache (embedded models, zero-shot heads; default ~/.cache/mima): on a
#                      cluster put it where the compute nodes see it, e.g. /scratch/$USER/mima-cache
#   MASTER_PORT        the TCP port of the processes' rendezvous on the first node. Lightning's default
#                      under SLURM is 15000 + the last four digits of $SLURM_JOB_ID (set by
#                      SLURMEnvironment.main_port), so two jobs sharing a node collide only when their
#                      ids end in the same four digits (e.g. 31234 and 41234) or when another program
#                      holds the port: then export a free port before sbatch, or in the sbatch script, e.g.
#                        export MASTER_PORT=$(python -c 'import socket; s=socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')
#                      (the batch script runs on the job's first node, the one Lightning uses as
#                      MASTER_ADDR, and srun passes the variable to every process).
#   MIMA_GPU_BIND      passed to `srun --gpu-bind` when set (gpus_per_task.sbatch sets "none")
#   MIMA_ONE_GPU_PER_TASK=1  start each process through slurm/one_gpu_task.sh, which lets Lightning
#                      run a process that sees only its own GPU (gpus_per_task.sbatch explains why)
# Extra arguments are passed on to `mima fit` (e.g. --model.iterations 8, --seed_everything 1).
set -euo pipefail
: "${MIMA_CONFIG:?set MIMA_CONFIG to the mima fit config}"
if [[ -n "${MIMA_ENV_ACTIVATE:-}" ]]; then
  eval "${MIMA_ENV_ACTIVATE}"
fi
# `mima fit` fills in the fields, so the name follows from the config and the arguments alone
default_name='{config}-N{iterations}-seed{seed}'
run_dir="${MIMA_RUNS:-runs}/${MIMA_RUN_NAME:-${default_name}}"
tasks_per_node="${SLURM_NTASKS_PER_NODE:-1}"
config_file="$(basename "${MIMA_CONFIG}")"
config_field='{config}'  # a plain pattern: quotes inside "${x//...}" mean different things to bash 4.2 and 5
echo "mima: job ${SLURM_JOB_ID} (restart ${SLURM_RESTART_COUNT:-0}) on ${SLURM_JOB_NODELIST}:" \
  "${SLURM_NNODES} node(s) x ${tasks_per_node} process(es) -> ${run_dir//${config_field}/${config_file%.*}}"

srun_options=(--kill-on-bad-exit=1)  # if one process dies, SLURM ends the others instead of letting them wait
# Since Slurm 22.05 srun no longer inherits sbatch's --cpus-per-task: without it every process would
# get one core however many the job asked for (and the data workers would share it).
if [[ -n "${SLURM_CPUS_PER_TASK:-}" ]]; then
  srun_options+=(--cpus-per-task="${SLURM_CPUS_PER_TASK}")
fi
if [[ -n "${MIMA_GPU_BIND:-}" ]]; then
  srun_options+=(--gpu-bind="${MIMA_GPU_BIND}")
fi
wrapper=()
if [[ "${MIMA_ONE_GPU_PER_TASK:-0}" == 1 ]]; then
  wrapper=(bash "$(dirname "${BASH_SOURCE[0]}")/one_gpu_task.sh")
fi
srun ${srun_options[@]+"${srun_options[@]}"} ${wrapper[@]+"${wrapper[@]}"} mima fit \
  --config "${MIMA_CONFIG}" \
  --trainer.accelerator "${MIMA_ACCELERATOR:-gpu}" \
  --trainer.devices "${tasks_per_node}" \
  --trainer.num_nodes "${SLURM_NNODES}" \
  --out "${run_dir}" \
  --ckpt_path last \
  "$@"
