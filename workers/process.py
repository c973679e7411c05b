"""The worker process: an RQ `SimpleWorker` on the saga queue with warm MCP sessions.

`SimpleWorker` runs jobs in the worker process itself; the forking `Worker` would start each job
in a fresh child, losing every session (a stdio server costs 0.6-0.9 s to start) and about 15 ms
of CPU per fork. The scheduler is on because RQ's retry intervals park jobs that only a
scheduler brings back. Signals are RQ's: SIGTERM or SIGINT finish the job in hand and stop (a
second one stops at once); the sessions are closed from their owning tasks on the way out.
"""

from __future__ import annotations

import logging

from redis import Redis
from rq import Queue, SimpleWorker

from saga.config import Config
from saga.keys import Keys
from saga.logs import configure, get_logger
from workers.job import clear_context, set_context
from workers.sessions import SessionPool

log = get_logger("worker")


def run_worker(
    redis_url: str,
    config: Config,
    *,
    name: str | None = None,
    burst: bool = False,
    logging_level: str = "INFO",
) -> int:
    """Work the queue until stopped (or, with `burst`, until it is empty); returns the exit status."""
    if not logging.getLogger("saga").handlers:  # `saga worker` configured them already
        configure(logging_level)
    for server, settings in config.servers.items():
        if settings.timeout >= config.worker.lease:
            log.warning(
                "call timeout is not below the lease: a slow call may outlive its lease",
                server=server, timeout=settings.timeout, lease=config.worker.lease,
            )  # fmt: skip
    connection = Redis.from_url(redis_url)
    queue = Queue(Keys(config.prefix).queue, connection=connection)
    worker = SimpleWorker([queue], connection=connection, name=name)
    pool = SessionPool(config.servers, tools_ttl=config.worker.tools_ttl)
    set_context(connection, config, pool, worker.name)
    log.info("worker started", worker=worker.name, queue=queue.name, servers=",".join(config.servers) or "none")
    try:
        worker.work(burst=burst, with_scheduler=True, logging_level=logging_level)
    finally:
        pool.close()
        clear_context()
        connection.close()
    return 0
