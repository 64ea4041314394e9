"""Process-level settings that make CPU training fast: glibc malloc that keeps its freed memory.

A training step allocates and frees the same large activation buffers every step. With glibc's
defaults, freeing them can leave more than the trim threshold free at the top of the heap, and glibc
returns it to the kernel (`brk` down); the next step takes it back, and the kernel zero-fills every
4 KiB page on first touch. Measured on bench/cpu_compare.py's llama (4 layers, hidden 256, one
thread, megalite alone in its process): 2,700-6,400 minor page faults per step with the defaults,
~1 tuned, and the step 1-4% faster; how much depends on where allocations happen to land. PyTorch's CPU allocator is plain malloc, so the usual cures are jemalloc/tcmalloc (LD_PRELOAD)
or glibc's own knobs; `tune_malloc` sets the latter from inside the process (`mallopt`):

  M_MMAP_THRESHOLD = 64 MiB  buffers up to this come from the heap (reused), not a fresh mmap each
                             time (glibc's dynamic threshold would otherwise move with every free)
  M_TRIM_THRESHOLD = 1 GiB   freed heap memory stays with the process for the next step

torch allocates with posix_memalign (64-byte alignment): glibc carves the request plus the alignment
slack and frees the slack at once, so a small allocation landing there can leave a freed buffer just
too small for the next identical request, and that step grows the heap instead (tests/test_runtime.py
measures the thresholds with plain malloc for this reason).

The cost is that the process keeps its peak heap resident (a training loop reaches the same peak every
step anyway). It is skipped when the environment already chose (`MALLOC_MMAP_THRESHOLD_`,
`MALLOC_TRIM_THRESHOLD_`, or jemalloc/tcmalloc/mimalloc in LD_PRELOAD) and where the C library is not
glibc. `train.tune_malloc=false` turns it off.
"""

from __future__ import annotations

import ctypes
import os
import platform
import re

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # <malloc.h>
MMAP_THRESHOLD_BYTES = 64 << 20
MMAP_THRESHOLD_FALLBACK = 32 << 20  # glibc's documented maximum on 64-bit before 2.35-ish relaxed it
TRIM_THRESHOLD_BYTES = 1 << 30


def tune_malloc() -> str:
    """Apply the settings above once per process; returns what was done, for the startup log."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return "malloc: not glibc, left as is"
    if any(k in os.environ for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")):
        return "malloc: thresholds set by the environment, left as is"
    if re.search(r"jemalloc|tcmalloc|mimalloc", os.environ.get("LD_PRELOAD", "")):
        return "malloc: another allocator is preloaded, left as is"
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return "malloc: libc.so.6 not found, left as is"
    mmap = MMAP_THRESHOLD_BYTES
    if libc.mallopt(M_MMAP_THRESHOLD, mmap) != 1:
        mmap = MMAP_THRESHOLD_FALLBACK
        if libc.mallopt(M_MMAP_THRESHOLD, mmap) != 1:
            return "malloc: mallopt refused, left as is"
    if libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) != 1:
        return "malloc: mallopt refused the trim threshold"
    return f"malloc: glibc keeps freed memory (mmap threshold {mmap >> 20} MiB, trim threshold 1 GiB)"
