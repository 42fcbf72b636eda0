"""What a node answers on the routes of the other kind of model: a text node's `/v1/images/*`, an image node's
chat and completions. A 404 that says what the node serves, rather than aiohttp's bare one, so that a client
pointed at the wrong node learns why."""

from __future__ import annotations

from aiohttp import web

from node.errors import NotFound

text_node_routes = web.RouteTableDef()
media_node_routes = web.RouteTableDef()

IMAGE_ROUTES = ("/v1/images/generations", "/v1/images/edits")
TEXT_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/messages")


async def _text_node(request: web.Request) -> web.StreamResponse:
    raise NotFound(f"this node serves a text model, which does not make images; {request.path} is served by a node "
                   "started with a diffusers model directory", code="unsupported_endpoint")


async def _media_node(request: web.Request) -> web.StreamResponse:
    raise NotFound(f"this node serves an image model, which does not generate text; use /v1/images/generations "
                   f"or /v1/images/edits, or a text node for {request.path}", code="unsupported_endpoint")


for _path in IMAGE_ROUTES:
    text_node_routes.post(_path)(_text_node)
for _path in TEXT_ROUTES:
    media_node_routes.post(_path)(_media_node)
