"""open_clip models: loading, the embedded tiny CLIP, zero-shot heads, the classifier wrapper."""

from mima.models.classifier import ZeroShotClassifier
from mima.models.clip import LoadedClip, load_clip

__all__ = ["LoadedClip", "ZeroShotClassifier", "load_clip"]
