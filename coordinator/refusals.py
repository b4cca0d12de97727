"""What the leader refused at the inbox's door, counted by sender and kind.

Every dead letter goes to the capped dead-letter stream with a bounded record
(`stores.DeadLetter`). That stream keeps the latest ones only, and a leader's
process counters die with it, so the leader also tallies them here and journals the
tally (`CommandsRefused`) every `EVERY` seconds while there is one: the evidence of a
flood of forgeries outlives the flood, the stream's cap and a leader change, and
`cohort replay --audit` lists it. Log lines are rate-limited per proven sender (and once
for all unproven ones, whose claimed names cost nothing to vary): the first `LINES` of a
window, then one line saying how many more there were.

Pure but for the injected time; the service feeds it what each saved turn dead-lettered.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

import msgpack

from cohort.coordinator.stores import DeadLetter
from cohort.events import identity
from cohort.events.codec import FIELD
from cohort.events.models import MAX_REFUSAL_ROWS, CommandsRefused, Refusal
from cohort.events.streams import Entry, id_after

EVERY = 5.0
"""Seconds between CommandsRefused facts while entries are being refused."""
LINES = 5
"""Dead letters logged one by one per sender and window; the rest are summed."""
WINDOW = 60.0
"""Seconds of a logging window."""
OTHER = "other"
UNKNOWN = "unknown"
UNPROVEN = "senders no signature proved"
"""Who the log's allowance of unproven dead letters is counted for, all names together."""

log = logging.getLogger("cohort.coordinator")

Row = tuple[str, bool, str]
"""(sender, verified, kind)."""


def claimed_sender(entry: Entry) -> str:
    """The worker an entry claims to be from: its signer field, else its command's worker,
    else `unknown`. Claimed, not proven: the caller says whether a signature proved it."""
    signer = entry.fields.get(identity.SIGNER)
    if signer is not None:
        name = signer.decode(errors="replace")
        return name if identity.WORKER_NAME.fullmatch(name) else UNKNOWN
    raw = entry.fields.get(FIELD)
    if raw is None or len(raw) > 65536:
        return UNKNOWN
    try:
        body = msgpack.unpackb(raw, raw=False)
    except Exception:  # noqa: BLE001 - any bytes at all: the name is unknown
        return UNKNOWN
    worker = body.get("worker") if isinstance(body, dict) else None
    return worker if isinstance(worker, str) and identity.WORKER_NAME.fullmatch(worker) else UNKNOWN


@dataclass
class Totals:
    """Refused entries and their bytes by (sender, verified, kind), summed over a journal's
    CommandsRefused facts: what `cohort replay --audit` and `cohort report` list."""

    counts: Counter[Row] = field(default_factory=Counter)
    sizes: Counter[Row] = field(default_factory=Counter)

    def add(self, fact: CommandsRefused) -> None:
        for refusal in fact.refusals:
            row = (refusal.sender, refusal.verified, refusal.kind)
            self.counts[row] += refusal.count
            self.sizes[row] += refusal.bytes

    def rows(self) -> tuple[tuple[str, bool, str, int, int], ...]:
        """(sender, proven by its signature, kind, entries, bytes), most entries first."""
        return tuple((*row, count, self.sizes[row]) for row, count in self.counts.most_common())

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def forged(self) -> int:
        return sum(n for (_, _, kind), n in self.counts.items() if kind == "forged")


@dataclass
class Refusals:
    """The tally since the last CommandsRefused, and the log's rate limit."""

    counts: Counter[Row] = field(default_factory=Counter)
    sizes: Counter[Row] = field(default_factory=Counter)
    first: str | None = None
    last: str | None = None
    journaled_at: float = -1e18
    window_start: float = -1e18
    logged: Counter[str] = field(default_factory=Counter)
    quiet: Counter[str] = field(default_factory=Counter)
    """Per sender: dead letters of this window not logged one by one."""

    def add(self, letters: Iterable[DeadLetter], now: float) -> None:
        """Count what a saved turn dead-lettered, and log it within the rate limit."""
        self._roll_window(now)
        for letter in letters:
            row = (letter.sender, letter.verified, letter.kind)
            self.counts[row] += 1
            self.sizes[row] += letter.size
            if self.first is None:
                self.first = letter.inbox_id
            if self.last is None or id_after(letter.inbox_id, self.last):
                self.last = letter.inbox_id
            self._log(letter)

    def pending(self, kind: str | None = None) -> int:
        """Entries tallied and not journaled yet (of `kind`, if given)."""
        return sum(n for row, n in self.counts.items() if kind is None or row[2] == kind)

    def due(self, now: float) -> bool:
        return bool(self.counts) and now - self.journaled_at >= EVERY

    def fact(self, job: str, now: float) -> CommandsRefused:
        """The tally as a fact (senders beyond MAX_REFUSAL_ROWS summed as `other`)."""
        rows = sorted(self.counts, key=lambda row: (-self.counts[row], row))
        kept, rest = rows[:MAX_REFUSAL_ROWS], rows[MAX_REFUSAL_ROWS:]
        refusals = [self._refusal(row, self.counts[row], self.sizes[row]) for row in kept]
        if rest:
            other: Counter[str] = Counter()
            for row in rest:
                other[row[2]] += self.counts[row]
            refusals += [
                Refusal(sender=OTHER, kind=kind, count=count)  # type: ignore[arg-type]
                for kind, count in sorted(other.items())
            ]
        assert self.first is not None and self.last is not None
        return CommandsRefused(
            at=now,
            job=job,
            refusals=tuple(refusals[: MAX_REFUSAL_ROWS + 1]),
            first=self.first,
            last=self.last,
        )

    def journaled(self, now: float) -> None:
        """The fact made by `fact` is in the journal: start a new tally."""
        self.counts.clear()
        self.sizes.clear()
        self.first = self.last = None
        self.journaled_at = now

    @staticmethod
    def _refusal(row: Row, count: int, size: int) -> Refusal:
        sender, verified, kind = row
        return Refusal(sender=sender, verified=verified, kind=kind, count=count, bytes=size)  # type: ignore[arg-type]

    def _log(self, letter: DeadLetter) -> None:
        # a claimed name costs nothing to vary: unproven senders share one allowance
        key = letter.sender if letter.verified else UNPROVEN
        if self.logged[key] >= LINES:
            self.quiet[key] += 1
            return
        self.logged[key] += 1
        who = letter.sender if letter.verified else f"{letter.sender} (claimed)"
        log.warning(
            "dead letter %s from %s, %d bytes: %s%s",
            letter.inbox_id,
            who,
            letter.size,
            letter.reason,
            " (more from this sender this minute are counted, not logged)"
            if self.logged[key] == LINES
            else "",
        )

    def _roll_window(self, now: float) -> None:
        if now - self.window_start < WINDOW:
            return
        for sender, count in sorted(self.quiet.items()):
            log.warning(
                "%d more dead letters from %s in the last %.0f s (not logged one by one)",
                count,
                sender,
                WINDOW,
            )
        self.window_start = now
        self.logged.clear()
        self.quiet.clear()
