"""`python -m eaglelab.export CHECKPOINT OUT [--format speculators]`: eaglelab.export.eagle3's command line."""

from eaglelab.export.eagle3 import main

if __name__ == "__main__":
    main()
