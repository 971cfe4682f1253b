"""The ``tp-run`` command: torchrun's command line, option for option.

Every torchrun 2.13 option is accepted with both its ``-`` and ``_`` spellings, the
same default and the same ``PET_<DEST>`` environment fallback. Option parsing stops at
the training script: everything after it reaches the script untouched. Bad input is one
line on stderr (``tp-run: error: ...``) and exit status 2, never a traceback.
"""

from __future__ import annotations

import logging
import os
import sys
import uuid
import warnings
from typing import Any, Callable

import click

from tp_launch.config import (
    ConfigError,
    LaunchConfig,
    check_seconds,
    parse_comma_list,
    parse_local_ranks_filter,
    parse_nnodes,
    parse_nproc_per_node,
    parse_preempt_signal,
    parse_rdzv_conf,
    parse_signals,
    parse_std_map,
)

USAGE_EXIT = 2
NUMA_MODES = ("node", "socket", "exclusive", "core-complex")


def _opt(*names: str, **kwargs: Any) -> Callable:
    """A click option that also reads ``PET_<DEST>``, torchrun's environment fallback.

    The first ``--long-name`` gives the destination, as in torchrun (argparse takes the
    first long option string): ``--nproc-per-node`` -> ``PET_NPROC_PER_NODE``.
    """
    long_names = [n for n in names if n.startswith("--")]
    dest = long_names[0][2:].replace("-", "_")
    kwargs.setdefault("envvar", f"PET_{dest.upper()}")
    kwargs.setdefault("show_default", "default" in kwargs and not kwargs.get("is_flag"))
    return click.option(*names, dest, **kwargs)


@click.command(
    name="tp-run",
    context_settings={
        "allow_interspersed_args": False,
        "help_option_names": ["-h", "--help"],
        "max_content_width": 100,
    },
)
@_opt("--nnodes", default="1:1", help="Number of nodes, or a range MIN:MAX.")
@_opt("--nproc-per-node", "--nproc_per_node", default="1",
      help="Workers per node: an integer, or auto, cpu, gpu, xpu.")
@_opt("--rdzv-backend", "--rdzv_backend", default="static",
      help="Rendezvous backend: static, c10d (a TCPStore on the endpoint host), etcd "
      "(etcd-v2 and etcd-v3 also mean the etcd v3 API).")
@_opt("--rdzv-endpoint", "--rdzv_endpoint", default="",
      help="Rendezvous endpoint, host:port (etcd: the etcd server; c10d: default port 29400).")
@_opt("--rdzv-id", "--rdzv_id", default="none",
      help="Job id, the same on every node (under srun: SLURM_JOB_ID.SLURM_STEP_ID).")
@_opt("--rdzv-conf", "--rdzv_conf", default="",
      help="Extra rendezvous settings: key1=value1,key2=value2 (join_timeout, "
      "last_call_timeout, keep_alive_interval, lease_ttl, cacert, cert, key, user, "
      "etcd_prefix, is_host...; the etcd password only via TP_RUN_ETCD_PASSWORD).")
@_opt("--standalone", is_flag=True,
      help="Single-node job on a store this agent hosts on a free port; "
      "ignores --rdzv-backend/--rdzv-endpoint/--rdzv-id.")
@_opt("--max-restarts", "--max_restarts", default=0, type=click.IntRange(min=0),
      help="Restarts of the whole worker group before the job fails.")
@_opt("--monitor-interval", "--monitor_interval", default=0.1, type=click.FloatRange(min=0.0),
      help="Seconds between checks of the workers (a worker's death is also seen at once).")
@_opt("--start-method", "--start_method", default="spawn",
      type=click.Choice(["spawn", "fork", "forkserver"]),
      help="Accepted for torchrun compatibility; script workers are always new processes.")
@_opt("--event-log-handler", "--event_log_handler", default="null",
      help="Where agent events go: null or console.")
@_opt("--role", default="default", help="Role name of the workers (ROLE_NAME).")
@_opt("-m", "--module", is_flag=True, help="Run the script as a module, like python -m.")
@_opt("--no-python", "--no_python", is_flag=True,
      help="Run the script directly, not through python.")
@_opt("--run-path", "--run_path", is_flag=True,
      help="Run the script with runpy.run_path (takes precedence over --no-python).")
@_opt("--log-dir", "--log_dir", default=None,
      help="Base directory for per-run, per-attempt, per-rank logs (default: a temp dir).")
@_opt("-r", "--redirects", default="0",
      help="Send worker streams to files: 0 none, 1 stdout, 2 stderr, 3 both; "
      "or per local rank, e.g. 0:1,1:2.")
@_opt("-t", "--tee", default="0", help="Like --redirects, and also print to the console.")
@_opt("--local-ranks-filter", "--local_ranks_filter", default="",
      help="Show only these local ranks' output on the console, e.g. 0,1.")
@_opt("--duplicate-stdout-filters", "--duplicate_stdout_filters", default="",
      help="Copy tee'd stdout lines containing any of these strings (comma separated, "
      ",, for a comma) to filtered_stdout.log.")
@_opt("--duplicate-stderr-filters", "--duplicate_stderr_filters", default="",
      help="The same for stderr, into filtered_stderr.log.")
@_opt("--node-rank", "--node_rank", default=0, type=click.IntRange(min=0),
      help="This node's rank (static rendezvous only).")
@_opt("--master-addr", "--master_addr", default="127.0.0.1",
      help="Address of node 0 (static rendezvous only).")
@_opt("--master-port", "--master_port", default=None, type=click.IntRange(0, 65535),
      help="Port on node 0 (static rendezvous only); default 29500.")
@_opt("--local-addr", "--local_addr", default=None,
      help="This node's address as other nodes reach it (default: its FQDN).")
@_opt("--logs-specs", "--logs_specs", default=None, envvar=None,
      help="Name of a torchrun.logs_specs entry point that lays out the log files.")
@_opt("--numa-binding", "--numa_binding", default=None, envvar=None,
      type=click.Choice(NUMA_MODES), help="Bind workers to CPUs near their GPU.")
@_opt("--signals-to-handle", "--signals_to_handle", default="SIGTERM,SIGINT,SIGHUP,SIGQUIT",
      help="Signals forwarded to the workers before tp-run stops them and exits 1.")
@_opt("--shutdown-timeout", "--shutdown_timeout", default=None, type=click.IntRange(min=0),
      help="Seconds a stopping worker gets before SIGKILL "
      "(default: TORCH_ELASTIC_SHUTDOWN_TIMEOUT or 30).")
@_opt("--virtual-local-rank", "--virtual_local_rank", is_flag=True,
      help="LOCAL_RANK=0 for every worker, each seeing only its own GPU.")
@_opt("--spares", default=0, type=click.IntRange(min=0),
      help="tp-run: spare processes per node, parked at tp_launch.resilient.run(); a dead "
      "rank is replaced by one and the survivors keep running (scripts that use "
      "tp_launch.resilient; others run as under torchrun). Multi-node: give every node "
      "the same value and use --rdzv-backend etcd; nodes beyond --nnodes MAX are spare "
      "nodes that take over a lost node's ranks.")
@_opt("--spare-policy", "--spare_policy", default="restart",
      type=click.Choice(["restart", "wait", "fail"]),
      help="tp-run: when a rank dies and no spare is parked: restart every worker "
      "(counted against --max-restarts, like torchrun), wait for a spare, or fail.")
@_opt("--spare-wait-timeout", "--spare_wait_timeout", default=300.0,
      type=click.FloatRange(min=0.0),
      help="tp-run: seconds --spare-policy wait waits for a spare before the job fails.")
@_opt("--verify-every", "--verify_every", default=0, type=click.IntRange(min=0),
      help="tp-run: every N committed steps the ranks compare a digest of their state "
      "and stop the job if they differ (0: only after each recovery).")
@_opt("--shard-copy-every", "--shard_copy_every", default=0, type=click.IntRange(min=0),
      help="tp-run: sharded state (State(build=...)): every N committed steps each rank "
      "copies its shard and its own state into another rank's host memory (a rank on "
      "another node where there is one); a rank lost with no other holder of its "
      "shard comes back from that copy, every rank going back to the copy's step "
      "(1: every step; 0: off, the default).")
@_opt("--hang-timeout", "--hang_timeout", default=None, type=click.FloatRange(min=0.0),
      help="tp-run: seconds without progress (no step committed, no collective issued) "
      "after which the rank that holds the others up has its stack logged, is killed "
      "and replaced; the limit grows to 20x the median step time for slow steps "
      "(default 300 with --spares and a resilient script; 0: off). A plain script: no "
      "output from any worker for that long restarts the workers (default: off).")
@_opt("--straggler-factor", "--straggler_factor", default=2.0, type=click.FloatRange(min=0.0),
      help="tp-run: a rank that needs this many times its peers' time per step for a "
      "whole --straggler-window migrates to a parked spare (0: off).")
@_opt("--straggler-window", "--straggler_window", default=60.0,
      type=click.FloatRange(min=1.0),
      help="tp-run: seconds a rank must stay slow before it is taken for a straggler.")
@_opt("--on-preempt", "--on_preempt", default="ignore",
      type=click.Choice(["migrate", "stop", "ignore"]),
      help="tp-run (with --spares): what --preempt-signal does: migrate this node's ranks "
      "to parked spares on other nodes (stop if none can take them), stop the job, or "
      "ignore (not handled by tp-run, as torchrun).")
@_opt("--preempt-signal", "--preempt_signal", default="SIGUSR1",
      help="tp-run: the preemption notice's signal (under Slurm: --signal=USR1@120).")
@_opt("--health-check", "--health_check", default=None,
      help="tp-run (with --spares): a shell command run every --health-interval seconds "
      "(that long at most); its first failure migrates this node's ranks, as "
      "--on-preempt migrate.")
@_opt("--health-interval", "--health_interval", default=30.0,
      type=click.FloatRange(min=0.0, min_open=True),
      help="tp-run: seconds between two runs of --health-check (also its timeout).")
@click.argument("training_script", envvar=None)
@click.argument("training_script_args", nargs=-1, type=click.UNPROCESSED)
def tp_run(**opts: Any) -> int:
    """Launch TRAINING_SCRIPT on this node's workers, like torchrun.

    Everything after TRAINING_SCRIPT is passed to the script as is.
    """
    config = config_from_options(opts)
    from tp_launch.agent import run_agent

    return run_agent(config)


def config_from_options(opts: dict[str, Any]) -> LaunchConfig:
    """Resolve torchrun's defaults (standalone, master port) into a LaunchConfig."""
    opts = _with_slurm_defaults(opts)
    min_nodes, max_nodes = parse_nnodes(opts["nnodes"])
    nproc = parse_nproc_per_node(opts["nproc_per_node"])
    backend, endpoint, run_id = opts["rdzv_backend"], opts["rdzv_endpoint"], opts["rdzv_id"]
    master_port = opts["master_port"]
    standalone = opts["standalone"]
    if standalone or (backend == "static" and not endpoint and master_port is None
                      and max_nodes == 1):
        # torchrun's (automatic) standalone: a store this agent hosts on a free port.
        standalone = True
        backend, endpoint, run_id = "c10d", "localhost:0", str(uuid.uuid4())
    if master_port is None:
        master_port = 29500
    if backend == "static" and not endpoint:
        addr = opts["master_addr"]
        bare_ipv6 = ":" in addr and not addr.startswith("[")
        endpoint = f"[{addr}]:{master_port}" if bare_ipv6 else f"{addr}:{master_port}"

    if not standalone:
        from rendezvous import unknown_backend

        bad_backend = unknown_backend(backend)
        if bad_backend is not None:
            raise ConfigError(bad_backend)
    rdzv_configs = parse_rdzv_conf(opts["rdzv_conf"])
    if not standalone and backend != "static" and max_nodes > 1:
        from rendezvous.conf import validate

        validate(backend, endpoint, rdzv_configs)  # bad etcd/c10d settings: exit 2 up front
        if opts["spares"]:
            from rendezvous.conf import with_resilient_lease

            rdzv_configs = with_resilient_lease(rdzv_configs)

    script, script_args = opts["training_script"], list(opts["training_script_args"])
    if script == "--" and script_args:
        script, script_args = script_args[0], script_args[1:]
    if opts["no_python"] and opts["module"] and not opts["run_path"]:
        raise ConfigError("--no-python and -m/--module cannot be used together")
    entrypoint, name = _entrypoint(script, script_args, opts)

    shutdown_timeout = opts["shutdown_timeout"]
    if shutdown_timeout is None:
        env_timeout = os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30")
        try:
            shutdown_timeout = float(env_timeout)
        except ValueError:
            raise ConfigError(
                f"TORCH_ELASTIC_SHUTDOWN_TIMEOUT={env_timeout!r} is not a number of seconds"
            ) from None
        check_seconds(shutdown_timeout, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
    # click's FloatRange lets nan and inf through (nan compares false with the bounds).
    check_seconds(opts["monitor_interval"], "--monitor-interval")
    check_seconds(opts["spare_wait_timeout"], "--spare-wait-timeout")
    for option in ("hang_timeout", "straggler_factor", "straggler_window", "health_interval"):
        if opts[option] is not None:
            check_seconds(opts[option], "--" + option.replace("_", "-"))
    preempt_signal = parse_preempt_signal(opts["preempt_signal"])
    health_check = opts["health_check"]
    if health_check is not None:
        from tp_launch.agent.health import check_command

        check_command(health_check, opts["health_interval"])
    if opts["spares"] == 0 and (opts["on_preempt"] != "ignore" or health_check
                                or opts["shard_copy_every"]):
        flag = f"--on-preempt {opts['on_preempt']}" if opts["on_preempt"] != "ignore" \
            else "--health-check" if health_check else "--shard-copy-every"
        raise ConfigError(f"{flag} needs resilient mode (--spares K)")

    return LaunchConfig(
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nproc_per_node=nproc,
        rdzv_backend=backend,
        rdzv_endpoint=endpoint,
        run_id=run_id,
        rdzv_configs=rdzv_configs,
        standalone=standalone,
        max_restarts=opts["max_restarts"],
        monitor_interval=opts["monitor_interval"],
        start_method=opts["start_method"],
        event_log_handler=opts["event_log_handler"],
        role=opts["role"],
        entrypoint=entrypoint,
        name=name,
        log_dir=opts["log_dir"],
        logs_specs=opts["logs_specs"],
        redirects=parse_std_map(opts["redirects"], "--redirects", nproc),
        tee=parse_std_map(opts["tee"], "--tee", nproc),
        local_ranks_filter=parse_local_ranks_filter(opts["local_ranks_filter"]),
        duplicate_stdout_filters=parse_comma_list(opts["duplicate_stdout_filters"]),
        duplicate_stderr_filters=parse_comma_list(opts["duplicate_stderr_filters"]),
        node_rank=opts["node_rank"],
        master_addr=opts["master_addr"],
        master_port=master_port,
        local_addr=opts["local_addr"],
        numa_binding=opts["numa_binding"],
        signals_to_handle=parse_signals(opts["signals_to_handle"]),
        signals_to_handle_str=opts["signals_to_handle"],
        shutdown_timeout=shutdown_timeout,
        virtual_local_rank=opts["virtual_local_rank"],
        log_line_prefix_template=os.environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"),
        spares=opts["spares"],
        spare_policy=opts["spare_policy"],
        spare_wait_timeout=opts["spare_wait_timeout"],
        verify_every=opts["verify_every"],
        shard_copy_every=opts["shard_copy_every"],
        hang_timeout=opts["hang_timeout"],
        straggler_factor=opts["straggler_factor"],
        straggler_window=opts["straggler_window"],
        on_preempt=opts["on_preempt"],
        preempt_signal=preempt_signal,
        health_check=health_check,
        health_interval=opts["health_interval"],
    )


def _with_slurm_defaults(opts: dict[str, Any]) -> dict[str, Any]:
    """Under srun, options left at their defaults take Slurm's values (tp_launch.slurm);
    a flag or PET_* variable the user gave always wins."""
    from tp_launch.slurm import slurm_defaults

    defaults = slurm_defaults(os.environ)
    ctx = click.get_current_context(silent=True)
    if not defaults or ctx is None:
        return opts
    out = dict(opts)
    for name, value in defaults.items():
        if ctx.get_parameter_source(name) in (None, click.core.ParameterSource.DEFAULT):
            out[name] = value
    return out


def _entrypoint(script: str, args: list[str], opts: dict[str, Any]) -> tuple[list[str], str]:
    """The worker's argv (before ``${local_rank}`` substitution) and the job's name."""
    python = os.environ.get("PYTHON_EXEC", sys.executable)
    if opts["run_path"]:
        if not os.path.isfile(script):
            raise ConfigError(f"training script not found: {script}")
        return [python, "-u", "-m", "tp_launch.procs.run_path", script, *args], "run_script_path"
    if opts["no_python"]:
        found = os.path.exists(script) if os.sep in script else _on_path(script)
        if not found:
            raise ConfigError(f"program not found: {script}")
        return [script, *args], script
    if opts["module"]:
        return [python, "-u", "-m", script, *args], python if python != sys.executable else script
    if not os.path.exists(script):
        raise ConfigError(f"training script not found: {script}")
    return [python, "-u", script, *args], python if python != sys.executable else script


def _on_path(program: str) -> bool:
    import shutil

    return shutil.which(program) is not None


def expand_abbreviations(command: click.Command, argv: list[str]) -> list[str]:
    """Expand unique prefixes of long options (``--nproc-per 2``), as torchrun's argparse does.

    Only the launcher's own options are touched: scanning stops at the training script
    (the first positional) or at ``--``.
    """
    takes_value: dict[str, bool] = {}
    for param in command.params:
        if isinstance(param, click.Option):
            for name in param.opts:
                takes_value[name] = not param.is_flag
    out = list(argv)
    i = 0
    while i < len(out):
        token = out[i]
        if token == "--" or not token.startswith("-") or token == "-":
            break
        name, eq, value = token.partition("=")
        if name.startswith("--") and name not in takes_value:
            matches = [n for n in takes_value if n.startswith(name)]
            if matches and len({n.replace("_", "-") for n in matches}) == 1:
                name = matches[0]
                out[i] = name + eq + value
        if takes_value.get(name) and not eq and not (len(name) == 2 and len(token) > 2):
            i += 1  # skip the option's value
        i += 1
    return out


def main(argv: list[str] | None = None) -> None:
    """Console entry point: click parsing with one-line usage errors."""
    # torch's CPU wheel does not bring numpy and warns about it when imported; tp-run
    # needs no numpy, and its errors stay one line.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    _setup_logging()
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["migrate"] and not os.path.exists("migrate"):
        # A control command for a running job (a training script named "migrate" wins).
        from tp_launch.migrate import main as migrate_main

        migrate_main(argv[1:])
    if argv[:1] == ["status"] and not os.path.exists("status"):
        # What a running job does (a training script named "status" wins).
        from tp_launch.status import main as status_main

        status_main(argv[1:])
    argv = expand_abbreviations(tp_run, argv)
    try:
        code = tp_run.main(args=argv, prog_name="tp-run", standalone_mode=False)
    except click.UsageError as e:
        click.echo(f"tp-run: error: {e.format_message()}", err=True)
        sys.exit(USAGE_EXIT)
    except ConfigError as e:
        click.echo(f"tp-run: error: {e}", err=True)
        sys.exit(USAGE_EXIT)
    except click.exceptions.Abort:  # click's KeyboardInterrupt: SIGINT not handled (yet)
        print("tp-run: stopped by SIGINT", file=sys.stderr)
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)


# The directory that holds the tp_launch and rendezvous packages: log lines name their
# source relative to it (tp_launch/agent/node_agent.py:42), as torchrun's name
# torch/distributed/elastic/agent/server/api.py:42.
_SOURCE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _TorchrunFormatter(logging.Formatter):
    """torchrun's line header, ``W1202 17:55:32.779000 2474 path/to/file.py:42] ``, on
    every line of a multi-line message, as torchrun does."""

    def __init__(self) -> None:
        super().__init__(datefmt="%m%d %H:%M:%S")

    def format(self, record: logging.LogRecord) -> str:
        path = record.pathname
        if path.startswith(_SOURCE_ROOT + os.sep):
            path = path[len(_SOURCE_ROOT) + 1:]
        header = (f"{record.levelname[:1]}{self.formatTime(record, self.datefmt)}."
                  f"{int(record.msecs):03d}000 {record.process} {path}:{record.lineno}] ")
        message = record.getMessage()
        if record.exc_info:
            message += "\n" + self.formatException(record.exc_info)
        return "\n".join(header + line for line in message.split("\n"))


def _setup_logging() -> None:
    """Agent log lines in torchrun's shape and at torchrun's default level (LOGLEVEL)."""
    level = os.environ.get("LOGLEVEL", "WARNING").upper()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_TorchrunFormatter())
    for name in ("tp_launch", "rendezvous"):
        log = logging.getLogger(name)
        log.addHandler(handler)
        log.setLevel(level if level in logging._nameToLevel else "WARNING")
        log.propagate = False


if __name__ == "__main__":
    main()
