"""Defaults from Slurm: under ``srun``, tp-run needs no rendezvous flags.

In a Slurm job step (``SLURM_JOB_ID`` and ``SLURM_STEP_ID`` set, one tp-run task per
node), the defaults become:

- ``--rdzv-id``: ``<SLURM_JOB_ID>.<SLURM_STEP_ID>`` (the same on every node of the step,
  different for the next step);
- ``--nnodes``: ``SLURM_NNODES`` (``SLURM_STEP_NUM_NODES`` if set);
- ``--node-rank`` (static): ``SLURM_NODEID``;
- ``--master-addr``: the first host of the step's node list (``SLURM_STEP_NODELIST``,
  else ``SLURM_JOB_NODELIST``), with Slurm's compressed host lists expanded;
- ``--local-addr``: ``SLURMD_NODENAME``, this node's name in that list. The stores and
  the rendezvous record of this node are then reached by the name every node already
  uses for node 0, not by this machine's own idea of its name (its FQDN, which need not
  resolve to the same address elsewhere, or may resolve to a loopback address).

Node names must therefore resolve to the nodes' addresses on every node (Slurm itself
needs them to unless ``NodeAddr`` is set); where they do not, pass ``--master-addr`` and
``--local-addr``.

Explicit flags (and ``PET_*`` variables) always win. ``TP_RUN_NO_SLURM=1`` turns the
defaults off.
"""

from __future__ import annotations

import logging
import re
from typing import Mapping

from tp_launch.config import ConfigError

logger = logging.getLogger(__name__)

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _split_top(text: str) -> list[str]:
    """Split at commas outside brackets."""
    parts: list[str] = []
    cur: list[str] = []
    depth = 0
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ConfigError(f"bad Slurm host list {text!r}: unbalanced ']'")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise ConfigError(f"bad Slurm host list {text!r}: unbalanced '['")
    parts.append("".join(cur))
    return [p for p in (s.strip() for s in parts) if p]


def _expand_one(pattern: str, whole: str) -> list[str]:
    """``gpu[01-03]x[1,2]`` -> every combination, zero padding kept."""
    start = pattern.find("[")
    if start < 0:
        return [pattern]
    end = pattern.index("]", start)
    head, body, tail = pattern[:start], pattern[start + 1:end], pattern[end + 1:]
    values: list[str] = []
    for item in body.split(","):
        m = _RANGE.match(item.strip())
        if not m:
            raise ConfigError(f"bad Slurm host list {whole!r}: {item!r} is not N or N-M")
        lo_s, hi_s = m.group(1), m.group(2) or m.group(1)
        lo, hi = int(lo_s), int(hi_s)
        if hi < lo:
            raise ConfigError(f"bad Slurm host list {whole!r}: range {item!r} runs backwards")
        width = len(lo_s) if lo_s.startswith("0") else 0
        values.extend(str(n).zfill(width) for n in range(lo, hi + 1))
    return [head + v + rest for v in values for rest in _expand_one(tail, whole)]


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed host list -> host names, in order.

    ``"gpu[01-04,07],login1"`` -> gpu01, gpu02, gpu03, gpu04, gpu07, login1.
    """
    hosts: list[str] = []
    for part in _split_top(text):
        hosts.extend(_expand_one(part, text))
    return hosts


def in_slurm_step(env: Mapping[str, str]) -> bool:
    return ("SLURM_JOB_ID" in env and "SLURM_STEP_ID" in env
            and env.get("TP_RUN_NO_SLURM", "") not in ("1", "true", "yes"))


def slurm_defaults(env: Mapping[str, str]) -> dict[str, object]:
    """The option defaults a Slurm step implies ({} outside one).

    Keys: ``rdzv_id``, ``nnodes``, ``node_rank``, ``master_addr``, ``local_addr`` (only
    those known).

    Raises:
        ConfigError: the step runs more than one tp-run task per node, or a malformed
            Slurm variable.
    """
    if not in_slurm_step(env):
        return {}
    out: dict[str, object] = {"rdzv_id": f"{env['SLURM_JOB_ID']}.{env['SLURM_STEP_ID']}"}
    nnodes = env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES")
    ntasks = env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS")
    try:
        if nnodes:
            out["nnodes"] = str(int(nnodes))
        if "SLURM_NODEID" in env:
            out["node_rank"] = int(env["SLURM_NODEID"])
    except ValueError:
        raise ConfigError(f"bad Slurm environment: SLURM_NNODES={nnodes!r}, "
                          f"SLURM_NODEID={env.get('SLURM_NODEID')!r}") from None
    if nnodes and ntasks and ntasks.isdigit() and int(ntasks) > int(nnodes):
        raise ConfigError(
            f"this Slurm step runs {ntasks} tasks on {nnodes} node(s); tp-run is one agent "
            "per node: srun --ntasks-per-node=1 tp-run ... (it starts the workers itself)")
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    if nodelist:
        hosts = expand_hostlist(nodelist)
        if hosts:
            out["master_addr"] = hosts[0]
    if env.get("SLURMD_NODENAME"):
        out["local_addr"] = env["SLURMD_NODENAME"]
    logger.info("Slurm step %s: defaults %s", out["rdzv_id"], out)
    return out
