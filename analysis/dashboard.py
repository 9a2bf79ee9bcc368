"""A W&B report comparing drafter variants, built from code (wandb-workspaces).

    python analysis/dashboard.py results/ --entity ME [--project eaglelab] [--group ablation_grid_...]
    python analysis/dashboard.py results/ --dry-run report.json     # the report's specification, no server

The runs must have been logged with `logger=wandb` (and, if offline, uploaded with `wandb sync`). The local
results store says which metrics exist (the trained depths, template conditions, context lengths); the report
then shows, per variant (W&B groups runs by `config.variant`, seeds aggregated as mean ± standard error):
τ vs draft depth k, τ relative to the trained depth, τ vs context length, τ and its ratio to native per
template condition, the attention-drift measures per draft depth, and the training curves.
A dry run writes the specification `Report.save()` would upload (blocks, panels, run sets, metric names).
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

from analysis import cli
from eaglelab.core.errors import first_line
from eaglelab.results.tracking import DRIFT_MEASURES  # the curves eaglelab.results.tracking logs

SEEDS = dict(groupby_aggfunc="mean", groupby_rangefunc="stderr")  # every panel: mean ± SE over seeds


def report_metrics(runs) -> dict:
    """What the runs measured: trained depths, and the per-condition summary keys of the templates suite."""
    keys = set().union(*(r.metrics for r in runs))
    ttts = sorted({r.ttt for r in runs})
    template_keys = sorted(
        k
        for k in keys
        if re.fullmatch(
            r"templates/simulated/(acceptance_length|ratio_to_native)"
            r"@.+@k\d+",
            k,
        )
    )
    return {
        "ttts": ttts,
        "templates": template_keys,
        "long_context": any(k.startswith("long_context/simulated/") for k in keys),
        "drift": any(k.startswith("drift/") for k in keys),
        "vllm": any(k.startswith("vllm/acceptance_length") for k in keys),
    }


def build_report(runs, project: str, entity: str, group: str | None, title: str):
    import wandb_workspaces.reports.v2 as wr

    seen = report_metrics(runs)
    variant = wr.Config("variant")
    runset = wr.Runset(
        entity=entity,
        project=project,
        name=group or "all runs",
        groupby=["config.variant"],
        filters=f"Metric('Group') == '{group}'" if group else "",
    )

    def line(title, x, y, xlabel, ylabel, **kw):
        return wr.LinePlot(title=title, x=x, y=[y], title_x=xlabel, title_y=ylabel, groupby=variant, **SEEDS, **kw)

    def grid(*panels):
        return wr.PanelGrid(runsets=[runset], panels=list(panels))

    by_k = [
        line(
            "τ vs draft depth (simulated, all held-out prompts)",
            "by_k/k",
            "by_k/acceptance_length",
            "draft tokens per round k",
            "acceptance length τ",
        ),
        line(
            "τ(k) / τ(ttt_steps): train → inference extrapolation",
            "by_k/k",
            "by_k/relative_to_ttt",
            "draft tokens per round k",
            "τ relative to the trained depth",
        ),
    ]
    if seen["vllm"]:
        by_k.append(
            line(
                "τ vs draft depth, vLLM",
                "by_k/k",
                "by_k/acceptance_length_vllm",
                "draft tokens per round k",
                "acceptance length τ (vLLM)",
            )
        )
    by_depth = [
        line("n-α(d), simulated (deepest k)", "by_depth/depth", "by_depth/n_alpha", "draft depth d", "n-α"),
        line("teacher-forced accuracy by depth", "by_depth/depth", "by_depth/tf_accuracy", "draft depth d", "accuracy"),
    ]
    if seen["vllm"]:
        by_depth.append(
            line("n-α(d), vLLM (deepest k)", "by_depth/depth", "by_depth/n_alpha_vllm", "draft depth d", "n-α (vLLM)")
        )
    blocks = [
        wr.TableOfContents(),
        wr.P(
            f"{len(runs)} runs, variants: {', '.join(sorted({r.variant for r in runs}))}; trained depths "
            f"ttt_steps ∈ {seen['ttts']}. Each line is a variant's mean over seeds, the band ± one standard "
            "error. Built by analysis/dashboard.py from the results store."
        ),
        wr.H1("Acceptance length vs draft depth"),
        grid(*by_k),
        wr.H1("Acceptance by depth: where the variants separate"),
        wr.P(
            "τ folds every depth into one number and chains rarely survive three drafts, so variants that differ at "
            "depth look alike in τ. n-α(d) is the acceptance rate at depth d among the rounds whose chain reached d; "
            "teacher-forced accuracy scores the d-th draft at every position. Paired per-prompt intervals: "
            "analysis/paired.py."
        ),
        grid(*by_depth),
    ]
    if seen["long_context"]:
        blocks += [
            wr.H1("Long context"),
            grid(
                line(
                    "τ vs prompt length (k = ttt_steps)",
                    "by_length/prompt_tokens",
                    "by_length/acceptance_length",
                    "prompt length (tokens)",
                    "acceptance length τ",
                    log_x=True,
                )
            ),
        ]
    if seen["templates"]:
        bars = [
            wr.BarPlot(
                title=f"τ per template condition ({kind})",
                orientation="v",
                groupby=variant,
                **SEEDS,
                metrics=[k for k in seen["templates"] if f"/{kind}@" in k],
                title_y=kind,
            )
            for kind in ("acceptance_length", "ratio_to_native")
        ]
        blocks += [wr.H1("Chat templates and system prompts"), grid(*bars)]
    if seen["drift"]:
        blocks += [
            wr.H1("Attention drift per draft depth"),
            grid(
                *(
                    line(f"{m} per draft depth", "by_depth/depth", f"by_depth/{m}", "draft depth j", m)
                    for m in DRIFT_MEASURES
                )
            ),
        ]
    blocks += [
        wr.H1("Training"),
        grid(
            line("training loss", "trainer/global_step", "train/loss", "optimizer step", "loss"),
            *(
                line(
                    f"validation τ at k = {t}",
                    "trainer/global_step",
                    f"val/acceptance_length@k{t}",
                    "optimizer step",
                    "τ",
                )
                for t in seen["ttts"]
            ),
        ),
    ]
    return wr.Report(
        project=project,
        entity=entity,
        title=title,
        blocks=blocks,
        description="EAGLE-3 / EAGLE-3.1 drafter variants under shifted conditions (eaglelab)",
    )


def specification(report) -> dict:
    """The report as plain data (what `save()` uploads), each block and panel named by its type."""
    import pydantic
    import wandb_workspaces.reports.v2 as wr

    spec = pydantic.TypeAdapter(wr.Report).dump_python(report, mode="json")
    for block, dumped in zip(report.blocks, spec["blocks"]):
        dumped["type"] = type(block).__name__
        for panel, dumped_panel in zip(getattr(block, "panels", None) or [], dumped.get("panels", [])):
            dumped_panel["type"] = type(panel).__name__
    return spec


def main(argv: list[str] | None = None) -> int:
    ap = cli.parser(__doc__, out=None)
    ap.add_argument("--project", default="eaglelab")
    ap.add_argument("--entity", default=os.environ.get("WANDB_ENTITY"), help="W&B entity (or WANDB_ENTITY)")
    ap.add_argument("--group", help="only the runs of this W&B group (a sweep's folder name)")
    ap.add_argument("--title", default="EAGLE-3 vs EAGLE-3.1: acceptance length under shifted conditions")
    ap.add_argument("--dry-run", type=Path, metavar="SPEC.json", help="write the specification instead of saving")
    args = ap.parse_args(argv)
    runs = cli.load_or_exit(args.roots)
    if not args.dry_run and not args.entity:
        return cli.fail("no W&B entity; pass --entity NAME (or set WANDB_ENTITY), or --dry-run SPEC.json")
    report = build_report(runs, args.project, args.entity or "", args.group, args.title)
    if args.dry_run:
        spec = specification(report)
        args.dry_run.parent.mkdir(parents=True, exist_ok=True)
        args.dry_run.write_text(json.dumps(spec, indent=1, ensure_ascii=False) + "\n")
        panels = sum(len(b.get("panels", [])) for b in spec["blocks"])
        print(f"{args.dry_run}: {len(spec['blocks'])} blocks, {panels} panels over {len(runs)} runs (not uploaded)")
        return 0
    try:
        report.save()
    except Exception as e:  # not logged in, no network, no such project
        return cli.fail(
            f"could not save the report to W&B ({first_line(e)}); run `wandb login` and "
            "`wandb sync` the runs first, or use --dry-run SPEC.json"
        )
    print(report.url)
    return 0


if __name__ == "__main__":
    sys.exit(main())
