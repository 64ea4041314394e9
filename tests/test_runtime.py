"""`megalite.runtime.tune_malloc`: what it does, when it stands aside, and that it works.

The working test runs in fresh subprocesses (allocator settings are process-wide): a 48 MiB buffer
is filled, freed and allocated and filled again. With glibc's defaults a buffer that size is
mmap'd each time (it is above the 32 MiB ceiling of glibc's dynamic threshold), so the second fill
page-faults all ~12,000 pages back in; tuned, the freed memory is reused and the second fill takes
(almost) no faults. The threshold of 1,000 faults sits far from both. (Where the kernel maps such a
buffer with transparent huge pages there is nothing to measure, and the test says so.)
"""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from megalite.runtime import malloc as runtime

PROBE = """
import resource, sys, torch
from megalite.runtime.malloc import tune_malloc
if sys.argv[1] == "tuned":
    print(tune_malloc(), file=sys.stderr)
n = 48 << 18  # fp32 elements in 48 MiB
torch.empty(n).fill_(1.0)  # allocate, touch, free
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
torch.empty(n).fill_(2.0)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""

glibc = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                           reason="glibc malloc only")


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120, check=True)
    return int(out.stdout.strip().splitlines()[-1])


@glibc
def test_tuned_malloc_reuses_freed_memory_without_page_faults() -> None:
    default = _faults("default")
    if default < 10_000:  # e.g. transparent huge pages set to "always": a few faults map the whole buffer
        pytest.skip(f"only {default} faults with glibc's defaults here: nothing for the tuning to remove")
    assert _faults("tuned") < 1_000


@glibc
def test_it_reports_what_it_did(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "LD_PRELOAD"):
        monkeypatch.delenv(var, raising=False)
    assert runtime.tune_malloc().startswith("malloc: glibc keeps freed memory")


def test_the_environment_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "0")
    assert "set by the environment" in runtime.tune_malloc() or "not glibc" in runtime.tune_malloc()
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_")
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2")
    assert "another allocator" in runtime.tune_malloc() or "not glibc" in runtime.tune_malloc()


def test_pretrain_can_turn_it_off() -> None:
    from megalite.config import parse_args

    assert parse_args([]).train.tune_malloc is True
    assert parse_args(["--train.tune_malloc", "false"]).train.tune_malloc is False
