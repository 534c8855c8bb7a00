"""Reading a run folder written by `mima fit` (the output contract):

    config.yaml                 the full config of the run
    pretrained.safetensors      theta_0, the image encoder before fine-tuning
    final/<task>.safetensors    each task's image encoder after the last phase (+ <task>.json metadata)
    metrics.jsonl               one JSON object per phase: phase, step, mean_cos_tau, mean_cos_delta, loss, ...
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from mima.errors import MimaError
from mima.safetensors_io import load_state_dict
from mima.state_dicts import cosine_matrix, difference, is_mergeable

StateDict = dict[str, torch.Tensor]


@dataclass
class RunFolder:
    path: Path

    def task_order(self) -> list[str]:
        """Tasks in run order (as the metadata of the final checkpoints lists them)."""
        metadata_files = sorted((self.path / "final").glob("*.json"))
        if not metadata_files:
            raise MimaError(f"{self.path}: no final/<task>.json files (is this a finished `mima fit` run folder?)")
        return list(json.loads(metadata_files[0].read_text())["tasks"])

    def pretrained(self) -> StateDict:
        return load_state_dict(self.path / "pretrained.safetensors")

    def final(self, task: str) -> StateDict:
        return load_state_dict(self.path / "final" / f"{task}.safetensors")

    def phase_records(self) -> list[dict]:
        file = self.path / "metrics.jsonl"
        if not file.is_file():
            return []
        return [json.loads(line) for line in file.read_text().splitlines() if line.strip()]


def task_vector_cosines(base: StateDict, models: list[StateDict]) -> torch.Tensor:
    """Pairwise cosine of the task vectors tau_t = theta_t - theta_0 over all floating tensors."""
    keys = [key for key, value in base.items() if is_mergeable(value)]
    return cosine_matrix([difference(model, base, keys) for model in models], keys)
