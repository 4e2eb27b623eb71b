"""The server of ``specdec serve`` (``run(ServeOptions)``): load (and compile) a model with an optional proposer,
then serve the HTTP API.

The server listens at once; the model loads and compiles in a thread (``/health`` answers 503 until
it is ready). Start-up logs are JSON lines on stderr (``{"event": ..., ...}``): what was loaded,
which graphs were compiled, and how long each phase took. SIGINT / SIGTERM drain the server
(``DrainingServer``: new requests 503, running ones finish within ``drain_timeout``, the rest end
with an error) and it exits with status 0; a second signal stops it at once.
"""
from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch

from ..core.decoder import DecoderModel
from ..core.engine import Engine
from ..core.graphs import COMPILING
from ..options import EMBEDDED_NAME, ModelOptions, SpeculationOptions, default_threads, precompile
from .logs import configure_logging, log_event

TP_SERVE_TIMEOUT_S = 365 * 24 * 3600.0    # a server's ranks wait for rank 0's next call as long as it runs


@dataclass(frozen=True)
class ServeOptions:
    """``specdec serve``: the target (``model``) and proposer (``speculation``), ``batch_size`` rows decoded at
    once, and the HTTP server: ``host`` / ``port``; ``max_waiting`` requests may wait for a free row (more get
    503); ``served_model_name`` (None: ``served_name``'s default); intra-op ``threads`` (None:
    ``default_threads()``) split over the tp processes; ``api_key`` required on every route but
    ``public_paths`` (None: no key); ``allowed_hosts`` (Host header values, ``*.example.com`` patterns; None:
    any); ``docs``: serve /docs and /openapi.json; ``max_body_size`` (bytes; larger bodies get 413);
    ``body_timeout`` (seconds until a body must have arrived: 408); ``max_connections`` served at once (more
    get 503); ``drain_timeout``: seconds running requests have to finish after SIGINT / SIGTERM."""

    model: ModelOptions = field(default_factory=ModelOptions)
    speculation: SpeculationOptions = field(default_factory=SpeculationOptions)
    batch_size: int = 4
    host: str = "127.0.0.1"
    port: int = 8000
    max_waiting: int = 64
    served_model_name: str | None = None
    threads: int | None = None
    api_key: str | None = None
    public_paths: tuple[str, ...] = ("/health", "/metrics")
    allowed_hosts: tuple[str, ...] | None = None
    docs: bool = False
    max_body_size: int = 4 * 2**20
    body_timeout: float = 30.0
    max_connections: int = 256
    drain_timeout: float = 30.0


def served_name(options: ServeOptions) -> str:
    """The model name clients send: ``served_model_name``, else the embedded or named model's name, else the
    checkpoint's directory / file name."""
    if options.served_model_name:
        return options.served_model_name
    from pathlib import Path

    from ..core.named_models import is_named_model
    model = options.model.model
    if model in (None, EMBEDDED_NAME) or is_named_model(model):
        return model or EMBEDDED_NAME      # (a name such as qwen2.5-coder-1.5b-instruct has no suffix to strip)
    return Path(model).stem


def load_engine(options: ServeOptions, progress: bool = False) -> Engine:
    """Load the target (this rank's shard at ``tp_degree`` > 1) and the proposer, compile the graphs
    serving uses → the core ``Engine``. Rank 0 logs what it did."""
    log_here = int(os.environ.get("RANK", 0)) == 0
    say = log_event if log_here else (lambda event, **fields: None)
    start = time.perf_counter()
    model, speculation = options.model, options.speculation
    say("loading", model=model.name, amp=model.amp, quantization=model.quantization,
        kv_cache_dtype=model.kv_cache_dtype, autotune=model.autotune, backend=model.backend,
        batch_size=options.batch_size, n_positions=model.n_positions, tp_degree=model.tp_degree,
        draft=speculation.draft, threads=torch.get_num_threads())
    target = model.load(batch_size=options.batch_size, progress=progress)
    proposer = speculation.make_proposer(target)
    gen = speculation.make_generator(proposer, target)
    say("loaded", seconds=round(time.perf_counter() - start, 2), layers=target.config.num_layers,
        vocab_size=target.vocab_size, proposer=type(proposer).__name__ if proposer else None, k=gen.k if gen else None)
    network = None if gen is None else (gen.proposer.draft or gen.proposer).model   # declared abilities
    models = [target] + ([network] if isinstance(network, DecoderModel) else [])
    # Graphs are built ahead only where a shape costs a compilation: not for models whose every shape is free
    # (block-kernel layers on regional), where warming every bucket of the longest prompt would only run them
    # (minutes for the 1.5B); always for fused steps and a draft network that is not a DecoderModel (EAGLE, Medusa).
    other_network = network is not None and not isinstance(network, DecoderModel)
    compiles = speculation.fused or other_network or not all(m.shapes_free for m in models)
    if model.backend in COMPILING and compiles:
        start = time.perf_counter()
        precompile(target, gen, target.n_positions - 1, target.n_positions, progress=progress and log_here,
                   single_row=True)
        graphs = [f"{'target' if m is target else 'draft'}: {key}" for m in models for key in m.compile_seconds]
        say("compiled", seconds=round(time.perf_counter() - start, 2), graphs=graphs,
            note="greedy graphs; sampling graphs compile on first use")
    return Engine(target, gen.speculator if gen else None)


def serving_engine(engine: Engine, max_waiting: int = ServeOptions.max_waiting):
    """Rank 0's ``AsyncEngine`` over ``engine`` (mirrored to the other ranks at ``tp_degree`` > 1), with
    ``max_waiting`` requests allowed to wait for a free row."""
    from .engine import AsyncEngine
    from .mirror import MirroredEngine
    core = MirroredEngine(engine) if engine.target.tp.processes > 1 else engine
    return AsyncEngine(core, tokenizer=engine.target.tokenizer, max_waiting=max_waiting)


def run(options: ServeOptions) -> int:
    """The ``serve`` command: one process, or ``tp_degree`` processes (rank 0 serves HTTP; Ctrl-C,
    which reaches every process of the terminal's group, stops rank 0, and rank 0 stops the others).
    Checks the options first (``ValueError``)."""
    try:
        import uvicorn  # noqa: F401

        from .app import create_app  # noqa: F401
    except ImportError as e:
        raise ValueError(f"specdec serve needs the serve extra ({e}): pip install 'specdec[serve]'") from None
    options = replace(options, speculation=options.speculation.checked(options.model))
    if options.max_waiting < 0:
        raise ValueError(f"--max-waiting must be >= 0, got {options.max_waiting}")
    if not options.body_timeout > 0:
        raise ValueError(f"--body-timeout must be > 0 seconds, got {options.body_timeout}")
    if options.max_connections < 1:
        raise ValueError(f"--max-connections must be >= 1, got {options.max_connections}")
    if not options.drain_timeout >= 0:
        raise ValueError(f"--drain-timeout must be >= 0 seconds, got {options.drain_timeout}")
    options = replace(options, threads=options.threads or default_threads())
    model = options.model
    if model.tp_degree > 1 and model.backend != "neuron":   # neuron: one process drives every NeuronCore
        from ..core.parallel import launch
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        return launch(serve_on_rank, model.tp_degree, options, timeout_s=TP_SERVE_TIMEOUT_S)
    return serve_on_rank(options)


def serve_on_rank(options: ServeOptions) -> int:
    """One rank of ``run``: rank 0 serves HTTP until drained, the others follow its engine calls."""
    import uvicorn

    from .app import create_app
    from .draining import DrainingServer
    from .mirror import follow

    torch.set_num_threads(options.model.threads_per_process(options.threads))
    torch.set_grad_enabled(False)
    configure_logging()
    if int(os.environ.get("RANK", 0)) > 0:
        follow(load_engine(options))
        return 0
    name = served_name(options)

    def loader():
        engine = serving_engine(load_engine(options), options.max_waiting)
        log_event("ready", model=name, url=f"http://{options.host}:{options.port}")
        return engine

    app = create_app(loader=loader, model_name=name, api_key=options.api_key, public_paths=options.public_paths,
                     allowed_hosts=options.allowed_hosts, docs=options.docs, max_body_bytes=options.max_body_size,
                     body_timeout_s=options.body_timeout)
    server = DrainingServer(uvicorn.Config(app, host=options.host, port=options.port, log_config=None,
                                           limit_concurrency=options.max_connections, timeout_keep_alive=5,
                                           timeout_graceful_shutdown=5), drain_timeout_s=options.drain_timeout)
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
