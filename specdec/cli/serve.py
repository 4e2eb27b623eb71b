"""``specdec serve``: the HTTP server (``specdec.serving.server``) of a model with an optional proposer."""
from __future__ import annotations

import argparse
import os

from ..options import EMBEDDED_NAME, options_from
from ..serving import server
from ..tools.arguments import add_model_arguments, add_speculation_arguments, positive_int
from .command import Command

NAME = "serve"
HELP = ("serve the model over HTTP: OpenAI-compatible completions and chat, /generate, /health, /metrics "
        "(continuous batching, speculation inside)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--batch-size", type=positive_int, metavar="N", default=4,
                   help="rows of the static batch: requests decoded at once (default: 4)")
    add_speculation_arguments(p)
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1; 0.0.0.0 for all)")
    s.add_argument("--port", type=int, default=8000, help="(default: 8000)")
    s.add_argument("--max-waiting", type=int, default=64, metavar="N",
                   help="requests allowed to wait for a free row; more get HTTP 503 (default: 64)")
    s.add_argument("--served-model-name", default=None, metavar="NAME",
                   help=f"the model name clients send (default: {EMBEDDED_NAME}, the named model's name, or the "
                        "checkpoint's directory / file name)")
    s.add_argument("--threads", type=positive_int, metavar="N", default=None,
                   help="intra-op threads, split over the --tp-degree processes (default: $OMP_NUM_THREADS if set, "
                        "else the cores this process may use)")
    s.add_argument("--tp-degree", type=positive_int, metavar="N", default=1,
                   help="tensor parallelism: shard the model over this many processes (rank 0 serves HTTP; "
                        "--backend neuron: over this many NeuronCores from this one process)")
    s.add_argument("--api-key", default=os.environ.get("SPECDEC_API_KEY") or None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' (what OpenAI clients send as api_key) on every route "
                        "but --public-paths; 401 without it (default: $SPECDEC_API_KEY; unset: no key)")
    s.add_argument("--public-paths", type=_paths, default=("/health", "/metrics"), metavar="PATHS",
                   help="comma-separated paths open without the API key (default: /health,/metrics; '' for none)")
    s.add_argument("--allowed-hosts", type=_paths, default=None, metavar="HOSTS",
                   help="comma-separated Host header values accepted, '*.example.com' patterns allowed; other "
                        "hosts get 400 (default: any)")
    s.add_argument("--docs", action="store_true", help="serve the interactive API docs at /docs and /openapi.json")
    s.add_argument("--max-body-size", type=_size, default=4 * 2**20, metavar="BYTES",
                   help="largest request body accepted (K/M suffixes); larger ones get 413 (default: 4M)")
    s.add_argument("--body-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="a request whose body has not arrived this long after its headers gets 408 and is "
                        "disconnected (slow clients; default: 30)")
    s.add_argument("--max-connections", type=int, default=256, metavar="N",
                   help="open connections served at once; more get 503 (default: 256)")
    s.add_argument("--drain-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGINT / SIGTERM: new requests get 503 and the running ones have this long to finish "
                        "before they end with an error (default: 30)")


def _paths(text: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in text.split(",") if p.strip())


def _size(text: str) -> int:
    units = {"k": 2**10, "m": 2**20, "g": 2**30}
    t = text.strip().lower().removesuffix("b").removesuffix("i")
    try:
        n = int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (bytes, or with a K or M suffix)") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"the size must be >= 1 byte, got {text!r}")
    return n



def run(args: argparse.Namespace) -> int:
    return server.run(options_from(server.ServeOptions, args))


COMMANDS = [Command(NAME, HELP, add_arguments, run)]
