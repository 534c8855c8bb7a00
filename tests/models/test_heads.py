"""Zero-shot head construction: a toy text tower with known embeddings, then a real open_clip model."""

import math

import torch
from torch import nn

from mima.models.clip import load_clip
from mima.models.heads import cached_zero_shot_head, zero_shot_head

CLASSES = ("cat", "dog", "owl")
TEMPLATES = ("a photo of a {}.", "a drawing of a {}.")


class ToyTextTower(nn.Module):
    """encode_text gives 3 * e_class + 4 * e_(3 + template): norm 5, so each normalised embedding is
    0.6 e_class + 0.8 e_template."""

    def __init__(self, logit_scale: float) -> None:
        super().__init__()
        self.logit_scale = nn.Parameter(torch.tensor(logit_scale))

    def encode_text(self, tokens: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(len(tokens), len(CLASSES) + len(TEMPLATES))
        out[torch.arange(len(tokens)), tokens[:, 0]] = 3.0
        out[torch.arange(len(tokens)), len(CLASSES) + tokens[:, 1]] = 4.0
        return out


def toy_tokenizer(texts: list[str]) -> torch.Tensor:
    rows = []
    for text in texts:
        template = 0 if text.startswith("a photo") else 1
        name = text.split()[-1].rstrip(".")
        rows.append([CLASSES.index(name), template])
    return torch.tensor(rows)


def test_zero_shot_head_on_toy_text_tower():
    tower = ToyTextTower(logit_scale=math.log(50.0))
    head = zero_shot_head(tower, toy_tokenizer, CLASSES, TEMPLATES)
    # mean over the two templates: 0.6 e_c + 0.4 e_t0 + 0.4 e_t1, norm sqrt(0.36 + 0.32); times exp(scale) = 50.
    norm = math.sqrt(0.36 + 0.16 + 0.16)
    expected = torch.zeros(3, 5)
    for c in range(3):
        expected[c, c] = 0.6 / norm * 50
        expected[c, 3] = expected[c, 4] = 0.4 / norm * 50
    torch.testing.assert_close(head, expected)


def test_head_rows_have_norm_exp_logit_scale_and_are_cached(small_clip, tmp_path):
    clip = load_clip(small_clip)
    classes = ("zero", "one", "two")
    head = cached_zero_shot_head(clip.model, clip.tokenizer, classes, TEMPLATES, tmp_path, "task")
    scale = float(clip.model.logit_scale.detach().exp())
    torch.testing.assert_close(head.norm(dim=1), torch.full((3,), scale))
    files = list((tmp_path / "heads").glob("task-*.safetensors"))
    assert len(files) == 1
    again = cached_zero_shot_head(clip.model, clip.tokenizer, classes, TEMPLATES, tmp_path, "task")
    torch.testing.assert_close(again, head)
    cached_zero_shot_head(clip.model, clip.tokenizer, classes, TEMPLATES[:1], tmp_path, "task")
    assert len(list((tmp_path / "heads").glob("task-*.safetensors"))) == 2  # other prompts, other file


def test_few_shot_probe_data_takes_the_first_k_of_each_class_in_the_fixed_order():
    """Checked against a plain loop over the same seeded permutation."""
    from torch.utils.data import TensorDataset

    from mima.models.heads import PROBE_SEED, few_shot_subset

    labels = torch.tensor([i % 3 for i in range(30)] + [3])  # class 3 has a single example
    dataset = TensorDataset(torch.arange(31.0)[:, None], labels)
    subset = few_shot_subset(dataset, shots=2, num_classes=4)
    order = torch.randperm(31, generator=torch.Generator().manual_seed(PROBE_SEED)).tolist()
    expected = []
    for c in range(4):
        expected += [i for i in order if int(labels[i]) == c][:2]
    assert subset.indices == sorted(expected)
    assert sorted(int(labels[i]) for i in subset.indices) == [0, 0, 1, 1, 2, 2, 3]
