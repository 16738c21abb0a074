"""Which UCX transports and protocol thresholds a node runs with, chosen from what UCX lists on
this host (the text of ``ucx_info -d``) and from the user's environment.

Pure: it reads no file, runs nothing and imports nothing of UCX, so it is tested on recorded and
composed listings (``tests/data/ucx_info_*.txt``). :mod:`.probe` reads the host's listing;
:func:`.settings.apply_ucx_defaults` applies the choice before ``ucxx`` loads.

The cases:

- **TCP only** (no verbs, no CUDA transports, or no readable listing): ``UCX_TLS=tcp`` and the eager
  protocol for every size (``UCX_RNDV_THRESH=inf``), the measured defaults of
  ``settings.UCX_DEFAULTS`` unchanged.
- **RDMA** (InfiniBand or RoCE: ``rc_*``, ``dc_mlx5``, ``ud_*`` listed): those transports plus
  ``tcp``, and UCX's own rendezvous threshold (``auto``), so large messages move zero-copy.
- **GPU** (``cuda_copy``, ``cuda_ipc`` listed): both added where device chunks go to UCX as they
  are (``HOPLITE_UCX_CUDA=1``; staging through pinned host buffers measured faster on an H100),
  ``gdr_copy`` too where RDMA transports are chosen (GPUDirect RDMA).

UCX's same-host transports (``posix``, ``sysv``, ``cma``, ...) stay off in every case, and a
``UCX_*`` variable the user set always wins over the choice.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ...errors import InvalidArgumentError

#: RDMA transports in the order ``UCX_TLS`` lists them (accelerated mlx5 ones first).
VERBS_TRANSPORTS = ("rc_mlx5", "dc_mlx5", "ud_mlx5", "rc_verbs", "ud_verbs")
#: CUDA transports added wherever UCX lists them.
GPU_TRANSPORTS = ("cuda_copy", "cuda_ipc")
#: UCX's same-host transports, left out: see :data:`SAME_HOST_REASON`.
SAME_HOST_TRANSPORTS = ("posix", "sysv", "cma", "xpmem", "knem")
#: Why the same-host transports stay off (the fault soak's finding, bench/pages/defaults.md#ucx-defaults).
SAME_HOST_REASON = (
    "with UCX_TLS=tcp,sm the randomized SIGKILL soak wedged a node (seed 3, run 8: every new "
    "endpoint to it timed out for the rest of its life) where tcp alone ran 60 runs clean; "
    "same-host bytes take hoplite_gpu's own shared-memory segments and CUDA IPC instead "
    "(bench/pages/defaults.md#ucx-defaults)"
)

#: ``UCX_TLS`` names that stand for several transports (UCX's aliases, as its FAQ lists them).
_ALIASES: dict[str, tuple[str, ...]] = {
    "all": (*VERBS_TRANSPORTS, *GPU_TRANSPORTS, "gdr_copy", "tcp", *SAME_HOST_TRANSPORTS),
    "ib": VERBS_TRANSPORTS,
    "rc": ("rc_mlx5", "rc_verbs"),
    "rc_x": ("rc_mlx5",),
    "rc_v": ("rc_verbs",),
    "ud": ("ud_mlx5", "ud_verbs"),
    "ud_x": ("ud_mlx5",),
    "ud_v": ("ud_verbs",),
    "dc": ("dc_mlx5",),
    "dc_x": ("dc_mlx5",),
    "cuda": (*GPU_TRANSPORTS, "gdr_copy"),
    "sm": SAME_HOST_TRANSPORTS,
    "shm": SAME_HOST_TRANSPORTS,
    "mm": ("posix", "sysv", "xpmem"),
}

_FIELD = re.compile(r"^#\s*(Memory domain|Component|Transport|Device|Type):\s*(.*?)\s*$")


@dataclass(frozen=True)
class Resource:
    """One transport on one device, as ``ucx_info -d`` lists it.

    Attributes:
        transport: UCX's name of the transport (``tcp``, ``rc_mlx5``, ``cuda_copy``, ...).
        device: The device it runs on (``eth0``, ``mlx5_0:1``, ``memory``, ``cuda``).
        memory_domain: The memory domain that lists it (``tcp``, ``mlx5_0``, ``cuda_cpy``).
        kind: The listing's ``Type`` (``network``, ``intra-node``, ``accelerator``,
            ``loopback``); "" where the listing gives none.
    """

    transport: str
    device: str
    memory_domain: str
    kind: str = ""


def parse_listing(text: str) -> tuple[Resource, ...]:
    """The transports of a ``ucx_info -d`` listing, in its order.

    Raises:
        InvalidArgumentError: ``text`` names no transport, or a transport without its device (a
            listing that is not one, or was cut off).
    """
    found: list[Resource] = []
    domain = transport = device = ""
    for line in text.splitlines():
        field = _FIELD.match(line.strip())
        if field is None:
            continue
        key, value = field.groups()
        if key in ("Memory domain", "Transport") and transport and not device:
            raise InvalidArgumentError(f"transport {transport!r} lists no device", argument="listing")
        if key == "Memory domain":
            domain, transport = value, ""
        elif key == "Transport":
            transport, device = value, ""
        elif key == "Device" and transport:
            device = value
            found.append(Resource(transport, device, domain))
        elif key == "Type" and found and found[-1].transport == transport and device:
            found[-1] = Resource(transport, device, domain, value)
    if transport and not device:
        raise InvalidArgumentError(f"transport {transport!r} lists no device", argument="listing")
    if not found:
        raise InvalidArgumentError("the listing names no UCX transport", argument="listing")
    return tuple(found)


@dataclass(frozen=True)
class UcxChoice:
    """The UCX settings chosen for this host, and why.

    Attributes:
        case: What the listing shows: ``tcp``, ``rdma``, ``gpu`` or ``rdma+gpu``.
        settings: ``(variable, value)`` pairs to write into the environment: the choice, less the
            variables the user set (but for ``cuda_copy`` added to their ``UCX_TLS`` with
            ``HOPLITE_UCX_CUDA=1``).
        kept: ``(variable, value)`` pairs the user set that override the choice.
        reasons: One line per decision.
        net_devices: The RDMA devices of the chosen transports (``mlx5_0:1``), which a node limited
            to one network interface (UCX's ``NET_DEVICES``) must name too.
        source: Where the listing came from (``ucx_info -d``, cached, ...), for ``hoplite-gpu info``.
    """

    case: str
    settings: tuple[tuple[str, str], ...]
    kept: tuple[tuple[str, str], ...]
    reasons: tuple[str, ...]
    net_devices: tuple[str, ...] = ()
    source: str = ""

    def effective(self) -> dict[str, str]:
        """The value UCX runs with for each variable of the choice: the user's, else the choice's."""
        merged = dict(self.kept) | dict(self.settings)
        first = [k for k in ("UCX_TLS", "UCX_RNDV_THRESH") if k in merged]
        return {k: merged[k] for k in [*first, *(k for k in merged if k not in first)]}

    def to_dict(self) -> dict[str, Any]:
        """The choice as plain types (``hoplite-gpu info --json``)."""
        return {
            "case": self.case,
            "settings": dict(self.settings),
            "kept": dict(self.kept),
            "effective": self.effective(),
            "reasons": list(self.reasons),
            "net_devices": list(self.net_devices),
            "source": self.source,
        }


def with_cuda_copy(tls: str) -> str:
    """``tls`` listing ``cuda_copy`` (kept as it is where it already does, or where it is ``all``
    or an exclusion list, ``^...``)."""
    names = [t.strip() for t in tls.split(",") if t.strip()]
    if not names or names[0].startswith("^") or {"all", "cuda", "cuda_copy"} & set(names):
        return tls
    return ",".join([*names, "cuda_copy"])


def enabled(tls: str, transport: str) -> bool:
    """Whether a ``UCX_TLS`` value lets UCX use ``transport`` (names, aliases, ``all``, ``^...``)."""
    names = [t.strip().split(":")[0] for t in tls.split(",") if t.strip()]
    if names and names[0].startswith("^"):
        names[0] = names[0][1:]
        return not any(transport == n or transport in _ALIASES.get(n, ()) for n in names)
    return any(transport == n or transport in _ALIASES.get(n, ()) for n in names)


def choose_ucx(
    listing: str | None,
    environ: Mapping[str, str],
    defaults: Mapping[str, str],
    *,
    problem: str = "",
    rdma_devices: Sequence[str] = (),
    source: str = "",
) -> UcxChoice:
    """Choose the UCX settings for a host from its listing and the user's environment.

    Never raises on a bad listing: a missing or unreadable one gives the TCP-only choice, with a
    reason that says why.

    Args:
        listing: The text of ``ucx_info -d`` on this host; None where it could not be had.
        environ: The environment (``os.environ``): its ``UCX_*`` variables win over the choice,
            ``HOPLITE_UCX_CUDA=1`` adds ``cuda_copy``.
        defaults: The TCP-only host's settings (``settings.UCX_DEFAULTS``); the other cases change
            ``UCX_TLS`` and ``UCX_RNDV_THRESH`` on top of them.
        problem: Why ``listing`` is None (shown as the reason for TCP only).
        rdma_devices: RDMA devices the kernel shows (``/sys/class/infiniband``), to say when UCX
            lists none of them.
        source: Where the listing came from, carried into :attr:`UcxChoice.source`.
    """
    reasons: list[str] = []
    resources: tuple[Resource, ...] = ()
    if listing is None:
        reasons.append(f"TCP only: no UCX listing ({problem or 'ucx_info gave none'})")
    else:
        try:
            resources = parse_listing(listing)
        except InvalidArgumentError as exc:
            reasons.append(f"TCP only: the UCX listing is unreadable ({exc})")
    listed = {r.transport for r in resources}
    verbs = [t for t in VERBS_TRANSPORTS if t in listed]
    gpu = [t for t in GPU_TRANSPORTS if t in listed]
    tls = [*verbs, "tcp"]
    if verbs:
        devices = sorted({r.device for r in resources if r.transport in verbs})
        reasons.append(
            f"RDMA: {', '.join(verbs)} on {', '.join(devices)} listed: used, with tcp for peers "
            "without RDMA and for connecting"
        )
    elif resources:
        reasons.append("TCP: UCX lists no RDMA transport (rc, dc, ud) on this host")
    if not verbs and rdma_devices:
        reasons.append(
            f"RDMA devices {', '.join(rdma_devices)} are present but this UCX lists no verbs "
            "transport (the libucx wheels are built without verbs): with a UCX built with them "
            "(RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=true) they would be chosen"
        )
    if resources and "tcp" not in listed:
        reasons.append("UCX lists no tcp transport: tcp kept (the data-plane listener needs it)")
    cuda_env = environ.get("HOPLITE_UCX_CUDA", "") == "1"
    if gpu and cuda_env:
        tls += gpu
        reasons.append(
            f"GPU: {', '.join(gpu)} listed and HOPLITE_UCX_CUDA=1: added, device chunks go to UCX "
            "as they are; same-host device reads take hoplite_gpu's own CUDA IPC"
        )
    elif gpu:
        reasons.append(
            f"GPU: {', '.join(gpu)} listed: left out, device chunks go through pinned host buffers, "
            "which measured faster on an H100 (bench/pages/gpu.md#gpu-benchgpupy; HOPLITE_UCX_CUDA=1 "
            "adds them), and same-host device reads take hoplite_gpu's own CUDA IPC"
        )
    if "gdr_copy" in listed:
        if verbs and gpu and cuda_env:
            tls.append("gdr_copy")
            reasons.append("gdr_copy listed with RDMA and HOPLITE_UCX_CUDA=1: added (GPUDirect RDMA copies)")
        else:
            reasons.append("gdr_copy listed: left out, it serves device chunks over RDMA and there are none")
    same_host = [t for t in SAME_HOST_TRANSPORTS if t in listed]
    if same_host:
        reasons.append(f"{', '.join(same_host)} listed: left out: {SAME_HOST_REASON}")
    case = "+".join(c for c, on in (("rdma", verbs), ("gpu", gpu)) if on) or "tcp"

    chosen = dict(defaults)
    chosen["UCX_TLS"] = ",".join(tls)
    if cuda_env and "cuda_copy" not in tls:
        chosen["UCX_TLS"] = with_cuda_copy(chosen["UCX_TLS"])
        reasons.append(
            "HOPLITE_UCX_CUDA=1: cuda_copy added (ucxx refuses device buffers without it)"
            + ("; this UCX does not list it: UCX warns, device chunks fail" if resources else "")
        )
    user_tls = environ.get("UCX_TLS")
    tls_in_effect = user_tls if user_tls else chosen["UCX_TLS"]
    zero_copy = [t for t in verbs if enabled(tls_in_effect, t)]
    if zero_copy:
        chosen["UCX_RNDV_THRESH"] = "auto"
        reasons.append(
            "UCX_RNDV_THRESH=auto (UCX's own): large messages take the rendezvous protocol, which "
            "moves them zero-copy over RDMA"
        )
    elif "UCX_RNDV_THRESH" in chosen:
        reasons.append(
            f"UCX_RNDV_THRESH={chosen['UCX_RNDV_THRESH']}: the eager protocol, as every byte between "
            "hosts crosses TCP, where rendezvous moved 0.5-1 GB/s and eager 2-5 "
            "(bench/pages/defaults.md#ucx-defaults)"
        )

    settings: dict[str, str] = {}
    kept: dict[str, str] = {}
    agreeing = []
    for name, value in chosen.items():
        if name not in environ:
            settings[name] = value
            continue
        kept[name] = environ[name]
        if environ[name] != value:
            reasons.append(f"{name}={environ[name]} is set in the environment: it wins over {value}")
        else:
            agreeing.append(name)
    if agreeing:
        reasons.append(f"{', '.join(agreeing)} set in the environment as chosen: kept")
    if user_tls is not None and cuda_env and with_cuda_copy(user_tls) != user_tls:
        settings["UCX_TLS"] = with_cuda_copy(user_tls)
        reasons.append(
            f"HOPLITE_UCX_CUDA=1: cuda_copy added to UCX_TLS={user_tls} from the environment "
            "(ucxx refuses device buffers without it)"
        )
    net_devices: tuple[str, ...] = ()
    if zero_copy:
        net_devices = tuple(sorted({r.device for r in resources if r.transport in zero_copy}))
    return UcxChoice(
        case=case,
        settings=tuple(settings.items()),
        kept=tuple(kept.items()),
        reasons=tuple(reasons),
        net_devices=net_devices,
        source=source,
    )
