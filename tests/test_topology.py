"""GPU inventory (NVML), source preference by link, and ``hoplite-gpu info``."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hoplite_gpu import topology
from hoplite_gpu.errors import InvalidArgumentError
from hoplite_gpu.memory import kernels, placement, shm
from hoplite_gpu.topology import GpuInfo, Inventory, LinkKind, NvLink, link_between, rank_sources


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hoplite_gpu.cli", *args],
        capture_output=True,
        text=True,
        timeout=50,
        env=env,
    )


def _env_without_tls() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "UCX_TLS"}


# --- hoplite-gpu info, as a real process ------------------------------------------------------


@pytest.mark.timeout(60)
def test_info_prints_what_this_node_sees() -> None:
    here = placement.inventory()
    out = _cli("info", env=_env_without_tls())
    assert out.returncode == 0, out.stderr
    assert f"host: {socket.gethostname()}" in out.stdout
    assert "UCX transports: tcp (hoplite_gpu default" in out.stdout
    assert "CuPy: " in out.stdout and "ucxx: " in out.stdout
    if here.gpus:
        for g in here.gpus:
            assert g.name in out.stdout
    else:  # this machine: no driver, so no GPU, and a reason
        assert here.error
        line = next(x for x in out.stdout.splitlines() if x.startswith("no NVIDIA GPU visible: "))
        assert len(line) > len("no NVIDIA GPU visible: ") and "NVML" in line


@pytest.mark.timeout(60)
def test_info_json_is_one_object_holding_the_inventory() -> None:
    env = _env_without_tls() | {"UCX_TLS": "tcp,cuda_copy"}
    out = _cli("info", "--json", env=env)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    inv = Inventory.from_dict(report)  # the extra keys (cupy, ucxx, ...) are ignored
    assert inv.host == socket.gethostname() and inv.host_key == shm.host_key()
    assert report["ucx_tls"] == "tcp,cuda_copy" and report["ucx_tls_source"] == "env"
    assert report["cupy"]["installed"] in (True, False) and report["ucxx"]["installed"] is True
    here = placement.inventory()
    if not here.gpus:  # this machine: no driver
        assert report["gpus"] == [] and report["error"] == here.error != ""
        assert report["cupy"]["usable"] is False and report["driver_version"] == ""


# --- inventory() against a stand-in pynvml --------------------------------------------------


class _NVMLError(Exception):
    pass


class _NotSupported(_NVMLError):
    pass


def _fake_nvml(devices: list[dict[str, Any]], init_error: Exception | None = None) -> types.ModuleType:
    """A pynvml stand-in: each device is a dict of answers; a missing answer raises NotSupported,
    an Exception value is raised."""
    nv = types.ModuleType("pynvml")
    nv.NVMLError = _NVMLError  # type: ignore[attr-defined]
    nv.NVML_NVLINK_MAX_LINKS = 4  # type: ignore[attr-defined]
    nv.shutdowns = 0  # type: ignore[attr-defined]

    def init() -> None:
        if init_error is not None:
            raise init_error

    def shutdown() -> None:
        nv.shutdowns += 1  # type: ignore[attr-defined]

    def answer(key: str) -> Any:
        def call(h: dict[str, Any], *args: Any) -> Any:
            value = h.get(key, _NotSupported("Not Supported"))
            if callable(value):
                value = value(*args)
            if isinstance(value, Exception):
                raise value
            return value

        return call

    def handle(i: int) -> dict[str, Any]:
        if isinstance(devices[i], Exception):
            raise devices[i]
        return devices[i]

    nv.__dict__.update(
        nvmlInit=init,
        nvmlShutdown=shutdown,
        nvmlSystemGetDriverVersion=lambda: b"550.54.15",
        nvmlSystemGetCudaDriverVersion=lambda: 12040,
        nvmlDeviceGetCount=lambda: len(devices),
        nvmlDeviceGetHandleByIndex=handle,
    )
    for key in (
        "UUID Name MemoryInfo PciInfo NumaNodeId CudaComputeCapability CurrPcieLinkGeneration "
        "MaxPcieLinkGeneration CurrPcieLinkWidth MaxPcieLinkWidth NvLinkState NvLinkRemotePciInfo "
        "NvLinkRemoteDeviceType"
    ).split():
        setattr(nv, f"nvmlDeviceGet{key}", answer(key))
    return nv


def _pci(bus: str) -> types.SimpleNamespace:
    return types.SimpleNamespace(busId=bus)


def _links(*ends: tuple[bool, str, int]) -> dict[str, Any]:
    """NVLink answers: link i is (active, remote bus id, remote device type); others unsupported."""

    def pick(i: int, what: int) -> Any:
        return ends[i][what] if i < len(ends) else _NotSupported("Not Supported")

    return {
        "NvLinkState": lambda i: pick(i, 0),
        "NvLinkRemotePciInfo": lambda i: _pci(pick(i, 1)) if i < len(ends) else pick(i, 1),
        "NvLinkRemoteDeviceType": lambda i: pick(i, 2),
    }


@pytest.fixture
def two_gpus(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> types.ModuleType:
    """A stand-in NVML with two H100s on one NVLink (the first also on an NVSwitch), a second GPU
    that reports little (its NUMA node comes from sysfs), and a third GPU that is lost."""
    (tmp_path / "0000:86:00.0").mkdir()
    (tmp_path / "0000:86:00.0" / "numa_node").write_text("1\n")
    monkeypatch.setattr(placement, "SYSFS_PCI", str(tmp_path))
    mem = types.SimpleNamespace(total=80 * 2**30, free=79 * 2**30, used=2**30)
    a = {
        "UUID": b"GPU-aaaa",
        "Name": "NVIDIA H100",
        "MemoryInfo": mem,
        "PciInfo": _pci("00000000:3B:00.0"),
        "NumaNodeId": 0,
        "CudaComputeCapability": (9, 0),
        "CurrPcieLinkGeneration": 5,
        "MaxPcieLinkGeneration": 5,
        "CurrPcieLinkWidth": 16,
        "MaxPcieLinkWidth": 16,
        **_links((True, "00000000:86:00.0", 0), (False, "00000000:86:00.0", 0), (True, "0000:c0:00.0", 2)),
    }
    b = {
        "UUID": "GPU-bbbb",
        "Name": "NVIDIA H100",
        "PciInfo": _pci("00000000:86:00.0"),
        "CudaComputeCapability": type("NVMLError_FunctionNotFound", (_NVMLError,), {})("Function Not Found"),
        **_links((True, "00000000:3B:00.0", 0)),
    }
    lost = type("NVMLError_GpuIsLost", (_NVMLError,), {})("GPU is lost")
    nv = _fake_nvml([a, b, lost])
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    return nv


def test_inventory_reads_nvml_and_tolerates_what_a_gpu_does_not_support(two_gpus: types.ModuleType) -> None:
    nv = two_gpus
    inv = placement.inventory()

    assert nv.shutdowns == 1  # type: ignore[attr-defined]
    assert (inv.driver_version, inv.cuda_driver_version) == ("550.54.15", "12.4")
    assert inv.host_key == shm.host_key() and inv.error == "GPU 2 skipped: GPU is lost"
    ga, gb = inv.gpus
    assert (ga.uuid, ga.pci_bus_id, ga.numa_node, ga.compute_capability) == (
        "GPU-aaaa",
        "0000:3b:00.0",
        0,
        (9, 0),
    )
    assert (ga.memory_total_bytes, ga.memory_free_bytes, ga.pcie_gen_max, ga.pcie_width) == (
        80 * 2**30,
        79 * 2**30,
        5,
        16,
    )
    assert ga.nvlinks == (
        NvLink(0, True, "0000:86:00.0", "gpu", "GPU-bbbb"),
        NvLink(1, False, "0000:86:00.0", "gpu", "GPU-bbbb"),
        NvLink(2, True, "0000:c0:00.0", "switch", None),
    )
    assert (gb.numa_node, gb.compute_capability, gb.memory_total_bytes, gb.pcie_gen) == (1, None, None, None)
    assert gb.nvlinks == (NvLink(0, True, "0000:3b:00.0", "gpu", "GPU-aaaa"),)
    assert link_between(inv, "GPU-aaaa", inv, "GPU-bbbb") is LinkKind.NVLINK
    assert Inventory.from_dict(json.loads(json.dumps(inv.to_dict()))) == inv


def test_info_table_lists_gpus_and_their_peers(
    two_gpus: types.ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from hoplite_gpu.cli import main

    # ucxx imports pynvml too: keep the stand-in from it (and from CuPy) so nothing half-imports
    monkeypatch.setitem(sys.modules, "ucxx", types.SimpleNamespace(__version__="0.0-test"))
    monkeypatch.setitem(sys.modules, "cupy", None)
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "NVIDIA driver: 550.54.15 (CUDA 12.4)" in out and "no NVIDIA GPU visible" not in out
    assert "ucxx: 0.0-test" in out and "CuPy: not installed" in out
    rows = [line.split("  ") for line in out.splitlines() if line.startswith(("0 ", "1 "))]
    cells = [[c.strip() for c in r if c.strip()] for r in rows]
    assert cells == [
        ["0", "NVIDIA H100", "80.0 (79.0)", "0000:3b:00.0", "0", "GPU1 x1, switch x1", "9.0"],
        ["1", "NVIDIA H100", "? (?)", "0000:86:00.0", "1", "GPU0 x1", "?"],
    ]
    assert out.rstrip().endswith("note: GPU 2 skipped: GPU is lost")


@pytest.mark.parametrize(
    "failure",
    [
        type("NVMLError_DriverNotLoaded", (_NVMLError,), {})("Driver Not Loaded"),
        OSError("libnvidia-ml.so.1"),
        RuntimeError("y" * 1000),  # a long reason is cut to what from_dict accepts
    ],
)
def test_inventory_without_a_driver_lists_no_gpu_and_says_why(
    monkeypatch: pytest.MonkeyPatch, failure: Exception
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml([{}], init_error=failure))
    inv = placement.inventory()
    assert inv.gpus == () and inv.host == socket.gethostname()
    assert inv.error.startswith("cannot initialise NVML") and str(failure)[:100] in inv.error
    assert Inventory.from_dict(inv.to_dict()) == inv


def test_inventory_with_no_device(monkeypatch: pytest.MonkeyPatch) -> None:
    nv = _fake_nvml([])
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    inv = placement.inventory()
    assert (inv.gpus, inv.error, inv.driver_version, nv.shutdowns) == (
        (),
        "NVML lists no GPU",
        "550.54.15",
        1,
    )


def test_inventory_without_pynvml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    inv = placement.inventory()
    assert inv.gpus == () and "pynvml" in inv.error and "not installed" in inv.error


def test_bus_id_in_sysfs_form() -> None:
    assert placement.bus_id("00000000:3B:00.0") == "0000:3b:00.0"
    assert placement.bus_id("00010000:C1:00.0") == "10000:c1:00.0"
    assert placement.bus_id("0000:3b:00.0") == "0000:3b:00.0"


# --- link_between / rank_sources on synthetic inventories -----------------------------------


def _g(uuid: str, numa: int | None, *links: NvLink, index: int = 0) -> GpuInfo:
    return GpuInfo(index=index, uuid=uuid, name="test GPU", numa_node=numa, nvlinks=links)


def _node(key: str, *gpus: GpuInfo) -> Inventory:
    return Inventory(host=f"host-{key}", host_key=key, gpus=gpus)


NODE = _node(
    "h1",
    _g("G0", 0, NvLink(0, True, remote_uuid="G1"), index=0),
    _g("G1", 0, index=1),  # reports no link back: one side's report is enough
    _g("G2", 0, NvLink(0, False, remote_uuid="G0"), index=2),  # inactive link
    _g("G3", 1, index=3),
    _g("G4", None, index=4),
    _g("G5", 1, NvLink(0, True, remote_kind="switch"), index=5),
    _g("G6", 0, NvLink(3, True, remote_kind="switch"), index=6),
    _g("G7", None, index=7),
)
OTHER = _node("h2", _g("G0", 0), _g("H0", 0))
NO_SHM = _node("", _g("G0", 0))


@pytest.mark.parametrize(
    ("a", "b", "kind"),
    [
        ("G0", "G0", LinkKind.SAME_GPU),
        ("G0", "G1", LinkKind.NVLINK),
        ("G1", "G0", LinkKind.NVLINK),
        ("G5", "G6", LinkKind.NVLINK),  # both on an NVSwitch, across NUMA nodes
        ("G0", "G6", LinkKind.SAME_NUMA),  # only one of them on the switch
        ("G0", "G2", LinkKind.SAME_NUMA),
        ("G0", "G3", LinkKind.SAME_HOST),
        ("G4", "G4", LinkKind.SAME_GPU),
        ("G4", "G1", LinkKind.SAME_HOST),
        ("G4", "G7", LinkKind.SAME_HOST),  # NUMA unknown on both: not the same node
        ("G0", "", LinkKind.SAME_HOST),  # a host-memory buffer on the same host
        ("G0", "nope", LinkKind.SAME_HOST),
    ],
)
def test_link_between_on_one_host(a: str, b: str, kind: LinkKind) -> None:
    assert link_between(NODE, a, NODE, b) is kind
    assert link_between(NODE, b, NODE, a) is kind


def test_link_between_hosts_is_the_network() -> None:
    assert link_between(NODE, "G0", OTHER, "H0") is LinkKind.NETWORK
    assert link_between(NODE, "G0", OTHER, "G0") is LinkKind.NETWORK  # host_key decides
    assert link_between(NO_SHM, "G0", NO_SHM, "G0") is LinkKind.NETWORK  # no key: no claim
    assert LinkKind.SAME_GPU < LinkKind.NVLINK < LinkKind.SAME_NUMA < LinkKind.SAME_HOST < LinkKind.NETWORK


def test_rank_sources_best_first_and_stable() -> None:
    candidates = [(OTHER, "H0"), (NODE, "G3"), (NODE, "G1"), (NODE, "G0"), (NODE, "G2"), (OTHER, "G0")]
    assert rank_sources((NODE, "G0"), candidates) == [3, 2, 4, 1, 0, 5]
    assert rank_sources((OTHER, "H0"), candidates) == [0, 5, 1, 2, 3, 4]
    assert rank_sources((NODE, "G0"), []) == []


# --- to_dict / from_dict --------------------------------------------------------------------

_text = st.text(max_size=12)
_opt_int = st.none() | st.integers(0, 2**63 - 1)
_links_st = st.lists(
    st.builds(
        NvLink,
        index=st.integers(0, topology.MAX_LINKS - 1),
        active=st.booleans(),
        remote_bus_id=st.none() | _text,
        remote_kind=st.none() | st.sampled_from(["gpu", "switch", "ibmnpu"]),
        remote_uuid=st.none() | _text,
    ),
    max_size=4,
).map(tuple)
_gpus_st = st.lists(
    st.builds(
        GpuInfo,
        index=st.integers(0, topology.MAX_GPUS - 1),
        uuid=_text,
        name=_text,
        memory_total_bytes=_opt_int,
        memory_free_bytes=_opt_int,
        pci_bus_id=st.none() | _text,
        numa_node=st.none() | st.integers(0, 7),
        compute_capability=st.none() | st.tuples(st.integers(0, 12), st.integers(0, 9)),
        pcie_gen=_opt_int,
        pcie_gen_max=_opt_int,
        pcie_width=_opt_int,
        pcie_width_max=_opt_int,
        nvlinks=_links_st,
    ),
    max_size=4,
    unique_by=lambda g: g.uuid,
).map(tuple)
_inventories = st.builds(
    Inventory,
    host=_text,
    host_key=_text,
    driver_version=_text,
    cuda_driver_version=_text,
    gpus=_gpus_st,
    error=_text,
)


@settings(max_examples=60, deadline=None)
@given(_inventories)
def test_round_trip_through_json_and_msgpack(inv: Inventory) -> None:
    d = inv.to_dict()
    assert Inventory.from_dict(d) == inv
    assert Inventory.from_dict(json.loads(json.dumps(d))) == inv
    assert Inventory.from_dict(msgpack.unpackb(msgpack.packb(d))) == inv


def _valid() -> dict[str, Any]:
    g = _g("GPU-x", 0, NvLink(0, True, "0000:86:00.0", "gpu", "GPU-y"))
    return _node("h1", g, GpuInfo(index=1, uuid="GPU-y", name="n", compute_capability=(8, 0))).to_dict()


def _set(path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    d = _valid()
    Inventory.from_dict(d)  # the base is valid: only the change can make it fail
    target: Any = d
    for step in path[:-1]:
        target = target[step]
    if value is _DELETE:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return d


_DELETE = object()
_LONG = "x" * (topology.MAX_STR + 1)


@pytest.mark.parametrize(
    ("path", "value", "field"),
    [
        (("host",), _DELETE, "host"),
        (("host",), _LONG, "host"),
        (("error",), 7, "error"),
        (("gpus",), {"0": {}}, "gpus"),
        (("gpus",), [_valid()["gpus"][0]] * (topology.MAX_GPUS + 1), "gpus"),
        (("gpus", 0), "GPU-x", r"gpus\[0\]"),
        (("gpus", 1, "uuid"), "GPU-x", "UUID twice"),
        (("gpus", 0, "uuid"), None, r"gpus\[0\]\.uuid"),
        (("gpus", 0, "index"), topology.MAX_GPUS, r"gpus\[0\]\.index"),
        (("gpus", 0, "memory_total_bytes"), -1, "memory_total_bytes"),
        (("gpus", 0, "memory_free_bytes"), 2**64, "memory_free_bytes"),
        (("gpus", 0, "numa_node"), True, "numa_node"),
        (("gpus", 0, "pcie_width"), 16.0, "pcie_width"),
        (("gpus", 0, "name"), _LONG, "name"),
        (("gpus", 1, "compute_capability"), [8], "compute_capability"),
        (("gpus", 1, "compute_capability"), [8, 0, 1], "compute_capability"),
        (("gpus", 1, "compute_capability"), ["8", "0"], "compute_capability"),
        (("gpus", 0, "nvlinks"), None, "nvlinks"),
        (("gpus", 0, "nvlinks"), [_valid()["gpus"][0]["nvlinks"][0]] * (topology.MAX_LINKS + 1), "nvlinks"),
        (("gpus", 0, "nvlinks", 0, "active"), "yes", "active"),
        (("gpus", 0, "nvlinks", 0, "index"), -1, "index"),
        (("gpus", 0, "nvlinks", 0, "remote_uuid"), 5, "remote_uuid"),
        (("gpus", 0, "nvlinks", 0, "remote_bus_id"), _LONG, "remote_bus_id"),
        (("gpus", 0, "nvlinks", 0), [], r"nvlinks\[0\]"),
    ],
)
def test_from_dict_rejects_malformed(path: tuple[Any, ...], value: Any, field: str) -> None:
    with pytest.raises(InvalidArgumentError, match=field):
        Inventory.from_dict(_set(path, value))


@pytest.mark.parametrize("data", [None, [], "inventory", 3, b"\x80"])
def test_from_dict_rejects_non_dicts(data: Any) -> None:
    with pytest.raises(InvalidArgumentError, match="inventory"):
        Inventory.from_dict(data)


_LINKS = ("index", "active", "remote_bus_id", "remote_kind", "remote_uuid")
_junk = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=300) | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_from_dict_never_fails_otherwise(data: st.DataObject) -> None:
    """Any field of a valid inventory replaced by junk: a valid inventory or InvalidArgumentError."""
    paths: list[tuple[Any, ...]] = [(k,) for k in _valid()]
    paths += [("gpus", 0, k) for k in _valid()["gpus"][0]] + [("gpus", 0, "nvlinks", 0, k) for k in _LINKS]
    d = _set(data.draw(st.sampled_from(paths)), data.draw(_junk))
    try:
        inv = Inventory.from_dict(d)
    except InvalidArgumentError:
        return
    assert Inventory.from_dict(inv.to_dict()) == inv


def test_the_inventory_a_node_sends_keeps_every_link_kind_in_little_space() -> None:
    routing = NODE.for_routing()
    uuids = [g.uuid for g in NODE.gpus]
    for a in uuids:
        for b in uuids:
            assert link_between(routing, a, routing, b) is link_between(NODE, a, NODE, b), (a, b)
    switched = tuple(NvLink(i, True, remote_bus_id="0000:01:00.0", remote_kind="switch") for i in range(18))
    dgx = _node("h1", *(_g(f"GPU-{i}", i // 4, *switched, index=i) for i in range(8)))
    assert len(msgpack.packb(dgx.to_dict())) > 8 * 1024 > 4 * len(msgpack.packb(dgx.for_routing().to_dict()))
    assert Inventory.from_dict(dgx.for_routing().to_dict()) == dgx.for_routing()


def test_a_process_without_a_gpu_in_use_names_none(monkeypatch: pytest.MonkeyPatch) -> None:
    """No CUDA or NVML start-up for a node whose process works with no GPU: its place is empty
    (CuPy not loaded; or the simulated backend, which has no UUIDs)."""
    from hoplite_gpu.memory import device

    if "cupy" not in sys.modules:
        assert placement.node_place() == topology.GpuPlace()
    monkeypatch.setenv(device.BACKEND_ENV, "sim")
    device.default_backend.cache_clear()
    try:
        assert device.default_backend().in_use() and placement.node_place() == topology.GpuPlace()
    finally:
        monkeypatch.undo()
        device.default_backend.cache_clear()


# --- on a machine with a GPU ----------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not kernels.available(), reason="needs CuPy and a CUDA device")
def test_inventory_matches_cupy() -> None:
    import cupy

    inv = placement.inventory()
    count = int(cupy.cuda.runtime.getDeviceCount())
    assert inv.error == "" and inv.driver_version and inv.cuda_driver_version
    if os.environ.get("CUDA_VISIBLE_DEVICES") is None:  # NVML ignores it, CuPy does not
        assert len(inv.gpus) == count
    else:
        assert len(inv.gpus) >= count
    uuids = [g.uuid for g in inv.gpus]
    assert len(set(uuids)) == len(uuids) and all(u.startswith(("GPU-", "MIG-")) for u in uuids)
    for g in inv.gpus:
        assert g.memory_total_bytes and g.compute_capability and g.pci_bus_id
        assert link_between(inv, g.uuid, inv, g.uuid) is LinkKind.SAME_GPU
    assert Inventory.from_dict(json.loads(json.dumps(inv.to_dict()))) == inv


@pytest.mark.gpu
@pytest.mark.skipif(not kernels.available(), reason="needs CuPy and a CUDA device")
def test_a_node_names_its_gpu_to_the_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA's UUID of the current device is NVML's, so the directory can rank holders by link."""
    import cupy

    import hoplite_gpu as hg
    from hoplite_gpu.memory import device

    monkeypatch.delenv(device.BACKEND_ENV, raising=False)
    device.default_backend.cache_clear()
    try:
        cupy.zeros(1)  # this process works with the GPU
        place = placement.node_place()
        assert place.uuid.startswith("GPU-")
        assert Inventory.from_dict(place.inventory).gpu(place.uuid) is not None
        with hg.init() as node:
            joined = [e for e in node.event_log() if e["kind"] == "node_joined"]
            assert joined[-1]["gpu"] == place.uuid
    finally:
        device.default_backend.cache_clear()
