"""Each kind of node answers the other kind's routes with a 404 that says what it serves."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from node.api.keys import METRICS
from node.api.media_refusals import IMAGE_ROUTES, TEXT_ROUTES, media_node_routes, text_node_routes
from node.api.middleware import error_middleware
from node.metrics import NodeMetrics

ClientMaker = Callable[[web.Application], Awaitable[TestClient[Any, Any]]]


def app_with(routes: web.RouteTableDef) -> web.Application:
    app = web.Application(middlewares=[error_middleware])
    app[METRICS] = NodeMetrics(cached_bytes=lambda: 0.0, queue_waiting=lambda: 0.0)
    app.router.add_routes(routes)
    return app


@pytest.mark.parametrize("path", IMAGE_ROUTES)
async def test_a_text_node_says_it_serves_a_text_model(aiohttp_client: ClientMaker, path: str) -> None:
    client = await aiohttp_client(app_with(text_node_routes))
    response = await client.post(path, json={"prompt": "a cat"})
    assert response.status == 404
    error = (await response.json())["error"]
    assert (error["type"], error["code"]) == ("not_found_error", "unsupported_endpoint")
    assert error["message"].startswith("this node serves a text model")


@pytest.mark.parametrize("path", TEXT_ROUTES)
async def test_an_image_node_says_it_serves_an_image_model(aiohttp_client: ClientMaker, path: str) -> None:
    client = await aiohttp_client(app_with(media_node_routes))
    response = await client.post(path, json={})
    assert response.status == 404
    assert (await response.json())["error"]["message"].startswith("this node serves an image model")
