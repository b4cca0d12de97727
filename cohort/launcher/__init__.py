"""`cohort run`: one command that launches a job's ranks on this node, supervises them and
replaces the ones that fail, beside a coordinator and (where none is given) a private Redis.

`supervision.py` holds the rules, pure: what a slot does when its process exits.
`shadowing.py` finds a folder named `cohort` that would shadow the package in every rank.
`gpus.py` decides which GPU each slot's processes get (one of its own, or a refusal).
`children.py` starts the processes (own session, logs, prefixed output), `reaper.py` makes
sure none outlives the launcher, and `launcher.py` is the one loop that does I/O: load
(exits, the journal), decide (`supervision`), act (start, stop), show.

May import: `cohort.events`, `cohort.coordinator` (to read the journal and audit the run),
`cohort.processes`, `cohort.localredis`, `cohort.errors`. Not `cohort.worker`: the ranks are
the user's scripts.
"""
