"""Session-wide set-up: the local Ray that the Ray placement's tests start on first use is stopped at the end."""

from __future__ import annotations

import pytest

from placements import stop_local_ray


@pytest.fixture(autouse=True, scope="session")
def _stop_local_ray_at_the_end():
    yield
    stop_local_ray()
