"""`mima report DIR`: one page for a run or a sweep, as report.md (images linked) and report.html
(one self-contained file: the images are embedded as data URIs, so it can be mailed or attached).

A sweep folder (`mima demo`, benchmarks/offline_suite.py: results.json and runs/; `mima evaluate --out`:
results.json, its runs named in selection.json) gets the Table-1 results, the accuracy-vs-N and alignment plots, every analysis found under
DIR/analysis/ and the runs' analysis/ folders, and links to each run's checkpoints. A run folder
(`mima fit`: metrics.jsonl, final/) gets its settings, the per-phase alignment and loss table, its
evaluation (RUN/evaluation/, as the SLURM array writes it) when there is one, the analyses and the
checkpoints. The cosine analysis needs no data, so it is run here when its plots are missing.

Nothing is written beside the inputs when `--out` names another folder (the cosine plots it makes go to
OUT/analysis/cosine), and the page's files are written into a temporary folder and moved into place
together at the end, under the output folder's lock (mima.core.run_lock): a failed report leaves the
previous one as it was.
"""

from __future__ import annotations

import base64
import html
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from mima.core.errors import MimaError
from mima.core.files import refuse_overwrite
from mima.core.names import JOINT
from mima.core.publish import atomic_folder
from mima.core.run_folder import RunFolder, SweepFolder
from mima.core.run_outputs import refuse_output_on_runs
from mima.evaluation.results_files import read_results
from mima.evaluation.results import seeds_at
from mima.evaluation.tables import SIGNIFICANCE_NOTE, markdown_table, n_table, significance_table, summary_table
from mima.config.run_config import load_run_config

# What each plot shows, for the page's captions (file name -> caption); unknown PNGs get their name.
CAPTIONS = {
    "merged_accuracy_vs_N.png": "Average test accuracy of each merge vs the number of MIMA iterations N, with each task's "
    "own fine-tuned model (dashed) and the pretrained model (dotted) for reference.",
    "cosine_vs_N.png": "Left: pairwise cosines of the final task vectors per N. Right: mean pairwise cosine of tau and of "
    "the phase updates delta at the end of each phase.",
    "cosine_phases.png": "Pairwise cosines of tau (blue) and delta (orange) over all task pairs at the end of each phase.",
    "landscape.png": "Test error (%) on the plane through theta_0 spanned by two task vectors: task A, task B and their "
    "mean; theta_0, the task models and the merges (projected onto the plane) are marked.",
    "rank-sweep.png": "Merged accuracy vs the kept rank of the task vectors: centered (CART) vs original task vectors.",
    "rank-sweep_layers.png": "Row-space interference I(k) and reconstruction error R(k) per layer vs rank (paper 000 eq. 5, 7).",
    "ctl.png": "Cross-task linearity per layer: features of the weight-interpolated model vs the interpolation of the "
    "two models' features, against the baseline similarity of the two models' features.",
    "ctl_arithmetic.png": "Cross-task linearity of task arithmetic (theta_0 + lam (tau_A + tau_B)) per layer.",
    "gradients.png": "Each epoch's share of the total gradient norm, cosine of each epoch's gradient with the first, and "
    "task arithmetic of one-epoch vs converged task vectors.",
}


# ------------------------------------------------------------------------------------ page blocks
@dataclass
class Page:
    """A list of blocks rendered to Markdown and HTML. Text may hold [links](path) and `code`."""

    title: str
    blocks: list[tuple[str, object]] = field(default_factory=list)

    def heading(self, text: str) -> None:
        self.blocks.append(("heading", text))

    def text(self, text: str) -> None:
        self.blocks.append(("text", text))

    def bullets(self, items: list[str]) -> None:
        self.blocks.append(("bullets", items))

    def table(self, header: list[str], rows: list[list[str]]) -> None:
        self.blocks.append(("table", (header, rows)))

    def image(self, path: Path, caption: str, data: Path | None = None) -> None:
        """An image shown from `path` (where it is once the report is in place), its bytes read from
        `data` (where it is now, if elsewhere)."""
        self.blocks.append(("image", (path, caption, data or path)))


def render_markdown(page: Page, at: Path) -> str:
    lines = [f"# {page.title}", ""]
    for kind, value in page.blocks:
        if kind == "heading":
            lines += [f"## {value}", ""]
        elif kind == "text":
            lines += [value, ""]
        elif kind == "bullets":
            lines += [f"- {item}" for item in value] + [""]
        elif kind == "table":
            lines += markdown_table(*value) + [""]
        elif kind == "image":
            path, caption, _ = value
            lines += [f"![{caption}]({_relative(path, at)})", "", f"*{caption}*", ""]
    return "\n".join(lines)


_STYLE = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.2em;font-size:.9em}td,th{border:1px solid #ccc;padding:.25em .6em;text-align:right}
td:first-child,th:first-child{text-align:left}th{background:#f3f3f3}figure{margin:1em 0 2em}img{max-width:100%}
figcaption{color:#555;font-size:.9em}code{background:#f3f3f3;padding:0 .2em}"""


def render_html(page: Page, at: Path) -> str:
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(page.title)}</title>",
             f"<style>{_STYLE}</style></head><body><h1>{html.escape(page.title)}</h1>"]
    for kind, value in page.blocks:
        if kind == "heading":
            parts.append(f"<h2>{html.escape(value)}</h2>")
        elif kind == "text":
            parts.append(f"<p>{_inline_html(value, at)}</p>")
        elif kind == "bullets":
            parts.append("<ul>" + "".join(f"<li>{_inline_html(item, at)}</li>" for item in value) + "</ul>")
        elif kind == "table":
            header, rows = value
            head = "".join(f"<th>{html.escape(cell)}</th>" for cell in header)
            body = "".join("<tr>" + "".join(f"<td>{_inline_html(cell, at)}</td>" for cell in row) + "</tr>" for row in rows)
            parts.append(f"<table><tr>{head}</tr>{body}</table>")
        elif kind == "image":
            path, caption, source = value
            data = base64.b64encode(Path(source).read_bytes()).decode("ascii")
            parts.append(f"<figure><img src='data:image/png;base64,{data}' alt='{html.escape(caption)}'>"
                         f"<figcaption>{html.escape(caption)}</figcaption></figure>")
    parts.append("</body></html>")
    return "\n".join(parts)


def _inline_html(text: str, at: Path) -> str:
    escaped = html.escape(text)
    escaped = re.sub(r"`([^`]+)`", r"<code>\1</code>", escaped)
    escaped = re.sub(r"\*\*([^*]+)\*\*", r"<b>\1</b>", escaped)
    return re.sub(r"\[([^\]]+)\]\(([^)]+)\)", r"<a href='\2'>\1</a>", escaped)


def _relative(path: Path, at: Path) -> str:
    return Path(os.path.relpath(Path(path).resolve(), at.resolve())).as_posix()


def link(path: Path, at: Path, text: str | None = None) -> str:
    return f"[{text or path.name}]({_relative(path, at)})"


# ------------------------------------------------------------------------------------ sections
def _size(path: Path) -> str:
    size = path.stat().st_size
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return ""


def results_section(page: Page, folder: Path) -> None:
    """The Table-1 style tables of a results folder (results.json + selection.json)."""
    results = read_results(folder)
    page.heading("Results (paper 001, Table 1 style)")
    page.text("Average absolute test accuracy (%) over the tasks, per model and number of MIMA iterations N. "
              "`fine_tuned` is each task's own model on its own task; `zero_shot` is theta_0 with the frozen heads; "
              "the other rows are merges of the N-run's task models, hyperparameters chosen on the validation split. "
              "Last row: mean pairwise cosine of the final task vectors.")
    page.table(*summary_table(results))
    page.text("Per N: absolute accuracy; relative accuracy (merged accuracy on each task over that task's fine-tuned "
              "model, averaged); single-task gap (fine-tuned minus merged, in points); per-task accuracy; the chosen "
              "hyperparameters.")
    noted = False  # the intervals' note once, before the first of their tables
    for n in sorted({r.N for r in results}):
        page.text(f"**N = {n}**")
        page.table(*n_table(results, n))
        seeds = seeds_at(results, n)
        for seed in seeds:
            significance = significance_table(results, n, seed)
            if significance is None:
                continue
            if not noted:
                page.text(SIGNIFICANCE_NOTE)
                noted = True
            page.text(f"N = {n}{'' if len(seeds) == 1 else f', seed {seed}'}: 95 % intervals and paired tests")
            page.table(*significance)
    for name in ("merged_accuracy_vs_N.png", "cosine_vs_N.png"):
        if (folder / name).is_file():
            page.image(folder / name, CAPTIONS[name])


def phase_section(page: Page, run: Path) -> None:
    records = RunFolder(run).phase_records()
    if not records:
        return
    tasks = list(records[0]["tasks"])
    page.heading("Phases")
    page.text("At the end of each phase: mean pairwise cosine of the task vectors tau and of the phase updates delta, "
              "and each task's mean training loss over the phase.")
    header = ["phase", "step", "mean cos(tau)", "mean cos(delta)"] + [f"loss {t}" for t in tasks]
    rows = [[str(r["phase"]), str(r["step"]), f"{r['mean_cos_tau']:.3f}", f"{r['mean_cos_delta']:.3f}"]
            + [f"{r['loss'].get(t, float('nan')):.3f}" for t in tasks] for r in records]
    page.table(header, rows)


def cosine_section(page: Page, folder: Path, runs: list[Path], out: Path, staging: Path) -> None:
    """The cosine analysis of the input (its own analysis/cosine, or an earlier report's in OUT), or
    computed now into the staging folder (from where it moves to OUT/analysis/cosine with the page)."""
    from mima.analysis.cosine.command import analyse

    if not runs:
        return
    shown = RunFolder(out).analysis_dir("cosine")  # where the plots are once the report is in place
    source = next((candidate for candidate in (RunFolder(folder).analysis_dir("cosine"), shown)
                   if (candidate / "cosine.json").is_file()), None)
    if source is not None:
        shown = source
    else:
        source = RunFolder(staging).analysis_dir("cosine")
        analyse([folder] if folder in runs or SweepFolder(folder).runs_dir.is_dir() else runs, out=source,
                say=lambda line: None)  # it is written to a staging folder: the report says where it lands

    def image(name: str, caption: str) -> None:
        page.image(shown / name, caption, data=source / name)

    page.heading("Alignment of the task models (paper 001, Fig. 5 and 11)")
    image("cosine_phases.png", CAPTIONS["cosine_phases.png"])
    heatmaps = {int(p.stem.split("_N")[-1]): p.name for p in source.glob("cosine_heatmaps_N*.png")}
    if heatmaps:  # the largest N: the matrices sharpen phase by phase
        n = max(heatmaps)
        image(heatmaps[n], f"Pairwise cosine matrices of tau (top) and delta (bottom) at selected phases, N = {n}.")
    if (source / "cosine_vs_N.png").is_file() and not SweepFolder(folder).plot_file(SweepFolder.COSINE_PLOT).is_file():  # a sweep has its own
        image("cosine_vs_N.png", "Pairwise cosines of the final task vectors per N.")


def analyses_section(page: Page, folders: list[tuple[str, Path]]) -> None:
    """Every analysis output folder (RUN/analysis/<name>) except cosine, with its PNGs."""
    found = [(label, sub) for label, folder in folders for sub in RunFolder(folder).analysis_dirs()
             if sub.name != "cosine" and any(sub.glob("*.png"))]
    if not found:
        return
    page.heading("Analyses")
    page.text("Outputs of `mima analyze` found next to the runs (numbers in each folder's JSON).")
    for label, sub in found:
        page.text(f"**{sub.name}** ({label})")
        for png in sorted(sub.glob("*.png")):
            page.image(png, CAPTIONS.get(png.name, png.stem))


def checkpoints_section(page: Page, runs: list[Path], at: Path) -> None:
    page.heading("Checkpoints")
    page.text("Safetensors state dicts of the image encoder: theta_0 and each task's model after the last phase "
              "(load with `safetensors.torch.load_file`; merge with `mima merge --models RUN`).")
    rows = []
    for run in runs:
        folder = RunFolder(run)
        if folder.is_joint():  # one model for all tasks
            tasks = [JOINT]
        else:
            try:
                tasks = folder.task_order()
            except MimaError:
                continue
        files = [folder.pretrained_file] + [folder.final_file(t) for t in tasks]
        cells = [f"{link(f, at, f.stem)} ({_size(f)})" for f in files if f.is_file()]
        rows.append([link(run, at, run.name), ", ".join(cells)])
    page.table(["run", "theta_0 and task models"], rows)


# ------------------------------------------------------------------------------------ the page
def _weights(clip: str, pretrained: str | None) -> str:
    """Where the run's theta_0 came from, as the model loader read model.pretrained."""
    from mima.models.clip import EMBEDDED_PREFIX, LOCAL_DIR_PREFIX, effective_pretrained

    tag = effective_pretrained(clip, pretrained)
    if tag is not None:
        return f"pretrained: {tag}"
    if clip.startswith(EMBEDDED_PREFIX):
        return "pretrained by mima on first use"
    return "weights of the folder" if clip.startswith(LOCAL_DIR_PREFIX) else "random weights"


def _run_settings(run: Path) -> list[str]:
    config = load_run_config(run)  # the values `mima fit` used, defaults included
    model, data = config.model, config.data
    trainer = config.other.get("trainer") or {}
    return [
        f"model `{model.clip}` ({_weights(model.clip, model.pretrained)}), heads `{model.heads}`",
        f"tasks: {', '.join(data.tasks or [])}"
        + (f"benchmark {data.benchmark}" if getattr(data, "benchmark", None) is not None else "")
        + f" (suite `{data.suite}`)",
        f"{_budget_text(model.steps, model.iterations)}; "
        f"lr {model.lr}, batch {data.batch_size}, schedule {model.lr_schedule}, optimiser state {model.optimizer_state}",
        f"trainer: {trainer.get('accelerator')} x {trainer.get('devices')} device(s), {trainer.get('num_nodes', 1)} node(s), "
        f"precision {trainer.get('precision')}",
    ]


def folder_kind(folder: Path) -> str:
    """"sweep" (results.json: `mima demo`, `mima evaluate --out`, the offline suite) or "run"
    (metrics.jsonl: `mima fit`); anything else is one line."""
    if SweepFolder(folder).has_results():
        return "sweep"
    if RunFolder(folder).has_metrics():
        return "run"
    raise MimaError(f"{folder}: not a sweep folder (results.json: `mima demo`, `mima evaluate --out`) "
                    "nor a `mima fit` run folder (metrics.jsonl)")


def build_page(folder: Path, at: Path, staging: Path | None = None) -> Page:
    """The page of `folder`, its links relative to `at` (where report.md goes); files it makes (the
    cosine plots) go to `staging`, a folder that will become `at` (default: `at` itself)."""
    sweep, run = SweepFolder(folder), RunFolder(folder)
    staging = staging if staging is not None else at
    if folder_kind(folder) == "sweep":
        if sweep.runs_dir.is_dir():
            trained = [r.path for r in sweep.runs(include_joint=True)]
        else:  # `mima evaluate --out`: the runs it evaluated are wherever they were
            trained = [r.path for r in sweep.listed_runs(include_joint=True)]
        runs = [path for path in trained if not RunFolder(path).is_joint()]  # the MIMA runs, one per N
        kind = "sweep" if sweep.runs_dir.is_dir() else "evaluation"
        page = Page(f"mima report: {kind} {folder.name}")
        page.text(f"Generated {time.strftime('%Y-%m-%d %H:%M')} from {link(folder, at, str(folder))}; "
                  f"{len(runs)} runs ({', '.join(r.name for r in runs) or 'none found'}).")
        if runs:
            page.bullets(_run_settings(runs[0])[:2])
        results_section(page, folder)
    else:
        runs = trained = [folder]
        page = Page(f"mima report: run {folder.name}")
        page.text(f"Generated {time.strftime('%Y-%m-%d %H:%M')} from {link(folder, at, str(folder))}.")
        page.bullets(_run_settings(folder))
        if run.evaluation.has_results():
            results_section(page, run.evaluation.path)
        else:
            page.text("No evaluation yet: `mima evaluate RUN --out RUN/evaluation` adds the results table.")
        phase_section(page, folder)
    cosine_section(page, folder, runs, at, staging)
    analyses_section(page, [("sweep", folder)] * sweep.has_results() + [(f"run {r.name}", r) for r in runs])
    if trained:
        checkpoints_section(page, trained, at)
    return page


def write_report(folder: Path, out: Path | None = None, overwrite: bool = False) -> list[Path]:
    folder = Path(folder)
    if folder.is_file():
        raise MimaError(f"{folder}: a file, not a folder (give a `mima fit` run folder or a sweep folder)")
    if not folder.is_dir():
        raise MimaError(f"{folder}: no such folder")
    out = Path(out) if out is not None else folder
    report_files = RunFolder(out).report_files()
    read = [folder, *(run.path for run in SweepFolder(folder).runs(include_joint=True))]  # a sweep's runs are read too
    refuse_output_on_runs("--out", out, read, kept=RunFolder.report_files, written=report_files)
    if not overwrite:
        refuse_overwrite(report_files, what=f"--out {out}")
    folder_kind(folder)  # before anything is created
    with atomic_folder(out, overwrite=overwrite, lock="mima report") as staging:
        page = build_page(folder, out, staging)
        markdown_file, html_file = (staging / path.name for path in report_files)
        markdown_file.write_text(render_markdown(page, out))
        html_file.write_text(render_html(page, out))
    return report_files


def _budget_text(steps, iterations: int) -> str:
    """S and K, or each task's S_t and K_t (model.steps as a map)."""
    if isinstance(steps, Mapping):
        per_task = ", ".join(f"{task} {budget} (K = {budget // iterations})" for task, budget in steps.items())
        return f"per-task budgets S_t: {per_task}; N = {iterations} phases"
    return f"S = {steps} steps per task, N = {iterations} phases of K = {steps // iterations} steps"
