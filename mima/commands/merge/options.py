"""`mima merge`'s options: declared here, importing nothing heavy, so that `mima merge --help` and
argument errors answer before torch is loaded; `parse` (mima.commands.merge) reads them into a
MergeRequest, which the merge service (mima.services.merge) runs."""

from __future__ import annotations

import argparse
from pathlib import Path

from mima.commands.common import device_spelling
from mima.evaluation.cache_use import CACHE_MODES
from mima.merging.catalogue import HYPERPARAMETERS, STRATEGIES, Hyperparameter
from mima.services.merge_request import SELECT_ON, MergeRequest


def merge_request(namespace: argparse.Namespace) -> MergeRequest:
    """The request of a Namespace that add_merge_arguments' parser gave; the one place it is read."""
    given = {name: spec.from_command_line(getattr(namespace, name)) for name, spec in HYPERPARAMETERS.items()
             if getattr(namespace, name) is not None}
    return MergeRequest(method=namespace.method, models=tuple(namespace.models), output=namespace.output,
                        base=namespace.base, config=namespace.config, select_on=namespace.select_on,
                        overwrite=namespace.overwrite, allow_non_finite=namespace.allow_non_finite,
                        device=namespace.device, format=namespace.format, log_to_tracker=namespace.log_to_tracker,
                        cache=namespace.cache, hyperparameters=given)


def _flag_help(spec: Hyperparameter) -> str:
    takers = sorted(name for name, strategy in STRATEGIES.items() if spec.name in strategy.hyperparameters)
    what = spec.doc if spec.choices is not None else f"{spec.doc}; {spec.meaning}"  # argparse lists the choices
    return f"{what} (methods: {', '.join(takers) or 'none'})".replace("%", "%%")


def add_merge_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--method", required=True, help=f"one of: {', '.join(sorted(STRATEGIES))}")
    parser.add_argument("--base", type=Path, help="theta_0, the pretrained state dict (not needed by uniform, cart, ...)")
    parser.add_argument("--models", type=Path, nargs="+", required=True,
                        help="fine-tuned state dicts (.safetensors), or one `mima fit` run folder")
    parser.add_argument("--output", type=Path, required=True,
                        help="where to write the merged .safetensors (with --format open-clip: the folder)")
    parser.add_argument("--format", choices=("safetensors", "open-clip"), default="safetensors",
                        help="safetensors: the merged image encoder's state dict (the default); open-clip: a folder "
                        "with the full CLIP (the run's text tower, the merged image tower) that "
                        "open_clip.create_model_and_transforms('local-dir:DIR') loads, a model card, and the merged "
                        "encoder with its results (needs --config or a run folder)")
    parser.add_argument("--config", type=Path, help="a mima fit config or run folder: the tasks' model and data")
    parser.add_argument("--select-on", choices=SELECT_ON, help="choose hyperparameters on the validation splits")
    parser.add_argument("--overwrite", action="store_true", help="replace --output (and its results) if they exist")
    parser.add_argument("--allow-non-finite", action="store_true",
                        help="let weights holding NaN or Inf through the input check (by default an input tensor holding them "
                        "is an error naming the file and tensor, and so is a merged tensor that overflows, e.g. with a huge "
                        "--lam): a method working entry by entry keeps them in the entries they reach and the merge is "
                        "written with a warning line; one that needs a whole tensor (an SVD, a solve, the tasks' data) "
                        "refuses in one line (docs/merging.md, Degenerate inputs)")
    parser.add_argument("--log-to-tracker", action="store_true",
                        help="also log the results (merge/<method>/<task> test accuracies) to the experiment-tracker runs "
                        "the run folder's `mima fit` logged to (needs --models RUN_FOLDER)")
    parser.add_argument("--device", type=device_spelling, default="auto", metavar="auto|cpu|cuda|cuda:N",
                        help="where the merge's arithmetic runs, one tensor group at a time (default auto: the first GPU "
                        "when torch sees one, else the CPU); --device cpu gives the CPU's file bit for bit")
    parser.add_argument("--cache", choices=CACHE_MODES, default=CACHE_MODES[0],
                        help="whether the task pool that judges the merge (--select-on val, data-dependent methods, the "
                        "results table) reads its validation and test splits from the decoded-image cache, as `mima "
                        "evaluate --cache` (auto, the default: off, the pool evaluating on the CPU; on: the cache, "
                        "refusing tasks it cannot hold, e.g. the digits suite; off: item by item, as before)")
    hyper = parser.add_argument_group("hyperparameters (one flag per declaration in mima.merging.catalogue; "
                                      "each method takes some, see its docstring)")
    for spec in HYPERPARAMETERS.values():
        hyper.add_argument(spec.flag, dest=spec.name, default=None, help=_flag_help(spec), **spec.argparse_options())
