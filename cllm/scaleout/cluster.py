"""`python -m cllm.serve --replicas N` / `--ray-address ADDRESS`: start a local Ray, or join a
cluster, deploy the scale-out application (ray_app.py) and serve until SIGINT or SIGTERM;
then take it down: a local Ray entirely, on a joined cluster only this application."""
from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading

import ray
from ray import serve

from cllm.config import WAIT_VARIABLES, ServerConfig, apply_cpu_wait, usable_cores
from cllm.scaleout.environment import end_leftover_haproxy
from cllm.scaleout.ray_app import Plan, application

log = logging.getLogger(__name__)
APP_NAME = "cllm"
PROXY_TIMEOUT_MARGIN = 30.0  # seconds


def serve_on_ray(config: ServerConfig, options: dict) -> int:
    address = options["ray_address"]
    ray.init(address=address, include_dashboard=False if address is None else None,
             logging_level=logging.WARNING)
    try:
        config, plan = _layout(config, options)
        log.info("deploying %s replica(s), %s GPU and %s CPU each, %s routing",
                 plan.replicas if plan.min_replicas is None
                 else f"{plan.min_replicas}-{plan.max_replicas}",
                 plan.gpus_per_replica, plan.cpus_per_replica, plan.router)
        # Ray's access log would add a line for each request and each metrics report.
        logging_config = {"log_level": options["log_level"].upper(), "enable_access_log": False}
        # The proxy's deadline is a backstop past the engine's own (a 408 in the server's
        # shape): a request waiting for a replica that never comes does not wait forever.
        http = {"host": config.host, "port": config.port,
                "request_timeout_s": config.engine.request_timeout + PROXY_TIMEOUT_MARGIN}
        serve.start(http_options=http, logging_config=logging_config)
        serve.run(application(config, plan), name=APP_NAME, route_prefix="/",
                  logging_config=logging_config)
        log.info("serving on http://%s:%d", config.host, config.port)
        _wait_for_signal()
        return 0
    except Exception as exc:  # a replica that cannot start, a port taken: say it, clean up
        log.error("the Ray Serve application failed: %s", exc)
        return 1
    finally:
        _take_down(local=address is None)


def _layout(config: ServerConfig, options: dict) -> tuple[ServerConfig, Plan]:
    """The replicas' engine config and the application's plan. On CPU replicas --threads 0
    means this machine's cores shared among them, and each replica reserves its threads."""
    replicas = max(1, options["replicas"])
    gpus = options["gpus_per_replica"]
    if gpus is None:
        gpus = 1.0 if ray.cluster_resources().get("GPU", 0) > 0 else 0.0
    threads = config.engine.n_threads
    if gpus == 0 and threads == 0:
        threads = max(1, usable_cores() // replicas)
    config = dataclasses.replace(config, engine=dataclasses.replace(config.engine,
                                                                    n_threads=threads))
    apply_cpu_wait(config.engine.cpu_wait, threads)  # decided here, applied in the replicas
    parallel = config.engine.n_parallel
    # A front per replica: one front for 2 or 4 GPU replicas was their ceiling
    # (docs/design/scale-out.md).
    fronts = options["front_replicas"]
    if fronts is None:
        fronts = options["max_replicas"] or replicas
    plan = Plan(replicas=replicas, fronts=fronts,
                min_replicas=options["min_replicas"],
                max_replicas=options["max_replicas"],
                target_ongoing_requests=options["target_ongoing_requests"] or parallel,
                # Twice the slots: at the slots themselves, requests beyond them wait in the
                # fronts' routers, which probe the replicas until one has room, and on a CPU
                # the probes took half the engines' time (docs/design/scale-out.md).
                max_ongoing_requests=options["max_ongoing_requests"] or 2 * parallel,
                router=options["routing"], cpus_per_replica=1.0 if gpus else float(threads),
                gpus_per_replica=gpus,
                env_vars={k: os.environ[k] for k in WAIT_VARIABLES if k in os.environ})
    return config, plan


def _wait_for_signal() -> None:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()


def _take_down(local: bool) -> None:
    """A local Ray goes entirely (Serve's controller and proxies are its actors); on a joined
    cluster only this application, which other users of Serve there do not share."""
    try:
        if local:
            serve.shutdown()
        else:
            serve.delete(APP_NAME)
    finally:
        ray.shutdown()
        if local:
            for pid in end_leftover_haproxy():
                log.warning("stopped HAProxy (pid %d), which outlived Ray", pid)
