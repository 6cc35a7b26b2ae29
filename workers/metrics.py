"""A training worker's Prometheus metrics, served on ``KILN_WORKER_METRICS_PORT`` (one port per
worker process; 0, the default, serves none): jobs running and finished, each step's time and
tokens per second (from the trainer's step metrics), and the device's memory (read when scraped).

The worker runs jobs in its own process (the solo pool), so one in-process registry holds it all.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger("kiln.worker")

REGISTRY = CollectorRegistry()
RUNNING = Gauge("kiln_worker_jobs_running", "Jobs this worker is running now", registry=REGISTRY)
FINISHED = Counter("kiln_worker_jobs", "Jobs this worker ran, by outcome", ["outcome"], registry=REGISTRY)
STEP = Histogram(
    "kiln_worker_step_seconds",
    "Wall time of one optimizer step",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
    registry=REGISTRY,
)
TOKENS = Gauge("kiln_worker_tokens_per_second", "Tokens per second of the last step", registry=REGISTRY)
STEPS = Counter("kiln_worker_steps", "Optimizer steps taken", registry=REGISTRY)


class DeviceMemory(Collector):
    """The accelerator's memory as torch sees it (CUDA or an NPU), once a job has loaded torch."""

    def collect(self) -> Iterable[Metric]:
        import sys

        device = sys.modules.get("engine.device")  # never import torch for a scrape
        if device is None or (kind := device.best()) == "cpu":
            return
        family = GaugeMetricFamily(
            "kiln_worker_device_memory_bytes", "Device memory held by this worker", labels=["device", "kind"]
        )
        on = device.module(device.resolve(kind))
        for i in range(on.device_count()):
            family.add_metric([f"{kind}:{i}", "allocated"], on.memory_allocated(i))
            family.add_metric([f"{kind}:{i}", "reserved"], on.memory_reserved(i))
            family.add_metric([f"{kind}:{i}", "peak_allocated"], on.max_memory_allocated(i))
        yield family


REGISTRY.register(DeviceMemory())


def observe_step(values: dict[str, Any]) -> None:
    """One step's metrics as the trainer reported them."""
    STEPS.inc()
    if (seconds := values.get("step_seconds")) is not None:
        STEP.observe(seconds)
    if (tps := values.get("tokens_per_second")) is not None:
        TOKENS.set(tps)


def serve(port: int) -> None:
    if port <= 0:
        return
    try:
        start_http_server(port, registry=REGISTRY)
        log.info("worker metrics on :%d/metrics", port)
    except OSError as e:  # another worker on this host has the port: run without
        log.warning("worker metrics not served: port %d: %s", port, e)
