"""The torch.distributed backend "hoplite", with real processes (tests/torch_ranks.py): every
collective against Gloo's result on the same inputs, DDP and FSDP2 against Gloo, async work, a
timeout, bad input, and a rank SIGKILLed mid-allreduce."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from tests.torch_ranks import run_ranks  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def results(runs: dict[int, dict[str, Any]]) -> list[Any]:
    for rank, run in runs.items():
        assert "result" in run, f"rank {rank}: {run.get('traceback') or run['log']}"
    return [run["result"] for run in runs.values()]


@pytest.mark.parametrize(("world", "shm"), [(1, "0"), (3, "0"), (4, "1")])
def test_every_collective_matches_gloo(tmp_path: Path, world: int, shm: str) -> None:
    """Over the data plane (the suite's default), and with same-host shared memory (a user's)."""
    env = {"HOPLITE_SHARED_MEMORY": shm}
    for rank, found in enumerate(results(run_ranks("collectives", world, tmp_path, timeout=240, env=env))):
        assert found["bad"] == [], f"rank {rank}: {found['bad']}"
        assert found["ran"] > 200
        # Not compared where an older torch's Gloo lacks the collective (all_to_all in 2.11).
        assert all(name.startswith("all_to_all ") for name in found["skipped"]), found["skipped"]


def test_ddp_and_fsdp2_train_to_the_same_parameters_as_gloo(tmp_path: Path) -> None:
    """DDP in five modes, then FSDP2 (fully_shard), each against the same training over Gloo."""
    for found in results(run_ranks("training", 2, tmp_path)):
        diffs = found["ddp"]
        assert diffs.keys() == {"plain", "views", "unused", "hook", "no_sync"}
        assert all(d <= 1e-5 for d in diffs.values()), diffs
        assert found["fsdp"]["diff"] <= 1e-5, found


def test_a_rank_sigkilled_mid_allreduce_fails_every_survivor_with_a_typed_error(tmp_path: Path) -> None:
    """Rank 3 dies half way through serving a shard (its own fault injection, SIGKILL); ranks 0-2
    get a DistBackendError naming rank 3 within the stall timeout, and later collectives fail at
    once. The group's timeout (60 s) is far longer."""
    victim = {3: {"HOPLITE_FAULT_INJECTION": "serve:*:0.5:KILL"}}
    runs = run_ranks("killed", 4, tmp_path, arg="3", rank_env=victim, env={"HOPLITE_STALL_TIMEOUT": "10"})
    assert "result" not in runs[3] and "error" not in runs[3]  # killed: it wrote nothing
    for rank in range(3):
        found = results({rank: runs[rank]})[0]
        assert found["error"] == "RankLostError" and found["dist_backend_error"], found
        assert found["fields"]["lost_ranks"] == [3], found
        assert "rank 3" in found["message"]
        assert found["seconds"] < 10, found
        assert found["later"]["error"] == "RankLostError" and found["later"]["seconds"] < 1.0


def test_a_rank_that_destroys_its_group_and_exits_at_once_leaves_the_others_their_data(
    tmp_path: Path,
) -> None:
    """Rank 0's broadcast returns once its tensor is put; it destroys the group and exits while
    the others still pull it (its sends limited to 8 MiB/s: 4 MiB to each). The exit waits for the
    group's clean-up, so every rank gets the tensor (the soak saw RankLostError, rank 0's node
    gone, on the others)."""
    from hoplite_gpu.auth import new_token
    from hoplite_gpu.directory import DirectoryProcess
    from tests.procs import digest, make_array
    from tests.torch_ranks import SOAK_ELEMENTS

    token = new_token()
    directory = DirectoryProcess(token)
    directory.start()
    try:
        env = {
            "HOPLITE_DIRECTORY": directory.address,
            "HOPLITE_TOKEN": token,
            "HOPLITE_SHARED_MEMORY": "0",
            "HOPLITE_SEND_RATE_LIMIT": str(8 << 20),
        }
        runs = run_ranks("soak", 4, tmp_path, arg="broadcast:7", env=env)
    finally:
        directory.stop()
    want = digest(make_array("float32", (SOAK_ELEMENTS,), 7))
    assert results(runs) == [want] * 4


def test_the_directory_host_killed_fails_the_others_naming_it(tmp_path: Path) -> None:
    """Rank 0 hosts the directory; it is SIGKILLed mid-allreduce; the others name rank 0."""
    victim = {0: {"HOPLITE_FAULT_INJECTION": "serve:*:0.5:KILL"}}
    runs = run_ranks("killed", 3, tmp_path, arg="0", rank_env=victim)
    for rank in (1, 2):
        found = results({rank: runs[rank]})[0]
        assert found["error"] == "RankLostError" and found["dist_backend_error"], found
        assert found["fields"]["lost_ranks"] == [0] and "global rank 0" in found["message"], found
        assert found["seconds"] < 10, found


def test_a_standalone_directory_from_the_environment_outlives_rank_0(tmp_path: Path) -> None:
    """With HOPLITE_DIRECTORY and HOPLITE_TOKEN set, every rank joins that directory; rank 0
    SIGKILLed mid-allreduce is then reported as its node gone, not as the directory lost."""
    from hoplite_gpu.auth import new_token
    from hoplite_gpu.directory import DirectoryProcess

    token = new_token()
    directory = DirectoryProcess(token)
    directory.start()
    try:
        env = {"HOPLITE_DIRECTORY": directory.address, "HOPLITE_TOKEN": token}
        victim = {0: {"HOPLITE_FAULT_INJECTION": "serve:*:0.5:KILL"}}
        runs = run_ranks("killed", 3, tmp_path, arg="0", env=env, rank_env=victim)
        for rank in (1, 2):
            found = results({rank: runs[rank]})[0]
            assert found["directory"] == directory.address and found["host_rank"] == -1, found
            assert found["error"] == "RankLostError" and found["fields"]["lost_ranks"] == [0], found
            assert "rank 0's node is gone" in found["message"] and found["seconds"] < 10, found
    finally:
        directory.stop()


def test_a_timeout_fails_the_work_and_tells_the_other_rank(tmp_path: Path) -> None:
    # Rank 1 waits longer than rank 0: what ends its barrier is rank 0's giving up.
    runs = run_ranks(
        "timeout", 2, tmp_path, rank_env={0: {"TEST_PG_TIMEOUT": "3"}, 1: {"TEST_PG_TIMEOUT": "60"}}
    )
    first, second = results(runs)
    assert first["early"]["error"] == "BackendTimeoutError" and not first["early"]["completed"]
    assert first["error"] == "BackendTimeoutError" and first["dist_backend_error"]
    assert "rank 1" in first["message"] and 2.5 < first["seconds"] < 10, first
    assert second["error"] == "RankLostError" and "did not finish" not in second["message"], second
    assert "all_reduce" in second["message"] and second["fields"]["lost_ranks"] == [0]


def test_bad_input_is_refused_on_its_rank_and_breaks_the_group_for_the_others(tmp_path: Path) -> None:
    refused = results(run_ranks("bad_input", 3, tmp_path, arg="refused"))
    assert refused[1]["noncontiguous"]["error"] == "CollectiveArgumentError"
    assert "contiguous" in refused[1]["noncontiguous"]["message"]
    for rank in (0, 2):
        other = refused[rank]["noncontiguous"]
        assert other["error"] == "RankLostError" and "rank 1" in other["message"] and other["seconds"] < 10
    assert all(r["later"]["error"] == "RankLostError" for r in refused)

    # Tensors of other sizes on different ranks: whoever sees it names the ranks' inputs and
    # breaks the group; everyone fails at once.
    sizes = refused  # (a new group of the same ranks, after the first broke)
    errors = [r["sizes"] for r in sizes]
    assert all(e and e["error"] in ("CollectiveArgumentError", "RankLostError") for e in errors), errors
    assert all(e["seconds"] < 10 for e in errors), errors
    seen = [e for e in errors if e["error"] == "CollectiveArgumentError"]
    assert seen and all("shape" in e["message"] and "rank" in e["message"] for e in seen), errors
    assert all(r["sizes_later"]["error"] == "RankLostError" for r in sizes), sizes

    local = results(run_ranks("bad_input", 2, tmp_path, arg="local"))
    for found in local:
        assert (
            found["no_store"]["error"] == "InvalidArgumentError" and "store" in found["no_store"]["message"]
        )
        assert (
            found["float8"]["error"] == "CollectiveArgumentError" and "float8" in found["float8"]["message"]
        )
        assert "PREMUL_SUM" in found["premul_sum"]["message"]
        assert "non-integral" in found["band_float"]["message"]
        assert found["root_outside"]["error"] == "CollectiveArgumentError"
        assert found["send_to_self"]["error"] == "ValueError"  # torch's own check


def _cuda() -> bool:
    return bool(torch.cuda.is_available())


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="no CUDA GPU")
def test_cuda_tensors_through_the_backend(tmp_path: Path) -> None:
    """Two ranks on one GPU: collectives of CUDA tensors right, DDP on CUDA as DDP over Gloo on
    CPU, and no byte staged through host memory (CUDA IPC between the processes)."""
    env = {"HOPLITE_SHARED_MEMORY": "1"}  # (the suite turns it off; CUDA IPC needs it)
    for found in results(run_ranks("cuda", 2, tmp_path, timeout=240, env=env)):
        assert found["bad"] == [], found["bad"]
        assert found["ddp_diff"] <= 1e-4, found
        assert found["staged"] == {}, found
