"""Paired call-by-call timing on any bench family (`mmspec.bench.paired`: its docstring says how to write a
configuration; `--help` lists the options).

    python scripts/paired_calls.py --family llamagen --temperature 1 --family-option top_k=64 \
        --family-option decode=false --batch-size 8 --rounds 40 --methods sjd,eagle,draft-model --threads 2
"""

import sys

from mmspec.bench.paired import main

if __name__ == "__main__":
    sys.exit(main())
