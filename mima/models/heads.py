"""Frozen classification heads, one per task, cached as safetensors.

Zero-shot heads (the papers'): for each class, every prompt template is filled with the class
name and encoded by the text tower; the embeddings are L2-normalised, averaged, normalised again,
and the stacked rows are scaled by exp(logit_scale). The head is frozen during fine-tuning
(paper 001, section 5).

Linear-probe heads (the stand-in where no pretrained text tower exists, e.g. the offline suite's
ImageNet MobileNetV2): a multinomial logistic regression without intercept, fitted on the
L2-normalised features the pretrained image encoder gives the task's training images. It has the
zero-shot head's form (logits = normalize(features) @ head.T) and, like it, depends only on
theta_0 and is frozen: every task model and every merge is judged against the same heads.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset

from mima.config.model import HeadKind
from mima.models.fixed_threads import fixed_threads
from mima.models.clip import LoadedClip, text_tower_fingerprint
from mima.core.safetensors_io import load_state_dict, save_state_dict
from mima.core.subsets import fixed_order, fixed_subset

PROBE_EXAMPLES = 5000  # training images a probe is fitted on (a fixed-seed subset when there are more)
PROBE_C = 10.0  # inverse L2 strength; features have norm 1, so weights need room to grow
PROBE_SEED = 0


@torch.no_grad()
def zero_shot_head(
    model: nn.Module, tokenizer, classnames: Sequence[str], templates: Sequence[str]
) -> torch.Tensor:
    """A [num_classes, embed_dim] head: rows are normalised mean template embeddings times exp(logit_scale)."""
    if not classnames or not templates:
        raise ValueError("a zero-shot head needs at least one class name and one template")
    device = next(model.parameters()).device
    rows = []
    for classname in classnames:
        tokens = tokenizer([template.format(classname) for template in templates]).to(device)
        embeddings = F.normalize(model.encode_text(tokens).float(), dim=-1)
        rows.append(F.normalize(embeddings.mean(dim=0), dim=-1))
    return torch.stack(rows) * model.logit_scale.exp().float()


def cached_zero_shot_head(
    model: nn.Module,
    tokenizer,
    classnames: Sequence[str],
    templates: Sequence[str],
    cache_dir: Path,
    task_name: str,
    fingerprint: str | None = None,
) -> torch.Tensor:
    """`zero_shot_head`, read from `cache_dir/heads/` when the same text tower and prompts made it before."""
    fingerprint = fingerprint or text_tower_fingerprint(model)
    key = hashlib.sha256(
        json.dumps({"model": fingerprint, "classnames": list(classnames), "templates": list(templates)}).encode()
    ).hexdigest()[:20]
    path = Path(cache_dir) / "heads" / f"{task_name}-{key}.safetensors"
    if path.is_file():
        return load_state_dict(path)["head"]
    with fixed_threads():  # cached for every later run: the same bytes whatever built it
        head = zero_shot_head(model, tokenizer, classnames, templates)
    save_state_dict(path, {"head": head}, metadata={"task": task_name, "classnames": list(classnames)})
    return head


@torch.no_grad()
def encoder_features(encoder: nn.Module, dataset: Dataset, batch_size: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """L2-normalised features (eval mode) and labels of every example of `dataset`."""
    was_training = encoder.training
    encoder.eval()
    device = next(encoder.parameters()).device
    features, labels = [], []
    for images, targets in DataLoader(dataset, batch_size=batch_size, pin_memory=device.type == "cuda"):
        features.append(F.normalize(encoder(images.to(device)).float(), dim=-1).cpu())
        labels.append(torch.as_tensor(targets))
    encoder.train(was_training)
    return torch.cat(features), torch.cat(labels)


def few_shot_subset(dataset: Dataset, shots: int, num_classes: int, seed: int = PROBE_SEED) -> Dataset:
    """The first `shots` examples of every class in a fixed random order (fewer for a class that has
    fewer), kept in dataset order: the data of a deliberately weak probe."""
    taken: dict[int, int] = {}
    chosen = []
    for index in fixed_order(len(dataset), seed).tolist():
        label = int(dataset[index][1])
        if taken.get(label, 0) < shots:
            taken[label] = taken.get(label, 0) + 1
            chosen.append(index)
            if len(taken) == num_classes and all(count >= shots for count in taken.values()):
                break
    return Subset(dataset, sorted(chosen))


def fit_linear_probe(features: torch.Tensor, labels: torch.Tensor, num_classes: int, c: float = PROBE_C) -> torch.Tensor:
    """A [num_classes, dim] head W such that features @ W.T are the probe's logits (no intercept)."""
    from sklearn.linear_model import LogisticRegression

    present = sorted(set(labels.tolist()))
    probe = LogisticRegression(C=c, fit_intercept=False, max_iter=2000, tol=1e-6)
    probe.fit(features.double().numpy(), labels.numpy())
    coef = torch.from_numpy(probe.coef_).float()
    if len(present) == 2:  # scikit-learn keeps one row for two classes: logits (0, w.x) in class order
        coef = torch.cat([torch.zeros_like(coef), coef])
    head = torch.zeros(num_classes, features.shape[1])
    head[torch.tensor(present)] = coef  # classes absent from the probe's data stay at logit 0
    return head


def image_tower_fingerprint(encoder: nn.Module) -> str:
    digest = hashlib.sha256()
    for key, tensor in sorted(encoder.state_dict().items()):
        digest.update(key.encode())
        digest.update(tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def task_heads(
    loaded: LoadedClip,
    kind: HeadKind,
    tasks: Sequence,
    train_sets: Mapping[str, Dataset] | None,
    cache_dir: Path,
    data_key: str = "",
    probe_shots: int | None = None,
) -> dict[str, torch.Tensor]:
    """One frozen head per task spec (zero-shot, or a linear probe on `train_sets[task]`), cached.

    `data_key` names the probe's data (suite, root, split seed) in the cache key. A probe is fitted on
    a fixed subset of up to PROBE_EXAMPLES training images, or with `probe_shots` on that many
    images of each class (a weaker head, so that fine-tuning has more to add)."""
    if kind == "zero_shot":
        fingerprint = text_tower_fingerprint(loaded.model)
        return {
            spec.name: cached_zero_shot_head(
                loaded.model, loaded.tokenizer, spec.classnames, spec.templates, cache_dir, spec.name, fingerprint
            )
            for spec in tasks
        }
    if kind != "linear_probe":
        raise ValueError(f"unknown head kind {kind!r}")
    fingerprint = image_tower_fingerprint(loaded.encoder)
    heads = {}
    for spec in tasks:
        key = hashlib.sha256(
            json.dumps({"encoder": fingerprint, "task": spec.name, "classes": list(spec.classnames), "data": data_key,
                        "examples": PROBE_EXAMPLES, "c": PROBE_C, "seed": PROBE_SEED,
                        **({"shots": probe_shots} if probe_shots is not None else {})}).encode()
        ).hexdigest()[:20]
        path = Path(cache_dir) / "heads" / f"{spec.name}-probe-{key}.safetensors"
        if path.is_file():
            heads[spec.name] = load_state_dict(path)["head"]
            continue
        train = train_sets[spec.name]
        probe_data = (
            fixed_subset(train, PROBE_EXAMPLES, PROBE_SEED) if probe_shots is None
            else few_shot_subset(train, probe_shots, spec.num_classes)
        )
        with fixed_threads():  # cached for every later run: the same bytes whatever built it
            features, labels = encoder_features(loaded.encoder, probe_data)
            heads[spec.name] = fit_linear_probe(features, labels, spec.num_classes)
        save_state_dict(path, {"head": heads[spec.name]}, metadata={"task": spec.name, "kind": "linear_probe"})
    return heads
