"""Shared fixtures: one pool of gloo ranks per world size for the whole session."""

from __future__ import annotations

from typing import Callable, Iterator

import pytest

from tests.dist_harness import DistWorld


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
