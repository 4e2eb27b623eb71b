"""``specdec serve``: load (and compile) a model with an optional proposer, then serve the HTTP API.

The server listens at once; the model loads and compiles in a thread (``/health`` answers 503 until
it is ready). Start-up logs are JSON lines on stderr (``{"event": ..., ...}``): what was loaded,
which graphs were compiled, and how long each phase took. SIGINT / SIGTERM drain the server
(``DrainingServer``: new requests 503, running ones finish within ``--drain-timeout``, the rest end
with an error) and it exits with status 0; a second signal stops it at once.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ..cli import (
    EMBEDDED_NAME,
    add_model_arguments,
    add_speculation_arguments,
    check_speculation_arguments,
    default_k,
    default_threads,
    make_proposer,
    positive_int,
    precompile,
)
from ..core.decoder import DecoderModel
from ..core.engine import Engine
from ..core.graphs import COMPILING
from ..generator import SpeculativeGenerator

log = logging.getLogger("specdec.serving")
TP_SERVE_TIMEOUT_S = 365 * 24 * 3600.0    # a server's ranks wait for rank 0's next call as long as it runs


class JSONFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger and the record's message / ``fields``."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(record.created)),
                 "level": record.levelname.lower(), "logger": record.name}
        entry.update(getattr(record, "fields", None) or {"message": record.getMessage()})
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def log_event(event: str, **fields) -> None:
    log.info(event, extra={"fields": {"event": event, **fields}})


def configure_logging() -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JSONFormatter())
    for name in ("specdec.serving", "uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.setLevel(logging.INFO)
        logger.propagate = False


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


def served_name(args: argparse.Namespace) -> str:
    if args.served_model_name:
        return args.served_model_name
    from pathlib import Path

    from ..core.named_models import is_named_model
    if args.model in (None, EMBEDDED_NAME) or is_named_model(args.model):
        return args.model or EMBEDDED_NAME      # (a name such as qwen2.5-coder-1.5b-instruct has no suffix to strip)
    return Path(args.model).stem


def load_engine(args: argparse.Namespace, progress: bool = False) -> Engine:
    """Load the target (this rank's shard at ``--tp-degree`` > 1) and the proposer, compile the graphs
    serving uses → the core ``Engine``. Rank 0 logs what it did."""
    log_here = int(os.environ.get("RANK", 0)) == 0
    say = log_event if log_here else (lambda event, **fields: None)
    start = time.perf_counter()
    kv_cache_dtype = getattr(args, "kv_cache_dtype", None)     # (bench-serve's namespaces have none)
    autotune = getattr(args, "autotune", False)
    say("loading", model=args.model or EMBEDDED_NAME, amp=args.amp, quantization=args.quantization,
        kv_cache_dtype=kv_cache_dtype, autotune=autotune, backend=args.backend, batch_size=args.batch_size,
        n_positions=args.n_positions, tp_degree=args.tp_degree, draft=args.draft, threads=torch.get_num_threads())
    target = DecoderModel.from_pretrained(args.model, batch_size=args.batch_size, n_positions=args.n_positions,
                                          amp=args.amp, backend=args.backend, tp_degree=args.tp_degree,
                                          quantization=args.quantization, kv_cache_dtype=kv_cache_dtype,
                                          autotune=autotune, progress=progress)
    proposer = make_proposer(args, target)
    gen = None
    if proposer is not None:
        gen = SpeculativeGenerator(proposer, target, default_k(args), fused=getattr(args, "fused", False),
                                   adaptive=getattr(args, "adaptive_k", False), gate=getattr(args, "gate", False))
    say("loaded", seconds=round(time.perf_counter() - start, 2), layers=target.config.num_layers,
        vocab_size=target.vocab_size, proposer=type(proposer).__name__ if proposer else None, k=gen.k if gen else None)
    if args.backend in COMPILING:
        start = time.perf_counter()
        precompile(target, proposer, gen, target.n_positions - 1, target.n_positions, progress=progress and log_here,
                   single_row=True)
        network = None if gen is None else (gen.proposer.draft or gen.proposer).model   # declared abilities
        models = [target] + ([network] if isinstance(network, DecoderModel) else [])
        graphs = [f"{'target' if m is target else 'draft'}: {key}" for m in models for key in m.compile_seconds]
        say("compiled", seconds=round(time.perf_counter() - start, 2), graphs=graphs,
            note="greedy graphs; sampling graphs compile on first use")
    return Engine(target, gen.speculator if gen else None)


def serving_engine(engine: Engine, args: argparse.Namespace):
    """Rank 0's ``AsyncEngine`` over ``engine`` (mirrored to the other ranks at ``--tp-degree`` > 1)."""
    from .engine import AsyncEngine
    from .mirror import MirroredEngine
    core = MirroredEngine(engine) if engine.target.tp.processes > 1 else engine
    return AsyncEngine(core, tokenizer=engine.target.tokenizer, max_waiting=args.max_waiting)


def run(args: argparse.Namespace) -> int:
    """The ``serve`` command: one process, or ``--tp-degree`` processes (rank 0 serves HTTP; Ctrl-C,
    which reaches every process of the terminal's group, stops rank 0, and rank 0 stops the others)."""
    try:
        import uvicorn  # noqa: F401

        from .app import create_app  # noqa: F401
    except ImportError as e:
        raise ValueError(f"specdec serve needs the serve extra ({e}): pip install 'specdec[serve]'") from None
    check_speculation_arguments(args)
    if args.max_waiting < 0:
        raise ValueError(f"--max-waiting must be >= 0, got {args.max_waiting}")
    if not args.body_timeout > 0:
        raise ValueError(f"--body-timeout must be > 0 seconds, got {args.body_timeout}")
    if args.max_connections < 1:
        raise ValueError(f"--max-connections must be >= 1, got {args.max_connections}")
    if not args.drain_timeout >= 0:
        raise ValueError(f"--drain-timeout must be >= 0 seconds, got {args.drain_timeout}")
    args.threads = args.threads or default_threads()
    if args.tp_degree > 1 and args.backend != "neuron":   # neuron: one process drives every NeuronCore
        from ..core.parallel import launch
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        return launch(serve_on_rank, args.tp_degree, args, timeout_s=TP_SERVE_TIMEOUT_S)
    return serve_on_rank(args)


def serve_on_rank(args: argparse.Namespace) -> int:
    import uvicorn

    from .app import create_app
    from .draining import DrainingServer
    from .mirror import follow

    torch.set_num_threads(max(1, args.threads // (1 if args.backend == "neuron" else args.tp_degree)))
    torch.set_grad_enabled(False)
    configure_logging()
    if int(os.environ.get("RANK", 0)) > 0:
        follow(load_engine(args))
        return 0
    name = served_name(args)

    def loader():
        engine = serving_engine(load_engine(args), args)
        log_event("ready", model=name, url=f"http://{args.host}:{args.port}")
        return engine

    app = create_app(loader=loader, model_name=name, api_key=args.api_key, public_paths=args.public_paths,
                     allowed_hosts=args.allowed_hosts, docs=args.docs, max_body_bytes=args.max_body_size,
                     body_timeout_s=args.body_timeout)
    server = DrainingServer(uvicorn.Config(app, host=args.host, port=args.port, log_config=None,
                                           limit_concurrency=args.max_connections, timeout_keep_alive=5,
                                           timeout_graceful_shutdown=5), drain_timeout_s=args.drain_timeout)
    server.run()
    log_event("stopped")
    return 0


@contextmanager
def running_server(app, host: str = "127.0.0.1", timeout_s: float = 60.0) -> Iterator[str]:
    """Serve ``app`` with uvicorn on a free port of ``host`` in a background thread → its base URL;
    stopped (gracefully) when the block ends. For tests, benchmarks and notebooks."""
    import uvicorn

    from .draining import DrainingServer

    sock = socket.socket()
    sock.bind((host, 0))
    server = DrainingServer(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5), drain_timeout_s=5)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.02)
    try:
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.drain()
        thread.join(timeout_s)
        sock.close()
