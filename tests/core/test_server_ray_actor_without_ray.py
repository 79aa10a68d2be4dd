"""tensorhub/server/ray_actor.py where Ray is not installed (the core
environment): importing it costs nothing, an explicit address passes through,
and ``auto`` says what to do. The Ray side runs in tests/verl/test_ray_server_actor.py."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from tensorhub import ServerUnavailable
from tensorhub.server.ray_actor import resolve_address

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ray") is not None, reason="Ray is installed here")


def test_explicit_address_passes_through():
    assert resolve_address("10.0.0.5:50051") == "10.0.0.5:50051"
    assert "ray" not in sys.modules


def test_auto_without_ray_names_the_fix():
    with pytest.raises(ServerUnavailable, match=r"Ray is not installed here: install ray, or give the server's host:port"):
        resolve_address("auto")
