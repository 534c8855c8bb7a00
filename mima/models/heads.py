"""Zero-shot classification heads, built the CLIP way and cached as safetensors.

For each class, every prompt template is filled with the class name and encoded by the text
tower; the embeddings are L2-normalised, averaged, normalised again, and the stacked rows are
scaled by exp(logit_scale). The head is frozen during fine-tuning (paper 001, section 5).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from mima.models.clip import text_tower_fingerprint
from mima.safetensors_io import load_state_dict, save_state_dict


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
    head = zero_shot_head(model, tokenizer, classnames, templates)
    save_state_dict(path, {"head": head}, metadata={"task": task_name, "classnames": list(classnames)})
    return head
