#!/usr/bin/env bash
# Submits a sweep over N (and seeds): the fit array (sweep_n.sbatch, one element per N and seed),
# then its evaluation (evaluate_sweep.sbatch) with --dependency=afterany:<array id>. The evaluation
# starts once every element has ended (an element that requeued itself counts when its requeued run
# ends): completed, failed or cancelled (a partition whose preemption cancels instead of requeueing).
# It evaluates the runs that finished and names the others; submitting the same sweep again resumes
# exactly those (finished fits exit at once) and evaluates again.
# Run it from the repository root, where the jobs find slurm/:
#   MIMA_CONFIG=configs/clip/ViT-B-32.yaml slurm/submit_sweep.sh [SBATCH OPTIONS ...] [-- MIMA FIT ARGUMENTS ...]
#   MIMA_CONFIG=configs/clip/ViT-B-32.yaml MIMA_SEEDS="0 1 2" MIMA_RUNS=/scratch/$USER/mima-runs \
#     slurm/submit_sweep.sh --account=my_account -- --data.root /data/clip
# SBATCH OPTIONS go to both jobs; MIMA_FIT_SBATCH and MIMA_EVAL_SBATCH (space-separated options) to
# one of them each, after ours (so e.g. MIMA_FIT_SBATCH="--array=0-17%6" throttles the array).
# Both jobs see this shell's environment (sbatch's default --export=ALL; keep ALL if you pass
# --export): MIMA_CONFIG, MIMA_ITERATIONS (default "1 2 4 8 16 20"), MIMA_SEEDS (default: the
# config's seed), MIMA_RUNS, MIMA_RUN_NAME, MIMA_MERGES, MIMA_TABLE, MIMA_CACHE_DIR (see the scripts).
# Submitting the same sweep again resumes it: the run folders are named by config, N and seed, so
# finished fits exit at once and the evaluation redoes only what is missing.
set -euo pipefail
: "${MIMA_CONFIG:?set MIMA_CONFIG to the mima fit config of the sweep}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
sbatch_options=()
while (( $# > 0 )) && [[ "$1" != "--" ]]; do
  sbatch_options+=("$1")
  shift
done
if (( $# > 0 )); then
  shift  # the "--": what follows goes to `mima fit`
fi
read -r -a iterations <<< "${MIMA_ITERATIONS:-1 2 4 8 16 20}"
read -r -a seeds <<< "${MIMA_SEEDS:-}"
read -r -a fit_extra <<< "${MIMA_FIT_SBATCH:-}"
read -r -a eval_extra <<< "${MIMA_EVAL_SBATCH:-}"
count=$(( ${#iterations[@]} * (${#seeds[@]} > 0 ? ${#seeds[@]} : 1) ))

array_id="$(sbatch --parsable --array="0-$(( count - 1 ))" ${sbatch_options[@]+"${sbatch_options[@]}"} ${fit_extra[@]+"${fit_extra[@]}"} \
  "${here}/sweep_n.sbatch" "$@")"
array_id="${array_id%%;*}"  # --parsable prints "id" or "id;cluster"
eval_id="$(sbatch --parsable --dependency="afterany:${array_id}" \
  ${sbatch_options[@]+"${sbatch_options[@]}"} ${eval_extra[@]+"${eval_extra[@]}"} "${here}/evaluate_sweep.sbatch")"
eval_id="${eval_id%%;*}"
echo "mima sweep: fit array job ${array_id} (${count} runs: N in ${iterations[*]}${seeds:+; seeds ${seeds[*]}})"
echo "mima sweep: evaluation job ${eval_id} (starts when every element of array ${array_id} has ended)"
