"""Truncated SVD, the one low-rank tool that CART, CART-Indexing, TSV and the rank analyses share.

The SVD runs on the device its matrix is on. A singular pair (u_i, v_i) is defined only up to a
common sign, which LAPACK (CPU) and cuSOLVER (GPU) choose differently. Every user pairs each u_i with
its own v_i (U S V^T, low-rank approximations, polar factors, and what TSV and Iso-C build from
them), which does not depend on it, so the vectors are taken as the library gives them and the CPU
results stay bit for bit what they were. CART-Indexing stores U_r S_r and V_r apart: its index files
from two devices may differ by the sign of a pair, the task models rebuilt from them do not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SVD:
    """matrix = u diag(s) vh (thin SVD in float32); singular values in descending order."""

    u: torch.Tensor
    s: torch.Tensor
    vh: torch.Tensor

    @property
    def full_rank(self) -> int:
        return int(self.s.numel())

    def factors(self, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(left, right) with left @ right the best rank-`rank` approximation; left = U_r diag(s_r)."""
        rank = min(rank, self.full_rank)
        return self.u[:, :rank] * self.s[:rank], self.vh[:rank]

    def low_rank(self, rank: int) -> torch.Tensor:
        """The best rank-`rank` approximation (Eckart-Young); zeros for rank 0."""
        if rank <= 0:
            return torch.zeros(self.u.shape[0], self.vh.shape[1], dtype=self.u.dtype, device=self.u.device)
        left, right = self.factors(rank)
        return left @ right


def svd(matrix: torch.Tensor) -> SVD:
    """Thin SVD of a 2-D tensor, computed in float32 on its device."""
    u, s, vh = torch.linalg.svd(matrix.float(), full_matrices=False)
    return SVD(u, s, vh)


def low_rank(matrix: torch.Tensor, rank: int) -> torch.Tensor:
    """The best rank-`rank` approximation of a 2-D tensor, in float32."""
    if rank <= 0:
        return torch.zeros_like(matrix, dtype=torch.float32)
    return svd(matrix).low_rank(rank)


def polar_factor(matrix: torch.Tensor) -> torch.Tensor:
    """The orthogonal factor U Vh of the polar decomposition (the nearest semi-orthogonal matrix)."""
    decomposition = svd(matrix)
    return decomposition.u @ decomposition.vh
