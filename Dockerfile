FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY saga saga
COPY schemas schemas
COPY coordinator coordinator
COPY workers workers
COPY orchestrator orchestrator
COPY examples examples
RUN pip install --no-cache-dir . && mkdir -p /data
CMD ["saga", "--help"]
