"""The `cohort` subcommands, one module per group; `shared` holds what they all use.

`cohort.cli` is the group that registers them. Each module imports what its commands
need only when they run, so `cohort --help` and a worker's start stay quick.
"""
