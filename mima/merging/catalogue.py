"""What the command line, the registry and the documentation know of the merge strategies without
importing them (or torch): the declaration of every strategy (its name, the module that implements it,
its kind, its paper, what it does, whether it needs theta_0, the hyperparameters it takes with their
defaults, the grid its paper searches) and of every hyperparameter (check, meaning, flag).

This is the one place these facts are written. `mima merge --help` and the other parsers are built from
this module alone, so that help and argument errors answer before torch is imported; a strategy's
module implements it and registers it in mima.merging.registry under its declared name, where the
method reads everything else from here (`paper`, `summary`, `needs_base`, `defaults`, `grid`). The
registry checks each declaration as the strategy registers (its type is the declared kind; defaults and
grid values its hyperparameters accept) and, once all are loaded, that every name here was registered.
The strategy tables of README.md and docs/merging.md are rendered from here
(mima.merging.strategy_tables; tests/docs/test_strategy_tables.py holds them to it).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from mima.core.errors import MimaError

# The four kinds of strategy, each a type in mima.merging.registry (KIND_TYPES there), and what each is,
# as the strategy tables say it.
KINDS: dict[str, str] = {
    "streaming": "data-free",  # key by key from the inputs alone (StreamingMerge)
    "scaled": "data-free, lam-scaled",  # anchor + lam * direction: a lam grid costs one pass (ScaledMerge)
    "per-task": "one model per task",  # a shared model plus a small part per task, written as an index (PerTaskMerge)
    "data": "data-dependent",  # forward passes on the tasks' data (DataMerge)
}


@dataclass(frozen=True)
class Paper:
    """The paper a strategy follows: its short name, as the tables show it, and its address."""

    title: str
    url: str
    number: str | None = None  # its number among the papers mima cites by number (docs/index.md)


@dataclass(frozen=True)
class Strategy:
    """A merge strategy's declaration: where and as what it is implemented, its paper, what it does, what
    it needs, and the hyperparameters it takes."""

    module: str  # the module of mima.merging that implements and registers it
    kind: str  # one of KINDS: the registry's type it is registered as
    paper: Paper
    summary: str  # what it does, in one line
    needs_base: bool  # it needs theta_0, the pretrained model (--base)
    defaults: Mapping[str, object] = field(default_factory=dict)  # every hyperparameter it takes, with its default
    grid: Mapping[str, tuple] = field(default_factory=dict)  # the paper's values, searched on validation data

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"strategy of module {self.module}: kind {self.kind!r} is not one of {', '.join(KINDS)}")

    @property
    def hyperparameters(self) -> tuple[str, ...]:
        """The names it takes, in its order."""
        return tuple(self.defaults)

    @property
    def needs_data(self) -> bool:
        """It merges with forward passes on the tasks' data (a config or run folder)."""
        return self.kind == "data"


# The default of `matrix_keys` of CART and the merges built on it: the official rule
# (mima.merging.cart.cart_matrix_key) written as a pattern, for the places that take a pattern (the rank
# sweep's --matrix-keys). `is_matrix` applies the rule itself when given this value; `tests/merging/test_cart.py`
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
# What the default patterns select, in words, for the strategy tables (a pattern is hard to read there)
PATTERN_MEANINGS: dict[str, str] = {
    DEFAULT_MATRIX_KEYS: "2-D tensors whose key has attn or mlp and neither ln nor bias",
    EVERY_MATRIX: "every 2-D tensor",
    DEFAULT_TSV_MATRIX_KEYS: "every 2-D tensor but the text projection",
    DEFAULT_ACE_MATRIX_KEYS: "every 2-D tensor but the text projection",
    DEFAULT_SVC_MATRIX_KEYS: "every 2-D tensor but the text projection and embeddings",
}
# FW-Merging's default iterations per mode: paper 002's vision settings (its method takes the mode's
# when none is given: mima.merging.fw_merging).
ITERATIONS = {"hard": 3, "soft": 15}
# Iso-C and Iso-CTS's lambda grid: the authors' alpha search, np.linspace(0.0, 3.0, 31)[1:].
ISO_LAM_GRID = tuple(round(0.1 * i, 1) for i in range(1, 31))

# The papers, each once (several strategies follow one)
MODEL_SOUPS = Paper("Model soups", "https://arxiv.org/abs/2203.05482")
TASK_ARITHMETIC = Paper("Editing models with task arithmetic", "https://arxiv.org/abs/2212.04089")
TIES_MERGING = Paper("TIES-Merging", "https://arxiv.org/abs/2306.01708")
DARE = Paper("DARE", "https://arxiv.org/abs/2311.03099")
BREADCRUMBS = Paper("Model Breadcrumbs", "https://arxiv.org/abs/2312.06795")
TALL_MASKS = Paper("TALL masks / Consensus", "https://arxiv.org/abs/2405.07813")
TASK_SINGULAR_VECTORS = Paper("Task Singular Vectors", "https://arxiv.org/abs/2412.00081")
CART = Paper("CART", "https://arxiv.org/abs/2412.12153", number="000")
ADAMERGING = Paper("AdaMerging", "https://arxiv.org/abs/2310.02575")
FW_MERGING = Paper("FW-Merging", "https://arxiv.org/abs/2503.12649", number="002")
FISHER_MERGING = Paper("Fisher merging", "https://arxiv.org/abs/2111.09832")
REGMEAN = Paper("RegMean", "https://arxiv.org/abs/2212.09849")
REGMEAN_PLUS_PLUS = Paper("RegMean++", "https://arxiv.org/abs/2508.03121")
ISO_C_CTS = Paper("Iso-C / Iso-CTS", "https://arxiv.org/abs/2502.04959")
WUDI_MERGING = Paper("WUDI-Merging", "https://arxiv.org/abs/2503.08099")
MAGMAX = Paper("MagMax", "https://arxiv.org/abs/2407.06322")
MODEL_STOCK = Paper("Model Stock", "https://arxiv.org/abs/2403.19522")
LINES = Paper("LiNeS", "https://arxiv.org/abs/2410.17146")
ACE_MERGING = Paper("ACE-Merging", "https://arxiv.org/abs/2603.02945")
SVC = Paper("SVC", "https://arxiv.org/abs/2602.05536")
DELLA_MERGING = Paper("DELLA-Merging", "https://arxiv.org/abs/2406.11617")
EMR_MERGING = Paper("EMR-Merging", "https://arxiv.org/abs/2405.17461")

# grids several strategies search
LAM_0_TO_1 = tuple(round(0.05 * i, 2) for i in range(21))  # 0, 0.05 .. 1
LAM_TIES = tuple(round(0.8 + 0.05 * i, 2) for i in range(21))  # 0.8, 0.85 .. 1.8

# name -> Strategy, in the order the tables list them: the simplest first, each family together
STRATEGIES: dict[str, Strategy] = {
    "uniform": Strategy("uniform", "streaming", MODEL_SOUPS,
                        "element-wise mean of the models (MIMA's phase-end operator)", needs_base=False),
    "task_arithmetic": Strategy("task_arithmetic", "scaled", TASK_ARITHMETIC,
                                "theta_0 plus lam times the sum of the task vectors", needs_base=True,
                                defaults={"lam": 0.4}, grid={"lam": LAM_0_TO_1}),
    "ties": Strategy("ties", "scaled", TIES_MERGING,
                     "trim each task vector to its top-k% magnitudes, elect signs, disjoint mean, scaled by lam",
                     needs_base=True, defaults={"lam": 1.0, "k": 20.0, "trim": "global"}, grid={"lam": LAM_TIES}),
    "dare_task_arithmetic": Strategy("dare", "scaled", DARE,
                                     "random drop and rescale of the task vectors, then task arithmetic", needs_base=True,
                                     defaults={"lam": 0.3, "drop": 0.5, "seed": 0}, grid={"lam": LAM_0_TO_1}),
    "dare_ties": Strategy("dare", "scaled", DARE, "random drop and rescale of the task vectors, then TIES", needs_base=True,
                          defaults={"lam": 1.0, "drop": 0.5, "seed": 0, "k": 20.0, "trim": "global"},
                          grid={"lam": LAM_TIES}),
    "breadcrumbs": Strategy("breadcrumbs", "scaled", BREADCRUMBS,
                            "per row, drop the largest and the smallest task-vector entries, then task arithmetic",
                            needs_base=True, defaults={"lam": 0.2, "density": 0.15, "gamma": 0.006},
                            grid={"lam": tuple(round(0.05 * i, 2) for i in range(1, 21))}),
    "consensus": Strategy("consensus", "scaled", TALL_MASKS,
                          "task arithmetic on the entries that at least min_tasks tasks' TALL masks select",
                          needs_base=True, defaults={"lam": 0.4, "mask_lam": 0.4, "min_tasks": 2},
                          grid={"lam": tuple(round(0.1 * i, 1) for i in range(1, 11))}),
    "tall": Strategy("tall", "per-task", TALL_MASKS, "the sum of the task vectors, masked per task by its TALL mask",
                     needs_base=True, defaults={"mask_lam": 0.4}, grid={"mask_lam": (0.2, 0.3, 0.4, 0.5, 0.6)}),
    "tsv": Strategy("tsv", "scaled", TASK_SINGULAR_VECTORS,
                    "per matrix, each task's top singular vectors, orthogonalised across tasks", needs_base=True,
                    defaults={"lam": 1.0, "matrix_keys": DEFAULT_TSV_MATRIX_KEYS},
                    grid={"lam": tuple(round(0.1 * i, 1) for i in range(1, 31))}),
    "cart": Strategy("cart", "scaled", CART, "the average plus lam times the rank-reduced centered task vectors",
                     needs_base=False, defaults={"lam": 1.0, "rank_ratio": 0.08, "matrix_keys": DEFAULT_MATRIX_KEYS},
                     grid={"rank_ratio": (0.04, 0.08, 0.16, 0.32), "lam": tuple(round(1.0 + 0.2 * i, 1) for i in range(11))}),
    "cart_indexing": Strategy("cart_indexing", "per-task", CART,
                              "the shared average plus each task's rank-reduced centered vector", needs_base=False,
                              defaults={"rank_ratio": 0.08, "matrix_keys": DEFAULT_MATRIX_KEYS}),
    "adamerging": Strategy("adamerging", "data", ADAMERGING,
                           "task- or layer-wise coefficients learnt by entropy minimisation on unlabelled inputs",
                           needs_base=True, defaults={"granularity": "layer", "steps": 500, "lr": 1e-3, "prior": 0.3,
                                                      "adapt_on": "test"}),
    "adamerging_cart": Strategy("adamerging", "data", CART,
                                "AdaMerging on CART's centered rank-reduced vectors (paper 000, eq. 8)", needs_base=False,
                                defaults={"granularity": "layer", "steps": 500, "lr": 1e-3, "prior": 1.0,
                                          "adapt_on": "test", "rank_ratio": 0.08, "matrix_keys": DEFAULT_MATRIX_KEYS}),
    "fw_merging": Strategy("fw_merging", "data", FW_MERGING,
                           "Frank-Wolfe over the checkpoints' convex hull (hard: one vertex per step; "
                           "soft: AdaMerging over chosen vertices)", needs_base=True,
                           defaults={"mode": "hard", "iterations": ITERATIONS["hard"], "step_size": 0.1, "lam": 0.3,
                                     "examples": 100, "start": "adamerging", "ada_steps": 500, "lr": 1e-3}),
    "fisher": Strategy("fisher", "data", FISHER_MERGING,
                       "average weighted per parameter by each model's diagonal Fisher information", needs_base=False,
                       defaults={"examples": 256}),
    "regmean": Strategy("regmean", "data", REGMEAN,
                        "least-squares merge of each linear layer from its input Gram matrices; the rest averaged",
                        needs_base=False, defaults={"examples": 256, "alpha": 0.6}),
    "regmean_plus_plus": Strategy("regmean_plus_plus", "data", REGMEAN_PLUS_PLUS,
                                  "RegMean block by block, each block's Gram matrices from inputs through the merged "
                                  "blocks below", needs_base=False,
                                  defaults={"examples": 256, "alpha": 0.95, "block_keys": DEFAULT_BLOCK_KEYS}),
    "iso_c": Strategy("iso_c", "scaled", ISO_C_CTS,
                      "per matrix, the sum of the task vectors with its singular values flattened to their mean",
                      needs_base=True, defaults={"lam": 1.0, "matrix_keys": EVERY_MATRIX}, grid={"lam": ISO_LAM_GRID}),
    "iso_cts": Strategy("iso_cts", "scaled", ISO_C_CTS,
                        "per matrix, a common subspace of the sum plus each task's own directions, orthogonalised, "
                        "with a flat spectrum", needs_base=True,
                        defaults={"lam": 1.0, "common_space_fraction": 0.8, "matrix_keys": EVERY_MATRIX},
                        grid={"lam": ISO_LAM_GRID}),
    "wudi": Strategy("wudi", "streaming", WUDI_MERGING,
                     "per matrix, the merged task vector that least disturbs each task's subspace (Adam from the sum "
                     "of the task vectors)", needs_base=True,
                     defaults={"steps": 300, "lr": 1e-5, "matrix_keys": EVERY_MATRIX}),
    "magmax": Strategy("magmax", "scaled", MAGMAX,
                       "per entry, the task-vector value of largest magnitude (the later task on ties), scaled by lam",
                       needs_base=True, defaults={"lam": 0.5},
                       grid={"lam": tuple(round(0.05 * i, 2) for i in range(1, 21))}),
    "model_stock": Strategy("model_stock", "streaming", MODEL_STOCK,
                            "per tensor, t times the mean of the models plus (1 - t) theta_0, t from the tasks' mean "
                            "pairwise angle", needs_base=True),
    "lines": Strategy("lines", "streaming", LINES,
                      "a base merge's task vector scaled by alpha + beta l / (L - 1) in residual block l",
                      needs_base=True, defaults={"base_merge": "task_arithmetic", "lines_alpha": "auto",
                                                 "lines_beta": 0.5, "block_keys": DEFAULT_BLOCK_KEYS},
                      grid={"lines_beta": tuple(round(0.1 * i, 1) for i in range(1, 16))}),
    "ace": Strategy("ace", "scaled", ACE_MERGING,
                    "per matrix, a closed-form merge with input covariances estimated from the task vectors, plus an "
                    "isotropic spectral refinement where the tasks' update energies differ", needs_base=True,
                    defaults={"lam": 1.0, "ace_epsilon": 1e-2, "ace_rank_fraction": 0.3,
                              "matrix_keys": DEFAULT_ACE_MATRIX_KEYS}),
    "svc": Strategy("svc", "streaming", SVC,
                    "another merge's matrices with each singular value divided by the mean over tasks of "
                    "max(alpha, the task's projection coefficient on that direction)", needs_base=True,
                    defaults={"inner_merge": "task_arithmetic", "inner_hparams": "", "svc_alpha": 0.1,
                              "matrix_keys": DEFAULT_SVC_MATRIX_KEYS}),
    "della": Strategy("della", "scaled", DELLA_MERGING,
                      "magnitude-ranked random drop and rescale, sign election, disjoint mean, scaled by lam",
                      needs_base=True, defaults={"lam": 1.0, "density": 0.5, "epsilon": 0.15, "seed": 0},
                      grid={"lam": LAM_TIES}),
    "emr": Strategy("emr", "per-task", EMR_MERGING,
                    "an elected task vector plus a sign mask and a rescaler per task", needs_base=True),
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
