"""open_clip models: loading, the embedded tiny CLIP, zero-shot heads, the classifier function."""

from mima.models.classifier import classify
from mima.models.clip import LoadedClip, load_clip

__all__ = ["LoadedClip", "classify", "load_clip"]
