"""`cohort run`: launch a job's ranks on this node, supervise them, replace the ones that fail."""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import socket
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from click.core import ParameterSource

from cohort.commands.settings import JobSettings, job_settings
from cohort.commands.shared import (
    FILE,
    fail,
    job_option,
    redis_client,
    redis_settings,
    redis_url_option,
    wait_for_redis_option,
)
from cohort.errors import Exit
from cohort.launcher import slurm

if TYPE_CHECKING:
    from cohort.events.models import JobConfig
    from cohort.launcher.gpus import NodeGpus
    from cohort.launcher.launcher import LaunchSettings


@click.command(context_settings={"allow_interspersed_args": False})
@click.option(
    "-n",
    "--nproc-per-node",
    "nproc",
    default="1",
    show_default=True,
    metavar="N|gpu",
    help="Ranks to run on this node; `gpu`: one per GPU a process can open (those "
    "CUDA_VISIBLE_DEVICES names, else NVML's), less the --spares. With GPUs, each process "
    "(spares too) gets one of its own through CUDA_VISIBLE_DEVICES.",
)
@click.option(
    "--spares",
    default="0",
    show_default=True,
    metavar="K",
    help="Warm spares to keep on this node besides its ranks: each runs the script up to its "
    "first step (imports, model, loader) and waits there, synced, in no world; when a rank "
    "is lost a spare takes its place at once and a new spare starts behind it. With GPUs, "
    "each spare has a GPU of its own. For scripts on cohort's elastic loop (ElasticJob, "
    "NumpyElasticJob).",
)
@job_option(
    "The job (default $COHORT_JOB, else a name made from the script, its arguments, the job "
    "settings and the working directory: the same command is the same job); nodes of one "
    "job name the same.",
    required=False,
)
@redis_url_option()
@click.option(
    "--node",
    metavar="NAME",
    help="This node's name in worker ids and logs (default: the host name); two launchers "
    "of one job on one host need two names.",
)
@click.option(
    "--coordinators",
    type=click.IntRange(0, 16),
    default=1,
    show_default=True,
    help="Coordinators to run on this node (each a standby until it leads); 0: none here.",
)
@click.option("--no-coordinator", is_flag=True, help="Run no coordinator here (--coordinators 0).")
@click.option(
    "--max-restarts",
    type=click.IntRange(min=0),
    default=3,
    show_default=True,
    help="Per local rank: failures in a row within a minute of starting before it is given "
    "up (a rank that trained longer is replaced at once, its count afresh).",
)
@click.option(
    "--run-dir",
    type=click.Path(path_type=Path, file_okay=False),
    metavar="DIR",
    help="Where each rank's log, the coordinators', run.json and the private Redis's AOF go "
    "(default: the job's unfinished run under ./cohort-runs, resumed, else a new folder "
    "there, printed).",
)
@click.option(
    "--fresh",
    is_flag=True,
    help="Start the job over from step 0 in a new run directory, even where an earlier run "
    "of it did not finish or finished (default: resume the one that did not finish).",
)
@click.option("--export", type=FILE, help="At the end, export the job's journal to this file.")
@click.option(
    "--chaos",
    type=click.FloatRange(min=1),
    metavar="SECONDS",
    help="Every SECONDS of training, SIGKILL a random local rank (it is replaced): try the "
    "script's elasticity.",
)
@click.option(
    "--exit-reports/--no-exit-reports",
    default=True,
    show_default=True,
    help="Tell the leader the moment a rank's process ends, so it is failed at once (a spare "
    "in its place); off: its closed connections (--disconnect-grace) or its silence tell.",
)
@click.option(
    "--stop-grace",
    type=click.FloatRange(min=0),
    default=30.0,
    show_default=True,
    help="After Ctrl-C/SIGTERM, seconds the ranks get to finish their step and leave.",
)
@click.option(
    "--worker-credentials",
    is_flag=True,
    help="Give each rank its own Redis user, whose password signs its commands "
    "(docs/identity.md); the first switches the job to signed commands only. Automatic "
    "where the job signs already. Needs a --redis-url user allowed ACL SETUSER.",
)
@click.option(
    "--slurm/--no-slurm",
    default=None,
    help="Take from the SLURM job step this runs in (default: when $SLURM_JOB_ID and "
    "$SLURMD_NODENAME say there is one) what SLURM knows: the node, its ranks (its GPUs, "
    "else the job's --ntasks-per-node), the job (its name and id), the run directory "
    "($SLURM_SUBMIT_DIR/cohort-runs/slurm-ID, kept across requeues) and, on several nodes, "
    "the Redis the first node runs for the others. docs/slurm.md.",
)
@click.option(
    "--drain-signal",
    type=click.Choice(["USR1", "USR2", "none"]),
    envvar="COHORT_DRAIN_SIGNAL",
    help="A signal that makes every rank finish its step and leave, then ends the launcher "
    "with exit 75 (requeue me): SLURM's --signal=USR1@SECONDS before a time limit. The "
    "processes the launcher starts ignore it. Default: USR1 under SLURM, else none.",
)
@job_settings
@wait_for_redis_option()
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def run(ctx: click.Context, command: tuple[str, ...], **params: Any) -> None:
    """Run COMMAND as the job's ranks on this node, with a coordinator and (where no Redis
    is given) a private Redis; replace a rank that fails; end when the job does.

    The same command again resumes its job where a launcher was lost (killed, Ctrl-C, a
    reboot): from the run directory its unfinished run left under ./cohort-runs, on that
    run's Redis AOF. A job that finished says so and runs nothing; --fresh starts over.

    \b
      cohort run -n 3 --epochs 4 examples/numpy_train.py        a .py runs with this Python
      cohort run -n 4 --job J -- python train.py --lr 0.1      on every node of job J
    """
    from cohort.launcher.launcher import Launcher, LaunchError, launcher_console

    settings = _launch_settings(ctx, command, params)
    console = launcher_console()
    try:
        code = Launcher(settings, console).run()
    except LaunchError as exc:
        fail(str(exc) + (f" (log: {exc.log})" if exc.log else ""), exc.code)
    sys.exit(code)


def _launch_settings(
    ctx: click.Context, command: tuple[str, ...], params: dict[str, Any]
) -> LaunchSettings:
    """Every flag checked, nothing started yet: the launcher's settings, or exit 2 (3: the
    Redis given does not answer) naming the bad value."""
    from cohort.launcher.launcher import LaunchSettings
    from cohort.launcher.supervision import Policy

    job_settings_given = JobSettings.of(params)
    config, _ = job_settings_given.config()  # bad settings: exit 2 before anything starts
    under = _slurm_job(params["slurm"])
    node = params["node"] or (slurm.node_name(under) if under else _host_name())
    _check_node(node)
    argv = _command(command)
    _check_shadowing(argv)
    gpus = node_gpus()
    nproc = _slurm_nproc(ctx, params["nproc"], under)
    ranks = _whole_groups(_ranks(nproc, lambda: gpus, _spare_count(params["spares"])), config)
    redis_url = _slurm_redis(ctx, params, under)
    job = params["job"] or _job_name(command, job_settings_given, under)
    job, run_dir, resuming = _run_dir(ctx, job, params, shared=bool(redis_url))
    if config.checkpoint_uri is not None:
        _check_checkpoint_owner(config.checkpoint_uri, job)
    if under is not None or not redis_url:
        _start_with_every_rank(
            job_settings_given, slurm.start_workers(under, ranks) if under else ranks
        )
    spares = _spares(params["spares"], ranks, config.max_workers)
    placement = _placement(gpus, ranks, spares)
    if redis_url:
        wait = params["wait_for_redis"]
        _check_shared_redis(ctx, job, node, job_settings_given, wait, slurm=under is not None)
        _check_credentials(ctx, job, node, params["worker_credentials"])
    kept = f" and {spares} spare(s)" if spares else ""
    each = f", one GPU each ({gpus.source})" if placement else ""
    click.echo(f"cohort run: job {job!r}, {ranks} rank(s){kept} on node {node!r}{each}, logs in "
               f"{run_dir}")  # fmt: skip
    return LaunchSettings(
        job=job,
        command=argv,
        ranks=ranks,
        node=node,
        run_dir=run_dir,
        redis_url=redis_settings(ctx, "cohort-run").url if redis_url else None,
        coordinators=0 if params["no_coordinator"] else params["coordinators"],
        job_flags=tuple(job_settings_given.argv()),
        policy=Policy(max_restarts=params["max_restarts"]),
        export=params["export"],
        chaos=params["chaos"],
        live=sys.stdout.isatty(),
        log_level=ctx.find_root().params.get("log_level", "info"),
        stop_grace=params["stop_grace"],
        worker_credentials=params["worker_credentials"],
        spares=spares,
        gpus=placement,
        shard_group=config.shard_group,
        exit_reports=params["exit_reports"],
        resuming=resuming,
        **_slurm_settings(params["drain_signal"], under, shared=bool(redis_url)),
    )


def _job_name(command: tuple[str, ...], given: JobSettings, under: slurm.SlurmJob | None) -> str:
    """The job without --job: the SLURM job's, else one made from the command and the
    settings as given (-n, and the start-up wait it sets, may change between its runs)."""
    from cohort.launcher.rundir import job_for

    return slurm.job_name(under) if under else job_for(command, given.argv(), os.getcwd())


def _slurm_nproc(ctx: click.Context, given: str, under: slurm.SlurmJob | None) -> str:
    """-n as given, else under SLURM the node's GPUs or the job's tasks per node (said)."""
    if under is None:
        return given
    said = "-n"
    if ctx.get_parameter_source("nproc") is ParameterSource.DEFAULT:
        given, said = slurm.ranks(under, slurm.tasks_per_node(slurm.job_record(under)))
    click.echo(
        f"cohort run: SLURM job {under.job_id} (requeued {under.restarts} time(s)), node "
        f"{under.node_id + 1} of {under.nodes}: ranks from {said}"
    )
    return given


def _slurm_redis(
    ctx: click.Context, params: dict[str, Any], under: slurm.SlurmJob | None
) -> str | None:
    """The Redis URL given; under SLURM with none, on a node after the first, the one the
    first node runs for the job (awaited); and under SLURM the run directory, unless given."""
    redis_url: str | None = ctx.obj.get("redis_url")
    if under is None:
        return redis_url
    if not redis_url and not under.hosts_redis and under.nodes > 1:
        redis_url = ctx.obj["redis_url"] = _awaited_url(under)
    if params["run_dir"] is None:
        params["run_dir"] = slurm.run_dir(under, own_redis=not redis_url)
    return redis_url


def _slurm_settings(
    drain_signal: str | None, under: slurm.SlurmJob | None, shared: bool
) -> dict[str, Any]:
    """The drain signal (USR1 under SLURM unless given), and where this node runs the Redis
    of a SLURM job of several nodes: bound to an address they reach, with a password, its
    URL published for them."""
    drain = drain_signal or ("USR1" if under is not None else "none")
    host = under is not None and not shared and under.nodes > 1
    return {
        "drain_signal": None if drain == "none" else signal.Signals[f"SIG{drain}"],
        "redis_host": _redis_host() if host else "127.0.0.1",
        "redis_password": secrets.token_hex(16) if host else None,
        "slurm": under if host else None,
    }


def _slurm_job(asked: bool | None) -> slurm.SlurmJob | None:
    """The SLURM job step this runs in, unless --no-slurm; --slurm outside one: exit 2."""
    found = slurm.SlurmJob.of(os.environ) if asked is not False else None
    if asked and found is None:
        fail(
            "--slurm: this is not a SLURM job step ($SLURM_JOB_ID and $SLURMD_NODENAME are "
            "not both set): run it through srun inside sbatch or salloc"
        )
    return found


def _awaited_url(under: slurm.SlurmJob) -> str:
    """A node after the first: the Redis the first node runs for the job, once published."""
    click.echo(
        f"cohort run: SLURM job {under.job_id}: waiting for the first node's Redis "
        f"({under.root / slurm.URL_FILE})"
    )
    try:
        return slurm.await_url(under)
    except slurm.SlurmError as exc:
        fail(str(exc), Exit.REDIS)


def _redis_host() -> str:
    try:
        return slurm.redis_host(os.environ)
    except slurm.SlurmError as exc:
        fail(str(exc))


def _start_with_every_rank(given: JobSettings, ranks: int) -> None:
    """On its own Redis the launcher runs every rank of the job: its first world waits for
    all `ranks` (--start-workers N, bounded by --start-wait), so step 0 is not trained by
    one rank alone. Not where --start-workers or --min-workers says otherwise, nor on a
    shared Redis, whose other nodes' ranks this node cannot count."""
    flags = given.flags
    if ranks > 1 and flags.get("start_workers") is None and flags.get("min_workers") is None:
        flags["start_workers"] = ranks


def _run_dir(
    ctx: click.Context, job: str, params: dict[str, Any], shared: bool
) -> tuple[str, Path, bool]:
    """The job, its run directory and whether the run resumes one: --run-dir as given (the
    job of the run it holds, if --job is not given); else, on a private Redis, the job's
    latest run under ./cohort-runs unless it finished (then exit 0 saying so) or --fresh;
    else a new directory. Exit 2 where another launcher runs in the directory."""
    from cohort.launcher import rundir

    given, fresh = params["run_dir"], params["fresh"]
    if fresh and shared:
        fail(
            f"--fresh starts a job over on its private Redis; on a shared Redis (--redis-url) "
            f"`cohort reset --job {job}` deletes the job's journal so its name starts again"
        )
    if given is not None:
        earlier = rundir.read_run_json(given)
        if earlier is not None and fresh:
            fail(f"--fresh starts a new run: give a new --run-dir, not {str(given)!r}, or none")
        if earlier is not None and earlier.get("job") != job:
            if params["job"] is not None:
                fail(
                    f"--run-dir {str(given)!r} holds a run of job {earlier.get('job')!r}, not "
                    f"{job!r}: give another --run-dir, or leave out --job to resume that one"
                )
            job = str(earlier.get("job"))
        previous = rundir.Previous(given.resolve(), earlier) if earlier is not None else None
    else:
        runs = [] if shared or fresh else rundir.previous_runs()
        previous = rundir.latest(runs, job)
    if previous is not None and not shared:
        if previous.finished:
            click.echo(
                f"cohort run: job {job!r} finished ({previous.body['finished']}) in "
                f"{previous.dir}: nothing to run; `--fresh` starts it over from step 0, "
                f"`cohort status --run-dir {previous.dir}` shows it"
            )
            ctx.exit(0)
        if (why := rundir.busy(previous.dir)) is not None:
            fail(f"job {job!r} runs already: {why}")
        if previous.journaled:
            return job, previous.dir, True
    return job, (given or rundir.new_run_dir(job)).resolve(), False


def _check_checkpoint_owner(uri: str, job: str) -> None:
    """The checkpoint location is this job's or nobody's (claimed by the coordinator as it
    starts); else exit 2 naming its owner, before anything starts."""
    from cohort.events.storage import StorageError, check_owner

    try:
        check_owner(uri, job)
    except StorageError as exc:
        fail(str(exc))


def _command(command: tuple[str, ...]) -> tuple[str, ...]:
    """The argv of a rank: a .py first argument runs with this Python, as torchrun does."""
    if not command:
        fail(
            "no command to run: give one after the options, e.g. "
            "`cohort run -n 2 train.py --lr 0.1` or `cohort run -n 2 -- python train.py`"
        )
    first = command[0]
    if first.endswith(".py"):
        if not Path(first).is_file():
            fail(f"script {first!r} does not exist (looked in {os.getcwd()})")
        return (sys.executable, "-u", first, *command[1:])
    if shutil.which(first) is None:
        fail(f"command {first!r} is not found on PATH nor a file: give its path")
    return command


def _check_shadowing(argv: tuple[str, ...]) -> None:
    """Exit 2, starting nothing, where a folder named `cohort` would shadow the installed
    package in every rank (each would fail at import, restart after restart)."""
    from cohort.launcher.shadowing import shadow, shadowing_said

    package = Path(__file__).resolve().parents[1]  # this code's own package: cohort/
    folder = shadow(argv, Path.cwd(), package)
    if folder is not None:
        fail(shadowing_said(folder, package, argv))


def _ranks(text: str, gpus: Callable[[], NodeGpus] | None = None, spares: int = 0) -> int:
    """-n: a number of ranks >= 1, or `gpu` for one per GPU of the node that `spares` spares
    leave (launcher/gpus.py)."""
    from cohort.launcher.gpus import PlacementError, trainers_for

    if text == "gpu":
        try:
            return trainers_for((gpus or node_gpus)(), spares)
        except PlacementError as exc:
            fail(str(exc))
    if not text.isdigit() or int(text) < 1:
        fail(f"-n {text}: give a number of ranks of 1 or more, or `gpu`")
    return int(text)


def _spare_count(text: str) -> int:
    """--spares as a number of spares, 0 or more, else exit 2 naming it."""
    if not text.isdigit():
        fail(f"--spares {text}: give a number of spares of 0 or more (0: none)")
    return int(text)


def _whole_groups(ranks: int, config: JobConfig) -> int:
    """`ranks`, where this node's ranks are whole shard groups (--shard-group, the job's);
    else exit 2 naming it."""
    group = config.shard_group
    if group is not None and ranks % group:
        fail(
            f"--shard-group {group} with -n {ranks}: this node's ranks must be whole shard "
            f"groups; give -n a multiple of {group}, or a group size that divides {ranks}"
        )
    return ranks


def _spares(text: str, ranks: int = 1, max_workers: int = 64) -> int:
    """--spares: a number of warm spares, 0 or more, that fits in the job's max_workers
    beside this node's ranks (a spare is a member: one beyond it would be refused)."""
    if ranks + _spare_count(text) > max_workers:
        fail(
            f"--spares {text}: {ranks} rank(s) and {text} spare(s) are more members than the "
            f"job's max_workers={max_workers}; raise --max-workers or keep fewer spares"
        )
    return int(text)


def node_gpus(env: Mapping[str, str] | None = None, nvml: Any = None) -> NodeGpus:
    """The devices this node's processes may use, one CUDA_VISIBLE_DEVICES entry each: the
    ones an inherited CUDA_VISIBLE_DEVICES names, as CUDA reads it (trusted as given: the
    launcher opens no GPU), else each device NVML sees (a GPU, or each MIG instance of one in
    MIG mode) by UUID; none without NVML. `env` and `nvml` stand in for the process's own."""
    from cohort.launcher.gpus import NodeGpus
    from cohort.worker.telemetry.gpu import read_gpus
    from cohort.worker.telemetry.visible import VISIBLE_ENV, cuda_devices, visible_entries

    env = os.environ if env is None else env
    given = env.get(VISIBLE_ENV)
    if given is not None:
        return NodeGpus(visible_entries(given), f"{VISIBLE_ENV}={given!r}")
    found, said = read_gpus(nvml)
    return NodeGpus(cuda_devices(found), said)


def _placement(gpus: NodeGpus, ranks: int, spares: int) -> tuple[str, ...]:
    """Each slot's own GPU (launcher/gpus.py), or exit 2 saying which -n and --spares fit."""
    from cohort.launcher.gpus import PlacementError, place

    try:
        return place(gpus, ranks, spares)
    except PlacementError as exc:
        fail(str(exc))


def _check_shared_redis(
    ctx: click.Context, job: str, node: str, given: JobSettings, wait: float, slurm: bool = False
) -> None:
    """On a Redis shared with other nodes: it answers (else exit 3), its journaled settings
    agree with the ones given, and no other launcher runs ranks under this node's name (else
    exit 2; not under SLURM, whose node names are unique in an allocation: members under
    this one are an earlier allocation's, and the new ranks take ids the journal has not
    seen). A job that finished has nothing left for this node: it exits 0 saying so, as a
    late worker does (a scheduler that started it late must not count it failed)."""
    from cohort.coordinator.errors import ConfigConflictError
    from cohort.coordinator.replay import JournalWatch

    conn = redis_client(ctx, "cohort-run", wait)
    watch = JournalWatch.of(conn, job)
    watch.pull(0)
    state = watch.state
    if state.finished is not None:
        click.echo(
            f"job {job!r} finished at step {state.last_committed} ({state.finished}): nothing "
            f"to run on node {node!r}; `cohort reset --job {job}` to run the name again",
            err=True,
        )
        ctx.exit(0)
    config, names = given.config()
    conflict = ConfigConflictError.between(job, state.config, config, names)
    if conflict is not None:
        fail(str(conflict))
    mine = sorted(w for w in state.members if w.startswith(f"{node}-"))
    if mine and not slurm:
        fail(
            f"node name {node!r} is in use in job {job!r} (members {', '.join(mine[:4])}): give "
            "this launcher another with --node; if they are an earlier launcher's that is gone, "
            "they are failed within the heartbeat timeout: try again then"
        )


def _check_credentials(ctx: click.Context, job: str, node: str, asked: bool) -> None:
    """Where the job signs its commands (or is asked to), the Redis user given may issue each
    rank its own credential: the first rank's is issued now, else exit 3 naming the fix."""
    import redis

    from cohort import acl
    from cohort.launcher.credentials import Credentials

    conn = redis_client(ctx, "cohort-run")
    try:
        if Credentials.needed(conn, job, asked):
            acl.issue(conn, job, [f"{node}-0"])
    except (acl.AclError, redis.ResponseError) as exc:
        fail(
            f"job {job!r}: the --redis-url user cannot give each rank a credential of its own "
            f"(needed where the job signs its commands, or with --worker-credentials): {exc}",
            Exit.REDIS,
        )


def _host_name() -> str:
    host = socket.gethostname().split(".")[0] or "node"
    return re.sub(r"[^A-Za-z0-9._-]", "-", host)[:48]


def _check_node(node: str) -> None:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,47}", node):
        fail(
            f"--node {node!r}: use 1-48 characters from the letters, digits, '.', '_' and '-', "
            "starting with a letter or digit"
        )
