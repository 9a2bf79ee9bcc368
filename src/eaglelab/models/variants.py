"""The drafter variants the paper compares, defined once: name -> the design flags that make it.

`+ablation=NAME` (NAME with `_` for `.`: `eagle3_1`) sets these flags (eaglelab.core.config registers one Hydra
config per entry), a run's `variant` label is looked up here from its flags, and analysis/ hides exactly
these flags from its setup labels because the variant name already says them. Add a variant: one line.
"""

from __future__ import annotations

from collections.abc import Mapping

# The flags a variant fixes. Other drafter settings (norm_before_residual, num_layers, ...) are shown
# next to the variant's name wherever they differ between runs.
VARIANT_FLAGS = ("fc_norm", "norm_before_fc", "norm_output")

VARIANTS: dict[str, dict[str, bool]] = {
    "eagle3.1": dict(fc_norm=True, norm_before_fc=False, norm_output=True),  # both EAGLE-3.1 changes (default)
    "no_fc_norm": dict(fc_norm=False, norm_before_fc=False, norm_output=True),
    "no_norm_output": dict(fc_norm=True, norm_before_fc=False, norm_output=False),
    "eagle3": dict(fc_norm=False, norm_before_fc=False, norm_output=False),  # both changes off
    "norm_before_fc": dict(fc_norm=False, norm_before_fc=True, norm_output=True),  # one norm over the concat
}
CUSTOM = "custom"  # flags that match no named variant


def ablation_name(variant: str) -> str:
    """The config name of a variant (`+ablation=eagle3_1`): Hydra config names hold no dots."""
    return variant.replace(".", "_")


def variant_of(drafter: Mapping | object) -> str:
    """The name of the variant whose flags `drafter` (a config node or object with the flags) has."""
    get = drafter.get if isinstance(drafter, Mapping) else lambda k: getattr(drafter, k)
    flags = {k: bool(get(k)) for k in VARIANT_FLAGS}
    return next((name for name, fixed in VARIANTS.items() if fixed == flags), CUSTOM)
