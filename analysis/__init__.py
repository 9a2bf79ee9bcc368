"""Downstream of the results store: tables, figures and W&B reports from run directories (analysis/README.md).

Installed with eaglelab (`pip install -e .`), so `from analysis.store import load` works from anywhere; every
module with a command line runs both as `python analysis/<name>.py` and `python -m analysis.<name>`.
"""
