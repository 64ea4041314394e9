"""`megalite.runtime.tune_malloc`: what it does, when it stands aside, and that it works.

The working test runs in fresh subprocesses (allocator settings are process-wide) and calls glibc's
malloc/free directly through ctypes: a buffer is allocated, filled, freed, allocated and filled again,
and the second fill's minor page faults are counted. With glibc's defaults a 48 MiB buffer is above
the 32 MiB ceiling of the dynamic mmap threshold, so each allocation is a fresh mmap and the second
fill faults every page back in; tuned (mmap threshold 64 MiB, trim threshold 1 GiB) it comes from
the heap, the freed memory stays there and the second fill takes (almost) no faults.

Why not torch tensors: torch allocates with posix_memalign, which asks glibc for the size plus the
alignment slack and frees the slack at once. A small allocation landing in that slack leaves the freed
buffer a few bytes too small for the next, identical request, and the heap grows instead: on a 2-core
machine that happened in about half of the runs (12,288 faults tuned, the whole buffer), whatever the
thresholds. Plain malloc of the same size reuses the freed chunk exactly (same size class), so the
probe measures the thresholds and nothing else.

Where the mechanism cannot be seen the test skips and says why: transparent huge pages set to
"always" (a few faults map the whole buffer even with the defaults), or a glibc that refuses a
threshold above the buffer.
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megalite.runtime import malloc as runtime

REPO = Path(__file__).resolve().parents[1]

PROBE = """
import ctypes, resource, sys
from megalite.runtime.malloc import tune_malloc
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
n = int(sys.argv[2])
if sys.argv[1] == "tuned":
    print(tune_malloc(), file=sys.stderr)
first = libc.malloc(n)
ctypes.memset(first, 1, n)  # touch every page
libc.free(first)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
second = libc.malloc(n)
ctypes.memset(second, 2, n)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""

BUFFER_BYTES = 48 << 20  # above glibc's dynamic-threshold ceiling (32 MiB), below the tuned 64 MiB
PAGES = BUFFER_BYTES // 4096

glibc = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                           reason="glibc malloc only")


def _faults(mode: str) -> tuple[int, str]:
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}  # no MALLOC_* or LD_PRELOAD from the caller
    out = subprocess.run([sys.executable, "-c", PROBE, mode, str(BUFFER_BYTES)], capture_output=True, text=True,
                         timeout=600, check=True, env=env)
    return int(out.stdout.strip().splitlines()[-1]), out.stderr.strip()


def _transparent_huge_pages() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "unknown"
    chosen = re.search(r"\[(\w+)\]", text)
    return chosen.group(1) if chosen else text.strip()


@glibc
def test_tuned_malloc_reuses_freed_memory_without_page_faults() -> None:
    default, _ = _faults("default")
    if default < PAGES // 2:
        pytest.skip(f"only {default} page faults refilling a fresh {BUFFER_BYTES >> 20} MiB mmap with glibc's "
                    f"defaults (transparent huge pages: {_transparent_huge_pages()!r}): the kernel maps it in large "
                    f"pages, nothing for the tuning to remove")
    tuned, note = _faults("tuned")
    threshold = re.search(r"mmap threshold (\d+) MiB", note)
    if threshold is None or int(threshold.group(1)) << 20 <= BUFFER_BYTES:
        pytest.skip(f"tune_malloc could not raise the mmap threshold above {BUFFER_BYTES >> 20} MiB here ({note}): "
                    f"a buffer that size is mmap'd either way")
    # Tuned, the second buffer is the first one's memory: no page of it is new. The bound leaves room
    # for the interpreter's own few faults between the two getrusage calls (observed: 0-2).
    assert tuned < PAGES // 10, f"{tuned} faults tuned vs {default} with the defaults ({note})"


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


@glibc
def test_the_tcache_is_turned_off_by_one_re_exec_unless_someone_chose() -> None:
    """`tunables_to_exec` decides (pure); `exec_with_malloc_tunables` runs the same interpreter again once, with
    its flags and arguments, and the re-executed process does not exec again (its GLIBC_TUNABLES has ours)."""
    off = runtime.TCACHE_OFF
    assert runtime.tunables_to_exec({}, []) == off
    assert runtime.tunables_to_exec({"GLIBC_TUNABLES": "glibc.rtld.nns=2"}, []) == f"glibc.rtld.nns=2:{off}"
    assert runtime.tunables_to_exec({"GLIBC_TUNABLES": off}, []) is None  # the re-executed process
    assert runtime.tunables_to_exec({"GLIBC_TUNABLES": "glibc.malloc.arena_max=1"}, []) is None  # the user's
    assert runtime.tunables_to_exec({"MALLOC_TRIM_THRESHOLD_": "0"}, []) is None
    assert runtime.tunables_to_exec({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}, []) is None
    offs = (["--train.tune_malloc", "false"], ["--train.tune_malloc=False"], ["--x", "1", "--train.tune_malloc", "0"],
            ["--train.tune-malloc", "false"], ["--train.tune-malloc=no"], ["--train.tune_malloc", "OFF"])
    for argv in offs:
        assert runtime.tunables_to_exec({}, argv) is None, argv
    for argv in (["--train.tune_malloc", "true"], ["--train.tune-malloc"], ["--train.tune_malloc", "--x", "0"]):
        assert runtime.tunables_to_exec({}, argv) == off, argv
    script = ("import os, sys\nfrom megalite.runtime.malloc import exec_with_malloc_tunables\n"
              "print('ran', flush=True)\nexec_with_malloc_tunables()\n"
              "print(os.environ['GLIBC_TUNABLES'], sys.argv[1:], sys.flags.optimize)")
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-O", "-c", script, "a", "--b"], capture_output=True, text=True, timeout=120,
                         check=True, env=env).stdout.split("\n")
    assert out[:2] == ["ran", "ran"] and out[2] == f"{off} ['a', '--b'] 1", out  # twice, then never again


@glibc
def test_a_failed_re_exec_goes_on_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the interpreter cannot be run again, the process goes on with its environment as it found it."""
    for var in ("GLIBC_TUNABLES", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "LD_PRELOAD"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(sys, "argv", ["pretrain.py"])

    def refuse(path: str, args: list[str]) -> None:
        assert os.environ["GLIBC_TUNABLES"] == runtime.TCACHE_OFF  # what it would have run with
        raise PermissionError(path)

    monkeypatch.setattr(os, "execv", refuse)
    runtime.exec_with_malloc_tunables()
    assert "GLIBC_TUNABLES" not in os.environ


@glibc
def test_the_config_file_and_a_program_from_stdin_decide_the_re_exec_too(tmp_path: Path) -> None:
    """`[train] tune_malloc = false` in the --config file turns the restart off as the flag does (the command line
    wins); a program read from stdin is not run again (it would read nothing and exit 0, having done nothing)."""
    off = runtime.TCACHE_OFF
    cfg = tmp_path / "run.toml"
    cfg.write_text("[train]\ntune_malloc = false\n")
    assert runtime.tunables_to_exec({}, ["--config", str(cfg)]) is None
    assert runtime.tunables_to_exec({}, ["--config", str(cfg), "--train.tune_malloc", "true"]) == off
    assert runtime.tunables_to_exec({}, ["--config", str(tmp_path / "missing.toml")]) == off  # the run reports it
    cfg.write_text("[train]\ntune-malloc = false\n")  # the parser reads a dash as an underscore: so does this
    assert runtime.tunables_to_exec({}, ["--config", str(cfg)]) is None
    assert not runtime.runs_a_script("-") and not runtime.runs_a_script("") and runtime.runs_a_script("-c")
    script = ("import os\nfrom megalite.runtime.malloc import exec_with_malloc_tunables\n"
              "exec_with_malloc_tunables()\nprint('ran', os.environ.get('GLIBC_TUNABLES'))\n")
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-", "--x"], input=script, capture_output=True, text=True, timeout=120,
                         check=True, env=env).stdout
    assert out == "ran None\n", out
