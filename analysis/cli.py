"""What the analysis scripts' command lines share: the parser (results roots, --out, --reference, --resamples),
the finished runs under the roots, notes on stderr (a skipped directory with its reason) and the `error:` line with
its exit status 2."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from analysis.store import Run, StoreError, load

OUT = Path(__file__).resolve().parent / "out"  # --out's default: analysis/out/
REFERENCE = "eagle3"  # --reference's default: the variant the others are compared with


def parser(
    doc: str, roots: bool = True, out: Path | None = OUT, reference: str | None = None, resamples: bool = False
) -> argparse.ArgumentParser:
    """A script's parser, described by the first paragraph of its docstring `doc`: `roots` (results directories or
    run directories), `--out DIR` (default `out`; None: no --out), `--reference VARIANT` (with `reference` as its
    help) and `--resamples N` (bootstrap resamples) where asked for."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    if roots:
        ap.add_argument("roots", nargs="+", type=Path, help="results directories or run directories")
    if out is not None:
        ap.add_argument("--out", type=Path, default=out)
    if reference is not None:
        ap.add_argument("--reference", default=REFERENCE, help=reference)
    if resamples:
        ap.add_argument("--resamples", type=int, default=2000)
    return ap


def warn(message: str) -> None:
    """A note on stderr (`skipped DIR: reason`): stdout keeps the results."""
    print(message, file=sys.stderr)


def noting(messages: list[str]):
    """`warn`, keeping each message in `messages` too (to count them)."""
    return lambda message: (messages.append(message), warn(message))


def wrote(paths) -> None:
    """The last line of a script's output: `-> ` and the files it wrote."""
    print(f"-> {', '.join(map(str, paths))}")


def fail(message: str) -> int:
    """A command line's failure: one `error:` line on stderr; returns the exit status, 2."""
    warn(f"error: {message}")
    return 2


def load_or_exit(roots: list[Path]) -> list[Run]:
    """The finished runs under `roots` (analysis.store.load: each skipped directory named with its reason); none is
    one `error:` line and exit status 2."""
    try:
        return load(roots)
    except StoreError as e:
        sys.exit(fail(str(e)))
