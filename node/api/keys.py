"""The application's and requests' typed keys: the one module every route module imports, importing none."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from cache.summary import SummaryFilters
from node.api.prepare import FairPreparation
from node.auth import KeyRing
from node.config import Caller, NodeConfig
from node.identity import NodeIdentity
from node.meter import Meter
from node.metrics import NodeMetrics
from node.service import ModelService
from policies.node_policy import NodePolicy

CONFIG = web.AppKey("config", NodeConfig)
KEYRING = web.AppKey("keyring", KeyRing)
SERVICE = web.AppKey("service", ModelService)
METRICS = web.AppKey("metrics", NodeMetrics)
METER = web.AppKey("meter", Meter)
PREPARE = web.AppKey("prepare", FairPreparation)
"""Threads for the steps of a request that grow with its size (parsing, rendering, tokenizing), shared among
callers in turn."""
HYGIENE = web.AppKey("hygiene", dict[str, Any])
IDENTITY = web.AppKey("identity", NodeIdentity)
POLICY = web.AppKey("policy", NodePolicy)
TLS = web.AppKey("tls", dict[str, Any])
"""`node.tls.tls_json`: whether the node serves HTTPS and its certificate, for `GET /v1/node`."""
SUMMARIES = web.AppKey("summaries", SummaryFilters)
"""Each router's summary filter per model, kept between its reads."""

CALLER = web.RequestKey("caller", Caller)
"""The authenticated caller, set by the authentication middleware; absent on a public route called without a
key."""
