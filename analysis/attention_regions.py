"""Where the drafter's attention goes as it drafts deeper: the share on each region of the keys, per depth.

    python analysis/attention_regions.py results/ [more roots] [--sequences 8] [--out DIR]

The drift suite's shares overlap: at depth d the R most recent keys (`recent_share`) are the chain's d-1 own drafts
and the last R-d+1 verified tokens, so one number mixes attention on the drafts with attention on the local context,
which can move in opposite directions. Here every key of a query drafting from verified position t falls in exactly
one region, by position id:

    first token      0
    prompt           1 .. P-1 (the rest of the prompt: chat template, system prompt, the request)
    earlier answer   P .. t-R (the response before the local context)
    local context    max(t-R+1, 1) .. t (the R most recent verified tokens; R = the suite's recent_tokens)
    own drafts       t+1 .. t+d-1 (the chain's keys, this query's own included)

(regions are taken in the order own drafts, local context, first token, prompt, earlier answer). The attention is
the independent engine-style drafter's (analysis/drift_check.py: the exported folder and the target's embedding
only), on the first `--sequences` of the drift suite's sequences of each run, averaged over heads and layers, then
over drafts; then over the seeds of a setup (± SE). Writes DIR/attention_regions.{csv,md} and a figure per setup.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from analysis import cli
from analysis.drift_check import drafts, load_run, single_turn
from analysis.store import setups

REGIONS = ("first token", "prompt", "earlier answer", "local context", "own drafts")


def region_of(key_pos: torch.Tensor, t: int, prompt_len: int, recent: int) -> torch.Tensor:
    """[keys] the region index (REGIONS) of each key for a query drafting from verified position t."""
    region = torch.full_like(key_pos, REGIONS.index("earlier answer"))
    region[key_pos < prompt_len] = REGIONS.index("prompt")
    region[key_pos == 0] = REGIONS.index("first token")
    region[(key_pos > t - recent) & (key_pos <= t) & (key_pos > 0)] = REGIONS.index("local context")
    region[key_pos > t] = REGIONS.index("own drafts")
    return region


def run_regions(run_dir: Path, sequences: int) -> pd.DataFrame:
    """One run: rows (depth, region, share), each the mean over its drafts."""
    drafter, seqs, inputs = load_run(run_dir)
    sums, counts = defaultdict(float), defaultdict(int)
    for ids, aux, prompt_len in single_turn(seqs, run_dir.name, sequences):
        for t, j, _, layers in drafts(drafter, ids, aux, prompt_len, inputs["depth"]):
            for probs, key_pos in layers:
                region = region_of(key_pos, t, prompt_len, inputs["recent_tokens"])
                share = torch.zeros(len(REGIONS), dtype=torch.float64).index_add_(0, region, probs.mean(0))
                for r, name in enumerate(REGIONS):
                    sums[(j, name)] += float(share[r]) / len(layers)
            counts[j] += 1
    return pd.DataFrame(
        [{"depth": j, "region": name, "share": sums[(j, name)] / counts[j]} for j in sorted(counts) for name in REGIONS]
    )


def plot(table: pd.DataFrame, out: Path) -> Path:
    """One panel per setup: the regions' shares stacked by depth."""
    import matplotlib.pyplot as plt

    from eaglelab.evaluate.plots import save_figure

    names = list(dict.fromkeys(table["setup"]))
    fig, axes = plt.subplots(1, len(names), figsize=(3.4 * len(names) + 1.4, 3.2), sharey=True, squeeze=False)
    for ax, name in zip(axes[0], names):
        mine = table[table["setup"] == name].pivot(index="depth", columns="region", values="mean")[list(REGIONS)]
        ax.stackplot(mine.index, mine.T.to_numpy(), labels=REGIONS)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("draft depth d")
        ax.set_ylim(0, 1)
    axes[0][0].set_ylabel("share of attention")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles[::-1], labels[::-1], loc="center right", fontsize=8)  # top region first, as stacked
    fig.suptitle("where the attention goes by draft depth (independent engine-style drafter)", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1 - 1.4 / (3.4 * len(names) + 1.4), 1))
    path = out / "attention_regions.png"
    save_figure(fig, path)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = cli.parser(__doc__)
    ap.add_argument("--sequences", type=int, default=8, help="the first N of each run's drift sequences")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # small products one after another: more threads only wait on each other
    runs = [r for r in cli.load_or_exit(args.roots) if (r.dir / "suites" / "drift_inputs.json").is_file()]
    if not runs:
        return cli.fail("no finished run has suites/drift_inputs.json; evaluate with the drift suite on")
    per_run = []
    for label, members in setups(runs).items():
        for r in members:
            per_run.append(run_regions(r.dir, args.sequences).assign(setup=label, seed=r.seed))
    rows = pd.concat(per_run)
    table = (
        rows.groupby(["setup", "depth", "region"], sort=False)["share"]
        .agg(mean="mean", se=lambda x: float(np.std(x, ddof=1) / np.sqrt(len(x))) if len(x) > 1 else np.nan,
             seeds="count")
        .reset_index()
    )  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    table.to_csv(args.out / "attention_regions.csv", index=False)
    lines = ["| setup | depth | " + " | ".join(REGIONS) + " |", "|---" * (2 + len(REGIONS)) + "|"]
    for label in dict.fromkeys(table["setup"]):
        mine = table[table["setup"] == label]
        for d in (1, int(mine["depth"].max())):
            at = mine[mine["depth"] == d].set_index("region")
            cells = [f"{at.loc[n, 'mean']:.3f} ± {at.loc[n, 'se']:.3f}" for n in REGIONS]
            lines.append(f"| {label} | {d} | " + " | ".join(cells) + " |")
    text = (
        f"Share of attention per key region (mean ± SE over seeds; {args.sequences} sequences per run).\n\n"
        + "\n".join(lines)
        + "\n"
    )
    (args.out / "attention_regions.md").write_text(text)
    figure = plot(table, args.out)
    print(text)
    cli.wrote([args.out / "attention_regions.csv", args.out / "attention_regions.md", figure])
    return 0


if __name__ == "__main__":
    sys.exit(main())
