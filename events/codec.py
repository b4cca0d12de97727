"""msgpack on the wire: one map per event, the envelope's fields beside the body's.

Decoding is the door hostile bytes come through, so it is bounded at every
level (entry size, string, array and map lengths, nesting) before pydantic sees
anything, and every failure is a DecodeError that keeps the raw bytes and, once the
envelope named one, the entry's event type (`event_type`).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

import msgpack
from pydantic import TypeAdapter, ValidationError

from cohort.events.errors import DecodeError
from cohort.events.models import COMMANDS, FACTS, Command, Event, Fact
from cohort.events.upcasters import UPCASTED, upcast

E = TypeVar("E", bound=Event)

MAX_ENTRY_BYTES = 64 * 1024
MAX_FACT_BYTES = 16 * 1024 * 1024  # a WorldChanged of a very large world
FIELD = b"e"  # the one stream field holding an event
MAX_MAP_LEN = 1024


def encode(event: Event) -> bytes:
    return msgpack.packb(event.model_dump(mode="python"), use_bin_type=True)


def _reject_ext(code: int, data: bytes) -> Any:
    raise DecodeError(f"msgpack extension type {code} is not part of the wire format")


def _unpackb(raw: bytes) -> Any:
    """msgpack's own bounds, which already default to the tightest sound ones: no string,
    binary or array longer than the entry itself, str keys only, UTF-8 strings. On top:
    no extension types, at most 1024 keys in a map. (Every keyword costs on the hot path.)
    """
    return msgpack.unpackb(raw, ext_hook=_reject_ext, max_map_len=MAX_MAP_LEN)


def unpack(raw: bytes, limit: int = MAX_ENTRY_BYTES) -> dict[str, Any]:
    if not isinstance(raw, bytes | bytearray | memoryview):
        raise DecodeError(f"entry is {type(raw).__name__}, not bytes")
    if len(raw) > limit:
        raise DecodeError(f"entry is {len(raw)} bytes; the limit is {limit}", bytes(raw))
    try:
        body = _unpackb(raw)
    except DecodeError as exc:
        raise DecodeError(exc.reason, bytes(raw)) from None
    except Exception as exc:  # msgpack raises several unrelated types for bad bytes
        raise DecodeError(f"not msgpack: {type(exc).__name__}: {exc}", bytes(raw)) from exc
    if not isinstance(body, dict):
        raise DecodeError(f"entry is a msgpack {type(body).__name__}, not a map", bytes(raw))
    if not isinstance(body.get("type"), str):
        raise DecodeError(f"entry has no string 'type' (got {body.get('type')!r})", bytes(raw))
    return body


def _validation_reason(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        where = ".".join(str(p) for p in err["loc"]) or "entry"
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)


def _validated(adapter: TypeAdapter[E], body: dict[str, Any], raw: bytes, kind: str) -> E:
    """`body` as the event it names; a DecodeError naming its type and what is wrong."""
    try:
        return adapter.validate_python(body)
    except ValidationError as exc:
        raise DecodeError(
            f"invalid {body['type']!r} {kind}: {_validation_reason(exc)}",
            bytes(raw),
            event_type=body["type"],
        ) from None


def decode_command(raw: bytes) -> Command:
    return _validated(COMMANDS, upcast(unpack(raw)), raw, "command")


COMMAND_LIST: TypeAdapter[list[Command]] = TypeAdapter(list[Command])


def decode_commands(raws: Sequence[bytes]) -> list[Command | DecodeError]:
    """`decode_command` of each, its DecodeError as a value: the same commands and the same
    refusals, with the valid entries validated in one call (the leader's hot path: one
    pydantic call per inbox batch instead of one per entry).

    Unpacking is per entry (each is bounded alone); if any body fails validation, the
    batch is validated again entry by entry, so a refusal's reason is `decode_command`'s.
    """
    decoded: list[Command | DecodeError | None] = []
    bodies: list[dict[str, Any]] = []
    unpacked: list[bytes] = []
    for raw in raws:
        try:
            bodies.append(upcast(unpack(raw)))
        except DecodeError as exc:
            decoded.append(exc)
        else:
            unpacked.append(raw)
            decoded.append(None)
    valid: Iterator[Command | DecodeError]
    try:
        with gc_paused():
            valid = iter(COMMAND_LIST.validate_python(bodies))
    except ValidationError:
        valid = iter(_each_validated(bodies, unpacked))
    return [next(valid) if item is None else item for item in decoded]


def _each_validated(bodies: list[dict[str, Any]], raws: list[bytes]) -> list[Command | DecodeError]:
    """Each body validated alone: the invalid ones as the DecodeError `decode_command` raises."""
    out: list[Command | DecodeError] = []
    for body, raw in zip(bodies, raws, strict=True):
        try:
            out.append(_validated(COMMANDS, body, raw, "command"))
        except DecodeError as exc:
            out.append(exc)
    return out


FACT_LIST: TypeAdapter[list[Fact]] = TypeAdapter(list[Fact])


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic garbage collection while a batch of acyclic objects is built.

    Decoding a page of entries allocates thousands of objects that all survive;
    each allocation burst would otherwise set off collections that walk every
    object alive, which halved replay speed over a long journal. Nothing built
    here forms a cycle, so nothing is left for the collector to find.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def fact_bodies(raws: Sequence[bytes]) -> list[Any]:
    """The page's entries unpacked and upcast, for validating in one call.

    `unpack`'s checks minus those validation repeats (a map, with a string `type`);
    anything amiss raises, and `decode_facts` then finds and names the bad entry.
    """
    bodies: list[Any] = [_unpackb(raw) if len(raw) <= MAX_FACT_BYTES else None for raw in raws]
    return [upcast(b) if b["type"] in UPCASTED else b for b in bodies]


def decode_facts(raws: Sequence[bytes]) -> list[Fact]:
    """`decode_fact` of each, validated in one call (replay's hot path: about a third faster).

    On a bad entry it raises the same DecodeError `decode_fact` would, with `index`
    naming the entry's position in `raws`.
    """
    try:
        with gc_paused():
            return FACT_LIST.validate_python(fact_bodies(raws))
    except Exception:  # any failure: the slow path below names the entry and why
        pass
    for index, raw in enumerate(raws):  # find the culprit; rare, so slow is fine
        try:
            decode_fact(raw)
        except DecodeError as exc:
            exc.index = index
            raise
    raise AssertionError("a batch failed but no entry of it did")  # pragma: no cover


def decode_fact(raw: bytes) -> Fact:
    return _validated(FACTS, upcast(unpack(raw, MAX_FACT_BYTES)), raw, "fact")
