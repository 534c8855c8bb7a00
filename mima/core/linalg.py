"""The linear algebra of the merges: SVDs (truncated, polar factors) and linear solves, each with a
chain of fallbacks, so that a finite matrix is never given up on for a library's reason.

Every SVD, polar factor and solve of mima.merging (and the rank analyses) runs here. Each tries its
routes in order and returns the first that succeeds:

  SVD    LAPACK's default driver in the requested precision (float32 unless asked: the result of
         every well-behaved matrix, bit for bit what it always was) -> float64 -> float64 of the
         matrix divided by its largest entry (singular values scaled back: no overflow or underflow
         inside the library) -> another library (on the CPU numpy's LAPACK, not torch's MKL; on CUDA
         cuSOLVER's gesvd driver) -> float64 through a QR decomposition (the SVD of the triangular
         factor R, U = Q U_R: the same factors, a different iteration for the library to converge on)
  solve  LAPACK's solve in the requested precision -> float64 -> a ridge: (A + lam I) x = b + lam x0,
         lam = RIDGE * tr(A) / n (1 where tr(A) = 0), x0 the caller's prior (zero unless given):
         where A is singular (a direction the data never excite), x takes x0's value there

A matrix holding NaN or Inf is not handed to any route (LAPACK cannot take it and MKL prints lines
of its own for it); when every route fails, or the matrix is not finite, LinalgFailure says so in
one line, and the merge names the tensor (mima.merging.common.tensor_step). Each helper takes its
routes as a parameter, so a test can hand it a route that fails.

The SVD runs on the device its matrix is on. A singular pair (u_i, v_i) is defined only up to a
common sign, which LAPACK (CPU) and cuSOLVER (GPU) choose differently. Every user pairs each u_i with
its own v_i (U S V^T, low-rank approximations, polar factors, and what TSV and Iso-C build from
them), which does not depend on it, so the vectors are taken as the library gives them and the CPU
results stay bit for bit what they were. CART-Indexing stores U_r S_r and V_r apart: its index files
from two devices may differ by the sign of a pair, the task models rebuilt from them do not.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from mima.core.errors import MimaError

# The ridge of the last solve route, relative to the mean diagonal entry tr(A) / n: small enough to
# leave every direction the system determines as it was (to about 1e-8 relative, in float64), large
# enough to make a singular system solvable.
RIDGE = 1e-8

Factors = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (u, s, vh)
SvdRoute = Callable[[torch.Tensor], Factors]
SolveRoute = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


class LinalgFailure(MimaError):
    """A decomposition or solve that cannot give a finite answer, in one line: `step` names it ("SVD",
    "solve"), `finite` says whether its matrix was finite (when not, no route was tried), `reason`
    what went wrong. A merge adds the tensor's name (mima.merging.common.tensor_step)."""

    def __init__(self, step: str, finite: bool, reason: str) -> None:
        self.step, self.finite = step, finite
        super().__init__(reason)


def non_finite(step: str) -> LinalgFailure:
    return LinalgFailure(step, False, f"its {step} got NaN or Inf values")


def every_route_failed(step: str, reasons: Sequence[str]) -> LinalgFailure:
    return LinalgFailure(step, True, f"its {step} failed on every route tried ({'; '.join(reasons)})")


# ----------------------------------------------------------------------------- SVD routes
def lapack_svd(matrix: torch.Tensor) -> Factors:
    """torch.linalg.svd as it is: LAPACK's default driver (MKL's gesdd on the CPU), cuSOLVER's on CUDA."""
    return torch.linalg.svd(matrix, full_matrices=False)


def float64_svd(matrix: torch.Tensor) -> Factors:
    return lapack_svd(matrix.double())


def scaled_svd(matrix: torch.Tensor) -> Factors:
    """The SVD of matrix / max |entry| in float64, singular values scaled back: entries near
    float32's limit (1e38) no longer overflow the library's own norms."""
    scale = matrix.double().abs().amax()
    if scale == 0:
        return float64_svd(matrix)
    u, s, vh = float64_svd(matrix.double() / scale)
    return u, s * scale, vh


def other_library_svd(matrix: torch.Tensor) -> Factors:
    """Another implementation: cuSOLVER's gesvd driver on CUDA; numpy's LAPACK (not MKL) on the CPU."""
    if matrix.is_cuda:
        return torch.linalg.svd(matrix.double(), full_matrices=False, driver="gesvd")
    u, s, vh = np.linalg.svd(matrix.double().cpu().numpy(), full_matrices=False)
    return tuple(torch.from_numpy(np.ascontiguousarray(part)).to(matrix.device) for part in (u, s, vh))


def qr_svd(matrix: torch.Tensor) -> Factors:
    """The SVD through a QR decomposition of the tall orientation: A = Q R, R = U_R S V^T, U = Q U_R."""
    wide = matrix.shape[0] < matrix.shape[1]
    tall = matrix.double().mT if wide else matrix.double()
    q, r = torch.linalg.qr(tall)
    u_r, s, vh = lapack_svd(r)
    u = q @ u_r
    return (vh.mT, s, u.mT) if wide else (u, s, vh)


SVD_ROUTES: tuple[tuple[str, SvdRoute], ...] = (
    ("default driver", lapack_svd),
    ("float64", float64_svd),
    ("float64 scaled", scaled_svd),
    ("other library", other_library_svd),
    ("float64 via QR", qr_svd),
)


# ----------------------------------------------------------------------------- solve routes
def lapack_solve(system: torch.Tensor, rhs: torch.Tensor, prior: torch.Tensor | None) -> torch.Tensor:
    return torch.linalg.solve(system, rhs)


def float64_solve(system: torch.Tensor, rhs: torch.Tensor, prior: torch.Tensor | None) -> torch.Tensor:
    return torch.linalg.solve(system.double(), rhs.double())


def ridge_solve(system: torch.Tensor, rhs: torch.Tensor, prior: torch.Tensor | None) -> torch.Tensor:
    """(A + lam I) x = b + lam x0 in float64, lam = RIDGE * tr(A) / n, or 1 where tr(A) is 0 (then
    A x = b says nothing where A is zero, and x is x0 there)."""
    system, rhs = system.double(), rhs.double()
    size = system.shape[-1]
    trace = float(torch.diagonal(system).abs().sum())
    ridge = RIDGE * trace / size if trace > 0 else 1.0
    regularised = system + ridge * torch.eye(size, dtype=system.dtype, device=system.device)
    target = rhs if prior is None else rhs + ridge * prior.double()
    return torch.linalg.solve(regularised, target)


SOLVE_ROUTES: tuple[tuple[str, SolveRoute], ...] = (
    ("default", lapack_solve),
    ("float64", float64_solve),
    (f"float64 with a ridge of {RIDGE:g} tr(A)/n", ridge_solve),
)


# ----------------------------------------------------------------------------- the chains
def first_success(step: str, routes: Sequence[tuple[str, Callable]], *args) -> object:
    """The first route's result that is finite; LinalgFailure with every route's reason if none is."""
    reasons = []
    for name, route in routes:
        try:
            result = route(*args)
        except torch.linalg.LinAlgError as error:  # non-convergence, a singular matrix
            reasons.append(f"{name}: {first_line(error)}")
            continue
        parts = result if isinstance(result, tuple) else (result,)
        if all(is_finite(part) for part in parts):
            return result
        reasons.append(f"{name}: NaN or Inf in the result")
    raise every_route_failed(step, reasons)


def first_line(error: BaseException, limit: int = 120) -> str:
    line = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return line if len(line) <= limit else line[: limit - 3] + "..."


def is_finite(tensor: torch.Tensor) -> bool:
    """Whether every entry is finite; True on the meta device, whose tensors have shapes, no values
    (the device tests run strategies there to see where each tensor is made)."""
    return tensor.is_meta or bool(torch.isfinite(tensor).all())


def require_finite(matrix: torch.Tensor, step: str) -> None:
    """LinalgFailure (not finite) when `matrix` holds NaN or Inf: no route is tried on it."""
    if not is_finite(matrix):
        raise non_finite(step)


@dataclass(frozen=True)
class SVD:
    """matrix = u diag(s) vh (thin SVD, in the dtype asked: float32 by default); singular values in
    descending order."""

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


def decompose(matrix: torch.Tensor, dtype: torch.dtype = torch.float32,
              routes: Sequence[tuple[str, SvdRoute]] | None = None) -> Factors:
    """(u, s, vh) of the thin SVD of `matrix` in `dtype`, or where that fails by the next of `routes`
    (default SVD_ROUTES), as the route gives them (float64 after the first)."""
    prepared = matrix.to(dtype)
    require_finite(prepared, "SVD")
    return first_success("SVD", SVD_ROUTES if routes is None else routes, prepared)


def svd(matrix: torch.Tensor, dtype: torch.dtype = torch.float32,
        routes: Sequence[tuple[str, SvdRoute]] | None = None) -> SVD:
    """Thin SVD of a 2-D tensor on its device, computed in `dtype` (float32 by default) or, where that
    fails, by the next of `routes` (see the module docstring); the factors are returned in `dtype`.
    Singular values beyond `dtype`'s range (a float32 matrix of entries near 1e38) are a
    LinalgFailure: no product of these factors could be finite."""
    u, s, vh = decompose(matrix, dtype, routes)
    values = s.to(dtype)
    if not is_finite(values):
        name = str(dtype).removeprefix("torch.")
        raise LinalgFailure("SVD", True, f"its singular values exceed {name}'s range (the largest {float(s[0]):.3g}): "
                                         f"weights this large cannot be merged in {name}")
    return SVD(u.to(dtype), values, vh.to(dtype))


def low_rank(matrix: torch.Tensor, rank: int) -> torch.Tensor:
    """The best rank-`rank` approximation of a 2-D tensor, in float32."""
    if rank <= 0:
        return torch.zeros_like(matrix, dtype=torch.float32)
    return svd(matrix).low_rank(rank)


def polar_factor(matrix: torch.Tensor, routes: Sequence[tuple[str, SvdRoute]] | None = None) -> torch.Tensor:
    """The orthogonal factor U Vh of the polar decomposition (the nearest semi-orthogonal matrix), in
    float32 (its singular values, which it does not need, may lie beyond float32's range)."""
    u, _, vh = decompose(matrix, torch.float32, routes)
    return (u @ vh).float()


def solve(system: torch.Tensor, rhs: torch.Tensor, prior: torch.Tensor | None = None,
          routes: Sequence[tuple[str, SolveRoute]] | None = None) -> torch.Tensor:
    """x with system @ x = rhs (a square system; rhs a matrix or vector), in the dtype of `system`
    where its first route succeeds; else in float64 by the next of `routes` (default SOLVE_ROUTES),
    the last a ridge toward `prior` (zero unless given: see the module docstring). Returned in the
    dtype of `system`. Other `routes` may solve another system made of the same two (ACE's:
    x system = rhs, then the pseudo-inverse)."""
    require_finite(system, "solve")
    require_finite(rhs, "solve")
    return first_success("solve", SOLVE_ROUTES if routes is None else routes, system, rhs, prior).to(system.dtype)
