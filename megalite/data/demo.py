"""The embedded demo corpus: Python's own standard library source, tokenized, cached, ready to train on.

`python pretrain.py` with no arguments must train on *something* without a download (the test
machines have no network). Every Python installation carries a few tens of MB of real, varied text: its
standard library's `.py` files. We take them in sorted path order (skipping test directories and
site-packages), one file per document, until `max_bytes`, train a tokenizer on them and preprocess them
into a `.bin`/`.idx` pair.

The result is cached in `cache_dir/demo-<hash>/`, where the hash covers everything that changes the
bytes (Python version, max_bytes, vocab_size, format version, sentencepiece version). It is built in a
temporary directory and renamed into place, so the cache directory either is complete or does not
exist. When several processes start at once (all ranks of a job), one takes a lock file created with
`O_CREAT | O_EXCL` and builds; the others poll until the directory appears.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import sys
import sysconfig
import time

import sentencepiece as spm

from megalite.data.preprocess import ReadOptions, preprocess
from megalite.data.tokenizer import train_tokenizer
from megalite.errors import DataError

FORMAT_VERSION = 1
_SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})
DATA_NAME, TOKENIZER_NAME, CORPUS_NAME = "demo", "tokenizer.model", "corpus.jsonl"


def default_cache_dir(cache_dir: str = "") -> str:
    """`cache_dir` if set, else $MEGALITE_CACHE, else ~/.cache/megalite."""
    return os.path.abspath(os.path.expanduser(cache_dir or os.environ.get("MEGALITE_CACHE", "")
                                              or "~/.cache/megalite"))


def stdlib_documents(max_bytes: int) -> list[str]:
    """The stdlib's `.py` files in sorted order, whole, until `max_bytes` UTF-8 bytes (the last one cut at a line)."""
    root = sysconfig.get_paths()["stdlib"]
    paths: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        paths += [os.path.join(dirpath, f) for f in filenames
                  if f.endswith(".py") and not f.startswith("test_")]
    paths.sort(key=lambda p: os.path.relpath(p, root).replace(os.sep, "/"))
    docs: list[str] = []
    total = 0
    for path in paths:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (UnicodeDecodeError, OSError):
            continue  # a few files are in other encodings; skipping them is deterministic too
        if not text.strip():
            continue
        size = len(text.encode("utf-8"))
        if total + size > max_bytes:
            head = text.encode("utf-8")[: max_bytes - total].decode("utf-8", errors="ignore")
            head = head[: head.rfind("\n") + 1]
            if head:
                docs.append(head)
            break
        docs.append(text)
        total += size
    if not docs:
        raise DataError(f"no Python source found under {root!r} to build the demo corpus (or "
                        f"data.demo_max_bytes={max_bytes} is too small): set data.path to your own dataset")
    return docs


def _cache_key(max_bytes: int, vocab_size: int) -> str:
    spec = f"py{sys.version_info[0]}.{sys.version_info[1]}.{sys.version_info[2]}|{max_bytes}|{vocab_size}|" \
           f"v{FORMAT_VERSION}|spm{spm.__version__}"
    return hashlib.sha256(spec.encode()).hexdigest()[:12]


def _build(tmp: str, max_bytes: int, vocab_size: int) -> None:
    os.makedirs(tmp)
    docs = stdlib_documents(max_bytes)
    corpus = os.path.join(tmp, CORPUS_NAME)
    with open(corpus, "w", encoding="utf-8") as f:
        for doc in docs:
            f.write(json.dumps({"text": doc}) + "\n")
    model = train_tokenizer([corpus], os.path.join(tmp, TOKENIZER_NAME[: -len(".model")]), vocab_size,
                            json_key="text")
    preprocess([corpus], model, os.path.join(tmp, DATA_NAME), ReadOptions(json_key="text"), show_progress=False)
    os.remove(corpus)  # the .bin holds it; keeping the text would double the cache's size
    with open(os.path.join(tmp, "manifest.json"), "w") as f:
        json.dump({"documents": len(docs), "bytes": sum(len(d.encode()) for d in docs), "max_bytes": max_bytes,
                   "vocab_size": vocab_size, "python": sys.version.split()[0], "format_version": FORMAT_VERSION},
                  f, indent=1, sort_keys=True)


def _lock_is_stale(lock: str) -> bool:
    """A lock left by a dead process on this host (a crash); on another host we cannot tell, so wait."""
    try:
        with open(lock) as f:
            host, pid = f.read().split()
    except (OSError, ValueError):
        return False  # being written right now, or gone
    if host != socket.gethostname():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, ValueError):
        return False
    return False


def cached_demo_data(cache_dir: str, max_bytes: int, vocab_size: int) -> tuple[str, str] | None:
    """`(data_prefix, tokenizer_model_path)` of an already built demo corpus, or None; builds nothing (for
    tools that only read a checkpoint: they must not write into the cache a saved config names)."""
    final = os.path.join(default_cache_dir(cache_dir), f"demo-{_cache_key(max_bytes, vocab_size)}")
    result = (os.path.join(final, DATA_NAME), os.path.join(final, TOKENIZER_NAME))
    return result if os.path.isfile(result[1]) else None


def prepare_demo_data(cache_dir: str, max_bytes: int, vocab_size: int,
                      timeout_s: float = 1800.0) -> tuple[str, str]:
    """Build (once) and return `(data_prefix, tokenizer_model_path)` of the demo corpus under `cache_dir`."""
    if max_bytes < 1:
        raise DataError(f"data.demo_max_bytes must be positive, got {max_bytes}")
    cache_dir = default_cache_dir(cache_dir)
    final = os.path.join(cache_dir, f"demo-{_cache_key(max_bytes, vocab_size)}")
    result = (os.path.join(final, DATA_NAME), os.path.join(final, TOKENIZER_NAME))
    lock = final + ".lock"
    deadline = time.monotonic() + timeout_s
    while not os.path.isdir(final):
        os.makedirs(cache_dir, exist_ok=True)
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            if _lock_is_stale(lock):
                try:
                    os.remove(lock)
                except FileNotFoundError:
                    pass
            elif time.monotonic() > deadline:
                raise DataError(f"waited {timeout_s:.0f}s for another process to build {final!r}; if none is "
                                f"running, delete the stale lock {lock!r}") from None
            time.sleep(0.2)
            continue
        try:
            os.write(fd, f"{socket.gethostname()} {os.getpid()}".encode())
            os.close(fd)
            if not os.path.isdir(final):  # another process may have finished between our check and the lock
                tmp = f"{final}.tmp-{socket.gethostname()}-{os.getpid()}"
                shutil.rmtree(tmp, ignore_errors=True)
                print(f"megalite: building the demo corpus ({max_bytes:,} bytes of Python stdlib source, "
                      f"vocab {vocab_size}) in {final}", file=sys.stderr, flush=True)
                try:
                    _build(tmp, max_bytes, vocab_size)
                    try:
                        os.rename(tmp, final)  # atomic publish: final is complete or absent
                    except OSError:
                        if not os.path.isdir(final):  # lost a race to an identical build: keep theirs
                            raise
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
        finally:
            try:
                os.remove(lock)
            except FileNotFoundError:
                pass
    return result
