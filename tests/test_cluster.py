"""The emulated cluster of the benchmarks (bench/cluster.py): built, shaped, and torn down."""

from __future__ import annotations

import subprocess

import pytest

from bench.cluster import Cluster, ClusterUnavailable, check, link_throughput

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]


def namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


@pytest.fixture(scope="module", autouse=True)
def needs_root_and_iproute2() -> None:
    try:
        check()
    except ClusterUnavailable as exc:
        pytest.skip(str(exc))


def test_links_are_shaped_to_the_set_rate_and_everything_is_removed_after() -> None:
    with Cluster(hosts=2, rate_bytes=50e6, prefix="hgt") as cluster:
        assert {"hgt0", "hgt1", "hgtsw"} <= namespaces()
        rate = link_throughput(cluster, nbytes=32 << 20)
        assert 0.8 * 50e6 < rate < 1.1 * 50e6, rate  # the shaping holds (TCP gets ~96% of it)
        assert cluster.run(1, ["ip", "-brief", "addr", "show", "eth0"]).split()[2].startswith("10.77.0.2/")
    assert not {"hgt0", "hgt1", "hgtsw"} & namespaces()


def test_a_failure_while_building_removes_what_was_made(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("bench.cluster.SUBNET", "10.77.999")  # `ip addr add` refuses it half way
    with pytest.raises(ClusterUnavailable, match="failed"):
        Cluster(hosts=2, prefix="hgt").open()
    assert not {"hgt0", "hgt1", "hgtsw"} & namespaces()


def test_closing_kills_the_processes_started_on_its_hosts() -> None:
    with Cluster(hosts=2, rate_bytes=50e6, prefix="hgt") as cluster:
        sleeper = cluster.popen(1, ["sleep", "300"])
        done = cluster.popen(0, ["true"])
        assert done.wait(30) == 0 and sleeper.poll() is None
    assert sleeper.wait(10) == -9  # SIGKILLed by close, not left running without its network
    assert not {"hgt0", "hgt1", "hgtsw"} & namespaces()
