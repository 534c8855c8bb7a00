#!/usr/bin/env bash
# What the tests need beyond `pip install -e '.[test]'`: SLURM and munge (Debian's slurm-wlm), for
# the test that submits slurm/cpu.sbatch to a real cluster. Installs them with apt-get when they are
# missing and this is a root shell on a Debian-like system; otherwise says so, and that test skips.
set -euo pipefail
needed=(slurmctld slurmd slurm-client munge)
if command -v sbatch >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null; then
  echo "setup_assets: SLURM and munge already installed"
elif [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
  echo "setup_assets: installing ${needed[*]} with apt-get"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${needed[@]}" >/dev/null
else
  echo "setup_assets: cannot install SLURM here (needs root and apt-get); the real-SLURM test will skip"
fi
