"""Serving: a continuous-batching engine with speculation inside (``AsyncEngine``) and an
OpenAI-compatible HTTP server (``create_app``; the ``specdec serve`` command).

    from specdec.serving import AsyncEngine, RequestParams, create_app

Needs the ``serve`` extra (fastapi, uvicorn, prometheus-client). Names are imported on first use,
so ``specdec --help`` does not load the web stack.
"""
from importlib import import_module

_EXPORTS = {"create_app": "app", "AsyncEngine": "engine", "EngineBusy": "engine", "EngineStopped": "engine",
            "RequestOutput": "engine", "RequestStream": "engine", "ServingMetrics": "metrics",
            "RequestParams": "params", "InvalidParam": "params"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'specdec.serving' has no attribute {name!r}")
    return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
