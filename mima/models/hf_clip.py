"""Hugging Face `transformers` CLIP vision towers <-> open_clip image encoders, by renaming tensors.

A `transformers` CLIPVisionModelWithProjection (or the vision half of a CLIPModel, or a
CLIPVisionModel, which has no projection) and open_clip's `VisionTransformer` (`model.visual`) are
the same network, OpenAI's CLIP ViT (Radford et al. 2021, https://arxiv.org/abs/2103.00020):
pre-norm residual blocks, a class token read out after a final LayerNorm, then a linear projection.
Only the names and three layouts differ, so the conversion is a pure key mapping; it reads no
code and needs neither `transformers` nor a model object:

    open_clip (model.visual)                    transformers (vision_model. ...)
    class_embedding                             embeddings.class_embedding
    positional_embedding                        embeddings.position_embedding.weight
    conv1.weight                                embeddings.patch_embedding.weight
    ln_pre.{weight,bias}                        pre_layrnorm.{weight,bias}   (sic: "layrnorm")
    transformer.resblocks.i.ln_1                encoder.layers.i.layer_norm1
    transformer.resblocks.i.attn.in_proj_weight encoder.layers.i.self_attn.{q,k,v}_proj.weight, stacked
    transformer.resblocks.i.attn.in_proj_bias   encoder.layers.i.self_attn.{q,k,v}_proj.bias, stacked
    transformer.resblocks.i.attn.out_proj       encoder.layers.i.self_attn.out_proj
    transformer.resblocks.i.ln_2                encoder.layers.i.layer_norm2
    transformer.resblocks.i.mlp.c_fc            encoder.layers.i.mlp.fc1
    transformer.resblocks.i.mlp.c_proj          encoder.layers.i.mlp.fc2
    ln_post                                     post_layernorm
    proj  (width x embed_dim)                   visual_projection.weight (embed_dim x width), transposed

The fused `in_proj_*` of torch's MultiheadAttention stacks the query, key and value rows in that
order. Reference: transformers' `models/clip/convert_clip_original_pytorch_to_hf.py` (OpenAI ->
HF, the same table) and open_clip's `VisionTransformer`; this module is written from that table,
not copied. Differences from the reference script: it goes both ways, checks every shape against
one inferred geometry (a wrong or truncated file is one MimaError line naming the key), and never
builds a model. Every tensor is moved as is (same dtype, no arithmetic), so a round trip
open_clip -> HF -> open_clip gives back the same bits.

What the weights do not say: the number of attention heads and the activation. HF keeps them in
config.json (`num_attention_heads`, `hidden_act`); open_clip in the architecture's config
(`head_width`, `quick_gelu`). OpenAI's CLIP weights, and the task models FusionBench fine-tuned from
them, use QuickGELU: build the open_clip model with `force_quick_gelu=True` (mima's `load_clip`
does so for the `openai` tag).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass

import torch

from mima.core.errors import MimaError

StateDict = dict[str, torch.Tensor]

HF_PROJECTION = "visual_projection.weight"
HF_CLASS_EMBEDDING = "embeddings.class_embedding"
# Tensors of a CLIPModel checkpoint outside the image tower, and buffers that carry no weights.
HF_IGNORED_PREFIXES = ("text_model.", "text_projection.", "logit_scale")
HF_IGNORED_SUFFIXES = ("embeddings.position_ids",)  # a persistent buffer in transformers < 4.31: arange, not a weight
ACTIVATIONS = ("quick_gelu", "gelu")
# The architectures tried, in this order, when none is named (OpenAI's CLIP ViTs, those of FusionBench).
KNOWN_ARCHITECTURES = ("ViT-B-32", "ViT-B-16", "ViT-L-14", "ViT-L-14-336")
# open_clip vision_cfg keys that leave the plain CLIP ViT (the layout mapped here) unchanged.
PLAIN_VISION_KEYS = {"image_size", "layers", "width", "patch_size", "head_width", "mlp_ratio", "patch_dropout"}
LAYER_NORM_EPS = 1e-5  # open_clip's ViT LayerNorm (torch's default); HF CLIP's default too

# open_clip name inside a block -> HF name inside a layer, for the tensors moved unchanged
BLOCK_RENAMES = {
    "ln_1.weight": "layer_norm1.weight", "ln_1.bias": "layer_norm1.bias",
    "attn.out_proj.weight": "self_attn.out_proj.weight", "attn.out_proj.bias": "self_attn.out_proj.bias",
    "ln_2.weight": "layer_norm2.weight", "ln_2.bias": "layer_norm2.bias",
    "mlp.c_fc.weight": "mlp.fc1.weight", "mlp.c_fc.bias": "mlp.fc1.bias",
    "mlp.c_proj.weight": "mlp.fc2.weight", "mlp.c_proj.bias": "mlp.fc2.bias",
}
TOP_RENAMES = {
    "class_embedding": "embeddings.class_embedding",
    "positional_embedding": "embeddings.position_embedding.weight",
    "conv1.weight": "embeddings.patch_embedding.weight",
    "ln_pre.weight": "pre_layrnorm.weight", "ln_pre.bias": "pre_layrnorm.bias",
    "ln_post.weight": "post_layernorm.weight", "ln_post.bias": "post_layernorm.bias",
}
QKV = ("q_proj", "k_proj", "v_proj")  # the row order of MultiheadAttention's in_proj


@dataclass(frozen=True)
class VisionGeometry:
    """Everything the tensor shapes of a CLIP ViT depend on. `embed_dim` is None for a tower without
    a projection (a CLIPVisionModel); `heads` is None where only the weights were seen."""

    width: int
    layers: int
    patch_size: int
    image_size: int
    mlp_width: int
    embed_dim: int | None
    heads: int | None = None

    def describe(self) -> str:
        projection = f"projection {self.embed_dim}" if self.embed_dim is not None else "no projection"
        heads = f", {self.heads} heads" if self.heads is not None else ""
        return (f"width {self.width}, {self.layers} layers{heads}, patch {self.patch_size}, image {self.image_size}, "
                f"MLP {self.mlp_width}, {projection}")

    def same_weights_as(self, other: "VisionGeometry") -> bool:
        """Whether the two towers have the same tensors (heads compared only when both are known)."""
        mine, theirs = asdict(self), asdict(other)
        for optional in ("heads", "embed_dim"):
            if mine[optional] is None or theirs[optional] is None:
                del mine[optional]
                del theirs[optional]
        return mine == theirs


# ------------------------------------------------------------------------------ shapes
def open_clip_shapes(geometry: VisionGeometry) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor of open_clip's `model.visual.state_dict()` for this geometry."""
    w, grid = geometry.width, geometry.image_size // geometry.patch_size
    shapes: dict[str, tuple[int, ...]] = {
        "class_embedding": (w,),
        "positional_embedding": (grid * grid + 1, w),
        "conv1.weight": (w, 3, geometry.patch_size, geometry.patch_size),
        "ln_pre.weight": (w,), "ln_pre.bias": (w,),
    }
    for i in range(geometry.layers):
        block = f"transformer.resblocks.{i}."
        shapes.update({
            block + "ln_1.weight": (w,), block + "ln_1.bias": (w,),
            block + "attn.in_proj_weight": (3 * w, w), block + "attn.in_proj_bias": (3 * w,),
            block + "attn.out_proj.weight": (w, w), block + "attn.out_proj.bias": (w,),
            block + "ln_2.weight": (w,), block + "ln_2.bias": (w,),
            block + "mlp.c_fc.weight": (geometry.mlp_width, w), block + "mlp.c_fc.bias": (geometry.mlp_width,),
            block + "mlp.c_proj.weight": (w, geometry.mlp_width), block + "mlp.c_proj.bias": (w,),
        })
    shapes.update({"ln_post.weight": (w,), "ln_post.bias": (w,)})
    if geometry.embed_dim is not None:
        shapes["proj"] = (w, geometry.embed_dim)
    return shapes


def hf_shapes(geometry: VisionGeometry, prefix: str = "vision_model.") -> dict[str, tuple[int, ...]]:
    """The shape of every tensor of the HF vision tower (keys under `prefix`, and the projection)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for key, shape in open_clip_shapes(geometry).items():
        if key == "proj":
            shapes[HF_PROJECTION] = (shape[1], shape[0])
        elif key.endswith("attn.in_proj_weight") or key.endswith("attn.in_proj_bias"):
            layer, kind = _block_index(key), key.rsplit("_", 1)[1]  # "weight" or "bias"
            for name in QKV:
                shapes[f"{prefix}encoder.layers.{layer}.self_attn.{name}.{kind}"] = (shape[0] // 3, *shape[1:])
        else:
            shapes[prefix + _hf_name(key)] = shape
    return shapes


def _block_index(open_clip_key: str) -> int:
    return int(open_clip_key.split(".")[2])


def _hf_name(open_clip_key: str) -> str:
    """The HF name (without the vision_model. prefix) of an open_clip key moved unchanged."""
    if open_clip_key in TOP_RENAMES:
        return TOP_RENAMES[open_clip_key]
    layer, rest = _block_index(open_clip_key), open_clip_key.split(".", 3)[3]
    return f"encoder.layers.{layer}.{BLOCK_RENAMES[rest]}"


def _check_shapes(state: Mapping[str, torch.Tensor], expected: Mapping[str, tuple[int, ...]], source: str,
                  geometry: VisionGeometry, ignored: Collection[str] = ()) -> None:
    """One line naming the first missing, unexpected or misshapen tensor."""
    for key, shape in expected.items():
        if key not in state:
            raise MimaError(f"{source}: has no tensor '{key}' (expected a CLIP ViT with {geometry.describe()})")
        if tuple(state[key].shape) != shape:
            raise MimaError(f"{source}: '{key}' has shape {tuple(state[key].shape)}, expected {shape} "
                            f"(a CLIP ViT with {geometry.describe()})")
        if not state[key].is_floating_point():
            raise MimaError(f"{source}: '{key}' holds {state[key].dtype}, expected floating-point weights")
    unexpected = sorted(set(state) - set(expected) - set(ignored))
    if unexpected:
        raise MimaError(f"{source}: unexpected tensor '{unexpected[0]}' ({len(unexpected)} unexpected in all); "
                        "not the plain CLIP ViT image tower this converter maps")


# -------------------------------------------------------------------- geometry from weights
def _integer_grid(positions: int, key: str, source: str) -> int:
    grid = math.isqrt(max(positions - 1, 0))
    if positions < 2 or grid * grid != positions - 1:
        raise MimaError(f"{source}: '{key}' has {positions} positions, expected a square grid of patches plus one class token")
    return grid


def _layer_count(keys, marker: str, source: str) -> int:
    """How many blocks the keys hold: indices after `marker` must run 0 .. L-1."""
    indices = {int(key[len(marker):].split(".", 1)[0]) for key in keys
               if key.startswith(marker) and key[len(marker):].split(".", 1)[0].isdigit()}
    if not indices:
        raise MimaError(f"{source}: has no '{marker}0.*' tensors (no transformer blocks)")
    missing = sorted(set(range(max(indices) + 1)) - indices)
    if missing:
        raise MimaError(f"{source}: has no '{marker}{missing[0]}.*' tensors but has block {max(indices)} (blocks missing)")
    return max(indices) + 1


def _require(state: Mapping[str, torch.Tensor], key: str, source: str, rank: int) -> torch.Tensor:
    if key not in state:
        raise MimaError(f"{source}: has no tensor '{key}'")
    tensor = state[key]
    if tensor.dim() != rank:
        raise MimaError(f"{source}: '{key}' has shape {tuple(tensor.shape)}, expected {rank} dimensions")
    return tensor


def hf_prefix(state: Mapping[str, torch.Tensor], source: str) -> str:
    """Where the vision tower's keys start: 'vision_model.' (CLIPModel, CLIPVisionModelWithProjection,
    and CLIPVisionModel as transformers 4 saves it) or '' (CLIPVisionModel as transformers 5 saves it)."""
    found = [key[: -len(HF_CLASS_EMBEDDING)] for key in state if key.endswith(HF_CLASS_EMBEDDING)]
    found = [prefix for prefix in found if prefix in ("", "vision_model.")]
    if len(found) > 1:
        raise MimaError(f"{source}: holds two vision towers (keys with and without the vision_model. prefix)")
    if not found:
        if "class_embedding" in state or "visual.class_embedding" in state:
            raise MimaError(f"{source}: is an open_clip state dict, not a transformers CLIP checkpoint "
                            "(convert it with --to hf-clip, or use it as it is)")
        raise MimaError(f"{source}: has no 'vision_model.{HF_CLASS_EMBEDDING}' "
                        "(expected a transformers CLIPModel, CLIPVisionModelWithProjection or CLIPVisionModel checkpoint)")
    return found[0]


def hf_geometry(state: Mapping[str, torch.Tensor], source: str, prefix: str | None = None) -> VisionGeometry:
    """The geometry of an HF CLIP vision tower, read from its tensors (heads unknown)."""
    prefix = hf_prefix(state, source) if prefix is None else prefix
    width = _require(state, prefix + HF_CLASS_EMBEDDING, source, 1).shape[0]
    patch = _require(state, prefix + "embeddings.patch_embedding.weight", source, 4).shape[-1]
    positions_key = prefix + "embeddings.position_embedding.weight"
    grid = _integer_grid(_require(state, positions_key, source, 2).shape[0], positions_key, source)
    layers = _layer_count(state, prefix + "encoder.layers.", source)
    mlp = _require(state, prefix + "encoder.layers.0.mlp.fc1.weight", source, 2).shape[0]
    embed = _require(state, HF_PROJECTION, source, 2).shape[0] if HF_PROJECTION in state else None
    return VisionGeometry(width=width, layers=layers, patch_size=patch, image_size=grid * patch, mlp_width=mlp, embed_dim=embed)


def open_clip_geometry(state: Mapping[str, torch.Tensor], source: str) -> VisionGeometry:
    """The geometry of an open_clip ViT image tower, read from its tensors (heads unknown)."""
    if "class_embedding" not in state and any(key.endswith(HF_CLASS_EMBEDDING) for key in state):
        raise MimaError(f"{source}: is a transformers CLIP checkpoint, not an open_clip state dict (convert it with --from hf-clip)")
    width = _require(state, "class_embedding", source, 1).shape[0]
    patch = _require(state, "conv1.weight", source, 4).shape[-1]
    grid = _integer_grid(_require(state, "positional_embedding", source, 2).shape[0], "positional_embedding", source)
    layers = _layer_count(state, "transformer.resblocks.", source)
    mlp = _require(state, "transformer.resblocks.0.mlp.c_fc.weight", source, 2).shape[0]
    embed = _require(state, "proj", source, 2).shape[1] if "proj" in state else None
    return VisionGeometry(width=width, layers=layers, patch_size=patch, image_size=grid * patch, mlp_width=mlp, embed_dim=embed)


# ----------------------------------------------------------------------------- mapping
def hf_to_open_clip(state: Mapping[str, torch.Tensor], source: str, projection: torch.Tensor | None = None) -> StateDict:
    """open_clip's `model.visual.state_dict()` from an HF CLIP checkpoint's tensors.

    `projection` (open_clip layout, width x embed_dim) supplies `proj` for a tower saved without
    one (a CLIPVisionModel, as FusionBench's task models are); it must then come from the model
    they were fine-tuned from. The text tower of a CLIPModel checkpoint is left out."""
    prefix = hf_prefix(state, source)
    geometry = hf_geometry(state, source, prefix)
    if HF_PROJECTION in state and projection is not None:
        raise MimaError(f"{source}: has its own '{HF_PROJECTION}'; a projection from elsewhere is not needed")
    ignored = {key for key in state if key.startswith(HF_IGNORED_PREFIXES) or key.endswith(HF_IGNORED_SUFFIXES)}
    _check_shapes(state, hf_shapes(geometry, prefix), source, geometry, ignored)
    converted: StateDict = {}
    for key in open_clip_shapes(geometry):
        if key == "proj":
            converted[key] = state[HF_PROJECTION].t().contiguous()
        elif key.endswith(("attn.in_proj_weight", "attn.in_proj_bias")):
            layer, kind = _block_index(key), key.rsplit("_", 1)[1]
            parts = [state[f"{prefix}encoder.layers.{layer}.self_attn.{name}.{kind}"] for name in QKV]
            converted[key] = torch.cat(parts, dim=0)
        else:
            converted[key] = state[prefix + _hf_name(key)].contiguous()
    if projection is not None:
        if tuple(projection.shape[:1]) != (geometry.width,) or projection.dim() != 2:
            raise MimaError(f"the projection given for {source} has shape {tuple(projection.shape)}, expected "
                            f"({geometry.width}, embed_dim) for a tower of width {geometry.width}")
        converted["proj"] = projection.contiguous()
    if "proj" not in converted:
        raise MimaError(f"{source}: has no '{HF_PROJECTION}' (a CLIPVisionModel, as FusionBench's task models are); "
                        "pass --projection-from the pretrained model it was fine-tuned from")
    return converted


def open_clip_to_hf(state: Mapping[str, torch.Tensor], source: str) -> StateDict:
    """An HF CLIPVisionModelWithProjection state dict (vision_model.* and visual_projection.weight)
    from open_clip's `model.visual.state_dict()`; the exact inverse of `hf_to_open_clip`."""
    geometry = open_clip_geometry(state, source)
    if geometry.embed_dim is None:
        raise MimaError(f"{source}: has no 'proj' (the image projection); a CLIPVisionModelWithProjection needs it")
    _check_shapes(state, open_clip_shapes(geometry), source, geometry)
    converted: StateDict = {}
    for key in open_clip_shapes(geometry):
        tensor = state[key]
        if key == "proj":
            converted[HF_PROJECTION] = tensor.t().contiguous()
        elif key.endswith(("attn.in_proj_weight", "attn.in_proj_bias")):
            layer, kind = _block_index(key), key.rsplit("_", 1)[1]
            for name, part in zip(QKV, tensor.chunk(3, dim=0)):
                converted[f"vision_model.encoder.layers.{layer}.self_attn.{name}.{kind}"] = part.contiguous()
        else:
            converted["vision_model." + _hf_name(key)] = tensor.contiguous()
    return converted


# ------------------------------------------------------------------------------ configs
@dataclass(frozen=True)
class HFVisionConfig:
    """What an HF config.json says about the vision tower (missing fields take CLIPVisionConfig's defaults)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    patch_size: int
    image_size: int
    projection_dim: int
    hidden_act: str
    layer_norm_eps: float
    num_channels: int


# transformers' CLIPVisionConfig defaults (the ViT-B/32 of openai/clip-vit-base-patch32)
HF_VISION_DEFAULTS = {
    "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
    "patch_size": 32, "image_size": 224, "projection_dim": 512, "hidden_act": "quick_gelu",
    "layer_norm_eps": 1e-5, "num_channels": 3,
}


def parse_hf_config(config: Mapping, source: str) -> HFVisionConfig:
    """The vision settings of a CLIPModel config (model_type 'clip': its vision_config, and the
    top-level projection_dim, which is what sizes visual_projection) or of a CLIPVisionConfig
    (model_type 'clip_vision_model')."""
    model_type = config.get("model_type")
    if model_type == "clip":
        vision_config = config.get("vision_config") or {}
        if not isinstance(vision_config, Mapping):
            raise MimaError(f"{source}: vision_config is a JSON {type(vision_config).__name__}, expected an object of settings")
        vision = dict(vision_config)
        vision["projection_dim"] = config.get("projection_dim", HF_VISION_DEFAULTS["projection_dim"])
    elif model_type == "clip_vision_model":
        vision = dict(config)
    else:
        raise MimaError(f"{source}: model_type is {model_type!r}, expected 'clip' or 'clip_vision_model' (a transformers CLIP)")
    values = {name: vision.get(name, default) for name, default in HF_VISION_DEFAULTS.items()}
    for name, value in values.items():
        expected_type = str if name == "hidden_act" else (int, float) if name == "layer_norm_eps" else int
        if not isinstance(value, expected_type) or isinstance(value, bool):
            raise MimaError(f"{source}: {name} is {value!r}, expected {'a string' if expected_type is str else 'a number'}")
    return HFVisionConfig(**values)


def check_hf_config(config: HFVisionConfig, geometry: VisionGeometry, source: str) -> VisionGeometry:
    """The geometry with its head count, after checking that config.json describes these weights
    and a tower open_clip can build. Returns `geometry` with `heads` set."""
    if config.hidden_act not in ACTIVATIONS:
        raise MimaError(f"{source}: hidden_act is '{config.hidden_act}'; open_clip's ViT has {' or '.join(ACTIVATIONS)} only")
    if not math.isclose(config.layer_norm_eps, LAYER_NORM_EPS, rel_tol=1e-9):
        raise MimaError(f"{source}: layer_norm_eps is {config.layer_norm_eps}; open_clip's ViT uses {LAYER_NORM_EPS}")
    declared = {
        "hidden_size": (config.hidden_size, geometry.width), "num_hidden_layers": (config.num_hidden_layers, geometry.layers),
        "patch_size": (config.patch_size, geometry.patch_size), "image_size": (config.image_size, geometry.image_size),
        "intermediate_size": (config.intermediate_size, geometry.mlp_width), "num_channels": (config.num_channels, 3),
    }
    if geometry.embed_dim is not None:
        declared["projection_dim"] = (config.projection_dim, geometry.embed_dim)
    for name, (said, found) in declared.items():
        if said != found:
            raise MimaError(f"{source}: {name} is {said} but the weights have {found} (config.json does not belong to these weights)")
    if config.num_attention_heads <= 0 or geometry.width % config.num_attention_heads:
        raise MimaError(f"{source}: num_attention_heads {config.num_attention_heads} does not divide hidden_size {geometry.width}")
    return VisionGeometry(**{**asdict(geometry), "heads": config.num_attention_heads})


def hf_config_dict(geometry: VisionGeometry, activation: str) -> dict:
    """config.json of a CLIPVisionModelWithProjection with this geometry (what save_pretrained writes,
    less the version fields)."""
    if geometry.heads is None or geometry.embed_dim is None:
        raise MimaError("an HF config needs the head count and the projection width")
    if activation not in ACTIVATIONS:
        raise MimaError(f"--activation: '{activation}', expected one of {', '.join(ACTIVATIONS)}")
    return {
        "architectures": ["CLIPVisionModelWithProjection"], "model_type": "clip_vision_model",
        "hidden_size": geometry.width, "intermediate_size": geometry.mlp_width,
        "num_hidden_layers": geometry.layers, "num_attention_heads": geometry.heads,
        "patch_size": geometry.patch_size, "image_size": geometry.image_size, "num_channels": 3,
        "projection_dim": geometry.embed_dim, "hidden_act": activation, "layer_norm_eps": LAYER_NORM_EPS,
        "attention_dropout": 0.0, "initializer_range": 0.02, "initializer_factor": 1.0, "dtype": "float32",
    }


@dataclass(frozen=True)
class OpenClipArchitecture:
    name: str
    geometry: VisionGeometry
    quick_gelu: bool  # the architecture's own setting (the `-quickgelu` variants); tags may ask for it too


def open_clip_architecture(name: str) -> OpenClipArchitecture:
    """The tower geometry of open_clip architecture `name`, from open_clip's model config; a
    one-line error for unknown names and for towers that are not the plain CLIP ViT."""
    import open_clip  # lazily: the mapping itself needs only torch

    config = open_clip.get_model_config(name)
    if config is None:
        raise MimaError(f"--arch: unknown open_clip architecture '{name}' (e.g. {', '.join(KNOWN_ARCHITECTURES)})")
    vision = dict(config.get("vision_cfg") or {})
    extra = sorted(set(vision) - PLAIN_VISION_KEYS)
    image_size, patch_size = vision.get("image_size", 224), vision.get("patch_size", 16)
    if extra:
        reason = f"it sets {', '.join(extra)}"
    elif not isinstance(vision.get("layers", 12), int) or not isinstance(vision.get("width"), int) or patch_size is None:
        reason = "a ResNet tower"
    elif not isinstance(image_size, int) or not isinstance(patch_size, int):
        reason = "non-square images or patches"
    else:
        reason = None
    if reason is not None:
        raise MimaError(f"--arch {name}: its image tower is not a plain CLIP ViT ({reason})")
    width = int(vision["width"])
    geometry = VisionGeometry(
        width=width, layers=int(vision.get("layers", 12)), patch_size=patch_size, image_size=image_size,
        mlp_width=int(width * vision.get("mlp_ratio", 4.0)), embed_dim=int(config["embed_dim"]),
        heads=width // int(vision.get("head_width", 64)),
    )
    return OpenClipArchitecture(name, geometry, bool(config.get("quick_gelu", False)))


def choose_architecture(geometry: VisionGeometry, source: str, name: str | None = None) -> OpenClipArchitecture:
    """Architecture `name` after checking it fits the weights, or else the first of
    KNOWN_ARCHITECTURES that does; one line naming the geometry when none fits."""
    candidates = [name] if name is not None else list(KNOWN_ARCHITECTURES)
    for candidate in candidates:
        architecture = open_clip_architecture(candidate)
        if architecture.geometry.same_weights_as(geometry):
            return architecture
    if name is not None:
        raise MimaError(f"--arch {name}: it has {architecture.geometry.describe()}, but {source} has {geometry.describe()}")
    raise MimaError(f"{source}: a ViT with {geometry.describe()} is none of {', '.join(KNOWN_ARCHITECTURES)}; "
                    "name its open_clip architecture with --arch")
