"""The model card (README.md) of an exported open_clip model: how it was made (the command), what from
(the run or config, the image-encoder file, the CLIP its text tower is), the merge and its
hyperparameters when it is one, the evaluation table when there is one, and how to load and publish it.

The card is Markdown with the Hugging Face hub's YAML header (library_name: open_clip), so that the
hub shows it and offers open_clip's loading snippet once the folder is uploaded (`hf upload`).
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class CardFacts:
    """What the card says; every field but the first four is optional (a section per field given)."""

    title: str
    command: Sequence[str]  # the mima command line that wrote the folder
    config: str  # the run folder or `mima fit` config that gave the text tower and the tasks
    encoder: str  # the image encoder: the merged or fine-tuned file, or what the merge wrote
    clip: str = ""  # model.clip of the run
    pretrained: str | None = None  # model.pretrained of the run
    quick_gelu: bool = False
    merge: Mapping[str, object] = field(default_factory=dict)  # the merged file's metadata (method, hparams, ...)
    test_accuracy: Mapping[str, float] = field(default_factory=dict)  # task -> accuracy in [0, 1], "mean" included
    selected_on: str | None = None  # "val" when the hyperparameters were chosen on the validation splits


def header() -> list[str]:
    return ["---", "library_name: open_clip", "tags:", "- clip", "- zero-shot-image-classification",
            "- model-merging", "- mima", "---", ""]


def source_section(facts: CardFacts) -> list[str]:
    pretrained = f" (`model.pretrained`: `{facts.pretrained}`)" if facts.pretrained else ""
    activation = "QuickGELU" if facts.quick_gelu else "GELU"
    return ["## Source", "",
            f"- Image tower: `{facts.encoder}`",
            f"- Text tower and logit scale: the run's CLIP, `{facts.clip}`{pretrained}, from `{facts.config}`",
            f"- MLP activation: {activation} (recorded in open_clip_config.json as `quick_gelu: "
            f"{str(facts.quick_gelu).lower()}`)", ""]


def merge_section(merge: Mapping[str, object], selected_on: str | None) -> list[str]:
    if not merge.get("method"):
        return []
    lines = ["## Merge", "", f"- Method: `{merge['method']}`",
             f"- Hyperparameters: `{json.dumps(merge.get('hparams') or {}, sort_keys=True)}`"
             + (f" (chosen on the {selected_on} splits)" if selected_on else "")]
    models = merge.get("models") or []
    if isinstance(models, Sequence) and not isinstance(models, str):
        lines += ["- Task models:"] + [f"  - `{model}`" for model in models]
    if merge.get("base"):
        lines.append(f"- theta_0 (base): `{merge['base']}`")
    return lines + [""]


def evaluation_section(accuracy: Mapping[str, float]) -> list[str]:
    if not accuracy:
        return []
    lines = ["## Evaluation", "", "Zero-shot accuracy on each task's test split (heads from this model's text tower).", "",
             "| task | test accuracy (%) |", "|---|---|"]
    return lines + [f"| {task} | {100 * float(value):.1f} |" for task, value in accuracy.items()] + [""]


def usage_section(folder: Path) -> list[str]:
    return ["## Use", "", "```python", "import open_clip", "",
            f'model, _, preprocess = open_clip.create_model_and_transforms("local-dir:{folder}")',
            f'tokenizer = open_clip.get_tokenizer("local-dir:{folder}")',
            "```", "",
            "After `hf upload USER/REPO` of this folder, load it with `hf-hub:USER/REPO` in place of `local-dir:...`.", ""]


def model_card(facts: CardFacts, folder: Path) -> str:
    """The README.md text of the exported folder `folder`."""
    lines = header() + [f"# {facts.title}", "",
                        "A full open_clip CLIP written by mima: the image tower below, with the text tower and "
                        "logit scale of the CLIP it was trained from.", "",
                        "## Recipe", "", "```bash", shlex.join(str(part) for part in facts.command), "```", ""]
    lines += source_section(facts) + merge_section(facts.merge, facts.selected_on)
    lines += evaluation_section(facts.test_accuracy) + usage_section(folder)
    return "\n".join(lines)
