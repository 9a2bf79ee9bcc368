"""Regenerate the paper from the results store: figures, tables, every number in the text, and paper.pdf.

    python paper/build.py [RESULTS ...] [--no-pdf]          # default RESULTS: results/   (make paper)

Writes paper/figures/*.{pdf,png} (analysis/figures.py), paper/tables/*.{tex,md,csv} (analysis/compare.py
and the per-condition tables), paper/generated/numbers.tex (every number the text quotes, as \\val{KEY}{NAME})
and builds paper/paper.pdf with latexmk. Everything is built in a staging folder and moved into place only
when all of it succeeded: a failed build leaves the previous paper as it was.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from analysis import cli
from analysis.compare import COLUMNS, cell, comparison, markdown, shown_columns, write
from analysis.drift_table import NAMES as DRIFT_NAMES
from analysis.drift_table import interval as drift_interval
from analysis.drift_table import tables as drift_tables
from analysis.drift_table import write as write_drift
from analysis.figures import draw_all, seed_frames
from analysis.paired import DRIFT, POWER_DEPTH, POWER_SHARE, first_resolved, paired_rows, suite_paired_rows
from analysis.paired import write as write_paired
from analysis.scaling import DEEP_K, MEASURES, scaling_rows
from analysis.scaling import write as write_scaling
from analysis.store import Run, StoreError, load, mean_ci, setups

PAPER = Path(__file__).resolve().parent
ROOT = PAPER.parent

OUTPUTS = ["figures", "tables", "generated", "paper.pdf"]
LATEX_HINT = (
    "latexmk not found: install LaTeX with `sudo apt-get install latexmk texlive-latex-recommended "
    "texlive-fonts-recommended` (`make paper` does, as root), or pass --no-pdf"
)
# The two tables of the paper: acceptance (what the drafter buys) and robustness (how it holds when shifted).
ACCEPTANCE = ["tau", "tau_2ttt", "extrapolation", "val_tau", "vllm_tau", "vllm_speedup_c1", "params_m"]
PAIRED_RESAMPLES = 2000  # bootstrap resamples of the paired comparisons (seeds, then prompts)
ROBUSTNESS = ["long_vs_short", "worst_template", "context_share_deep", "rms_growth"]


def tex_escape(text: str) -> str:
    return str(text).replace("\\", "/").replace("_", r"\_").replace("%", r"\%").replace("&", r"\&").replace("#", r"\#")


def latex_table(rows: list[dict], keys: list[str], reference: str | None) -> str:
    """A booktabs tabular: one row per setup, mean ± 95% CI over its seeds."""
    keys = [k for k in keys if k in shown_columns(rows)]
    head = ["setup", "$n$", *(COLUMNS[k][1] for k in keys)]
    head += [rf"$\tau$ / {tex_escape(reference)}"] if reference else []
    lines = [r"\begin{tabular}{l" + "r" * (len(head) - 1) + "}", r"\toprule", " & ".join(head) + r" \\", r"\midrule"]
    for r in rows:
        cells = [tex_escape(r["setup"]), str(r["seeds"]), *(cell(r, k, COLUMNS[k][2], pm=r" $\pm$ ") for k in keys)]
        if reference:
            cells.append("--" if math.isnan(r["tau_vs_reference"]) else f"{r['tau_vs_reference']:.3f}")
        lines.append(" & ".join(c.replace("–", "--") for c in cells) + r" \\")
    return "\n".join([*lines, r"\bottomrule", r"\end{tabular}"]) + "\n"


def condition_table(runs: list[Run], table: str, column: str, label: str) -> tuple[str, str] | None:
    """Setups × conditions (template condition or context length) at k = ttt_steps, simulated evaluator:
    mean ± 95% CI over seeds. Returns (LaTeX, markdown) or None when no run measured it."""
    groups = setups(runs)
    cells: dict[str, dict[str, str]] = {}
    conditions: list[str] = []
    for setup, members in groups.items():
        for frame in seed_frames(members, table, evaluator="simulated", k=lambda r: r.ttt):
            for condition in frame["condition"].astype(str):
                if condition not in conditions:
                    conditions.append(condition)
        for condition in conditions:
            values = [
                float(f[f["condition"].astype(str) == condition][column].iloc[0])
                for f in seed_frames(members, table, evaluator="simulated", k=lambda r: r.ttt)
                if (f["condition"].astype(str) == condition).any()
            ]
            mean, ci, _, n = mean_ci(values)
            if n:
                cells.setdefault(setup, {})[condition] = f"{mean:.3f}" + ("" if math.isnan(ci) else f" ± {ci:.3f}")
    if not cells:
        return None
    tex = [
        r"\begin{tabular}{l" + "r" * len(conditions) + "}",
        r"\toprule",
        " & ".join([label, *map(tex_escape, conditions)]) + r" \\",
        r"\midrule",
    ]
    md = ["| " + " | ".join([label, *conditions]) + " |", "|" + "---|" * (len(conditions) + 1)]
    for setup, row in cells.items():
        values = [row.get(c, "–") for c in conditions]
        tex.append(
            " & ".join([tex_escape(setup), *(v.replace("±", r"$\pm$").replace("–", "--") for v in values)]) + r" \\"
        )
        md.append("| " + " | ".join([setup, *values]) + " |")
    return "\n".join([*tex, r"\bottomrule", r"\end{tabular}"]) + "\n", "\n".join(md) + "\n"


def scaling_table(rows: list[dict]) -> str:
    """The data-scaling table (analysis/scaling.py) as booktabs: one row per setup and data size."""
    head = ["variant", "prompts", "response tokens", "$n$", *(tex for _, tex, _ in MEASURES.values())]
    lines = [r"\begin{tabular}{lrrr" + "r" * len(MEASURES) + "}", r"\toprule", " & ".join(head) + r" \\", r"\midrule"]
    previous = None
    for r in rows:
        if previous is not None and r["line"] != previous:
            lines.append(r"\addlinespace")  # the next setup's sizes
        previous = r["line"]
        cells = [tex_escape(r["line"]), str(r["num_prompts"]), f"{r['response_tokens']:,}", str(r["seeds"])]
        cells += [cell(r, "tau", 3, pm=r" $\pm$ "), cell(r, "tau_deep", 3, pm=r" $\pm$ ")]
        cells.append(_fmt(r["deep_ratio"]))  # the seed mean of each run's ratio (its CI is in the CSV)
        lines.append(" & ".join(c.replace("–", "--") for c in cells) + r" \\")
    return "\n".join([*lines, r"\bottomrule", r"\end{tabular}"]) + "\n"


def difference_cell(r: dict | None) -> str:
    """A paired difference to three decimals, bold where resolved; -- where this setup has no such depth (setups of
    other ttt_steps reach other depths) or nothing was measured there."""
    if r is None or math.isnan(r["difference"]):
        return "--"
    return rf"\textbf{{{r['difference']:+.3f}}}" if r["resolved"] else f"{r['difference']:+.3f}"


ACCEPTANCE_LABELS = {
    "tau": r"$\Delta\tau(k)$",
    "n_alpha": r"$\Delta\,n\text{-}\alpha(d)$",
    "tf_acc": r"$\Delta$acc$(d)$",
}


def paired_table(rows: list[dict], labels: dict = ACCEPTANCE_LABELS, power: tuple = ("n_alpha", "tf_acc")) -> str:
    """The paired differences against the reference by depth: one block per setup, a row per measure (`labels`:
    measure -> its label), a column per depth (or k); bold where the 95% interval excludes 0; the power rows (for the
    measures in `power`) give the smallest difference resolvable with 80% power at each depth."""
    depths = sorted({r["at"] for r in rows})
    head = ["setup", "", *(f"${d}$" for d in depths)]
    lines = [r"\begin{tabular}{ll" + "r" * len(depths) + "}", r"\toprule", " & ".join(head) + r" \\", r"\midrule"]
    for setup in dict.fromkeys(r["setup"] for r in rows):
        mine = [r for r in rows if r["setup"] == setup]
        name = f"{tex_escape(setup)} $-$ {tex_escape(mine[0]['reference'])}"
        for measure, label in labels.items():
            at = {r["at"]: r for r in mine if r["measure"] == measure}
            cells = [difference_cell(at.get(d)) for d in depths]
            lines.append(" & ".join([name, label, *cells]) + r" \\")
            name = ""
        for measure in power:
            at = {r["at"]: r for r in mine if r["measure"] == measure}
            cells = [f"{at[d]['mde80']:.3f}" if d in at and not math.isnan(at[d]["mde80"]) else "--" for d in depths]
            lines.append(" & ".join(["", f"resolvable, {labels[measure]}", *cells]) + r" \\")
        lines.append(r"\midrule")
    lines[-1] = r"\bottomrule"
    return "\n".join([*lines, r"\end{tabular}"]) + "\n"


def suite_paired_table(rows: list[dict]) -> str:
    """The paired differences against the reference per suite condition (each long-context length and template
    condition on its own prompts): Δτ(k) and Δn-α(d) by depth, bold where the 95% interval excludes 0; last columns:
    the prompts measured and those n-α(POWER_DEPTH) would need to resolve POWER_SHARE of the reference's value with
    80% power."""
    depths = sorted({r["at"] for r in rows})
    head = ["setup", "condition", "", *(f"${d}$" for d in depths), "prompts", r"for 10\%"]
    lines = [r"\begin{tabular}{lll" + "r" * (len(depths) + 2) + "}", r"\toprule", " & ".join(head) + r" \\"]
    lines.append(r"\midrule")
    labels = {"tau": r"$\Delta\tau(k)$", "n_alpha": r"$\Delta\,n\text{-}\alpha(d)$"}

    for setup in dict.fromkeys(r["setup"] for r in rows):
        name = f"{tex_escape(setup)} $-$ {tex_escape(next(r for r in rows if r['setup'] == setup)['reference'])}"
        for scope in dict.fromkeys(r["scope"] for r in rows if r["setup"] == setup):
            mine = [r for r in rows if r["setup"] == setup and r["scope"] == scope]
            condition = tex_escape(scope)
            for measure, label in labels.items():
                at = {r["at"]: r for r in mine if r["measure"] == measure}
                tail = ["", ""]
                if measure == "n_alpha":
                    need = at[POWER_DEPTH]["prompts_for_10pct"] if POWER_DEPTH in at else math.nan
                    tail = [str(mine[0]["prompts"]), "--" if math.isnan(need) else f"{need:.0f}"]
                cells = [difference_cell(at.get(d)) for d in depths]
                lines.append(" & ".join([name, condition, label, *cells, *tail]) + r" \\")
                name = condition = ""
        lines.append(r"\midrule")
    lines[-1] = r"\bottomrule"
    return "\n".join([*lines, r"\end{tabular}"]) + "\n"


def drift_paper_table(rows: list[dict]) -> str:
    """The measures the paper reports: its values (depth 1 -> 8) beside ours, then each claim's interval and verdict
    on a line of its own (the table stays narrow enough to read)."""
    arrow = lambda text: text.replace("→", r"$\to$").replace("(stated, no values)", "(in words)")  # noqa: E731
    head = ["measure", "", "paper, EAGLE-3", "ours", "paper, EAGLE-3.1", "ours"]
    lines = [r"\begin{tabular}{llrrrr}", r"\toprule", " & ".join(head) + r" \\", r"\midrule"]
    for r in rows:
        name = r"\texttt{" + tex_escape(r["measure"]) + "}"
        values = [arrow(r[k]) for k in ("paper_reference", "ours_reference", "paper_variant", "ours_variant")]
        lines.append(" & ".join([name, "value, $d{=}1 \\to$ deepest", *values]) + r" \\")
        change = rf"EAGLE-3, deepest $-$ first: {drift_interval(r, 'change')}"
        pair = rf"EAGLE-3.1 $-$ EAGLE-3 at the deepest: {drift_interval(r, 'pair')}"
        lines.append(
            rf" & \multicolumn{{3}}{{l}}{{{change}}} & \multicolumn{{2}}{{l}}{{\textit{{{r['verdict_change']}}}}} \\"
        )
        lines.append(
            rf" & \multicolumn{{3}}{{l}}{{{pair}}} & \multicolumn{{2}}{{l}}{{\textit{{{r['verdict_pair']}}}}} \\"
        )
        lines.append(r"\midrule")
    lines[-1] = r"\bottomrule"
    return "\n".join([*lines, r"\end{tabular}"]) + "\n"


def drift_sentences(rows: list[dict]) -> str:
    """A sentence per paper measure, generated from the verdicts (generated/drift_verdicts.tex)."""
    out = []
    for r in rows:
        name = tex_escape(DRIFT_NAMES[r["measure"]])
        values = (
            f"the paper has EAGLE-3 {r['paper_reference']} and EAGLE-3.1 {r['paper_variant']}, we have "
            f"{r['ours_reference']} and {r['ours_variant']}"
        ).replace("→", r"$\to$")
        out.append(
            f"{name[0].upper() + name[1:]}: {values}. EAGLE-3's change from the first depth to the deepest is "
            f"{drift_interval(r, 'change')}: the paper's direction {r['verdict_change']}; EAGLE-3.1 $-$ EAGLE-3 at the "
            f"deepest depth is {drift_interval(r, 'pair')}: {r['verdict_pair']}."
        )
    return "% Generated by paper/build.py (analysis/drift_table.py). Do not edit.\n" + "\n".join(out) + "\n"


def _fmt(value, decimals: int = 3) -> str:
    if isinstance(value, float):
        return "--" if math.isnan(value) else f"{value:.{decimals}f}"
    return tex_escape(value)


def step_weights(runs: list[Run]) -> str:
    """The loss weight of each draft step j = 1..ttt_steps, train.step_decay**(j-1) (eaglelab.train.ttt_module), from
    the runs' stored configs: one list per distinct (step_decay, ttt_steps), lists separated by semicolons."""
    combos = sorted({(float(r.config["train.step_decay"]), int(r.config["train.ttt_steps"])) for r in runs})
    return "; ".join(", ".join(f"{decay ** (j - 1):.3g}" for j in range(1, ttt + 1)) for decay, ttt in combos)


def _by_value(text: str) -> tuple:
    """Numbers in numeric order (40 before 160), then anything else alphabetically."""
    try:
        return (0, float(text), "")
    except ValueError:
        return (1, 0.0, text)


def batch_of(config: dict) -> str:
    """A run's batch as the text quotes it: its token budget per process (train.tokens_per_batch), or where it had
    none (or its config predates the key) its sequences per process."""
    budget = config.get("train.tokens_per_batch")
    return f"{budget:,} tokens" if budget else f"{config.get('train.batch_size')} sequences"


def numbers(runs: list[Run], rows: list[dict], skipped: int, duplicates: int, paired: list[dict] = ()) -> str:
    """numbers.tex: \\val{setup or variant}{name} for every number the text quotes, \\val{store}{name} for the
    setup, \\val{scaling}{name} for the data-scaling study. An unknown key prints a bold ?? (and the build still
    succeeds), never a stale number."""
    first = runs[0].config
    listed = lambda values: ", ".join(sorted({str(v) for v in values}, key=_by_value))  # distinct, in order
    one = lambda key: listed(r.config.get(key) for r in runs)
    store = {
        "runs": str(len(runs)),
        "setups": str(len(rows)),
        "skipped": str(skipped),
        "duplicates": str(duplicates),
        "cilevel": "95",
        "seeds": "–".join(sorted({str(r["seeds"]) for r in rows}, key=int)),
        "target": {"smollm2": "SmolLM2-135M-Instruct", "tiny": "a tiny random Llama (test target)"}.get(
            first.get("target.kind"), str(first.get("target.name_or_path"))
        ),
        "ttt": one("train.ttt_steps"),
        "epochs": one("train.epochs"),
        "lr": one("train.lr"),
        "stepdecay": one("train.step_decay"),
        "stepweights": step_weights(runs),
        "batch": listed(batch_of(r.config) for r in runs),
        "loss": one("train.loss"),
        "prompts": one("data.num_prompts"),
        "draftvocab": one("drafter.draft_vocab_size"),
        "trainseq": listed(int(r.metrics.get("data/train_sequences", 0)) for r in runs),
        "evalseq": listed(int(r.metrics.get("data/eval_sequences", 0)) for r in runs),
        "evaluator": "simulated and vLLM"
        if any("vllm/acceptance_length@k1" in r.metrics for r in runs)
        else "simulated",
    }
    lines = [
        r"% Generated by paper/build.py from the results store. Do not edit: run `make paper`.",
        r"\makeatletter",
        r"\newcommand{\val}[2]{\ifcsname eaglelab@#1@#2\endcsname\csname eaglelab@#1@#2\endcsname"
        r"\else\textbf{??}\fi}",
    ]

    def define(key: str, name: str, value: str):
        lines.append(rf"\expandafter\def\csname eaglelab@{key}@{name}\endcsname{{{value}}}")

    for name, value in store.items():
        define("store", name, tex_escape(value))
    if scaling := scaling_rows(runs):  # the data-scaling paragraph's numbers (it is there only with its figure)
        tokens = [r["response_tokens"] for r in scaling]
        define("scaling", "prompts", listed(r["num_prompts"] for r in scaling))
        define("scaling", "tokensmin", f"{min(tokens):,}")
        define("scaling", "tokensmax", f"{max(tokens):,}")
        define("scaling", "k", str(DEEP_K))
    variants = [r["variant"] for r in rows]
    for r in rows:
        keys = [r["setup"]] + ([r["variant"]] if variants.count(r["variant"]) == 1 else [])
        for key in keys:
            define(key, "seeds", str(r["seeds"]))
            define(key, "vsref", _fmt(r["tau_vs_reference"]))
            for measure, (_, _, decimals) in COLUMNS.items():
                define(key, measure, _fmt(r[measure], decimals))
                ci = r[f"{measure}_ci95"]
                define(key, f"{measure}ci", _fmt(ci, decimals))
                # "± ci" for the text (math mode), nothing with a single seed
                define(key, f"{measure}pm", "" if math.isnan(ci) else rf"\pm {ci:.{decimals}f}")
    define("store", "resamples", str(PAIRED_RESAMPLES))
    define("store", "power", "80")  # analysis.paired.MDE_Z: a two-sided 5% test with 80% power
    define("store", "powertarget", f"{POWER_SHARE * 100:g}")  # analysis.paired.prompts_for's share of the reference,
    define("store", "powerdepth", str(POWER_DEPTH))  # quoted for n-α at that depth (suite_paired_table)
    for setup in dict.fromkeys(r["setup"] for r in paired):  # the paired paragraph: τ at ttt, the deepest depth
        mine = [r for r in paired if r["setup"] == setup]
        define(setup, "pairedseeds", str(mine[0]["seeds"]))
        define(setup, "pairedprompts", str(mine[0]["prompts"]))
        for measure, short in (("tau", "tau"), ("n_alpha", "na"), ("tf_acc", "tf")):
            at = {r["at"]: r for r in mine if r["measure"] == measure and not math.isnan(r["difference"])}
            first = first_resolved(paired, setup, measure)
            define(setup, f"first{short}", str(first) if first else "no depth measured")
            for where, d in (("ttt", mine[0]["ttt"]), ("deep", max(at, default=None))):
                if d in at:
                    define(setup, f"{short}{where}at", str(d))
                    define(setup, f"{short}{where}", f"{at[d]['difference']:+.3f}")
                    define(setup, f"{short}{where}ci", f"[{at[d]['ci_low']:+.3f}, {at[d]['ci_high']:+.3f}]")
                    define(setup, f"{short}{where}mde", f"{at[d]['mde80']:.3f}")
    lines.append(r"\makeatother")
    return "\n".join(lines) + "\n"


def generate(runs: list[Run], out: Path, skipped: int, duplicates: int, reference: str) -> list[Path]:
    """Figures, tables and numbers.tex under `out`; returns the files written."""
    written = [p for png in draw_all(runs, out / "figures") for p in (png, png.with_suffix(".pdf"))]
    rows = comparison(runs, reference)
    tables = out / "tables"
    written += write(rows, tables, reference)
    for name, keys in (("acceptance", ACCEPTANCE), ("robustness", ROBUSTNESS)):
        (tables / f"{name}.tex").write_text(latex_table(rows, keys, reference if name == "acceptance" else None))
        written.append(tables / f"{name}.tex")
    for name, table, column, label in (
        ("templates", "suites/templates", "acceptance_length", "setup"),
        ("long_context", "suites/long_context", "acceptance_length", "setup"),
        ("benchmarks", "suites/benchmarks", "acceptance_length", "setup"),
    ):
        if made := condition_table(runs, table, column, label):
            (tables / f"{name}.tex").write_text(made[0])
            (tables / f"{name}.md").write_text(made[1])
            written += [tables / f"{name}.tex", tables / f"{name}.md"]
    if scaling := scaling_rows(runs):
        written += write_scaling(scaling, tables)
        (tables / "data_scaling.tex").write_text(scaling_table(scaling))
        written.append(tables / "data_scaling.tex")
    if paired := paired_rows(runs, reference, PAIRED_RESAMPLES):
        suite_paired = suite_paired_rows(runs, reference, PAIRED_RESAMPLES)
        written += write_paired(paired, tables, suite_paired)
        (tables / "paired.tex").write_text(paired_table(paired))
        written.append(tables / "paired.tex")
        if suite_paired:
            (tables / "paired_suites.tex").write_text(suite_paired_table(suite_paired))
            written.append(tables / "paired_suites.tex")
    (out / "generated").mkdir(parents=True, exist_ok=True)
    if len({r.config.get("train.loss") for r in runs}) > 1:  # a loss study (sweeps/loss_grid.yaml)
        written += loss_study(runs, tables, out / "generated")
    drift_paired, drift_changes, drift_paper = drift_tables(runs, reference, count=PAIRED_RESAMPLES)
    if drift_paired:  # the drift suite's measures paired per flag, and held to the paper's values
        written += write_drift(drift_paired, drift_changes, drift_paper, tables)
        drift_labels = {m: tex_escape(DRIFT_NAMES[m]) for m in DRIFT}  # (the drift measures: no power rows)
        (tables / "drift_paired.tex").write_text(paired_table(drift_paired, drift_labels, power=()))
        written.append(tables / "drift_paired.tex")
        if drift_paper:
            (tables / "drift_vs_paper.tex").write_text(drift_paper_table(drift_paper))
            (out / "generated" / "drift_verdicts.tex").write_text(drift_sentences(drift_paper))
            written += [tables / "drift_vs_paper.tex", out / "generated" / "drift_verdicts.tex"]
    (out / "generated" / "numbers.tex").write_text(numbers(runs, rows, skipped, duplicates, paired))
    written.append(out / "generated" / "numbers.tex")
    print(markdown(rows, reference))
    return written


LOSS_NAMES = {
    "ce": "CE",
    "kl": "forward KL",
    "rkl": "reverse KL",
    "jsd": "JSD",
    "tv": "TV",
    "nla": r"$-\log\alpha$",
    "lk_hybrid": "KL/TV blend",
}


def loss_study(runs: list[Run], tables: Path, generated: Path) -> list[Path]:
    """Every loss paired with forward KL and with CE on the same prompts and seeds (tables/loss_vs_{kl,ce}.tex) and
    the study's finding in words (generated/loss_study.tex): Δτ at the trained and the deepest k, by loss."""
    written, sentences = [], []
    for ref in ("kl", "ce"):
        rows = [r for r in paired_rows(runs, f"loss={ref}", PAIRED_RESAMPLES)]
        if not rows:
            continue
        (tables / f"loss_vs_{ref}.tex").write_text(paired_table(rows))
        written.append(tables / f"loss_vs_{ref}.tex")
        tau = {(r["setup"], r["at"]): r for r in rows if r["measure"] == "tau"}
        trained, deepest = runs[0].ttt, max(k for _, k in tau)
        said, above, below = [], 0, 0
        for setup in dict.fromkeys(r["setup"] for r in rows):
            cells = []
            for k in dict.fromkeys((trained, deepest)):
                if (r := tau.get((setup, k))) is None:
                    continue
                interval = f"[{r['ci_low']:+.3f}, {r['ci_high']:+.3f}]"
                cells.append(
                    rf"$\Delta\tau({k}) = {r['difference']:+.3f}$ {interval}" + ("" if r["resolved"] else " (n.s.)")
                )
            if (r := tau.get((setup, trained))) is not None and r["resolved"]:
                above, below = above + (r["difference"] > 0), below + (r["difference"] < 0)
            loss = setup.split("loss=")[-1].split()[0]
            said.append(f"{LOSS_NAMES.get(loss, loss)}: " + "; ".join(cells))
        verdict = (
            f"At the trained depth {above} of {len(said)} losses resolve above {LOSS_NAMES[ref]} and {below} below it; "
            "the rest are within their intervals (n.s.)."
        )
        head = rf"Against {LOSS_NAMES[ref]} (Table~\ref{{tab:loss_vs_{ref}}}): "
        sentences.append(head + "; ".join(said) + ". " + verdict)
    if sentences:
        (generated / "loss_study.tex").write_text("\n\n".join(sentences) + "\n")
        written.append(generated / "loss_study.tex")
    return written


def build_pdf(staging: Path) -> Path:
    """latexmk on paper.tex next to the generated files."""
    if not shutil.which("latexmk"):
        raise StoreError(LATEX_HINT)
    shutil.copy(PAPER / "paper.tex", staging / "paper.tex")
    try:
        proc = subprocess.run(
            ["latexmk", "-pdf", "-interaction=nonstopmode", "-halt-on-error", "paper.tex"],
            cwd=staging,
            capture_output=True,
            text=True,
            timeout=600,
        )
    except subprocess.TimeoutExpired:
        raise StoreError("latexmk did not finish in 600 s; see paper.log") from None
    if proc.returncode != 0:
        log = staging / "paper.log"
        errors = [
            line
            for line in (log.read_text(errors="replace").splitlines() if log.exists() else [])
            if line.startswith("!")
        ]
        raise StoreError(f"latexmk failed ({errors[0] if errors else proc.stdout[-300:]}); see paper.log")
    return staging / "paper.pdf"


def install(staging: Path, out: Path) -> None:
    """Swap the new outputs in: each old one is renamed away first, then the new one renamed into place. An old
    paper.pdf that was not rebuilt (--no-pdf) goes too: it would quote the previous store's numbers."""
    trash = Path(tempfile.mkdtemp(prefix=".old-", dir=out))
    for name in OUTPUTS:
        if (out / name).exists():
            os.replace(out / name, trash / name)
        if (staging / name).exists():
            os.replace(staging / name, out / name)
    shutil.rmtree(trash, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = cli.parser(__doc__, roots=False, out=None, reference="variant the τ ratios are taken against")
    ap.add_argument(
        "roots",
        nargs="*",
        type=Path,
        default=[ROOT / "results"],
        help="results directories or run directories (default: results/)",
    )
    ap.add_argument("--no-pdf", action="store_true", help="figures, tables and numbers only (no LaTeX needed)")
    ap.add_argument("--out", type=Path, default=PAPER, help="where figures/, tables/, generated/ and paper.pdf go")
    args = ap.parse_args(argv)
    skipped: list[str] = []
    duplicates: list[str] = []
    args.out.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".build-", dir=args.out))
    try:
        runs = load(
            args.roots,
            warn=cli.noting(skipped),
            duplicate=cli.noting(duplicates),
        )
        written = generate(runs, staging, len(skipped), len(duplicates), args.reference)
        if not args.no_pdf:
            written.append(build_pdf(staging))
        install(staging, args.out)
    except StoreError as e:
        return cli.fail(str(e))
    finally:
        if (staging / "paper.log").exists():  # LaTeX's log, kept for a failed build too
            shutil.copy(staging / "paper.log", args.out / "paper.log")
        shutil.rmtree(staging, ignore_errors=True)
    print(f"{len(runs)} runs ({len(skipped)} directories skipped, {len(duplicates)} repeated seeds set aside) ->")
    for path in written:
        print("  ", args.out / path.relative_to(staging))
    return 0


if __name__ == "__main__":
    sys.exit(main())
