"""Tokenize raw documents into a `.bin`/`.idx` dataset (the library side of tools/preprocess_data.py).

Every document is tokenized and followed by the tokenizer's end-of-document id (and preceded by its BOS
when the tokenizer's convention or `add_bos` says so: `megalite.data.tokenizer.document_ids`), so that
documents can be concatenated into training sequences and the model still sees where one ends (GPT-2,
Radford et al. 2019, and Megatron-LM do the same). With `workers > 1`, documents are tokenized by a process pool through
`imap`, which returns results in input order: the output is byte-identical for any number of workers.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing as mp
import signal
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from megalite.data.documents import Replacements, check_inputs, iter_documents
from megalite.data.indexed import IndexedDatasetWriter
from megalite.data.tokenizer import Tokenizer, document_ids, load_tokenizer
from megalite.observability.progress import Progress

# Documents handed to a worker at a time: large enough to amortize pickling, small enough to stream.
_CHUNKSIZE = 16


@functools.lru_cache(maxsize=4)
def _load_cached(tokenizer_path: str) -> Tokenizer:
    """One tokenizer per (worker) process: loaded on the first document, not once per document."""
    return load_tokenizer(tokenizer_path)


def encode_document(tokenizer_path: str, add_bos: bool | None, text: str) -> np.ndarray:
    """[BOS] + ids of `text` + EOD, as int64 (ids of large vocabularies exceed int32's sign bit only
    beyond 2^31, but int64 keeps the writer's range check honest for any tokenizer)."""
    return np.asarray(document_ids(_load_cached(tokenizer_path), text, add_bos), dtype=np.int64)


@dataclass(frozen=True)
class ReadOptions:
    """How documents are read from the inputs: text files are one document each (or one per blank-line-separated
    paragraph with `split_paragraphs`); with `json_key`, inputs are JSON lines and each line's `json_key` is one."""

    json_key: str | None = None
    split_paragraphs: bool = False


def preprocess(inputs: Sequence[str], tokenizer_path: str, output_prefix: str, read: ReadOptions = ReadOptions(),
               workers: int = 1, show_progress: bool = True, add_bos: bool | None = None,
               replaced: Replacements | None = None) -> str:
    """Tokenize `inputs` (documents as `read` says) into `output_prefix.bin/.idx`; returns the prefix. `replaced`
    counts the unpaired surrogates of JSON inputs replaced by U+FFFD (see `megalite.data.documents`).
    """
    json_key, split_paragraphs = read.json_key, read.split_paragraphs
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    check_inputs(inputs, json_key)
    tok = load_tokenizer(tokenizer_path)  # fail here, in the parent, if the file is missing or unreadable
    document_ids(tok, "", add_bos)  # an impossible --add-bos fails here too, not in a worker
    docs = iter_documents(inputs, json_key, split_paragraphs, replaced, checked=True)
    encode = functools.partial(encode_document, tokenizer_path, add_bos)
    with IndexedDatasetWriter(output_prefix, tok.vocab_size) as writer, \
            Progress(desc=f"tokenizing into {output_prefix}", unit="docs", enabled=show_progress) as bar:
        if workers == 1:
            for text in docs:
                writer.add_document(encode(text))
                bar.update()
        else:
            # spawn, not fork: forking a process that already runs threads (a launcher's, a test
            # harness's, torch's) can deadlock the children on a lock held by a thread that was not copied.
            with _sigint_deferred():  # a worker half-started by a Ctrl-C would die with a traceback of its own
                pool = mp.get_context("spawn").Pool(workers, initializer=_ignore_sigint)
            with pool:
                # Read documents here, in the main thread, a batch at a time: a bad input line raises
                # where it is read, never inside the pool's feeder thread (which would wedge the pool).
                for batch in _batches(docs, workers * _CHUNKSIZE * 4):
                    for ids in pool.map(encode, batch, chunksize=_CHUNKSIZE):
                        writer.add_document(ids)
                        bar.update()
        return writer.finalize()


@contextlib.contextmanager
def _sigint_deferred() -> Iterator[None]:
    """Hold a Ctrl-C back while the pool starts: spawn writes each worker's start-up data down a pipe, and a
    KeyboardInterrupt in the middle of that leaves the worker reading half of it (an EOFError traceback on the
    shared stderr). Delivered right after, at a point where stopping the pool is clean.

    Two mechanisms, because either alone leaks. Blocking SIGINT in this thread is inherited by the workers
    (a Ctrl-C to the whole process group waits in each until its initializer ignores it), but the kernel then
    hands the parent's SIGINT to any other thread that does not block it (the process has native threads of
    its own), and Python runs the handler in the main thread all the same. So a handler that only records
    the signal is installed as well, and the interrupt is raised once the pool is up."""
    if threading.current_thread() is not threading.main_thread():  # signal handlers are main-thread only
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    masked = hasattr(signal, "pthread_sigmask")  # Windows has no signal masks
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT}) if masked else None
    try:
        yield
    finally:
        if old_mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)  # a pending SIGINT lands in `caught` here
        signal.signal(signal.SIGINT, previous)
    if caught:
        if callable(previous):
            previous(signal.SIGINT, None)  # the default handler raises KeyboardInterrupt
        elif previous == signal.SIG_DFL:
            raise KeyboardInterrupt


def _ignore_sigint() -> None:
    """Workers leave Ctrl-C to the parent: it stops the pool and removes the partial output, and one line
    is printed instead of a KeyboardInterrupt traceback from every worker."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _batches(items: Iterator[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch
