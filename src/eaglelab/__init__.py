"""eaglelab: train and evaluate EAGLE-3 / EAGLE-3.1 speculative-decoding drafters."""

__version__ = "0.1.0"
