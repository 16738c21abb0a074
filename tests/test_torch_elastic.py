"""Elastic DDP (hoplite_gpu.torch.elastic) with real processes (tests/elastic_ranks.py): ranks
SIGKILLed or SIGSTOPped at random points of random steps; the survivors finish with identical
parameters, near those of an uninterrupted run of the survivors alone. Every run uses a standalone
directory, so any rank (rank 0, which hosts torch's store, too) may die."""

from __future__ import annotations

import json
import os
import random
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from tests.elastic_ranks import alone  # noqa: E402
from tests.torch_ranks import run_ranks  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

STEPS = 8


@pytest.fixture
def directory() -> Iterator[dict[str, str]]:
    from hoplite_gpu.auth import new_token
    from hoplite_gpu.directory import DirectoryProcess

    token = new_token()
    process = DirectoryProcess(token)
    process.start()
    try:
        yield {"HOPLITE_DIRECTORY": process.address, "HOPLITE_TOKEN": token}
    finally:
        process.stop()


def train(tmp: Path, env: dict[str, str], world: int = 4, **plan: Any) -> dict[int, dict[str, Any]]:
    plan.setdefault("steps", STEPS)
    plan.setdefault("name", f"elastic-{uuid.uuid4().hex}")  # one directory serves every run
    name = "-".join(f"{k}{v}" for k, v in sorted(plan.items()) if k not in ("steps", "name"))
    work = tmp / "".join(c for c in name if c.isalnum() or c in "-_")[:80]
    work.mkdir()
    return run_ranks("elastic", world, work, timeout=150, arg=json.dumps(plan), env=env)


def survivors(runs: dict[int, dict[str, Any]], dead: set[int]) -> dict[int, dict[str, Any]]:
    """The survivors' results (each must have one); the dead wrote none."""
    for rank in dead:
        assert "result" not in runs[rank], f"rank {rank} should have died: {runs[rank]}"
    found = {}
    for rank in sorted(set(runs) - dead):
        assert "result" in runs[rank], f"rank {rank}: {runs[rank].get('traceback') or runs[rank]['log']}"
        found[rank] = runs[rank]["result"]
    return found


def check_consistent(found: dict[int, dict[str, Any]], dead: set[int]) -> list[dict[str, Any]]:
    """Every survivor holds the same parameters and saw the same steps; the dead are lost in one
    step and contribute to none after it. Returns the steps' reports."""
    digests = {r["digest"] for r in found.values()}
    assert len(digests) == 1, f"survivors' parameters differ: {found}"
    reports = [r["reports"] for r in found.values()]
    assert all(rep == reports[0] for rep in reports), reports
    steps = reports[0]
    assert [s["step"] for s in steps] == list(range(STEPS))
    live = sorted(found)
    assert steps[-1]["members"] == live
    lost_at = [i for i, s in enumerate(steps) if s["lost"]]
    assert lost_at and sorted(r for i in lost_at for r in steps[i]["lost"]) == sorted(dead), steps
    for s in steps[max(lost_at) + 1 :]:
        assert s["contributors"] == live and s["rounds"] == 1, steps
    return steps


def test_a_rank_killed_at_a_random_point_of_a_random_step(tmp_path: Path, directory: dict[str, str]) -> None:
    """4 ranks, one SIGKILLed at a random time of a random step after DDP's bucket layout is
    settled; the 3 survivors end with identical parameters, and their loss is within 5% of an
    uninterrupted run of 3 ranks fed the survivors' data (one process on their batches joined)."""
    seed = int(os.environ.get("HOPLITE_TEST_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    victim, step, after = rng.randrange(4), rng.randrange(2, STEPS - 1), rng.uniform(0.0, 0.12)
    print(f"seed {seed}: rank {victim} killed {after:.3f} s into step {step}")
    runs = train(tmp_path, directory, kill={str(victim): [step, after]})
    found = survivors(runs, {victim})
    check_consistent(found, {victim})
    ours, theirs = next(iter(found.values()))["loss"], alone(STEPS, sorted(found))
    assert abs(ours - theirs) <= 0.05 * theirs, (seed, ours, theirs)


def test_a_step_redone_after_a_death_mid_allreduce_averages_the_survivors_gradients(
    tmp_path: Path, directory: dict[str, str]
) -> None:
    """Every rank fed the same data: whoever averages with whom, the result is that data's
    gradient, so the survivors must end where one process training alone does. Rank 2 dies
    serving a shard of step 4's allreduce: the step is redone among the survivors from their
    kept gradients (a wrong restore would show here)."""
    runs = train(tmp_path, directory, data=[0, 0, 0, 0], kill_serving={"2": 4})
    found = survivors(runs, {2})
    steps = check_consistent(found, {2})
    assert steps[4]["rounds"] == 2 and steps[4]["contributors"] == [0, 1, 3], steps
    ours, theirs = found[0]["loss"], alone(STEPS, [0])
    assert abs(ours - theirs) <= 1e-4 * theirs, (ours, theirs)


def test_two_ranks_killed_in_one_step_rank_0_among_them(tmp_path: Path, directory: dict[str, str]) -> None:
    runs = train(tmp_path, directory, kill={"0": [3, 0.02], "2": [3, 0.05]})
    found = survivors(runs, {0, 2})
    steps = check_consistent(found, {0, 2})
    assert steps[2]["contributors"] == [0, 1, 2, 3]


def test_a_stopped_rank_is_given_up_on_and_told_so_when_it_wakes(
    tmp_path: Path, directory: dict[str, str]
) -> None:
    """Rank 1 is SIGSTOPped mid-step for 8 s, past its lease (5 s): the others go on without it
    after the lease; when it wakes, its step raises, naming it removed."""
    runs = train(tmp_path, directory, stop={"1": [3, 0.03, 8.0]})
    assert "result" not in runs[1]
    assert "was given up on by the other ranks" in runs[1]["message"], runs[1]
    found = survivors({r: v for r, v in runs.items() if r != 1}, set())
    check_consistent(found, {1})


def test_without_elastic_mode_a_dead_rank_fails_the_others_with_the_typed_error(
    tmp_path: Path, directory: dict[str, str]
) -> None:
    runs = train(tmp_path, directory, elastic=False, kill={"3": [3, 0.03]})
    for rank in (0, 1, 2):
        assert "result" not in runs[rank], runs[rank]
        assert "RankLostError" in runs[rank]["message"] or runs[rank]["error"] == "RankLostError", runs[rank]
        assert "rank 3" in runs[rank]["message"], runs[rank]


def train_with_joiner(tmp: Path, env: dict[str, str], **plan: Any) -> dict[int, dict[str, Any]]:
    """4 members and a joiner (process 4, a group of its own) that comes after step 2."""
    plan = {"steps": STEPS + 2, "joiner": 4, "join_after": 2, "name": f"elastic-{uuid.uuid4().hex}", **plan}
    work = tmp / f"join-{len(list(tmp.iterdir()))}"
    work.mkdir()
    env = {**env, "TEST_PG_WORLD": "4"}
    alone = {4: {"TEST_PG_ALONE": "1"}}
    return run_ranks("elastic", 5, work, timeout=150, arg=json.dumps(plan), env=env, rank_env=alone)


def test_a_joiner_gets_the_state_from_the_members_and_ends_with_their_parameters(
    tmp_path: Path, directory: dict[str, str]
) -> None:
    runs = train_with_joiner(tmp_path, directory)
    found = survivors(runs, set())
    assert len({r["digest"] for r in found.values()}) == 1, found
    members = found[0]["reports"]
    admitted = [s["step"] for s in members if s["joined"]]
    assert len(admitted) == 1 and members[admitted[0]]["joined"] == [4], members
    assert found[4]["rank"] == 4
    joiner = found[4]["reports"]
    assert joiner == members[admitted[0] + 1 :], (joiner, members)  # every step after its admission
    assert all(s["contributors"] == [0, 1, 2, 3, 4] for s in joiner)


def test_a_joiner_killed_during_its_join_leaves_the_members_consistent(
    tmp_path: Path, directory: dict[str, str]
) -> None:
    """Killed at a random point of its join: before its ticket (never admitted), after its
    admission but before it watches its place (given up on after join_timeout), or while it
    pulls the state (lost at once)."""
    seed = int(os.environ.get("HOPLITE_TEST_SEED", random.randrange(1 << 30)))
    after = random.Random(seed).uniform(0.0, 0.15)
    print(f"seed {seed}: the joiner is killed {after:.3f} s into its join")
    runs = train_with_joiner(tmp_path, directory, kill_join=after, join_timeout=3)
    assert "result" not in runs[4]
    found = survivors({r: v for r, v in runs.items() if r != 4}, set())
    assert len({r["digest"] for r in found.values()}) == 1, (seed, found)
    steps = found[0]["reports"]
    assert all(r["reports"] == steps for r in found.values()), seed
    assert steps[-1]["members"] == [0, 1, 2, 3] and steps[-1]["contributors"] == [0, 1, 2, 3], (seed, steps)
    if any(s["joined"] for s in steps):  # admitted, then lost
        assert [r for s in steps for r in s["lost"]] == [4], (seed, steps)


def test_elastic_mode_refuses_what_it_cannot_serve(tmp_path: Path) -> None:
    [found] = survivors(run_ranks("elastic_refusals", 1, tmp_path, timeout=120), set()).values()
    assert found == {
        "buffers broadcast": "module",
        "unused parameters": "module",
        "not DDP": "module",
        "gloo group": "group",
        "joiner without a name": "join",
        "max_rounds 0": "max_rounds",
        "join_timeout 0": "join_timeout",
        "forward_sync_buffers=False": found["forward_sync_buffers=False"],
    }, found
    assert found["forward_sync_buffers=False"].endswith("/elastic")
