"""FSDP2 over every rank under `cohort run` on CPU/gloo (issue 50, phase 1): cohort shards
the model in each world (tests/integration/sharded_script.py), the ranks' whole-model
digests agree at every step, `job.save` writes the whole state dict; a rank SIGKILLed takes
its shard with it, so the job rewinds to its last checkpoint and finishes from there."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path

import pytest

if os.environ.get("CI") == "true":
    import torch  # CI installs torch's CPU build: a missing torch must fail, not skip
else:
    torch = pytest.importorskip("torch")

from cohort.coordinator.replay import JournalWatch, from_file  # noqa: E402
from cohort.errors import Exit  # noqa: E402
from cohort.events.models import (  # noqa: E402
    CheckpointSaved,
    Rewound,
    StepCommitted,
    WeightsDiverged,
    WeightsLost,
    WorkerFailed,
    WorldChanged,
)
from cohort.worker.loop import checkpoints  # noqa: E402
from cohort.worker.pytorch import shards  # noqa: E402
from tests.helpers import wait_until  # noqa: E402
from tests.integration.gloo import load_example  # noqa: E402
from tests.integration.launch import Launch, worker_of  # noqa: E402

pytestmark = [pytest.mark.slow]

SCRIPT = str(Path(__file__).with_name("sharded_script.py"))
FLAGS = (
    "--min-workers", "2", "--batch-size", "16", "--epochs", "2",
    "--heartbeat-interval", "0.5", "--heartbeat-timeout", "5",
)  # fmt: skip
JOB = ("--dataset-size", "257", *FLAGS)
"""Each epoch's last step gives one rank one sample and the other none."""


def unsharded_model() -> torch.nn.Sequential:
    return torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(),
        torch.nn.Linear(32, 1),
    )  # fmt: skip


def journal_of(export: Path) -> list[object]:
    return [fact for _, fact in from_file(export).facts()]


def share_of(out: Path, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """What rank `rank` trained on at `step` (its micro-batches joined), None if nothing."""
    files = sorted(out.glob(f"batch-{step}-{rank}-*.pt"), key=lambda f: int(f.stem.split("-")[3]))
    parts = [torch.load(f) for f in files]
    if not parts:
        return None
    return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])


def replayed(
    out: Path, steps: int, ranks: int = 2, global_batch: bool = False
) -> dict[str, torch.Tensor]:
    """The script's model trained in one process on the batches its ranks wrote, each step
    on the ranks' mean gradient (a rank without samples adds zeros: each rank's batch counts
    alike, as under DDP), or, with a `global_batch`, on the mean gradient of every sample of
    the step, whatever the ranks' shares: the update either route must apply."""
    torch.manual_seed(0)  # as the script: the same initial weights
    model = unsharded_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    for step in range(steps):
        shares = [s for s in (share_of(out, step, rank) for rank in range(ranks)) if s]
        optimizer.zero_grad()
        if global_batch:
            x, y = torch.cat([x for x, _ in shares]), torch.cat([y for _, y in shares])
            torch.nn.functional.mse_loss(model(x), y).backward()
        else:
            losses = [torch.nn.functional.mse_loss(model(x), y) for x, y in shares]
            (torch.stack(losses).sum() / ranks).backward()
        optimizer.step()
    return model.state_dict()


def ran(out: Path, *flags: str) -> tuple[Launch, list[object]]:
    """sharded_script.py under `cohort run *flags`, writing to `out`, ended well: the run
    and its journal."""
    export = out / "run.export"
    run = Launch(*flags, "--export", str(export), SCRIPT, str(out), cwd=out)
    assert run.wait(300) == Exit.OK, run.output[-3000:]
    return run, journal_of(export)


def killed_once(
    run: Launch,
    watch: JournalWatch,
    ready: Callable[[], bool],
    what: str,
    rank: int,
    export: Path,
    script: str = SCRIPT,
) -> list[object]:
    """Once `ready()`, SIGKILL the world's `rank` (running `script`); the run ends well all
    the same, its audit passed and that rank its only failure. Returns the run's journal."""
    wait_until(ready, 240, message=what)
    victim = watch.state.ranks[rank]
    (pid,) = [p for p in run.ranks(script) if worker_of(p) == victim]
    os.kill(pid, signal.SIGKILL)
    assert run.wait(300) == Exit.OK, run.output[-3000:]
    assert "audit (every sample exactly once per epoch): passed" in run.output
    journal = journal_of(export)
    failed = [f for f in journal if isinstance(f, WorkerFailed)]
    assert [f.worker for f in failed] == [victim], (failed, run.output[-3000:])
    return journal


def test_an_fsdp_model_trains_to_its_end_and_saves_its_whole_weights(tmp_path: Path) -> None:
    """...and they are DDP's: the same model, data and seed trained unsharded end equal
    (within float rounding), and both are one process's replay of the ranks' batches. JOB
    gives a rank no sample in each epoch's last step: its backward must add nothing of the
    step before (whose gradients a script that zeroes before backward leaves)."""
    run, journal = ran(tmp_path, "-n", "2", "--node", "n", *JOB)
    ddp = tmp_path / "ddp"
    ddp.mkdir()
    reference = Launch("-n", "2", "--node", "n", *JOB, SCRIPT, str(ddp), "ddp", cwd=ddp)
    assert reference.wait(300) == Exit.OK, reference.output[-3000:]
    sharded, plain = torch.load(tmp_path / "final.pt"), torch.load(ddp / "final.pt")
    replay = replayed(ddp, 18)
    assert share_of(tmp_path, 8, 1) is None  # rank 1 had an empty step
    assert sharded.keys() == plain.keys() == replay.keys()
    for name in plain:
        torch.testing.assert_close(plain[name], replay[name], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(sharded[name], plain[name], rtol=1e-4, atol=1e-5)
    assert "audit (every sample exactly once per epoch): passed" in run.output
    assert [f for f in journal if isinstance(f, WeightsDiverged)] == []
    committed = [f for f in journal if isinstance(f, StepCommitted)]
    assert len(committed) == 18  # 2 epochs of 9 steps, the 9th of 1 sample
    assert all(f.digest is not None for f in committed)  # every rank's whole-model digest
    model = unsharded_model()
    model.load_state_dict(torch.load(tmp_path / "final.pt"))  # whole: loads unsharded
    assert not torch.equal(model[0].weight, unsharded_model()[0].weight)  # it trained


MICRO = (
    "--dataset-size", "21", "--batch-size", "4", "--global-batch", "17", "--placement",
    "strided", "--min-workers", "2", "--epochs", "3", "--heartbeat-interval", "0.5",
    "--heartbeat-timeout", "5",
)  # fmt: skip
"""Each epoch: a step of 17 samples dealt in whole units of 4, rank 0 three micro-batches
of 4 and rank 1 two of 4 and 1 (so it runs one pass more, of nothing, and its last
micro-batch weighs a quarter of its first), then a step of 4 samples, all rank 0's."""


def test_fsdp_micro_batches_of_unequal_shares_learn_the_mean_over_the_global_batch(
    tmp_path: Path,
) -> None:
    """`--global-batch` on a sharded model: every micro-batch but a step's last accumulates
    without a reduce-scatter, and each rank's sum is weighed by its share, so the update is
    one process's on the mean gradient of the step's every sample (float rounding apart).
    The job's sums would be exact by default (strided): the sharded wrap says they are not."""
    run, journal = ran(tmp_path, "-n", "2", "--node", "n", *MICRO)
    assert "a sharded model's gradient sums are floating point" in run.output
    assert "audit (every sample exactly once per epoch): passed" in run.output
    assert [len(list(tmp_path.glob(f"batch-0-{r}-*.pt"))) for r in (0, 1)] == [3, 2]
    assert share_of(tmp_path, 1, 1) is None  # rank 1's stand-in step
    learned_the_mean(tmp_path, journal, 6)


def test_a_rank_without_a_sample_makes_up_each_pass_of_a_step_of_several(
    tmp_path: Path,
) -> None:
    """Micro-batches of 1 (--global-batch 5 over 2 ranks: 3 and 2 a step), and each
    epoch's last step all rank 0's, in 2 micro-batches: rank 1 runs a pass of nothing, then
    its stand-in, so that FSDP's collectives meet rank 0's two passes."""
    run, journal = ran(
        tmp_path, "-n", "2", "--node", "n", "--dataset-size", "12", "--batch-size", "1",
        "--global-batch", "5", "--min-workers", "2", "--epochs", "2",
        "--heartbeat-interval", "0.5", "--heartbeat-timeout", "5",
    )  # fmt: skip
    assert "audit (every sample exactly once per epoch): passed" in run.output
    assert [len(list(tmp_path.glob(f"batch-2-{r}-*.pt"))) for r in (0, 1)] == [2, 0]
    learned_the_mean(tmp_path, journal, 6)


def learned_the_mean(out: Path, journal: list[object], steps: int) -> None:
    """The run that wrote to `out` committed `steps` steps, its ranks' digests agreeing,
    and its weights are one process's trained on the mean gradient of each step's every
    sample."""
    assert [f for f in journal if isinstance(f, WeightsDiverged)] == []
    assert len([f for f in journal if isinstance(f, StepCommitted)]) == steps
    sharded, replay = torch.load(out / "final.pt"), replayed(out, steps, global_batch=True)
    assert sharded.keys() == replay.keys()
    for name in replay:
        torch.testing.assert_close(sharded[name], replay[name], rtol=1e-4, atol=1e-5)


def test_a_rank_sigkilled_rewinds_the_sharded_job_to_its_checkpoint(tmp_path: Path) -> None:
    export = tmp_path / "run.export"
    store = tmp_path / "ckpt"
    run = Launch(
        "-n", "2", "--node", "n", *JOB, "--checkpoint-uri", str(store), "--checkpoint-every",
        "4", "--export", str(export), SCRIPT, str(tmp_path), cwd=tmp_path,
    )  # fmt: skip
    watch = run.journal()

    def checkpointed() -> bool:
        watch.pull(100)
        return bool(watch.state.checkpoints) and watch.state.last_committed >= 5

    journal = killed_once(run, watch, checkpointed, "a checkpoint, training past it", 1, export)
    assert [f for f in journal if isinstance(f, Rewound)] != []  # the survivor held a shard
    assert [f for f in journal if isinstance(f, WeightsDiverged)] == []
    model = unsharded_model()
    model.load_state_dict(torch.load(tmp_path / "final.pt"))


def test_a_checkpoint_written_by_3_ranks_is_read_back_by_2_each_its_own_shards(
    tmp_path: Path,
) -> None:
    """FSDP over every rank, 3 -> 2 -> 3: a rank SIGKILLed takes its shard with it, the two
    left rewind to the last checkpoint, which 3 ranks wrote (each its shards, beside the
    file), and read it back resharded for 2; the lost rank's replacement then joins, and the
    world grows to 3 from the shards the 2 hold, with no second rewind."""
    export, store = tmp_path / "run.export", tmp_path / "ckpt"
    # 8 epochs: the replacement joins before the end
    run = Launch(
        "-n", "3", "--node", "n", "--dataset-size", "257", "--min-workers", "2",
        "--batch-size", "16", "--epochs", "8", "--heartbeat-interval", "0.5",
        "--heartbeat-timeout", "5", "--checkpoint-uri", str(store), "--checkpoint-every", "2",
        "--export", str(export), SCRIPT, str(tmp_path), cwd=tmp_path,
    )  # fmt: skip
    watch = run.journal()

    def by_3(uri: str) -> bool:
        """Whether 3 ranks wrote the shards of checkpoint `uri` (one file each)."""
        return any(store.glob(f"{Path(uri).name}.shards/world*/__2_0.distcp"))

    def checkpointed() -> bool:
        watch.pull(100)
        saved = [c for c in watch.state.checkpoints if by_3(c.uri)]
        return bool(saved) and len(watch.state.ranks) == 3 and watch.state.last_committed >= 3

    journal = killed_once(run, watch, checkpointed, "a checkpoint of 3 ranks", 2, export)
    sizes: dict[int, int] = {}  # world -> its ranks
    wrote: dict[int, int] = {}  # step -> the ranks of the world that committed it last
    starts = []  # (where the world's weights came from, ranks that wrote them, its ranks)
    for f in journal:
        if isinstance(f, StepCommitted):
            wrote[f.step] = sizes[f.world]
        elif isinstance(f, WorldChanged):
            sizes[f.version] = len(f.ranks)
            if f.weights is not None and f.ranks and f.weights.source != "initial":
                starts.append((f.weights.source, wrote[f.weights.step], len(f.ranks)))
    back = starts.index(("checkpoint", 3, 2))  # written by 3, read back by 2
    grown = starts.index(("rank", 2, 3), back)  # then grown from the 2's shards
    assert [s for s in starts[grown:] if s[0] == "checkpoint"] == [], starts  # no rewind
    assert [f for f in journal if isinstance(f, WeightsDiverged)] == []
    final = [c for c in journal if isinstance(c, CheckpointSaved)][-1]
    manifest = shards.read_manifest(final.uri, checkpoints.read(final.uri, final.sha256).payload)
    assert shards.METADATA in manifest.files  # the job's last checkpoint: sharded, checked
    model = unsharded_model()
    model.load_state_dict(torch.load(tmp_path / "final.pt"))
    assert not torch.equal(model[0].weight, unsharded_model()[0].weight)


HSDP = (
    "-n", "4", "--node", "n", "--dataset-size", "257", "--min-workers", "2",
    "--batch-size", "16", "--heartbeat-interval", "0.5", "--heartbeat-timeout", "5",
    "--start-workers", "4", "--start-wait", "240",
)  # fmt: skip
"""4 ranks from the first step, however long a loaded machine takes to start them."""


def test_hsdp_two_groups_of_two_learn_what_ddp_over_four_ranks_learns(tmp_path: Path) -> None:
    """`cohort run --shard-group 2` over 4 ranks: 2 copies of the model, each sharded over 2
    ranks (meshes of 2), their gradients averaged over the copies through cohort's guarded
    all-reduce: the same weights as DDP over the 4 ranks on the same batches. A constant
    global batch of 102 gives the ranks unequal shares (26, 26, 25, 25: micro-batches of 16
    and 10 or 9), each weighed by its size in both the groups' sums and the copies' mean."""
    job = (*HSDP, "--global-batch", "102", "--epochs", "2")
    run, journal = ran(tmp_path, *job, "--shard-group", "2")
    ddp = tmp_path / "ddp"
    ddp.mkdir()
    reference = Launch(*job, SCRIPT, str(ddp), "ddp", cwd=ddp)
    assert reference.wait(300) == Exit.OK, reference.output[-3000:]
    assert sorted(p.name for p in tmp_path.glob("mesh-*")) == ["mesh-2"]  # only groups of 2
    hsdp, plain = torch.load(tmp_path / "final.pt"), torch.load(ddp / "final.pt")
    assert hsdp.keys() == plain.keys()
    for name in plain:
        torch.testing.assert_close(hsdp[name], plain[name], rtol=1e-4, atol=1e-5)
    assert "audit (every sample exactly once per epoch): passed" in run.output
    assert [len(f.ranks) for f in journal if isinstance(f, WorldChanged)] == [4]
    assert [f for f in journal if isinstance(f, WeightsDiverged)] == []
    assert all(f.digest is not None for f in journal if isinstance(f, StepCommitted))
    assert sorted(p.name for p in tmp_path.glob("batch-0-3-*.pt")) == [
        "batch-0-3-0.pt", "batch-0-3-1.pt",
    ]  # fmt: skip


def hsdp_killed(
    out: Path, rank: int, *flags: str
) -> tuple[Launch, list[object], list[tuple[str, int]]]:
    """sharded_script.py as HSDP 2 x 2 under `cohort run *flags` with no checkpoint, the
    world's `rank` SIGKILLed past step 3; the run ended well with no rewind. The run, its
    journal and each world's start: (where its weights came from, its ranks). 40 epochs:
    a replacement joins long before the end."""
    export = out / "run.export"
    run = Launch(
        *HSDP, "--shard-group", "2", *flags, "--epochs", "40", "--export", str(export),
        SCRIPT, str(out), cwd=out,
    )  # fmt: skip
    watch = run.journal()

    def training() -> bool:
        watch.pull(100)
        return len(watch.state.ranks) == 4 and watch.state.last_committed >= 3

    journal = killed_once(run, watch, training, "4 ranks past step 3", rank, export)
    assert [f for f in journal if isinstance(f, Rewound | WeightsLost)] == []
    starts = [
        (f.weights.source, len(f.ranks))
        for f in journal
        if isinstance(f, WorldChanged) and f.weights is not None and f.ranks
    ]
    return run, journal, starts


def test_an_hsdp_group_that_loses_a_rank_heals_from_the_other_with_no_checkpoint(
    tmp_path: Path,
) -> None:
    """HSDP 2 x 2 and no checkpoint at all: a rank SIGKILLed takes one copy's shard with
    it, but the other group holds that shard too, so the next world starts from the
    survivors' pieces (3 ranks, one FSDP copy over all of them, then 4 again in groups of 2
    once the replacement joins): no rewind, no lost weights, every sample once."""
    _, journal, starts = hsdp_killed(tmp_path, 3)
    assert starts[0] == ("initial", 4), starts
    assert ("rank", 3) in starts and starts[-1] == ("rank", 4), starts  # healed, grown back
    assert [f for f in journal if isinstance(f, WeightsDiverged)] == []
    assert {p.name for p in tmp_path.glob("mesh-*")} == {"mesh-2", "mesh-3"}
    model = unsharded_model()
    model.load_state_dict(torch.load(tmp_path / "final.pt"))
    assert not torch.equal(model[0].weight, unsharded_model()[0].weight)


def test_a_spare_promoted_into_an_hsdp_copy_heals_it_in_place_from_the_other_copy(
    tmp_path: Path,
) -> None:
    """HSDP 2 x 2 with a warm spare and no checkpoint: a rank SIGKILLed, the spare takes
    its place in the same world change (4 ranks again, never 3), the 3 survivors keep their
    shards, and only the lost shard moves, from its holder in the other copy: no rewind,
    every step's digest agreeing, every sample once."""
    run, journal, starts = hsdp_killed(tmp_path, 1, "--spares", "1")
    assert starts == [("initial", 4), ("rank", 4)], starts
    assert [f for f in journal if isinstance(f, WeightsDiverged)] == []
    assert {p.name for p in tmp_path.glob("mesh-*")} == {"mesh-2"}  # HSDP throughout
    healed = [line for line in run.output.splitlines() if "starts from its ranks' shards" in line]
    assert len(healed) == 4 and all("in place: shards [1] moved" in line for line in healed), (
        healed or run.output[-3000:]
    )


LM = str(Path(__file__).resolve().parents[2] / "examples" / "lm_train.py")


def test_the_lm_example_sharded_rewinds_a_sigkilled_rank_to_its_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """examples/lm_train.py --shard: the transformer FSDP2-sharded over 2 ranks (each block,
    then the root), a global batch of 17 in micro-batches of 8 (rank 0: 8 and 1, rank 1: 8
    and a pass of nothing), a checkpoint every 3 steps. A rank SIGKILLed takes its shard with
    it: the job rewinds to the checkpoint, the replacement joins, and the epoch ends with its
    validation pass and the whole weights saved."""
    monkeypatch.setenv("COHORT_TORCH_BACKEND", "gloo")
    export, store, saved = tmp_path / "run.export", tmp_path / "ckpt", tmp_path / "final.pt"
    run = Launch(
        "-n", "2", "--node", "n", "--min-workers", "2", "--dataset-size", "204",
        "--batch-size", "8", "--global-batch", "17", "--placement", "strided", "--reduction",
        "float", "--epochs", "1", "--heartbeat-interval", "0.5", "--heartbeat-timeout", "5",
        "--checkpoint-uri", str(store), "--checkpoint-every", "3", "--export", str(export),
        LM, "--shard", "--save", str(saved), cwd=tmp_path,
    )  # fmt: skip
    watch = run.journal()

    def checkpointed() -> bool:
        watch.pull(100)
        saved = watch.state.checkpoints
        return bool(saved) and watch.state.last_committed > saved[-1].step

    journal = killed_once(run, watch, checkpointed, "a checkpoint, past it", 1, export, LM)
    assert "Traceback" not in run.output  # the survivor too: its clip found no gradient
    assert '"val_loss"' in run.output  # the epoch's validation pass, sharded
    assert [f for f in journal if isinstance(f, Rewound)] != []  # its shard went with it
    assert [f for f in journal if isinstance(f, WeightsDiverged)] == []
    assert len({f.step for f in journal if isinstance(f, StepCommitted)}) == 12
    model = load_example("lm").TinyLM()
    model.load_state_dict(torch.load(saved))  # the whole weights, unsharded


def test_a_rank_killed_as_an_epoch_ends_leaves_the_survivors_training_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """examples/lm_train.py --shard as HSDP 2 x 2 with a spare and no checkpoint: rank 0
    SIGKILLed as the first epoch's last step commits, while the ranks run the epoch's
    validation pass (sharded forwards, then job.sum over the world). The survivors' sums
    give NaN, their scripts go on, and the spare heals the copy in place: no rewind, no
    weights lost. (Before, every survivor's job.sum raised, every script ended, and the
    sharded weights were lost with them.)"""
    monkeypatch.setenv("COHORT_TORCH_BACKEND", "gloo")
    export = tmp_path / "run.export"
    run = Launch(
        *HSDP, "--shard-group", "2", "--spares", "1", "--global-batch", "32", "--placement",
        "strided", "--reduction", "float", "--epochs", "3", "--export", str(export), LM,
        "--shard", cwd=tmp_path,
    )  # fmt: skip
    watch = run.journal()

    def evaluating() -> bool:
        watch.pull(50)
        return watch.state.epoch >= 1 and len(watch.state.ranks) == 4

    journal = killed_once(run, watch, evaluating, "the first epoch's end", 0, export, LM)
    assert [f for f in journal if isinstance(f, Rewound | WeightsLost)] == []
    assert "Traceback" not in run.output, run.output[-3000:]
