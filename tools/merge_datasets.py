#!/usr/bin/env python3
"""Concatenate indexed datasets (same dtype) into one, in the order given.

The command line of `megatron_lc.data.merge_tool` (its docstring has the details).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from megatron_lc.data.merge_tool import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
