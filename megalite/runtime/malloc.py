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

The cost is that the process keeps its peak heap resident (a training loop reaches the same peak every
step anyway). It is skipped when the environment already chose (`MALLOC_MMAP_THRESHOLD_`,
`MALLOC_TRIM_THRESHOLD_`, or jemalloc/tcmalloc/mimalloc in LD_PRELOAD) and where the C library is not
glibc. `train.tune_malloc=false` turns it off.

What the heap keeps beyond the live tensors (docs/estimator.md, "What the allocator adds"): torch allocates
every CPU tensor with posix_memalign(64). glibc before 2.38 serves it by carving size + 64 + 32 bytes and
freeing the leading and trailing slack at once; those small pieces go to the thread cache (tcache) and the
fastbins, where glibc never merges them with their neighbours, or small objects take them. A freed tensor
is then a hole exactly its own size, too small for the next identical request (which asks for the slack
again), and each layer's forward transients of one step land above the last: measured with a malloc trace
on a llama of hidden 768 at tp 2 + SP, 87 x 1.5 MiB and 19 x 3 MiB tensors are allocated and freed in every
forward, and the heap held 96-120 MiB of such holes at its peak. With the tcache and the fastbins off the
slack merges back when its tensor is freed, and the hole fits the next identical request: 80-100 MiB less per
process at the same speed (docs/performance.md; tests/test_runtime.py measures the thresholds with plain malloc,
whose same-size requests reuse a freed chunk exactly). The fastbins are a `mallopt` (M_MXFAST = 0); the tcache
is read once, at process start, from `GLIBC_TUNABLES`, so `exec_with_malloc_tunables` (pretrain.py's first
call, before torch is imported) re-executes the process once with `glibc.malloc.tcache_count=0` added, unless
the user set GLIBC_TUNABLES' malloc entries, another allocator, or train.tune_malloc false (`--train.tune_malloc
false`, `--train.tune-malloc=no`, or `tune_malloc = false` under `[train]` of the `--config` file); and only where
the program is a script it can run again (not one read from stdin).
"""

from __future__ import annotations

import ctypes
import os
import platform
import re
import sys
from collections.abc import Mapping, Sequence

M_MXFAST, M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = 1, -1, -3  # <malloc.h>
MMAP_THRESHOLD_BYTES = 64 << 20
MMAP_THRESHOLD_FALLBACK = 32 << 20  # glibc's documented maximum on 64-bit before 2.35-ish relaxed it
TRIM_THRESHOLD_BYTES = 1 << 30
TCACHE_OFF = "glibc.malloc.tcache_count=0"


def _environment_chose(env: Mapping[str, str]) -> str | None:
    """Why the environment's own allocator settings stand (None: they do not)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return "malloc: not glibc, left as is"
    if any(k in env for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")):
        return "malloc: thresholds set by the environment, left as is"
    if re.search(r"jemalloc|tcmalloc|mimalloc", env.get("LD_PRELOAD", "")):
        return "malloc: another allocator is preloaded, left as is"
    return None


_FALSE = frozenset({"false", "0", "no", "n", "off"})  # megalite/config/cli.py's spellings of false


def _turned_off(argv: Sequence[str]) -> bool:
    """Whether `argv` sets train.tune_malloc to false, read as the config parser reads it (a layer below
    megalite.config, so by the same rules rather than by importing it): a dash in the field name is an
    underscore (`--train.tune-malloc`), `--k=v` is `--k v`, a bare flag is true, the command line wins over a
    `--config` file's `[train] tune_malloc`. An unreadable file leaves the choice to the defaults: the run
    reports that file itself, after the restart."""
    value: object = None
    config_file = None
    for i, arg in enumerate(argv):
        name, eq, given = arg.partition("=")
        if not eq:
            given = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else "true"
        if name == "--config":
            config_file = given
        elif name.replace("-", "_") == "__train.tune_malloc":
            value = given
    if value is None and config_file is not None:
        try:
            import tomllib

            with open(config_file, "rb") as f:
                train = tomllib.load(f).get("train", {})
            value = {k.replace("-", "_"): v for k, v in train.items()}.get("tune_malloc") \
                if isinstance(train, dict) else None
        except (OSError, ValueError, UnicodeDecodeError):
            value = None
    if isinstance(value, bool):
        return not value
    return isinstance(value, str) and value.strip().lower() in _FALSE


def runs_a_script(argv0: str) -> bool:
    """Whether running the interpreter again with its arguments runs the same program: a script file or `-c`
    (`-m` sets argv[0] to the module's file). Not a program read from stdin (`python - < pretrain.py`: argv[0]
    "-", or "" for `python < pretrain.py`) or from a pipe (`python <(cat pretrain.py)`): it was consumed, and
    the restarted process would read nothing, run nothing and exit 0."""
    return argv0 == "-c" or os.path.isfile(argv0)


def tunables_to_exec(env: Mapping[str, str], argv: Sequence[str]) -> str | None:
    """The GLIBC_TUNABLES value to re-execute with (the tcache off, the caller's other tunables kept), or None
    where the process should run as it is: not glibc, the environment chose (above, or any glibc.malloc
    tunable of its own, ours included: the re-executed process), or train.tune_malloc false in `argv`
    (`_turned_off`)."""
    if _environment_chose(env) is not None:
        return None
    tunables = env.get("GLIBC_TUNABLES", "")
    if "glibc.malloc." in tunables or _turned_off(argv):
        return None
    return f"{tunables}:{TCACHE_OFF}" if tunables else TCACHE_OFF


def exec_with_malloc_tunables() -> None:
    """Re-execute this process (same interpreter, flags and arguments) with `tunables_to_exec`'s GLIBC_TUNABLES,
    once; returns without doing anything where it is None. Call it first, before torch is imported."""
    tunables = tunables_to_exec(os.environ, sys.argv[1:])
    # An embedded interpreter has no executable to run again; a program read from stdin cannot be read twice.
    if tunables is None or not sys.executable or not sys.argv or not runs_a_script(sys.argv[0]):
        return
    before = os.environ.get("GLIBC_TUNABLES")
    os.environ["GLIBC_TUNABLES"] = tunables
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
    except OSError:  # could not run it again: go on with the tcache on (tune_malloc's log line says so)
        if before is None:
            del os.environ["GLIBC_TUNABLES"]
        else:
            os.environ["GLIBC_TUNABLES"] = before


def tune_malloc() -> str:
    """Apply the settings above once per process; returns what was done, for the startup log."""
    chose = _environment_chose(os.environ)
    if chose is not None:
        return chose
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
    fastbins = "fastbins off" if libc.mallopt(M_MXFAST, 0) == 1 else "fastbins on (mallopt refused)"
    tcache = "tcache off" if TCACHE_OFF in os.environ.get("GLIBC_TUNABLES", "") else "tcache on"
    return (f"malloc: glibc keeps freed memory (mmap threshold {mmap >> 20} MiB, trim threshold 1 GiB, "
            f"{fastbins}, {tcache})")
