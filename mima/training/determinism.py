"""`trainer.deterministic: true` on CUDA, made to mean what it says.

Lightning turns on `torch.use_deterministic_algorithms` and sets CUBLAS_WORKSPACE_CONFIG when the
Trainer is built. Two things are left:
  * cuBLAS reads CUBLAS_WORKSPACE_CONFIG when its first handle is made: anything that multiplies on
    the GPU before the Trainer exists would keep a non-deterministic workspace. `mima fit` sets it
    before any module or tensor is built, and its processes inherit it;
  * attention: PyTorch picks among flash, memory-efficient, cuDNN and math kernels for
    `scaled_dot_product_attention` (open_clip's ViT attention). mima keeps only the math kernel,
    plain matmuls and a softmax, deterministic under cuBLAS's fixed workspace; the fused kernels'
    backward passes accumulate in an order that may vary between runs.
An operation that still has no deterministic implementation fails in torch with a RuntimeError;
`deterministic_refusal` turns it into one line naming the operation and the option.
"""

from __future__ import annotations

import os
import re

import torch

from mima.core.errors import MimaError

CUBLAS_WORKSPACE = ":4096:8"  # cuBLAS's documented setting for reproducible results (Lightning's too)


def prepare_deterministic(deterministic: object, on_gpu: bool) -> str | None:
    """Make `trainer.deterministic: true` hold on a GPU (module docstring); call before any CUDA
    work. Returns what it changed, for the log (None: nothing to do)."""
    if deterministic is not True or not on_gpu:
        return None
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    torch.backends.cuda.enable_cudnn_sdp(False)
    torch.backends.cuda.enable_math_sdp(True)
    return (f"trainer.deterministic: cuBLAS workspace {os.environ['CUBLAS_WORKSPACE_CONFIG']}, attention on the math "
            "kernel only (the flash, memory-efficient and cuDNN kernels are off)")


# torch: "<op> does not have a deterministic implementation, but you set 'torch.use_deterministic_algorithms(True)'"
_NO_DETERMINISTIC_OP = re.compile(r"^(?P<op>.+?) does not have a deterministic implementation")


def deterministic_refusal(error: BaseException) -> MimaError | None:
    """The one-line refusal for torch's error about an operation without a deterministic
    implementation, None for any other error."""
    if not isinstance(error, RuntimeError):
        return None
    found = _NO_DETERMINISTIC_OP.search(str(error).strip().splitlines()[0] if str(error).strip() else "")
    if found is None:
        return None
    return MimaError(f"trainer.deterministic: {found.group('op').strip()} has no deterministic implementation on this "
                     "device; set trainer.deterministic to warn (run on, with a warning) or false")
