"""Truncated SVD, the one low-rank tool that CART, CART-Indexing, TSV and the rank analyses share.

The SVD runs on the device its matrix is on. A singular pair (u_i, v_i) is defined only up to a
common sign, which LAPACK (CPU) and cuSOLVER (GPU) choose differently. Products that pair each u_i
with its own v_i (U S V^T, low-rank approximations, polar factors, and what TSV and Iso-C build from
them) do not depend on it, so they take the vectors as the library gives them (the CPU results stay
bit for bit what they were). A user of U or V alone asks for canonical signs (`canonical_signs=True`:
in each pair, the largest-magnitude entry of u_i is positive), which CART-Indexing's stored factors
need so that the CPU and a GPU write the same index.
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


def signs_fixed(u: torch.Tensor, vh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(u, vh) with each singular pair's signs fixed: the largest-magnitude entry of each column of u
    is positive (scikit-learn's svd_flip convention). Exact: a flip only negates."""
    if u.numel() == 0:
        return u, vh
    largest = u.abs().argmax(dim=0, keepdim=True)  # per column; the first such entry on a tie
    signs = torch.where(u.gather(0, largest) < 0, -1.0, 1.0).to(u.dtype)
    return u * signs, vh * signs.reshape(-1, 1)


def svd(matrix: torch.Tensor, canonical_signs: bool = False) -> SVD:
    """Thin SVD of a 2-D tensor, computed in float32 on its device; with `canonical_signs`, each
    singular pair's sign fixed as `signs_fixed` says (for users of U or V alone)."""
    u, s, vh = torch.linalg.svd(matrix.float(), full_matrices=False)
    if canonical_signs:
        u, vh = signs_fixed(u, vh)
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
