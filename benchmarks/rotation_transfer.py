"""How separate the offline task family's rotations are for theta_0 (docs/data.md, "The offline task
family"): on theta_0's L2-normalised features (the offline suite's ImageNet MobileNetV2), a logistic
regression fitted on SHOTS training images per class of one rotation of a source, scored on the test
split of each of the source's four rotations. A rotation that theta_0 saw as the same task would score
as well on the other rotations as on its own.

    python benchmarks/rotation_transfer.py            # about 9 minutes on 2 shared cores

Needs the offline assets: `bash tests/setup_assets.sh`.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import torch
from sklearn.linear_model import LogisticRegression

from mima.data import offline
from mima.data.tasks import LoadOptions
from mima.models.clip import load_clip


def features(encoder: torch.nn.Module, dataset, indices: list[int], batch: int = 256) -> np.ndarray:
    """L2-normalised theta_0 features of `dataset`'s examples `indices`."""
    out = []
    with torch.no_grad():
        for start in range(0, len(indices), batch):
            images = torch.stack([dataset[i][0] for i in indices[start:start + batch]])
            out.append(torch.nn.functional.normalize(encoder(images), dim=-1).numpy())
    return np.concatenate(out)


def transfer(shots: int, c: float) -> dict[str, dict[int, float]]:
    """{"<source> probe@<degrees>": {degrees: test accuracy (%)}} for the family's sources."""
    clip = load_clip("embedded:mobilenetv2-imagenet")
    encoder = clip.encoder.eval()
    options = LoadOptions(preprocess=clip.preprocess)
    table = {}
    for source in offline.SOURCES:
        splits = {}
        for degrees in offline.ROTATIONS:
            data = offline.TASKS[offline.rotated_name(source, degrees)].load(options)
            labels = data.train.dataset.labels[np.asarray(data.train.indices)]
            rng = np.random.default_rng(0)  # the same images for every rotation of a source
            pick = np.concatenate([rng.permutation(np.flatnonzero(labels == label))[:shots] for label in range(10)])
            test_labels = data.test.dataset.labels[np.asarray(data.test.indices)]
            splits[degrees] = (features(encoder, data.train, pick.tolist()), labels[pick],
                               features(encoder, data.test, list(range(len(data.test)))), test_labels)
        for trained in offline.ROTATIONS:
            probe = LogisticRegression(max_iter=2000, C=c).fit(splits[trained][0], splits[trained][1])
            row = {d: round(100 * probe.score(splits[d][2], splits[d][3]), 1) for d in offline.ROTATIONS}
            table[f"{source} probe@{trained}"] = row
            print(f"{source} probe fitted at {trained}: {row}", flush=True)
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shots", type=int, default=50, help="training images per class of each probe")
    parser.add_argument("--c", type=float, default=10.0, help="inverse L2 strength of the logistic regression")
    parser.add_argument("--threads", type=int, default=2)
    options = parser.parse_args(argv)
    torch.set_num_threads(options.threads)
    print(json.dumps(transfer(options.shots, options.c)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
