"""The HTTP layer: OpenAI-compatible routes, metering and attestation routes, JSON-RPC, and the middleware that
authenticates callers and turns the node's domain errors into OpenAI-shaped JSON.

`keys` is the leaf every route module imports; `app` imports every route table and builds the application.
"""
