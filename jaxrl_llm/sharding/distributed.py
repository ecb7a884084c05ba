"""Multi-process start-up: `initialize()` joins the JAX distributed runtime when more than one
process is configured (TPU pod workers, multi-node GPU, SLURM, several CPU processes) and does
nothing for a single process. Call it first thing, before any other JAX call.

Sources, first match wins: explicit arguments; the env vars JAX_COORDINATOR_ADDRESS,
JAX_NUM_PROCESSES, JAX_PROCESS_ID (and JAX_LOCAL_DEVICE_IDS, read by JAX itself); otherwise JAX's
own cluster detection (Cloud TPU VM metadata / GKE TPU_WORKER_HOSTNAMES, SLURM, Open MPI),
which is used only when it reports more than one process.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import jax

logger = logging.getLogger(__name__)


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} must be an integer") from None


def detect_cluster() -> tuple[str, int] | None:
    """(cluster kind, process count) from JAX's cluster detection, or None when not in a cluster.

    Opt-in methods (mpi4py) are skipped, as `jax.distributed.initialize()` skips them by default.
    """
    try:
        from jax._src import clusters  # JAX's own detection; private, so guarded
        cluster_types = list(clusters.ClusterEnv._cluster_types)
    except (ImportError, AttributeError):  # a JAX without this module: no auto-detection
        logger.debug("jax cluster detection unavailable")
        return None
    for env in cluster_types:
        if getattr(env, "opt_in_only_method", False) or not env.is_env_present():
            continue
        return env.__name__, int(env.get_process_count())
    return None


def _use_gloo_for_cpu_collectives() -> None:
    """Cross-process collectives on CPU need an implementation; keep the user's if they chose one."""
    if jax.config.jax_cpu_collectives_implementation is None:  # pyright: ignore[reportAttributeAccessIssue]
        jax.config.update("jax_cpu_collectives_implementation", "gloo")


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None,
               local_device_ids: int | Sequence[int] | None = None) -> bool:
    """Joins the distributed runtime if more than one process is configured; idempotent.

    Returns True when running multi-process (now or from an earlier call), False for one process.
    """
    if jax.distributed.is_initialized():
        return True
    coordinator_address = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS") or None
    if num_processes is None:
        num_processes = _env_int("JAX_NUM_PROCESSES")
    if process_id is None:
        process_id = _env_int("JAX_PROCESS_ID")

    if num_processes is not None:
        if num_processes < 1:
            raise ValueError(f"num_processes (JAX_NUM_PROCESSES) must be >= 1, got {num_processes}")
        if num_processes == 1:
            return False
        if coordinator_address is None:
            raise ValueError(f"num_processes={num_processes} needs coordinator_address "
                             "(or JAX_COORDINATOR_ADDRESS=host:port of process 0)")
        if process_id is None:
            raise ValueError(f"num_processes={num_processes} needs process_id (or JAX_PROCESS_ID)")
        if not 0 <= process_id < num_processes:
            raise ValueError(f"process_id={process_id} must be in [0, {num_processes})")
    else:
        cluster = detect_cluster()
        if cluster is None or cluster[1] <= 1:
            if coordinator_address is not None:
                raise ValueError("coordinator_address (JAX_COORDINATOR_ADDRESS) is set but the number "
                                 "of processes is unknown: set num_processes / JAX_NUM_PROCESSES")
            return False
        logger.info("detected %s with %d processes", cluster[0], cluster[1])

    _use_gloo_for_cpu_collectives()
    # Unset arguments are filled in by JAX's cluster detection.
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id, local_device_ids=local_device_ids)
    logger.info("process %d of %d; %d local / %d global devices", jax.process_index(),
                jax.process_count(), jax.local_device_count(), jax.device_count())
    return True
