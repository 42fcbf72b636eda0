"""The HTTP layer: OpenAI-compatible routes, metering and attestation routes, JSON-RPC, routers' cache summaries,
and the middleware that authenticates callers (and the callers a router acts for) and turns the node's domain
errors into OpenAI-shaped JSON.

`keys` is the leaf every route module imports; `app` imports every route table and builds the application.
"""
