"""What the command line knows of the merge strategies without importing them (or torch): their
names, the module that registers each, the hyperparameters each takes, and those hyperparameters'
declarations.

`mima merge --help` and the other parsers are built from this module alone, so that help and argument
errors answer before torch is imported. The strategies themselves live in their modules and register
in mima.merging.registry, which checks every registration against STRATEGIES (a strategy missing here,
or taking other hyperparameters than listed, fails at import) and, once all are loaded, that every
name here was registered: the table and the strategies cannot drift apart.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from mima.core.errors import MimaError


@dataclass(frozen=True)
class Strategy:
    """A registered merge strategy as the command line sees it."""

    module: str  # the module of mima.merging that registers it
    hyperparameters: tuple[str, ...]  # the names it takes (its `defaults`), in its order


# name -> Strategy, in the order the modules are loaded (so the registry fills in this order)
STRATEGIES: dict[str, Strategy] = {
    "ace": Strategy("ace", ("lam", "ace_epsilon", "ace_rank_fraction", "matrix_keys")),
    "cart": Strategy("cart", ("lam", "rank_ratio", "matrix_keys")),
    "adamerging": Strategy("adamerging", ("granularity", "steps", "lr", "prior", "adapt_on")),
    "adamerging_cart": Strategy("adamerging", ("granularity", "steps", "lr", "prior", "adapt_on", "rank_ratio", "matrix_keys")),
    "breadcrumbs": Strategy("breadcrumbs", ("lam", "density", "gamma")),
    "cart_indexing": Strategy("cart_indexing", ("rank_ratio", "matrix_keys")),
    "consensus": Strategy("consensus", ("lam", "mask_lam", "min_tasks")),
    "ties": Strategy("ties", ("lam", "k", "trim")),
    "dare_task_arithmetic": Strategy("dare", ("lam", "drop", "seed")),
    "dare_ties": Strategy("dare", ("lam", "drop", "seed", "k", "trim")),
    "della": Strategy("della", ("lam", "density", "epsilon", "seed")),
    "emr": Strategy("emr", ()),
    "fisher": Strategy("fisher", ("examples",)),
    "task_arithmetic": Strategy("task_arithmetic", ("lam",)),
    "fw_merging": Strategy("fw_merging", ("mode", "iterations", "step_size", "lam", "examples", "start", "ada_steps", "lr")),
    "iso_c": Strategy("iso_c", ("lam", "matrix_keys")),
    "iso_cts": Strategy("iso_cts", ("lam", "common_space_fraction", "matrix_keys")),
    "lines": Strategy("lines", ("base_merge", "lines_alpha", "lines_beta", "block_keys")),
    "magmax": Strategy("magmax", ("lam",)),
    "model_stock": Strategy("model_stock", ()),
    "regmean": Strategy("regmean", ("examples", "alpha")),
    "regmean_plus_plus": Strategy("regmean_plus_plus", ("examples", "alpha", "block_keys")),
    "svc": Strategy("svc", ("inner_merge", "inner_hparams", "svc_alpha", "matrix_keys")),
    "tall": Strategy("tall", ("mask_lam",)),
    "tsv": Strategy("tsv", ("lam", "matrix_keys")),
    "uniform": Strategy("uniform", ()),
    "wudi": Strategy("wudi", ("steps", "lr", "matrix_keys")),
}

def check_method_name(name: str) -> None:
    """Refuse, in one line, a name that is not a merge strategy's."""
    if name not in STRATEGIES:
        raise MimaError(f"unknown merge method '{name}' (known: {', '.join(sorted(STRATEGIES))})")


# The default of `matrix_keys` of CART and the merges built on it: the official rule
# (mima.merging.cart.cart_matrix_key) written as a pattern, for the places that take a pattern (the rank
# sweep's --matrix-keys). `is_matrix` applies the rule itself when given this value; `test_merge_cart.py`
# checks that both agree.
DEFAULT_MATRIX_KEYS = r"^(?=[\s\S]*(?:attn|mlp))(?![\s\S]*(?:ln|bias))"


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
