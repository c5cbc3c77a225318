"""`python -m moesplit COMMAND ...`: the same as the `moesplit` console script."""
import sys

from moesplit.cli import main

sys.exit(main())
