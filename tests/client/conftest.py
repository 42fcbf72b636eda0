"""The node fixtures, for the client's tests against real nodes."""

from __future__ import annotations

from tests.node.conftest import node_factory

__all__ = ["node_factory"]
