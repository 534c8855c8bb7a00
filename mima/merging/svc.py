"""SVC: Singular Value Calibration of another merge's matrices, a data-free post-processing step.

Li et al. 2026, "When Shared Knowledge Hurts: Spectral Over-Accumulation in Model Merging",
https://arxiv.org/abs/2602.05536, as the authors' code (lyymuwu/SVC, merge_func.py:
`coef_cal_multi_ranks`, `Align`, `layer_wise_Align`, run by main.py after the base merge) and
FusionBench's fusion_bench/method/singular_value_calibration/ (svc.py; generic.py runs any base
method first, as `inner_merge` does here).

Per 2-D tensor: tau_m = theta_inner - theta_0, the task vector of the inner merge (its own lam
included), with thin SVD tau_m = U diag(s) V^T, and the task vectors tau_t (t = 1 .. T). For every
singular direction r (all min(m, n) of them):

  a_r = u_r^T tau_m (= s_r v_r^T),  a_r^t = u_r^T tau_t        responses along u_r (paper eq. 4)
  c_r^t = <a_r, a_r^t> / max(||a_r^t||^2, 1e-12)              projection coefficient (eq. 8)
  s_r' = s_r / mean_t max(alpha, c_r^t)                        calibrated singular value

and theta = theta_0 + U diag(s') V^T. Where the tasks share a direction, a sum-like merge puts about
T times a task's response there (c_r^t ~ T) and the calibration divides the excess back out; alpha
floors the coefficients of tasks that barely respond. The basis is the merged matrix's U for both
responses, as the paper's eq. 4 (quoted in FusionBench's documentation) and the authors'
`coef_cal_multi_ranks`; the loop-form `subspace_consistency_spectral_calibration` of FusionBench's
utils.py projects each task on its own singular vectors instead (U from the SVD of tau_t), which pairs
the r-th direction of the merge with the r-th of each task and makes the coefficient's sign depend on
SVD sign conventions; that is not followed. Other tensors keep the inner merge's values; integer
tensors too.

Which tensors: 2-D tensors whose key contains neither `text_projection` nor `embedding` (the
authors' rule; FusionBench calibrates every 2-D parameter: `--matrix-keys '.*'`).

Hyperparameters:
  * `inner_merge` (default task_arithmetic) and `inner_hparams` ('' = the inner merge's defaults;
    e.g. 'lam=0.3' for the references' task arithmetic, 'base_merge=ties,lines_beta=0.8' for LiNeS).
    Any registered data-free merge that gives one model; data-dependent and per-task merges, and SVC
    itself, are refused in one line, as are names and values the inner merge does not take.
  * `svc_alpha` 0.1 (FusionBench's default; the authors' run.sh uses 1/T, and 1.0 after TSV-M).
    Neither reference searches it, so there is no grid: `--select-on val` scores the default.
Computed in float64: a task whose response along u_r is zero in exact arithmetic leaves float32
round-off of ~1e-7 in a_r^t, and its ratio to the 1e-12 floor would then be a huge coefficient.
Streams one key at a time when the inner merge does: the inner merge's tensor, the T task vectors of
it, one SVD.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import torch

from mima.core.errors import MimaError
from mima.core.linalg import svd
from mima.merging.catalogue import DEFAULT_SVC_MATRIX_KEYS
from mima.merging.common import is_matrix_key, tensor_step
from mima.merging.registry import (
    HYPERPARAMETERS,
    MERGE_METHODS,
    DataFreeMerge,
    MergeMethod,
    StreamingMerge,
    get_method,
    register,
)

# The authors' floor of ||a_r^t||^2 (clamp_min), so a task without response has coefficient 0.
FLOOR = 1e-12
Spell = Callable[[str], str]


def _plain(name: str) -> str:
    return name


# ------------------------------------------------------------------------- the inner merge
def eligible_inner_merges() -> list[str]:
    """The merges SVC can calibrate: data-free, one model, not SVC."""
    return sorted(name for name, method in MERGE_METHODS.items() if isinstance(method, DataFreeMerge) and name != "svc")


def inner_method(name: str, spell: Spell = _plain) -> DataFreeMerge:
    """The inner merge, refused in one line when SVC cannot run it."""
    method = get_method(name)
    why = ("is SVC itself" if name == "svc" else "needs task data" if method.needs_data
           else "keeps one model per task" if method.per_task else None)
    if why is not None:
        raise MimaError(f"merge method 'svc': {spell('inner_merge')} '{name}' {why}; SVC calibrates one data-free "
                        f"merge, one of: {', '.join(eligible_inner_merges())}")
    return method


def parse_inner_hparams(method: MergeMethod, text: str, spell: Spell = _plain) -> dict[str, object]:
    """'name=value,name=value' as the inner merge's hyperparameters, each word read as its command-line
    flag reads it (several values of a many-valued one separated by spaces)."""
    given: dict[str, object] = {}
    option = spell("inner_hparams")
    for pair in filter(None, (part.strip() for part in text.split(","))):
        name, _, raw = (part.strip() for part in pair.partition("="))
        name = name.replace("-", "_")
        if name not in method.defaults:
            raise MimaError(f"merge method 'svc': {option} names '{name}', which inner merge '{method.name}' does not "
                            f"take (it takes: {', '.join(method.defaults) or 'none'})")
        if name in given:
            raise MimaError(f"merge method 'svc': {option} gives '{name}' twice")
        spec = HYPERPARAMETERS[name]
        try:
            words = [spec.type(word) for word in raw.split()] if spec.many else spec.type(raw)
        except ValueError:
            raise MimaError(f"merge method 'svc': {option} {name}={raw}: {name} must be {spec.meaning}") from None
        given[name] = spec.from_command_line(words)
    return given


def inner_given(method: MergeMethod, inner_hparams: str | Mapping[str, object], spell: Spell = _plain) -> dict[str, object]:
    """The inner merge's given hyperparameters (a string from the command line, or a mapping)."""
    if isinstance(inner_hparams, Mapping):
        return dict(inner_hparams)
    return parse_inner_hparams(method, inner_hparams, spell)


def as_svc_error(method: MergeMethod, error: MimaError) -> MimaError:
    """The inner merge's refusal, said as SVC's (still one line)."""
    text = str(error)
    own = f"merge method '{method.name}': "
    return MimaError(f"merge method 'svc': inner merge '{method.name}': {text[len(own):] if text.startswith(own) else text}")


def validate(values: Mapping[str, object], spell: Spell = _plain) -> None:
    """The inner merge and its setting, refused before any work (SingularValueCalibration.validate)."""
    method = inner_method(str(values["inner_merge"]), spell)
    given = inner_given(method, values["inner_hparams"], spell)
    try:
        method.hyperparameters(given, spell=lambda name: f"{spell('inner_hparams')} {name}")
    except MimaError as error:
        raise as_svc_error(method, error) from None


# ---------------------------------------------------------------------------- calibration
def calibrate(merged: torch.Tensor, taus: list[torch.Tensor], alpha: float) -> torch.Tensor:
    """U diag(s / mean_t max(alpha, c_t)) V^T of the merged task matrix (float64)."""
    decomposition = svd(merged, dtype=torch.float64)
    u, s, vh = decomposition.u, decomposition.s, decomposition.vh
    merged_responses = u.T @ merged.double()  # row r: a_r
    floors = torch.zeros_like(s)
    for tau in taus:
        responses = u.T @ tau.double()  # row r: a_r^t
        coefficients = (merged_responses * responses).sum(dim=1) / responses.square().sum(dim=1).clamp_min(FLOOR)
        floors += coefficients.clamp_min(alpha)
    return (u * (s * len(taus) / floors)) @ vh


def svc(models, base, inner_merge: str, inner_hparams, svc_alpha: float, matrix_keys: str = DEFAULT_SVC_MATRIX_KEYS):
    """(key, merged tensor) per key: the inner merge's model with its matrices calibrated.

    The inner merge's own rules (its task count, min_tasks, matrix_keys) run here, before the first key."""
    method = inner_method(inner_merge)
    try:  # the inputs are checked already (finite unless allowed): only the inner merge's rules remain
        checked = method.check(models, base, allow_non_finite=True, **inner_given(method, inner_hparams))
    except MimaError as error:
        raise as_svc_error(method, error) from None
    return _calibrated(method.run(models, base, checked.values), models, base, svc_alpha, matrix_keys)


def _calibrated(items: Iterator, models, base, alpha: float, matrix_keys: str):
    for key, merged in items:
        anchor = base[key]
        if not anchor.is_floating_point() or not is_matrix_key(key, anchor, matrix_keys):
            yield key, merged
            continue
        reference = anchor.double()
        taus = [model[key].double() - reference for model in models]
        with tensor_step(key, models, base):
            calibrated = calibrate(merged.double() - reference, taus, alpha)
        yield key, (reference + calibrated).to(anchor.dtype)


class SingularValueCalibration(StreamingMerge):
    """SVC's merge: a StreamingMerge whose setting names another merge and that merge's own setting,
    each checked against the registry before any work."""

    def validate(self, values: Mapping[str, object], spell: Spell) -> None:
        validate(values, spell)


register(
    SingularValueCalibration(
        name="svc",
        stream_fn=svc,
    )
)
