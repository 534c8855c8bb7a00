"""What a model costs in bytes, measured without its weights: its tensors and its activations.

`measure_footprint` builds the configured CLIP on PyTorch's meta device (shapes and dtypes, no
storage, no pretrained file read, no embedded model pretrained), and runs one forward pass of the
image tower at two small batches under `torch.autograd.graph.saved_tensors_hooks`, adding up the bytes
of every tensor autograd keeps for the backward pass. The difference between the two batches is what
a training step holds per example, in the precision it runs in and with gradient checkpointing as
configured (`mima plan` scales it to the batch); the rest does not grow with the batch (the weights'
low-precision copies under mixed precision). Tensors saved twice as views of one storage are counted
twice (meta tensors have no addresses to tell them apart), so the figures err on the high side.
The same pass counts the forward FLOPs per example (torch.utils.flop_counter, from shapes alone),
from which the plan estimates step times.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import open_clip
import torch
from torch.utils.flop_counter import FlopCounterMode

from mima.core.errors import MimaError
from mima.core.bounded_json import read_json
from mima.models.clip import EMBEDDED_PREFIX, LOCAL_DIR_PREFIX

TRACE_BATCHES = (2, 4)  # the traced forward passes' batch sizes (per example: the difference over theirs)
# precision (Lightning's names) -> the dtype activations are kept in; weights stay float32 ("mixed")
ACTIVATION_DTYPES = {"bf16-mixed": torch.bfloat16, "bf16-true": torch.bfloat16, "bf16": torch.bfloat16,
                     "16-mixed": torch.float16, "16-true": torch.float16, "16": torch.float16}
SAFETENSORS_DTYPE_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64"}


@dataclass(frozen=True)
class ModelFootprint:
    """Bytes of one image encoder (the fine-tuned tower) and of its training activations."""

    source: str  # model.clip as configured
    parameters: int  # number of encoder parameters (all of them train)
    parameter_shapes: tuple[tuple[int, ...], ...]  # each trainable tensor's shape, in the optimiser's order
    parameter_bytes: int  # the trainable parameters' bytes (gradients and each AdamW moment: the same)
    state_bytes: int  # the encoder's state dict (parameters and buffers): a weights file's data
    file_bytes: int  # one .safetensors file of that state dict, header included
    model_bytes: int  # the whole CLIP (image and text towers) as loaded before the heads are built
    activation_bytes_per_example: int  # kept for the backward pass, per training example
    activation_fixed_bytes: int  # kept for the backward pass whatever the batch (e.g. weights cast to bf16)
    forward_flops_per_example: int  # of the image tower's forward pass (a training step: about three times that)
    image_size: int
    embed_dim: int


def model_config(clip: str, cache_dir: Path | None = None) -> dict:
    """The open_clip model config of `model.clip`, read without loading (or pretraining) weights."""
    if clip.startswith(EMBEDDED_PREFIX):
        from mima.models.embedded import EMBEDDED_MODELS

        name = clip[len(EMBEDDED_PREFIX):]
        if name not in EMBEDDED_MODELS:
            raise MimaError(f"model.clip: unknown embedded model '{clip}' (known: {', '.join(EMBEDDED_MODELS)})")
        recipe_of, _ = EMBEDDED_MODELS[name]
        return json.loads(json.dumps(recipe_of()["model_cfg"]))
    if clip.startswith(LOCAL_DIR_PREFIX):
        config_file = Path(clip[len(LOCAL_DIR_PREFIX):]) / "open_clip_config.json"
        if not config_file.is_file():
            raise MimaError(f"model.clip: {config_file.parent} has no open_clip_config.json (expected an open_clip model folder)")
        model_cfg = read_json(config_file).get("model_cfg")
        if not isinstance(model_cfg, dict):
            raise MimaError(f"model.clip: {config_file} has no model_cfg mapping (expected open_clip's folder layout)")
        return model_cfg
    config = open_clip.get_model_config(clip)
    if config is None:
        raise MimaError(f"model.clip: unknown open_clip architecture '{clip}' (use e.g. ViT-B-32, local-dir:PATH or "
                        "embedded:tiny-digits)")
    return config


def measure_footprint(clip: str, precision: str | None = "32-true", grad_checkpointing: bool = False) -> ModelFootprint:
    """The footprint of `model.clip` (see the module docstring); nothing is allocated or downloaded."""
    config = dict(model_config(clip))
    custom_text = bool(config.pop("custom_text", False))
    config = {key: value for key, value in config.items() if key in ("embed_dim", "vision_cfg", "text_cfg", "quick_gelu")}
    with torch.device("meta"):
        model = (open_clip.CustomTextCLIP if custom_text else open_clip.CLIP)(**config)
    encoder = model.visual
    state = encoder.state_dict()
    image_size = getattr(encoder, "image_size", 224)
    image_size = int(image_size[0] if isinstance(image_size, (tuple, list)) else image_size)
    sizes = dict(  # before the trace casts the tower to the activations' precision
        parameters=sum(p.numel() for p in encoder.parameters()),
        parameter_shapes=tuple(tuple(p.shape) for p in encoder.parameters()),
        parameter_bytes=sum(p.numel() * p.element_size() for p in encoder.parameters()),
        state_bytes=sum(t.numel() * t.element_size() for t in state.values()),
        file_bytes=safetensors_file_bytes(state),
        model_bytes=sum(t.numel() * t.element_size() for t in model.state_dict().values()),
    )
    flops = _forward_flops(encoder, image_size)
    per_example, fixed = _activation_bytes(encoder, image_size, precision, grad_checkpointing)
    return ModelFootprint(
        source=clip,
        **sizes,
        activation_bytes_per_example=per_example,
        activation_fixed_bytes=fixed,
        forward_flops_per_example=flops,
        image_size=image_size,
        embed_dim=int(config["embed_dim"]),
    )


def _forward_flops(encoder: torch.nn.Module, image_size: int) -> int:
    """FLOPs of one example's forward pass through the tower (meta tensors: shapes only), counted
    over a batch of two (BatchNorm in training mode needs more than one example)."""
    batch = TRACE_BATCHES[0]
    images = torch.empty(batch, 3, image_size, image_size, device="meta")
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        encoder(images)
    return int(counter.get_total_flops()) // batch


def _activation_bytes(encoder: torch.nn.Module, image_size: int, precision: str | None,
                      grad_checkpointing: bool) -> tuple[int, int]:
    """(bytes per example, bytes whatever the batch) autograd keeps in a training forward pass. With
    gradient checkpointing a checkpointed block keeps only its input, but the backward pass rebuilds
    one block's activations at a time: the largest block's share (the full figure over the number of
    blocks) is added."""
    dtype = ACTIVATION_DTYPES.get(str(precision), torch.float32)
    traced = encoder.to(dtype)
    traced.train()
    full = _per_example_and_fixed(traced, image_size, dtype)
    if not grad_checkpointing:
        return full
    try:
        traced.set_grad_checkpointing(True)
    except (AttributeError, NotImplementedError, AssertionError):
        raise MimaError("model.grad_checkpointing: this image tower has no gradient checkpointing switch") from None
    per_example, fixed = _per_example_and_fixed(traced, image_size, dtype)
    return per_example + full[0] // max(1, _block_count(traced)), fixed


def _per_example_and_fixed(encoder: torch.nn.Module, image_size: int, dtype: torch.dtype) -> tuple[int, int]:
    small, large = TRACE_BATCHES
    saved_small, saved_large = (_saved_bytes(encoder, image_size, dtype, batch) for batch in TRACE_BATCHES)
    per_example = (saved_large - saved_small) // (large - small)
    return per_example, max(0, saved_small - small * per_example)


def _saved_bytes(encoder: torch.nn.Module, image_size: int, dtype: torch.dtype, batch: int) -> int:
    saved: list[int] = []

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor.numel() * tensor.element_size())
        return tensor

    images = torch.empty(batch, 3, image_size, image_size, device="meta", dtype=dtype)
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        encoder(images)
    return sum(saved)


def _block_count(encoder: torch.nn.Module) -> int:
    """Residual blocks of a ViT tower (open_clip's Transformer.resblocks); 1 for other towers."""
    transformer = getattr(encoder, "transformer", None)
    blocks = getattr(transformer, "resblocks", None)
    return len(blocks) if blocks is not None else 1


def safetensors_file_bytes(state: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> int:
    """The size of a .safetensors file holding `state`: an 8-byte length, the JSON header (padded
    to a multiple of 8 bytes, as the format asks), then the tensors' bytes."""
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    # safetensors lays tensors out by decreasing alignment (dtype size), then by name
    for name, tensor in sorted(state.items(), key=lambda item: (-item[1].element_size(), item[0])):
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPE_NAMES.get(tensor.dtype, "F32"), "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":"))
    return 8 + len(text) + (-len(text)) % 8 + offset
