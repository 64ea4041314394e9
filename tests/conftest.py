"""Shared fixtures: one pool of gloo ranks per world size for the whole session."""

from __future__ import annotations

import os

# The kernel tests run Triton in its interpreter (kernels/testing.py), and Triton picks interpreter or
# compiled mode once, at its first import: set it before any test module (torch.compile's, for one) imports it.
os.environ.setdefault("TRITON_INTERPRET", "1")

import signal  # noqa: E402
import socket  # noqa: E402
from typing import Callable, Iterator  # noqa: E402

import pytest  # noqa: E402

from tests.dist_harness import DistWorld  # noqa: E402

# A shell without job control starts background commands (`pytest &`) with SIGINT ignored, and Python then
# leaves it ignored (no KeyboardInterrupt), as does every process a test starts (an ignored signal stays
# ignored across exec). The Ctrl-C tests would then test nothing the user gets: give the session the
# interactive default, which the processes it starts inherit as SIG_DFL (and Python turns into
# KeyboardInterrupt again).
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def dist_world() -> Iterator[Callable[[int], DistWorld]]:
    worlds: dict[int, DistWorld] = {}

    def get(world_size: int) -> DistWorld:
        if world_size not in worlds:
            worlds[world_size] = DistWorld(world_size)
        return worlds[world_size]

    yield get
    for w in worlds.values():
        w.close()


@pytest.fixture(scope="session")
def demo_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A session-wide cache for the small demo corpus the end-to-end tests train on."""
    return str(tmp_path_factory.mktemp("megalite-cache"))


SMALL_RUN = ["--data.demo_max_bytes", "300000", "--data.demo_vocab_size", "512", "--model.seq_len", "32",
             "--model.num_layers", "2", "--model.hidden_size", "64", "--train.micro_batch_size", "4",
             "--train.warmup_steps", "2", "--logging.interval", "1", "--train.eval_interval", "0"]


def free_port() -> int:
    """A TCP port nobody listens on now: tests never use fixed ports, so concurrent runs cannot collide."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
