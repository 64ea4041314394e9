#!/usr/bin/env python
"""megalite's single entry point.

    python pretrain.py [--config FILE.toml] [--section.field VALUE ...]
    torchrun --nproc-per-node N pretrain.py --parallel.tp 2 ...

With no arguments it trains a small Llama-style GPT on the embedded demo corpus (the Python
standard library's source), on whatever device is present. `--help` lists every option.
`--check-config [--world-size N] [--local-processes M]` only validates the run (config and predicted
memory) in this one process, as the launch scripts do before starting their workers.
"""

import sys

from megalite.training.trainer import main

if __name__ == "__main__":
    sys.exit(main())
