"""``DrainingServer``: uvicorn's server with a graceful drain on SIGINT / SIGTERM (``specdec serve``,
``running_server``)."""
from __future__ import annotations

import asyncio
import signal

import uvicorn

from .logs import log, log_event


class DrainingServer(uvicorn.Server):
    """uvicorn's server with a graceful drain: the first SIGINT / SIGTERM (or ``drain()``, from any
    thread) runs the app's ``state.drain(drain_timeout_s)`` (new requests 503, the running ones
    finish or are aborted with an error), then the server stops; a second signal stops it at once.
    The signal is not re-raised afterwards, so the process exits normally (status 0)."""

    def __init__(self, config, drain_timeout_s: float = 30.0):
        super().__init__(config)
        self.drain_timeout_s = drain_timeout_s
        self.draining = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets=sockets)

    def handle_exit(self, sig, frame) -> None:
        if self.draining or self._loop is None:   # a second signal, or nothing started yet: stop now
            self.force_exit = self.draining
            self.should_exit = True
            return
        self.draining = True
        name = signal.Signals(sig).name if sig else None
        log_event("draining", signal=name, drain_timeout_s=self.drain_timeout_s)
        try:
            self._loop.call_soon_threadsafe(self._start_drain)
        except RuntimeError:   # the loop is closed
            self.should_exit = True

    def drain(self) -> None:
        """Drain and stop (thread-safe), as SIGTERM does."""
        self.handle_exit(signal.SIGTERM, None)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        try:
            drain = getattr(getattr(self.config.app, "state", None), "drain", None)
            if drain is not None:
                await drain(self.drain_timeout_s)
        except Exception:
            log.exception("drain failed")
        finally:
            self.should_exit = True
