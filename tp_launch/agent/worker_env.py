"""The environment and command line each worker gets: torchrun's, variable for variable."""

from __future__ import annotations

import os
from collections.abc import Mapping
from string import Template

from rendezvous.api import RendezvousInfo
from rendezvous.etcd import PASSWORD_ENV
from tp_launch.config import ConfigError, LaunchConfig

# The agent's own secrets: a worker runs the user's script and needs none of them.
_AGENT_ONLY = (PASSWORD_ENV,)


def without_agent_secrets(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` less the agent's own secrets: what a process the agent starts for
    someone else's code (a worker, the health check) may see."""
    return {k: v for k, v in environ.items() if k not in _AGENT_ONLY}


# The variables worker_env sets per worker: a process forked from the template may have
# them differently from it (torch does not read them at import).
PER_WORKER_VARS = frozenset({
    "RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
    "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_SIGNALS_TO_HANDLE",
    "TORCHELASTIC_ERROR_FILE", "LOCAL_RANK", "CUDA_VISIBLE_DEVICES",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING", "PYTHONFAULTHANDLER"})


def worker_env(config: LaunchConfig, info: RendezvousInfo, local_rank: int,
               restart_count: int, error_file: str) -> dict[str, str]:
    """The full environment of one worker: the agent's (less the etcd password), plus
    torchrun's variables."""
    rank = info.rank_offset + local_rank
    env = without_agent_secrets(os.environ)
    env.update({
        "RANK": str(rank),
        "GROUP_RANK": str(info.node_rank),
        "ROLE_RANK": str(rank),
        "ROLE_NAME": config.role,
        "LOCAL_WORLD_SIZE": str(config.nproc_per_node),
        "WORLD_SIZE": str(info.world_size),
        "GROUP_WORLD_SIZE": str(info.nnodes),
        "ROLE_WORLD_SIZE": str(info.world_size),
        "MASTER_ADDR": info.master_addr,
        "MASTER_PORT": str(info.master_port),
        "TORCHELASTIC_RESTART_COUNT": str(restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(config.max_restarts),
        "TORCHELASTIC_RUN_ID": config.run_id,
        "TORCHELASTIC_USE_AGENT_STORE": str(info.use_agent_store),
        "TORCHELASTIC_SIGNALS_TO_HANDLE": config.signals_to_handle_str,
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        "TORCHELASTIC_ERROR_FILE": error_file,
        "LOCAL_RANK": str(local_rank),
        # A hung worker is ended with SIGABRT: this prints its stack first.
        **({"PYTHONFAULTHANDLER": "1"} if config.hang_timeout else {}),
    })
    if config.virtual_local_rank:
        env["LOCAL_RANK"] = "0"
        env["CUDA_VISIBLE_DEVICES"] = _visible_device(local_rank)
    return env


def _visible_device(local_rank: int) -> str:
    parent = os.environ.get("CUDA_VISIBLE_DEVICES")
    if parent is None:
        return str(local_rank)
    devices = parent.split(",")
    if local_rank >= len(devices):
        raise ConfigError(
            f"--virtual-local-rank: local rank {local_rank} has no device in "
            f"CUDA_VISIBLE_DEVICES={parent}"
        )
    return devices[local_rank].strip()


def worker_argv(config: LaunchConfig, local_rank: int) -> list[str]:
    """The worker's argv with torchrun's ``${local_rank}`` macro substituted."""
    argv = [Template(a).safe_substitute(local_rank=str(local_rank)) for a in config.entrypoint]
    if config.numa_binding:
        argv = _numa_wrapped(argv, config.numa_binding, local_rank)
    return argv


def _numa_wrapped(argv: list[str], mode: str, local_rank: int) -> list[str]:
    """Let torch's own NUMA helper bind the worker, exactly as torchrun does."""
    from torch.numa.binding import (
        AffinityMode,
        NumaOptions,
        _maybe_wrap_command_args_with_numa_binding,
    )

    wrapped = _maybe_wrap_command_args_with_numa_binding(
        tuple(argv), gpu_index=local_rank,
        numa_options=NumaOptions(affinity_mode=AffinityMode(mode)))
    return list(wrapped)


# A spare is not a rank until it is promoted: these are set by tp_launch.resilient then.
_RANK_VARS = ("RANK", "ROLE_RANK")


def spare_env(config: LaunchConfig, info: RendezvousInfo, device: int, restart_count: int,
              error_file: str) -> dict[str, str]:
    """A parked spare's environment: a worker's, with no rank, LOCAL_RANK = ``device``
    (its own device: one that no live process of this node uses)."""
    env = worker_env(config, info, device, restart_count, error_file)
    for key in _RANK_VARS:
        env.pop(key, None)
    env["LOCAL_RANK"] = str(device)
    return env  # TP_RUN_SPARE=1 comes with the worker settings (tp_launch.worker_settings)
