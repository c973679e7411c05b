FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY mcp_saga mcp_saga
COPY schemas schemas
COPY runtime runtime
COPY coordinator coordinator
COPY workers workers
COPY orchestrator orchestrator
COPY cli cli
COPY examples examples
RUN pip install --no-cache-dir . && mkdir -p /data
CMD ["saga", "--help"]
