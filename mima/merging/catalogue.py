"""What the command line knows of the merge strategies without importing them (or torch): the
declaration of every strategy (its name, the module that implements it, the hyperparameters it takes
with their defaults, the grid its paper searches) and of every hyperparameter (check, meaning, flag).

This is the one place a strategy's hyperparameters are written. `mima merge --help` and the other
parsers are built from this module alone, so that help and argument errors answer before torch is
imported; a strategy's module implements it and registers it in mima.merging.registry under its
declared name, where the method reads its `defaults` and `grid` from here. The registry checks each
declaration as the strategy registers (defaults and grid values its hyperparameters accept) and, once
all are loaded, that every name here was registered.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from mima.core.errors import MimaError


@dataclass(frozen=True)
class Strategy:
    """A merge strategy's declaration: where it is implemented and the hyperparameters it takes."""

    module: str  # the module of mima.merging that implements and registers it
    defaults: Mapping[str, object] = field(default_factory=dict)  # every hyperparameter it takes, with its default
    grid: Mapping[str, tuple] = field(default_factory=dict)  # the paper's values, searched on validation data

    @property
    def hyperparameters(self) -> tuple[str, ...]:
        """The names it takes, in its order."""
        return tuple(self.defaults)


# The default of `matrix_keys` of CART and the merges built on it: the official rule
# (mima.merging.cart.cart_matrix_key) written as a pattern, for the places that take a pattern (the rank
# sweep's --matrix-keys). `is_matrix` applies the rule itself when given this value; `test_merge_cart.py`
# checks that both agree.
DEFAULT_MATRIX_KEYS = r"^(?=[\s\S]*(?:attn|mlp))(?![\s\S]*(?:ln|bias))"
# The pattern of "every 2-D tensor is a matrix" (Iso-C, Iso-CTS and WUDI's reference default).
EVERY_MATRIX = r".*"
# TSV's reference: every 2-D tensor but the CLIP text projection.
DEFAULT_TSV_MATRIX_KEYS = r"^(?!.*text_projection).*$"
# ACE's reference: every 2-D tensor but the CLIP text projection (`"text_projection" not in layer`).
DEFAULT_ACE_MATRIX_KEYS = r"^(?!.*text_projection).*$"
# SVC's authors' rule: 2-D, and neither the text projection nor an embedding.
DEFAULT_SVC_MATRIX_KEYS = r"^(?!.*(?:text_projection|embedding)).*$"
# The tensors of residual block <index> (LiNeS, RegMean++).
DEFAULT_BLOCK_KEYS = r"blocks\.(\d+)\."
# FW-Merging's default iterations per mode: paper 002's vision settings (its method takes the mode's
# when none is given: mima.merging.fw_merging).
ITERATIONS = {"hard": 3, "soft": 15}
# Iso-C and Iso-CTS's lambda grid: the authors' alpha search, np.linspace(0.0, 3.0, 31)[1:].
ISO_LAM_GRID = tuple(round(0.1 * i, 1) for i in range(1, 31))


# name -> Strategy, in the order the modules are loaded (so the registry fills in this order)
STRATEGIES: dict[str, Strategy] = {
    "ace": Strategy("ace", {"lam": 1.0, "ace_epsilon": 1e-2, "ace_rank_fraction": 0.3,
                            "matrix_keys": DEFAULT_ACE_MATRIX_KEYS}),
    "cart": Strategy("cart", {"lam": 1.0, "rank_ratio": 0.08, "matrix_keys": DEFAULT_MATRIX_KEYS},
                     grid={"rank_ratio": (0.04, 0.08, 0.16, 0.32), "lam": tuple(round(1.0 + 0.2 * i, 1) for i in range(11))}),
    "adamerging": Strategy("adamerging", {"granularity": "layer", "steps": 500, "lr": 1e-3, "prior": 0.3,
                                          "adapt_on": "test"}),
    "adamerging_cart": Strategy("adamerging", {"granularity": "layer", "steps": 500, "lr": 1e-3, "prior": 1.0,
                                               "adapt_on": "test", "rank_ratio": 0.08,
                                               "matrix_keys": DEFAULT_MATRIX_KEYS}),
    "breadcrumbs": Strategy("breadcrumbs", {"lam": 0.2, "density": 0.15, "gamma": 0.006},
                            grid={"lam": tuple(round(0.05 * i, 2) for i in range(1, 21))}),
    "cart_indexing": Strategy("cart_indexing", {"rank_ratio": 0.08, "matrix_keys": DEFAULT_MATRIX_KEYS}),
    "consensus": Strategy("consensus", {"lam": 0.4, "mask_lam": 0.4, "min_tasks": 2},
                          grid={"lam": tuple(round(0.1 * i, 1) for i in range(1, 11))}),
    "ties": Strategy("ties", {"lam": 1.0, "k": 20.0, "trim": "global"},
                     grid={"lam": tuple(round(0.8 + 0.05 * i, 2) for i in range(21))}),
    "dare_task_arithmetic": Strategy("dare", {"lam": 0.3, "drop": 0.5, "seed": 0},
                                     grid={"lam": tuple(round(0.05 * i, 2) for i in range(21))}),
    "dare_ties": Strategy("dare", {"lam": 1.0, "drop": 0.5, "seed": 0, "k": 20.0, "trim": "global"},
                          grid={"lam": tuple(round(0.8 + 0.05 * i, 2) for i in range(21))}),
    "della": Strategy("della", {"lam": 1.0, "density": 0.5, "epsilon": 0.15, "seed": 0},
                      grid={"lam": tuple(round(0.8 + 0.05 * i, 2) for i in range(21))}),
    "emr": Strategy("emr"),
    "fisher": Strategy("fisher", {"examples": 256}),
    "task_arithmetic": Strategy("task_arithmetic", {"lam": 0.4},
                                grid={"lam": tuple(round(0.05 * i, 2) for i in range(21))}),
    "fw_merging": Strategy("fw_merging", {"mode": "hard", "iterations": ITERATIONS["hard"], "step_size": 0.1, "lam": 0.3,
                                          "examples": 100, "start": "adamerging", "ada_steps": 500, "lr": 1e-3}),
    "iso_c": Strategy("iso_c", {"lam": 1.0, "matrix_keys": EVERY_MATRIX}, grid={"lam": ISO_LAM_GRID}),
    "iso_cts": Strategy("iso_cts", {"lam": 1.0, "common_space_fraction": 0.8, "matrix_keys": EVERY_MATRIX},
                        grid={"lam": ISO_LAM_GRID}),
    "lines": Strategy("lines", {"base_merge": "task_arithmetic", "lines_alpha": "auto", "lines_beta": 0.5,
                                "block_keys": DEFAULT_BLOCK_KEYS},
                      grid={"lines_beta": tuple(round(0.1 * i, 1) for i in range(1, 16))}),
    "magmax": Strategy("magmax", {"lam": 0.5}, grid={"lam": tuple(round(0.05 * i, 2) for i in range(1, 21))}),
    "model_stock": Strategy("model_stock"),
    "regmean": Strategy("regmean", {"examples": 256, "alpha": 0.6}),
    "regmean_plus_plus": Strategy("regmean_plus_plus", {"examples": 256, "alpha": 0.95, "block_keys": DEFAULT_BLOCK_KEYS}),
    "svc": Strategy("svc", {"inner_merge": "task_arithmetic", "inner_hparams": "", "svc_alpha": 0.1,
                            "matrix_keys": DEFAULT_SVC_MATRIX_KEYS}),
    "tall": Strategy("tall", {"mask_lam": 0.4}, grid={"mask_lam": (0.2, 0.3, 0.4, 0.5, 0.6)}),
    "tsv": Strategy("tsv", {"lam": 1.0, "matrix_keys": DEFAULT_TSV_MATRIX_KEYS},
                    grid={"lam": tuple(round(0.1 * i, 1) for i in range(1, 31))}),
    "uniform": Strategy("uniform"),
    "wudi": Strategy("wudi", {"steps": 300, "lr": 1e-5, "matrix_keys": EVERY_MATRIX}),
}


def check_method_name(name: str) -> None:
    """Refuse, in one line, a name that is not a merge strategy's."""
    if name not in STRATEGIES:
        raise MimaError(f"unknown merge method '{name}' (known: {', '.join(sorted(STRATEGIES))})")


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _regex(value) -> bool:
    if not isinstance(value, str):
        return False
    try:
        re.compile(value)
    except re.error:
        return False
    return True


def _registered_name(value) -> bool:
    return isinstance(value, str) and value in STRATEGIES


# one `name=value` pair of a nested setting (SVC's inner_hparams); the value may hold spaces (many values)
_PAIR = re.compile(r"\s*[A-Za-z_][A-Za-z0-9_-]*\s*=\s*[^,=\s][^,=]*")


def _name_value_pairs(value) -> bool:
    """'' or 'name=value,name=value' (the syntax only: the names and values are checked against the
    method they configure), or a mapping from names to values (the Python API)."""
    if isinstance(value, Mapping):
        return all(isinstance(name, str) for name in value)
    if not isinstance(value, str):
        return False
    return value.strip() == "" or all(_PAIR.fullmatch(pair) for pair in value.split(","))


def _non_negative_or_per_task(value) -> bool:
    if isinstance(value, (list, tuple)):
        return len(value) > 0 and all(_finite(x) and x >= 0 for x in value)
    return _finite(value) and value >= 0


@dataclass(frozen=True)
class Hyperparameter:
    """One hyperparameter, declared once: its check, what it must be, what it does, and how the
    command line reads it (`mima merge` makes one flag per declaration)."""

    name: str
    meaning: str  # what a valid value is; completes "<name> must be ..."
    doc: str  # what it controls
    check: Callable[[object], bool] | None = None  # None: one of `choices`
    type: Callable[[str], object] = str  # how a command-line word becomes a value
    choices: tuple[str, ...] | None = None
    many: bool = False  # the flag takes one or more values; a single one is given as that value

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def accepts(self, value: object) -> bool:
        if self.check is not None:
            return bool(self.check(value))
        return value in self.choices

    def argparse_options(self) -> dict[str, object]:
        """Keyword arguments of argparse's add_argument for this hyperparameter's flag."""
        options: dict[str, object] = {"type": self.type}
        if self.choices is not None:
            options["choices"] = self.choices
        if self.many:
            options["nargs"] = "+"
        return options

    def from_command_line(self, value: object) -> object:
        """The parsed flag as the strategy takes it (several values as a list, one as itself)."""
        if self.many and isinstance(value, list):
            return value[0] if len(value) == 1 else list(value)
        return value


def _choice(name: str, choices: tuple[str, ...], doc: str) -> Hyperparameter:
    quoted = [repr(c) for c in choices]
    meaning = ", ".join(quoted[:-1]) + " or " + quoted[-1]
    return Hyperparameter(name, meaning, doc, choices=choices)


# Every hyperparameter any strategy takes. The strategies, `MergeMethod.hyperparameters` and the
# command line all read this one table, so they accept and reject the same values with the same words.
HYPERPARAMETERS: dict[str, Hyperparameter] = {
    spec.name: spec
    for spec in (
        Hyperparameter("lam", "a finite number", "scaling coefficient lambda of the merged task vector "
                       "(FW-Merging hard: of each step and of the task-arithmetic start)", _finite, float),
        Hyperparameter("k", "a percentage of entries kept, in (0, 100]", "TIES: share of each task vector kept by the trim",
                       lambda v: _finite(v) and 0 < v <= 100, float),
        Hyperparameter("rank_ratio", "a fraction of the rank, in [0, 1]", "CART: share of each matrix's rank kept",
                       lambda v: _finite(v) and 0 <= v <= 1, float),
        Hyperparameter("common_space_fraction", "a fraction of the rank, in [0, 1]",
                       "Iso-CTS: share of each matrix's rank given to the common subspace (the rest is split among the tasks)",
                       lambda v: _finite(v) and 0 <= v <= 1, float),
        Hyperparameter("drop", "a drop probability, in [0, 1)", "DARE: probability p of dropping a task-vector entry",
                       lambda v: _finite(v) and 0 <= v < 1, float),
        Hyperparameter("density", "a fraction of entries kept, in (0, 1]", "Breadcrumbs: share of each row kept below the top gamma",
                       lambda v: _finite(v) and 0 < v <= 1, float),
        Hyperparameter("gamma", "a fraction of the largest entries removed, in [0, 1)",
                       "Breadcrumbs: share of each row's largest entries removed", lambda v: _finite(v) and 0 <= v < 1, float),
        Hyperparameter("seed", "an integer", "seed of the random drop masks", _whole, int),
        _choice("trim", ("global", "per-tensor"), "TIES: trim over the whole task vector or each tensor"),
        Hyperparameter("matrix_keys", "a regular expression", "which 2-D tensors get the matrix (low-rank) treatment",
                       _regex, str),
        Hyperparameter("mask_lam", "a non-negative number (or one per task)", "TALL mask threshold lambda_t",
                       _non_negative_or_per_task, float, many=True),
        Hyperparameter("min_tasks", "a whole number of tasks, at least 1", "consensus: how many task masks must select an entry",
                       lambda v: _whole(v) and v >= 1, int),
        Hyperparameter("alpha", "a number in [0, 1]", "RegMean: scale of the Gram matrices' off-diagonal entries",
                       lambda v: _finite(v) and 0 <= v <= 1, float),
        Hyperparameter("steps", "a positive whole number of steps", "AdaMerging: Adam steps",
                       lambda v: _whole(v) and v >= 1, int),
        Hyperparameter("lr", "a positive number", "learning rate (Adam) of the AdaMerging coefficients", lambda v: _finite(v) and v > 0, float),
        _choice("granularity", ("task", "layer"), "AdaMerging: one coefficient per task, or per task and tensor"),
        Hyperparameter("iterations", "a positive whole number", "FW-Merging: Frank-Wolfe iterations",
                       lambda v: _whole(v) and v >= 1, int),
        _choice("mode", ("hard", "soft"), "FW-Merging: one vertex and a fixed step, or AdaMerging over T vertices"),
        Hyperparameter("prior", "a finite number", "AdaMerging: initial value of the coefficients", _finite, float),
        Hyperparameter("examples", "a positive whole number of examples", "calibration examples per task (train split)",
                       lambda v: _whole(v) and v >= 1, int),
        _choice("adapt_on", ("test", "val", "train"), "AdaMerging: split whose unlabelled inputs it adapts on"),
        _choice("start", ("pretrained", "task_arithmetic", "adamerging"), "FW-Merging hard: the initial merge"),
        Hyperparameter("step_size", "a positive number", "FW-Merging hard: step size, times 2 / (t + 2) and lam",
                       lambda v: _finite(v) and v > 0, float),
        Hyperparameter("ada_steps", "a positive whole number of steps", "FW-Merging: Adam steps of each AdaMerging run",
                       lambda v: _whole(v) and v >= 1, int),
        _choice("base_merge", ("task_arithmetic", "ties", "consensus"),
                "LiNeS: the merge whose task vector is scaled layer by layer (run at its own defaults)"),
        Hyperparameter("lines_alpha", "'auto' or a finite number",
                       "LiNeS: scale of the first block and of every tensor outside the blocks; 'auto' = "
                       "||sum_t tau_t||_1 / (T ||merged tau||_1), the reference's multi-task rule",
                       lambda v: v == "auto" or _finite(v), lambda word: word if word == "auto" else float(word)),
        Hyperparameter("lines_beta", "a finite number", "LiNeS: scale added from the first block to the last",
                       _finite, float),
        Hyperparameter("block_keys", "a regular expression with a group that captures the block index",
                       "LiNeS, RegMean++: the tensors of residual block <index> (blocks in depth order)",
                       lambda v: _regex(v) and re.compile(v).groups >= 1, str),
        Hyperparameter("epsilon", "a number in [0, 0.5)",
                       "DELLA: half-width of the keep probabilities, density - epsilon (smallest magnitude of a row) "
                       "to density + epsilon (largest)", lambda v: _finite(v) and 0 <= v < 0.5, float),
        Hyperparameter("ace_epsilon", "a non-negative number",
                       "ACE-Merging: ridge eps added to each task's estimated covariance (divided by its trace in "
                       "heterogeneous layers)", lambda v: _finite(v) and v >= 0, float),
        Hyperparameter("ace_rank_fraction", "a fraction of the rank, in [0, 1]",
                       "ACE-Merging: share of the spectrum whose mean singular value makes the isotropic refinement "
                       "of heterogeneous layers", lambda v: _finite(v) and 0 <= v <= 1, float),
        Hyperparameter("inner_merge", "the name of a registered merge method",
                       "SVC: the data-free merge whose result is calibrated", _registered_name, str),
        Hyperparameter("inner_hparams", "'' or comma-separated name=value pairs (e.g. 'lam=0.3,k=20')",
                       "SVC: hyperparameters of the inner merge (the others at its defaults); a many-valued one "
                       "takes its values separated by spaces", _name_value_pairs, str),
        Hyperparameter("svc_alpha", "a positive number",
                       "SVC: floor alpha of each task's projection coefficient; singular value r is divided by "
                       "mean_t max(alpha, c_r^t)", lambda v: _finite(v) and v > 0, float),
    )
}
