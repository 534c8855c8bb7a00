"""A second task family for the phase-start ablation (issue 12, item 4): four 10-class image-folder
tasks of procedurally drawn marks, written as `data.custom_tasks` folders, plus a `mima fit`
config that trains the offline suite's model (ImageNet MobileNetV2) on them.

The ten classes are simple marks (circle, square, triangle, cross, plus, diamond, arrow, L, bar,
ring) drawn at random size, position, stroke, small tilt and colours on 32x32 RGB canvases. The
four tasks share the classes and differ by a transform of every image, so they pull one encoder in
different directions as the benchmark's tasks do:

    marks          upright
    marks_rot90    turned by 90 degrees (a triangle or arrow now points elsewhere)
    marks_mirror   mirrored left-right (the arrow and the L change meaning)
    marks_negative colours inverted

Each task has `--train` images per class in train/ and `--test` per class in test/ (validation is
carved from train/ by the usual rule). Deterministic for a given --seed.

    python benchmarks/marks_family.py --out /tmp/marks           # writes /tmp/marks/{task}/..., marks.yaml
    python benchmarks/ablation.py --config /tmp/marks/marks.yaml --iterations 1 2 4 8
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np
import yaml
from PIL import Image, ImageDraw, ImageOps

ROOT = Path(__file__).resolve().parents[1]
CLASSES = ("circle", "square", "triangle", "cross", "plus", "diamond", "arrow", "ell", "bar", "ring")
SIZE = 32
TASKS = {
    "marks": lambda image: image,
    "marks_rot90": lambda image: image.transpose(Image.Transpose.ROTATE_90),
    "marks_mirror": lambda image: image.transpose(Image.Transpose.FLIP_LEFT_RIGHT),
    "marks_negative": ImageOps.invert,
}


def _outline(name: str) -> list[list[tuple[float, float]]]:
    """The mark as polylines in the unit square [-1, 1]^2 (y down), before tilt and placement."""
    if name in ("circle", "ring"):
        return [[(math.cos(a), math.sin(a)) for a in np.linspace(0, 2 * math.pi, 25)]]
    if name == "square":
        return [[(-1, -1), (1, -1), (1, 1), (-1, 1), (-1, -1)]]
    if name == "triangle":
        return [[(0, -1), (1, 1), (-1, 1), (0, -1)]]
    if name == "cross":
        return [[(-1, -1), (1, 1)], [(-1, 1), (1, -1)]]
    if name == "plus":
        return [[(0, -1), (0, 1)], [(-1, 0), (1, 0)]]
    if name == "diamond":
        return [[(0, -1), (1, 0), (0, 1), (-1, 0), (0, -1)]]
    if name == "arrow":
        return [[(-1, 0), (1, 0)], [(0.3, -0.6), (1, 0), (0.3, 0.6)]]
    if name == "ell":
        return [[(-0.6, -1), (-0.6, 1), (0.8, 1)]]
    if name == "bar":
        return [[(-1, 0), (1, 0)]]
    raise ValueError(name)


def draw_mark(name: str, rng: np.random.Generator) -> Image.Image:
    background = tuple(int(v) for v in rng.integers(0, 256, 3))
    foreground = tuple((c + int(rng.integers(96, 160))) % 256 for c in background)  # always contrasts
    image = Image.new("RGB", (SIZE, SIZE), background)
    draw = ImageDraw.Draw(image)
    radius = SIZE * rng.uniform(0.22, 0.36)
    centre = SIZE / 2 + rng.uniform(-4, 4, 2)
    tilt = math.radians(rng.uniform(-15, 15))
    cos_t, sin_t = math.cos(tilt), math.sin(tilt)
    width = int(rng.integers(2, 4)) + (2 if name == "ring" else 0)
    for line in _outline(name):
        points = [(centre[0] + radius * (x * cos_t - y * sin_t), centre[1] + radius * (x * sin_t + y * cos_t)) for x, y in line]
        draw.line(points, fill=foreground, width=width, joint="curve")
    if name == "circle":  # a filled disc, so circle and ring differ
        draw.ellipse([centre[0] - radius, centre[1] - radius, centre[0] + radius, centre[1] + radius], fill=foreground)
    pixels = np.asarray(image, dtype=np.int16) + rng.integers(-12, 13, (SIZE, SIZE, 3))
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def write_family(out: Path, train_per_class: int, test_per_class: int, seed: int) -> list[dict]:
    custom_tasks = []
    for task_index, (task, transform) in enumerate(TASKS.items()):
        for split, count in (("train", train_per_class), ("test", test_per_class)):
            rng = np.random.default_rng([seed, task_index, 0 if split == "train" else 1])
            for class_name in CLASSES:
                folder = out / task / split / class_name
                folder.mkdir(parents=True, exist_ok=True)
                for index in range(count):
                    transform(draw_mark(class_name, rng)).save(folder / f"{index:04d}.png")
        custom_tasks.append({"name": task, "path": str(out / task)})
    return custom_tasks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the four tasks and marks.yaml")
    parser.add_argument("--train", type=int, default=100, help="training images per class")
    parser.add_argument("--test", type=int, default=40, help="test images per class")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--base-config", type=Path, default=ROOT / "configs" / "offline.yaml",
                        help="model/trainer settings to copy (default: the offline suite's)")
    options = parser.parse_args(argv)
    if options.out.exists() and any(options.out.iterdir()):
        print(f"marks_family: error: --out {options.out} is not empty", file=sys.stderr)
        return 2
    custom_tasks = write_family(options.out, options.train, options.test, options.seed)
    config = yaml.safe_load(options.base_config.read_text())
    config["model"]["probe_shots"] = None  # full probes, as the held-out family
    config["data"] = {"suite": None, "tasks": None, "custom_tasks": custom_tasks,
                      "batch_size": config["data"]["batch_size"], "seed": 0}
    (options.out / "marks.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    print(f"marks_family: {len(TASKS)} tasks x {len(CLASSES)} classes -> {options.out} (config {options.out / 'marks.yaml'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
