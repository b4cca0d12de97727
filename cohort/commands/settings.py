"""The job's settings as flags, declared once: `cohort coordinator` and `cohort run` take the
same ones, and `run` hands the ones it was given on to the coordinators it starts."""

from __future__ import annotations

import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import click
from pydantic import ValidationError

from cohort.commands.shared import FILE, fail
from cohort.events.models import JobConfig

F = TypeVar("F", bound=Callable[..., Any])

OPTIONS = [
    click.option(
        "--config",
        "config_file",
        type=FILE,
        help="TOML file with job settings (keys as the flags, with underscores); "
        "flags win over the file.",
    ),
    click.option("--min-workers", type=int, help="Pause training below this many (default 1)."),
    click.option(
        "--start-workers",
        type=int,
        help="Ready workers the first world waits for, at most --start-wait seconds after "
        "the first (default: --min-workers; `cohort run -n N` on its own Redis: N).",
    ),
    click.option(
        "--start-wait",
        type=float,
        help="Seconds the first world waits for --start-workers once one worker is ready; "
        "it then starts with those there, saying how many are missing (default 30).",
    ),
    click.option("--max-workers", type=int, help="Refuse joins beyond this many (default 64)."),
    click.option(
        "--heartbeat-interval", type=float, help="Seconds between heartbeats (default 1)."
    ),
    click.option(
        "--heartbeat-timeout",
        type=float,
        help="Seconds of silence before a worker is failed (default 5).",
    ),
    click.option(
        "--disconnect-grace",
        type=float,
        help="Seconds a worker whose connections to Redis all closed (its process died) may "
        "take to connect again before it is failed, long before its silence would tell; 0: "
        "by silence alone (default 0.3).",
    ),
    click.option(
        "--dataset-size",
        type=int,
        help="Samples per epoch (default: the dataset the first worker to join declares; a "
        "worker declaring other data is refused).",
    ),
    click.option(
        "--batch-size",
        type=int,
        help="Samples per rank per step; with --global-batch, the most per forward (default 32).",
    ),
    click.option(
        "--global-batch",
        type=int,
        help="Keep this many samples per step whatever the world size: ranks split them and "
        "accumulate micro-batches of --batch-size, so the update equals a bigger world's "
        "(default: --batch-size per rank; the global batch follows the world).",
    ),
    click.option(
        "--placement",
        type=click.Choice(["contiguous", "strided", "hash", "locality"]),
        help="How each epoch's samples are dealt to ranks: contiguous runs, strided (rank r "
        "takes r, r+n, ...: the global batches follow the epoch's order at any world size), or, "
        "for a dataset of files, hash (a worker keeps its files across epochs and worlds) or "
        "locality (files the worker's node holds first). Default: contiguous.",
    ),
    click.option(
        "--reduction",
        type=click.Choice(["exact", "float"]),
        help="How the ranks' gradients are summed: exact (each micro-batch dealt whole to one "
        "rank, its gradient summed as exact integers: the update is the same bits at any world "
        "size) or float (faster floating-point sums, whose last bits follow the grouping). "
        "Default: exact with --global-batch and --placement strided, else float.",
    ),
    click.option(
        "--shard-group",
        type=int,
        metavar="S",
        help="HSDP: each copy of a sharded model (ElasticJob.wrap(shard=...)) is sharded over "
        "S consecutive ranks, the copies its data-parallel replicas; a new world keeps every "
        "rank's place (its shard) and puts a spare in a lost rank's place (docs/sharded.md). "
        "`cohort run` gives the scripts $COHORT_SHARD_GROUP, and each node's ranks must be "
        "whole groups.",
    ),
    click.option(
        "--shuffle/--no-shuffle",
        default=None,
        help="Visit each epoch's samples in its own pseudorandom order, keyed by the seed and "
        "the epoch, exactly once whatever the world does (default: shuffle); --no-shuffle: in "
        "index order.",
    ),
    click.option(
        "--seed",
        type=click.IntRange(0, 2**53),
        help="The shuffle's seed: the same seed gives the same orders (default 0).",
    ),
    click.option("--straggler-factor", type=float, help="x median step time (default 1.5)."),
    click.option("--straggler-steps", type=int, help="Steps in a row to flag (default 5)."),
    click.option(
        "--checkpoint-uri",
        metavar="URI",
        help="Where the weights are checkpointed: an absolute path, file://..., or any fsspec "
        "filesystem (s3://, gs://, ... with its extra installed on the workers).",
    ),
    click.option(
        "--checkpoint-every",
        type=int,
        help="Committed steps between checkpoints (default 100).",
    ),
    click.option(
        "--checkpoint-keep",
        type=int,
        help="Checkpoints kept; older files are deleted (default 3).",
    ),
    click.option(
        "--max-steps",
        type=int,
        help="The job finishes once this many steps committed (default: no limit).",
    ),
    click.option(
        "--epochs",
        type=int,
        help="The job finishes once this many epochs finished (default: no limit).",
    ),
    click.option(
        "--gpu-rules",
        "gpu_rules_file",
        type=FILE,
        help="GPU rules (TOML or YAML) replacing the defaults; see docs/gpu.md.",
    ),
]
"""The settings' options, in the order `--help` lists them."""

FILES = {"config_file": "--config", "gpu_rules_file": "--gpu-rules"}
"""The settings given as files: parameter -> flag."""


def job_settings(command: F) -> F:
    """Give `command` every job setting as an option (`JobSettings.of` collects them)."""
    for option in reversed(OPTIONS):
        command = option(command)
    return command


@dataclass(frozen=True)
class JobSettings:
    """The job settings one command was given (None: not given)."""

    config_file: Path | None
    gpu_rules_file: Path | None
    flags: dict[str, Any]

    @classmethod
    def of(cls, params: dict[str, Any]) -> JobSettings:
        """Take the settings out of a command's parameters (what remains is its own)."""
        config_file, gpu_rules_file = params.pop("config_file"), params.pop("gpu_rules_file")
        names = [_name(option) for option in OPTIONS]
        flags = {name: params.pop(name) for name in names if name not in FILES}
        return cls(config_file, gpu_rules_file, flags)

    def config(self) -> tuple[JobConfig, frozenset[str]]:
        """The job's settings as a JobConfig, and the names of those given; exit 2 naming a
        bad one."""
        return job_config(self.config_file, self.gpu_rules_file, self.flags)

    def argv(self) -> list[str]:
        """The settings given, as flags again: what a coordinator started with them is given."""
        args: list[str] = []
        for name, path in (
            ("config_file", self.config_file),
            ("gpu_rules_file", self.gpu_rules_file),
        ):
            if path is not None:
                args += [FILES[name], str(path.resolve())]
        for name, value in self.flags.items():
            if value is None:
                continue
            flag = "--" + name.replace("_", "-")
            if isinstance(value, bool):
                args.append(flag if value else f"--no-{name.replace('_', '-')}")
            else:
                args += [flag, str(value)]
        return args


def _name(decorator: Callable[[Callable[..., Any]], Callable[..., Any]]) -> str:
    """The parameter name an option decorator gives its command."""
    command = click.command()(decorator(lambda **kwargs: None))
    name = command.params[0].name
    assert name is not None
    return name


def job_config(
    config_file: Path | None, gpu_rules_file: Path | None, flags: dict[str, Any]
) -> tuple[JobConfig, frozenset[str]]:
    """The job's settings (the TOML file's, then the flags given, then the GPU rules) and
    the names of those that were given."""
    from cohort.coordinator.gpu_rules import RulesError, load_rules, parse_rules

    values = _load_config_file(config_file)
    values.update({k: v for k, v in flags.items() if v is not None})
    try:
        if gpu_rules_file is not None:
            rules = load_rules(gpu_rules_file)
        elif "gpu_rules" in values:
            rules = parse_rules({"rules": values["gpu_rules"]}, str(config_file))
        else:
            rules = None
    except RulesError as exc:
        fail(str(exc))
    if rules is not None:
        values["gpu_rules"] = tuple(r.model_dump(mode="json") for r in rules.rules)
    if values.get("checkpoint_uri") is not None:
        _check_checkpoint_uri(str(values["checkpoint_uri"]))
    try:
        return JobConfig(**values), frozenset(values)
    except ValidationError as exc:
        fail(_pydantic_message(exc, str(config_file) if config_file else "the flags"))
    except TypeError as exc:
        fail(f"bad job settings: {exc}")


def _check_checkpoint_uri(uri: str) -> None:
    check_storage_uri("--checkpoint-uri", uri)


def check_storage_uri(flag: str, uri: str) -> None:
    """An absolute path or a URL of a filesystem fsspec knows; else exit 2 naming it."""
    from fsspec.registry import known_implementations, registry
    from fsspec.utils import get_protocol

    protocol = get_protocol(uri)
    if "://" not in uri and not uri.startswith("/"):
        fail(
            f"{flag} {uri!r} is a relative path; every process resolves it in its own "
            "directory: give an absolute path or a URL (file:///..., s3://...)"
        )
    if protocol not in known_implementations and protocol not in registry:
        fail(
            f"{flag} {uri!r}: fsspec knows no filesystem {protocol!r}; use an absolute "
            "path, file:///..., or e.g. s3://, gs://, abfs:// (with s3fs, gcsfs, adlfs installed)"
        )


def _load_config_file(path: Path | None) -> dict[str, Any]:
    if path is None:
        return {}
    try:
        return tomllib.loads(path.read_text())
    except OSError as exc:
        fail(f"cannot read config file {str(path)!r}: {exc.strerror}")
    except tomllib.TOMLDecodeError as exc:
        fail(f"config file {str(path)!r} is not valid TOML: {exc}")


def _pydantic_message(exc: ValidationError, source: str) -> str:
    problems = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"])
        message = err["msg"].removeprefix("Value error, ")
        problems.append(f"{where}={err.get('input')!r}: {message}" if where else message)
    return f"bad job settings from {source}: " + "; ".join(problems)
