"""The UCX settings chosen from the host's hardware: the pure choice on recorded and composed
``ucx_info -d`` listings (tests/data), the probe that reads and caches the listing (run as real
processes: the libucx wheel's ``ucx_info``, and stand-in ``ucx_info`` scripts that fail), and
``hoplite-gpu info`` printing the choice."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hoplite_gpu.dataplane.ucx import probe as ucx_probe
from hoplite_gpu.dataplane.ucx import settings as ucx_settings
from hoplite_gpu.dataplane.ucx.choice import choose_ucx, enabled, parse_listing
from hoplite_gpu.errors import InvalidArgumentError

pytestmark = pytest.mark.timeout(120)

DATA = Path(__file__).resolve().parent / "data"
TCP = (DATA / "ucx_info_tcp.txt").read_text()  # recorded on the development machine
IB = (DATA / "ucx_info_ib.txt").read_text()  # composed
NVLINK = (DATA / "ucx_info_nvlink.txt").read_text()  # composed
VERBS_TLS = "rc_mlx5,dc_mlx5,ud_mlx5,rc_verbs,ud_verbs,tcp"


def _choose(listing: str | None, **environ: str) -> dict[str, object]:
    choice = choose_ucx(listing, environ, ucx_settings.UCX_DEFAULTS, problem="test")
    return choice.to_dict()


# --- the listings ---------------------------------------------------------------------------


def test_the_recorded_and_composed_listings_parse_into_their_transports() -> None:
    tcp = parse_listing(TCP)
    assert {r.transport for r in tcp} == {"self", "tcp", "sysv", "posix", "cma"}
    assert {r.device for r in tcp if r.transport == "tcp"} == {"eth0", "lo"}
    assert {r.kind for r in tcp if r.transport == "posix"} == {"intra-node"}
    ib = parse_listing(IB)
    assert {r.device for r in ib if r.memory_domain == "mlx5_0"} == {"mlx5_0:1"}
    assert [r.transport for r in ib if r.memory_domain == "mlx5_0"] == [
        "rc_verbs",
        "rc_mlx5",
        "dc_mlx5",
        "ud_verbs",
        "ud_mlx5",
    ]
    gpu = {r.transport: r for r in parse_listing(NVLINK)}
    assert gpu["cuda_copy"].memory_domain == "cuda_cpy" and gpu["cuda_copy"].kind == "accelerator"
    assert {"cuda_ipc", "gdr_copy"} <= set(gpu)


@pytest.mark.parametrize(
    "text",
    ["", "hello\nworld", "# Memory domain: tcp\n#     Component: tcp\n", IB[: IB.index("rc_mlx5") + 8]],
    ids=["empty", "not-a-listing", "no-transport", "cut-after-a-transport"],
)
def test_a_garbled_listing_is_refused(text: str) -> None:
    with pytest.raises(InvalidArgumentError):
        parse_listing(text)


# --- the choice per host ---------------------------------------------------------------------


def test_a_tcp_only_host_gets_exactly_the_measured_defaults() -> None:
    choice = _choose(TCP)
    assert choice["case"] == "tcp" and choice["settings"] == ucx_settings.UCX_DEFAULTS
    assert choice["kept"] == {} and choice["net_devices"] == []
    reasons = "\n".join(choice["reasons"])  # type: ignore[arg-type]
    assert "posix, sysv, cma listed: left out" in reasons and "seed 3, run 8" in reasons
    assert "UCX_RNDV_THRESH=inf" in reasons


def test_an_infiniband_host_gets_verbs_and_zero_copy_rendezvous() -> None:
    choice = _choose(IB)
    settings = choice["settings"]
    assert choice["case"] == "rdma" and isinstance(settings, dict)
    assert settings["UCX_TLS"] == VERBS_TLS and settings["UCX_RNDV_THRESH"] == "auto"
    assert {k: v for k, v in settings.items() if k not in ("UCX_TLS", "UCX_RNDV_THRESH")} == {
        k: v for k, v in ucx_settings.UCX_DEFAULTS.items() if k not in ("UCX_TLS", "UCX_RNDV_THRESH")
    }
    assert choice["net_devices"] == ["mlx5_0:1"]
    reasons = "\n".join(choice["reasons"])  # type: ignore[arg-type]
    assert "on mlx5_0:1 listed: used" in reasons and "zero-copy" in reasons
    assert "posix, cma listed: left out" in reasons


def test_an_nvlink_host_stages_device_chunks_unless_told_and_keeps_eager_over_tcp() -> None:
    choice = _choose(NVLINK)
    settings = choice["settings"]
    assert choice["case"] == "gpu" and isinstance(settings, dict)
    # staging through pinned host buffers measured faster on an H100: UCX_TLS as on a TCP host
    assert settings["UCX_TLS"] == "tcp" and settings["UCX_RNDV_THRESH"] == "inf"
    assert choice["net_devices"] == []
    reasons = "\n".join(choice["reasons"])  # type: ignore[arg-type]
    assert "cuda_copy, cuda_ipc listed: left out" in reasons and "HOPLITE_UCX_CUDA=1" in reasons
    assert "gdr_copy listed: left out" in reasons


def test_a_gpu_host_with_infiniband_adds_gdr_copy_where_device_chunks_go_to_ucx() -> None:
    choice = _choose(IB + NVLINK, HOPLITE_UCX_CUDA="1")
    settings = choice["settings"]
    assert choice["case"] == "rdma+gpu" and isinstance(settings, dict)
    assert settings["UCX_TLS"] == f"{VERBS_TLS},cuda_copy,cuda_ipc,gdr_copy"
    assert settings["UCX_RNDV_THRESH"] == "auto"
    staged = _choose(IB + NVLINK)["settings"]
    assert staged["UCX_TLS"] == VERBS_TLS  # type: ignore[index]


def test_hoplite_ucx_cuda_adds_cuda_copy_as_before() -> None:
    assert _choose(TCP, HOPLITE_UCX_CUDA="1")["settings"]["UCX_TLS"] == "tcp,cuda_copy"  # type: ignore[index]
    assert _choose(TCP, HOPLITE_UCX_CUDA="0")["settings"]["UCX_TLS"] == "tcp"  # type: ignore[index]
    nvlink = _choose(NVLINK, HOPLITE_UCX_CUDA="1")["settings"]
    assert nvlink["UCX_TLS"] == "tcp,cuda_copy,cuda_ipc"  # type: ignore[index]
    # the user's own list gains cuda_copy: a process started by a node inherits the node's UCX_TLS
    choice = _choose(TCP, HOPLITE_UCX_CUDA="1", UCX_TLS="tcp")
    assert choice["settings"]["UCX_TLS"] == "tcp,cuda_copy"  # type: ignore[index]
    assert choice["effective"]["UCX_TLS"] == "tcp,cuda_copy"  # type: ignore[index]


def test_the_users_own_ucx_settings_win_and_the_reason_says_so() -> None:
    choice = _choose(IB, UCX_TLS="tcp", UCX_TCP_TX_SEG_SIZE="8k")
    assert "UCX_TLS" not in choice["settings"] and "UCX_TCP_TX_SEG_SIZE" not in choice["settings"]  # type: ignore[operator]
    assert choice["kept"] == {"UCX_TLS": "tcp", "UCX_TCP_TX_SEG_SIZE": "8k"}
    # TCP alone carries the bytes then: eager, as on a TCP-only host, and no RDMA device needed
    assert choice["settings"]["UCX_RNDV_THRESH"] == "inf" and choice["net_devices"] == []  # type: ignore[index]
    reasons = "\n".join(choice["reasons"])  # type: ignore[arg-type]
    assert f"UCX_TLS=tcp is set in the environment: it wins over {VERBS_TLS}" in reasons
    assert "UCX_TCP_TX_SEG_SIZE=8k is set in the environment: it wins over 1m" in reasons
    threshold = _choose(IB, UCX_RNDV_THRESH="64k")
    assert threshold["kept"] == {"UCX_RNDV_THRESH": "64k"}
    assert threshold["effective"]["UCX_RNDV_THRESH"] == "64k"  # type: ignore[index]
    assert "UCX_RNDV_THRESH=64k is set in the environment: it wins over auto" in threshold["reasons"]  # type: ignore[operator]
    # the user's list still reaches RDMA: zero-copy rendezvous and the devices follow it
    for tls in ("all", "rc,tcp", "^ud,sm"):
        mine = _choose(IB, UCX_TLS=tls)
        assert mine["settings"]["UCX_RNDV_THRESH"] == "auto", tls  # type: ignore[index]
        assert mine["net_devices"] == ["mlx5_0:1"], tls
    inherited = _choose(TCP, **ucx_settings.UCX_DEFAULTS)
    assert inherited["settings"] == {} and inherited["effective"] == ucx_settings.UCX_DEFAULTS
    assert inherited["reasons"][-1].endswith("set in the environment as chosen: kept")  # type: ignore[index]


@pytest.mark.parametrize("listing", [None, "", "garbage\n", IB[: IB.index("rc_mlx5") + 8]])
def test_a_missing_or_garbled_listing_gives_the_tcp_only_choice(listing: str | None) -> None:
    choice = _choose(listing)
    assert choice["case"] == "tcp" and choice["settings"] == ucx_settings.UCX_DEFAULTS
    first = choice["reasons"][0]  # type: ignore[index]
    assert first == "TCP only: no UCX listing (test)" if listing is None else "unreadable" in first


def test_rdma_devices_that_ucx_cannot_use_are_named() -> None:
    choice = choose_ucx(TCP, {}, ucx_settings.UCX_DEFAULTS, rdma_devices=["mlx5_0", "mlx5_1"])
    assert dict(choice.settings) == ucx_settings.UCX_DEFAULTS
    assert any("mlx5_0, mlx5_1 are present but this UCX lists no verbs" in r for r in choice.reasons)


def test_enabled_reads_names_aliases_and_exclusions() -> None:
    assert enabled("tcp,rc", "rc_mlx5") and enabled("all", "dc_mlx5") and enabled("^sm", "ud_verbs")
    assert not enabled("tcp", "rc_mlx5") and not enabled("^rc_mlx5,ud", "ud_mlx5")
    assert enabled("rc_x:aux,tcp", "rc_mlx5") and not enabled("", "tcp")


# --- the probe, as real processes -----------------------------------------------------------


def _fake_ucx_info(folder: Path, body: str) -> dict[str, str]:
    """An environment whose ``ucx_info`` is a script running ``body`` (libucx asked for the
    system's UCX, where hoplite_gpu then looks for ``ucx_info``), its cache in ``folder``."""
    script = folder / "bin" / "ucx_info"
    script.parent.mkdir(parents=True)
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UCX_", "UCXPY_", "HOPLITE_UCX"))}
    return env | {
        "PATH": f"{script.parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY": "true",
        "XDG_RUNTIME_DIR": str(folder),
    }


@pytest.fixture
def fresh_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    """No listing remembered from earlier tests of this process."""
    monkeypatch.setattr(ucx_probe, "_memo", {})


def test_the_wheels_ucx_info_is_run_once_then_read_from_this_boots_cache(
    tmp_path: Path, fresh_probe: None
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAPIDS_")}
    env["XDG_RUNTIME_DIR"] = str(tmp_path)
    binary = ucx_probe.ucx_info_path(env)
    if binary is None:
        pytest.skip("no libucx wheel here")
    first = ucx_probe.host_listing(env)
    assert first.text is not None and first.source.startswith(f"ucx_info -d ({binary}), run now")
    assert "tcp" in {r.transport for r in parse_listing(first.text)}
    cached = list((tmp_path / "hoplite_gpu").glob("ucx_info-*.json"))
    assert len(cached) == 1 and cached[0].stat().st_mode & 0o077 == 0
    ucx_probe._memo.clear()
    again = ucx_probe.host_listing(env)
    assert again.text == first.text and again.source.startswith("ucx_info -d, cached for this boot")
    cached[0].write_text("{not json")  # a damaged copy is probed anew
    ucx_probe._memo.clear()
    assert ucx_probe.host_listing(env).source.startswith(f"ucx_info -d ({binary}), run now")


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        ("echo broken >&2; exit 3", "no UCX listing (ucx_info -d exited with 3: broken)"),
        ("echo garbage", "the UCX listing is unreadable"),
        ("exec sleep 30", "no UCX listing (ucx_info -d took more than 0.5 s)"),
    ],
    ids=["fails", "garbage", "hangs"],
)
def test_a_failing_ucx_info_gives_tcp_only_and_the_reason(
    tmp_path: Path, fresh_probe: None, monkeypatch: pytest.MonkeyPatch, body: str, problem: str
) -> None:
    monkeypatch.setattr(ucx_probe, "PROBE_TIMEOUT", 0.5)
    choice = ucx_settings.ucx_choice(_fake_ucx_info(tmp_path, body))
    assert choice.case == "tcp" and dict(choice.settings) == ucx_settings.UCX_DEFAULTS
    assert problem in choice.reasons[0]


def test_apply_on_this_tcp_host_sets_what_it_always_set(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [*ucx_settings.UCX_DEFAULTS, ucx_settings.UCX_CUDA_ENV]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("UCX_TCP_RX_SEG_SIZE", "64k")
    choice = ucx_settings.apply_ucx_defaults()
    assert ucx_settings.applied_ucx_choice() is choice
    want = ucx_settings.UCX_DEFAULTS | {"UCX_TCP_RX_SEG_SIZE": "64k"}
    assert {k: os.environ[k] for k in ucx_settings.UCX_DEFAULTS} == want == choice.effective()
    assert ucx_settings.default_ucx_tls() == "tcp"


# --- hoplite-gpu info ----------------------------------------------------------------------


def _info(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hoplite_gpu.cli", "info", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def test_info_prints_the_choice_and_its_reasons(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UCX_", "UCXPY_", "HOPLITE_UCX"))}
    out = _info(env | {"XDG_RUNTIME_DIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert "UCX choice for this host (tcp): UCX_TLS=tcp, UCX_RNDV_THRESH=inf, " in out.stdout
    assert "  why: UCX_RNDV_THRESH=inf: the eager protocol" in out.stdout
    assert "data plane: tcp (auto: UCX lists no RDMA transport here (tcp)" in out.stdout
    out = _info(env | {"XDG_RUNTIME_DIR": str(tmp_path), "HOPLITE_DATA_PLANE": "ucx"})
    assert "data plane: ucx (Config.data_plane=ucx (HOPLITE_DATA_PLANE))" in out.stdout, out.stdout
    # on an InfiniBand host (its composed listing, from a stand-in ucx_info), with the user's
    # UCX_TLS: the choice, the setting that wins and why, in both forms
    listing = DATA / "ucx_info_ib.txt"
    env = _fake_ucx_info(tmp_path / "ib", f"cat {listing}") | {"UCX_RNDV_THRESH": "1m"}
    out = _info(env)
    assert out.returncode == 0, out.stderr
    assert f"UCX choice for this host (rdma): UCX_TLS={VERBS_TLS}, UCX_RNDV_THRESH=1m, " in out.stdout
    assert "  why: UCX_RNDV_THRESH=1m is set in the environment: it wins over auto" in out.stdout
    assert "  from: ucx_info -d (" in out.stdout
    assert "data plane: ucx (auto: UCX lists RDMA transports here (rdma))" in out.stdout
    report = json.loads(_info(env, "--json").stdout)
    assert report["data_plane"]["kind"] == "ucx"
    assert report["ucx_tls"] == VERBS_TLS and report["ucx_tls_source"] == "hoplite_gpu default"
    choice = report["ucx_choice"]
    assert choice["case"] == "rdma" and choice["kept"] == {"UCX_RNDV_THRESH": "1m"}
    assert choice["settings"]["UCX_TLS"] == VERBS_TLS and choice["net_devices"] == ["mlx5_0:1"]
    assert choice["source"].startswith("ucx_info -d, cached for this boot")
