"""eaglelab: train and evaluate EAGLE-3 / EAGLE-3.1 speculative-decoding drafters."""

from eaglelab.core.resolvers import register_resolver

__version__ = "0.1.0"
register_resolver()
