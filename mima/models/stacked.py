"""Several task models of one encoder stepped as one model (the core of `model.batch_tasks`).

A process that holds L tasks trains them one after another today, each at its own batch size, on a
GPU with room for all of them at once. Stacked, the L task models are one set of parameters with a
leading task dimension ([L, *shape] per tensor), and one forward pass maps a batch per task
([L, B, 3, S, S]) to features per task ([L, B, D]) through `torch.func.vmap` over
`torch.func.functional_call` of the encoder's code: one launch sequence for L models instead of L.

Why this equals training the tasks one after another:
  - the loss is the sum of the tasks' losses, and task t's loss depends only on slice t of every
    stacked tensor, so the gradient of slice t is task t's own gradient;
  - AdamW updates element by element, so one AdamW over the stacked tensors is L AdamWs over the
    slices, as long as every task has the same learning rate and step count at each step (equal
    phase lengths per task: what `model.batch_tasks` requires);
  - gradient clipping is per task (`clip_per_task`): the norm of each slice's gradients, not of
    all tasks together.
What differs is rounding: batched matrix products sum in another order than L separate ones, so
the task models agree within a tolerance, not bit for bit (tests/models/test_stacked_encoder.py).

The encoder's own module is kept on the meta device as the code to call (its tensors take no
memory); buffers (frozen BatchNorm statistics, fixed masks) are shared by every task, not
stacked. Attention runs on torch's math kernel under vmap: the memory-efficient kernel's backward
fails under vmap on an H200 ("LSE is not correctly aligned").
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

import torch
from torch import nn
from torch.func import functional_call, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel

from mima.core.errors import MimaError

StateDict = dict[str, torch.Tensor]
# the scaled-dot-product-attention kernels that run under vmap, forward and backward
VMAP_ATTENTION = [SDPBackend.MATH]


class StackedEncoder(nn.Module):
    """L copies of `encoder`'s trainable parameters, stacked; `forward` takes one batch per copy."""

    def __init__(self, encoder: nn.Module, copies: int) -> None:
        super().__init__()
        if copies < 1:
            raise ValueError(f"a stack needs at least one copy, got {copies}")
        frozen = [name for name, param in encoder.named_parameters() if not param.requires_grad]
        if frozen:
            raise MimaError(f"model.batch_tasks: the encoder has frozen parameters ({frozen[0]}, ...), which a stack "
                            "of task models cannot share; leave model.batch_tasks false")
        self.copies = copies
        self.names = [name for name, _ in encoder.named_parameters()]
        # the stacked parameters, registered under names without dots (a ParameterDict key may not hold one)
        self.stacked = nn.ParameterDict({
            _key(name): nn.Parameter(param.detach().unsqueeze(0).repeat(copies, *([1] * param.dim())).contiguous())
            for name, param in encoder.named_parameters()
        })
        self.buffer_names = [name for name, _ in encoder.named_buffers()]
        for name, buffer in encoder.named_buffers():  # read by every copy, not trained; moved with the stack
            self.register_buffer(_key(name), buffer, persistent=False)
        self.code = [copy.deepcopy(encoder).to("meta")]  # in a list: the code to call, not a submodule

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Features [L, B, ...] of images [L, B, 3, S, S]: copy t's weights on images[t]."""
        if images.shape[0] != self.copies:
            raise ValueError(f"a batch per copy: expected {self.copies} batches, got {images.shape[0]}")
        code = self.code[0]
        code.train(self.training)
        shared = {name: getattr(self, _key(name)) for name in self.buffer_names}

        def one(weights: StateDict, batch: torch.Tensor) -> torch.Tensor:
            return functional_call(code, (weights, shared), (batch,), strict=True)

        weights = {name: self.stacked[_key(name)] for name in self.names}
        with sdpa_kernel(VMAP_ATTENTION):
            return vmap(one, in_dims=(0, 0), randomness="error")(weights, images)

    # ------------------------------------------------------------------------ the copies' weights
    def copy_state(self, index: int) -> StateDict:
        """Copy `index`'s parameters, as the encoder's state_dict names them (views, no copies)."""
        return {name: self.stacked[_key(name)][index] for name in self.names}

    @torch.no_grad()
    def load_copy(self, index: int, state: Mapping[str, torch.Tensor]) -> None:
        """Copy `state` (an encoder state dict; its buffers are ignored) into copy `index`, in place."""
        for name in self.names:
            self.stacked[_key(name)][index].copy_(state[name])

    @torch.no_grad()
    def load_every_copy(self, state: Mapping[str, torch.Tensor]) -> None:
        """Every copy starts from `state` (a phase's start point), in place."""
        for name in self.names:
            self.stacked[_key(name)].copy_(state[name].unsqueeze(0).expand_as(self.stacked[_key(name)]))


def _key(name: str) -> str:
    return name.replace(".", "/")


def per_task_norms(stacked: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of each copy's gradients over every stacked tensor: [L] (float32 or wider), as
    torch.nn.utils.get_total_norm would give for each copy's gradients alone (the norm of the
    per-tensor norms)."""
    grads = [param.grad for param in stacked if param.grad is not None]
    if not grads:
        raise ValueError("no gradients to measure")
    per_tensor = torch.stack([grad.flatten(1).norm(dim=1) for grad in grads], dim=1)  # [L, tensors]
    return per_tensor.norm(dim=1)


@torch.no_grad()
def clip_per_task(stacked: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Clip each copy's gradients to total norm `max_norm`, as torch.nn.utils.clip_grad_norm_ clips one
    model's (coefficient max_norm / (norm + 1e-6), at most 1); returns the norms before clipping."""
    norms = per_task_norms(stacked)
    coefficients = (max_norm / (norms + 1e-6)).clamp(max=1.0)
    for param in stacked:
        if param.grad is not None:
            param.grad.mul_(coefficients.to(param.grad.dtype).view(-1, *([1] * (param.grad.dim() - 1))))
    return norms
