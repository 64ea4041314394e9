#!/usr/bin/env python
"""megalite's single entry point.

    python pretrain.py [--config FILE.toml] [--section.field VALUE ...]
    torchrun --nproc-per-node N pretrain.py --parallel.tp 2 ...

With no arguments it trains a small Llama-style GPT on the embedded demo corpus (the Python
standard library's source), on whatever device is present. `--help` lists every option.
`--check-config [--world-size N] [--local-processes M]` only validates the run (config and predicted
memory) in this one process, as the launch scripts do before starting their workers.
"""

import os
import sys

# Read once, when torch loads its OpenMP runtime, so before the import: waiting threads sleep instead of
# spinning on cores that other processes need (bench/threads.py; megalite/runtime/threads.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from megalite.runtime.malloc import exec_with_malloc_tunables  # noqa: E402

# glibc's tcache off, read only at process start: this process runs again once, with GLIBC_TUNABLES set, so
# freed tensors leave holes the next identical tensor fits (megalite/runtime/malloc.py; skipped where the user
# chose an allocator or --train.tune_malloc false).
if __name__ == "__main__":
    exec_with_malloc_tunables()

from megalite.training.trainer import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
