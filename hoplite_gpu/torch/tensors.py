"""Tensors as the library's arrays, for the torch.distributed backend: what a tensor may be, which
reductions of which dtypes run natively and how the others run, and the checks of a collective's
tensor lists against its group's size.

Data that only moves (broadcast, gather, scatter, all-to-all, send) travels as its bytes, so any
dtype goes. Reductions run natively on the library's dtypes (:data:`NATIVE`); ``int8`` and
``int16`` are reduced as ``int32`` and narrowed back (the same wrap-around as in their own width);
``bool`` as ``uint8`` with SUM as MAX and PRODUCT as MIN (logical or / and, as NCCL does); complex
tensors as their real and imaginary parts (SUM and AVG). The bitwise operators (BAND, BOR, BXOR) of
integer and ``bool`` tensors have no reduction of the library: they are computed from an
allgather, on every member.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CollectiveArgumentError
from ..ray.common import as_buffer
from ..reduce_ops import ReduceOp

#: torch's reduce operators the library reduces with, by torch's name.
OPS: dict[str, ReduceOp] = {
    "SUM": ReduceOp.SUM,
    "AVG": ReduceOp.AVG,
    "PRODUCT": ReduceOp.PROD,
    "MIN": ReduceOp.MIN,
    "MAX": ReduceOp.MAX,
}
#: The bitwise operators, computed from an allgather: torch's name -> the elementwise function.
BITWISE: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "BAND": torch.bitwise_and,
    "BOR": torch.bitwise_or,
    "BXOR": torch.bitwise_xor,
}
#: dtypes the library reduces as they are.
NATIVE = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64, torch.uint8)
#: dtypes reduced in a wider one, then narrowed back.
WIDENED = {torch.int8: torch.int32, torch.int16: torch.int32}
#: Complex dtypes, reduced as their real and imaginary parts.
COMPLEX = (torch.complex64, torch.complex128)


def op_name(op: Any) -> str:
    """The name of a ``dist.ReduceOp`` (or of its ``RedOpType``): ``"SUM"``, ``"BAND"``..."""
    kind = getattr(op, "op", op)
    return str(getattr(kind, "name", kind))


def argument_error(text: str, argument: str = "tensor") -> CollectiveArgumentError:
    return CollectiveArgumentError(text, argument=argument)


def check(tensor: Any, what: str = "tensor") -> torch.Tensor:
    """``tensor`` if it is a dense, contiguous CPU or CUDA tensor; else a clear error."""
    if not isinstance(tensor, torch.Tensor):
        raise argument_error(f"{what} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise argument_error(f"{what} must be a dense tensor, got layout {tensor.layout}")
    if tensor.device.type not in ("cpu", "cuda"):
        raise argument_error(f"{what} is on {tensor.device}: the hoplite backend takes CPU and CUDA tensors")
    if not tensor.is_contiguous():
        raise argument_error(
            f"{what} is not contiguous (shape {tuple(tensor.shape)}, strides {tensor.stride()}): "
            "the hoplite backend reads and writes tensors in place; pass tensor.contiguous() and "
            "copy the result back"
        )
    return tensor


def single(tensors: Any, what: str) -> torch.Tensor:
    """The one tensor of a list torch passes (``[tensor]``)."""
    if isinstance(tensors, torch.Tensor):
        return check(tensors, what)
    if not isinstance(tensors, list | tuple) or len(tensors) != 1:
        count = len(tensors) if isinstance(tensors, list | tuple) else type(tensors).__name__
        raise argument_error(f"{what}: the hoplite backend takes one tensor per process, got {count}")
    return check(tensors[0], what)


def as_bytes(tensor: torch.Tensor) -> Any:
    """The tensor's bytes as a flat ``uint8`` array sharing its memory (NumPy or CuPy)."""
    return _buffer(tensor.detach().reshape(-1).view(torch.uint8))


@dataclass(slots=True)
class Reduction:
    """How to reduce a tensor with the library: the array to reduce in place, the library's
    operator, and what to do after (copy a widened result back)."""

    array: Any
    op: ReduceOp
    finish: Callable[[], None] | None = None

    def done(self) -> None:
        if self.finish is not None:
            self.finish()


def reduction(tensor: torch.Tensor, op: Any) -> Reduction:
    """How the library reduces ``tensor`` with torch's ``op`` (not a bitwise one); a clear
    error where it cannot."""
    name, dtype = op_name(op), tensor.dtype
    if name not in OPS:
        raise argument_error(f"ReduceOp.{name} is not supported by the hoplite backend", "op")
    ours = OPS[name]
    if dtype in NATIVE:
        return Reduction(_buffer(tensor), ours)
    if dtype in WIDENED:
        wide = tensor.detach().to(WIDENED[dtype])

        def narrow() -> None:
            tensor.detach().copy_(wide)

        return Reduction(_buffer(wide), ours, narrow)
    if dtype == torch.bool:
        if ours is ReduceOp.AVG:
            raise argument_error("ReduceOp.AVG of bool tensors is not defined")
        bits = tensor.detach().view(torch.uint8)
        mapped = {ReduceOp.SUM: ReduceOp.MAX, ReduceOp.PROD: ReduceOp.MIN}.get(ours, ours)
        return Reduction(_buffer(bits), mapped)
    if dtype in COMPLEX:
        if ours not in (ReduceOp.SUM, ReduceOp.AVG):
            raise argument_error(f"ReduceOp.{name} of complex tensors is not defined (SUM and AVG are)")
        return Reduction(_buffer(torch.view_as_real(tensor.detach())), ours)
    raise argument_error(
        f"the hoplite backend cannot reduce {dtype} tensors (it reduces "
        f"{', '.join(str(d).removeprefix('torch.') for d in (*NATIVE, *WIDENED, torch.bool, *COMPLEX))})"
    )


def check_bitwise(tensor: torch.Tensor, op: Any) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The elementwise function of a bitwise ``op`` for ``tensor``'s dtype (integers and bool)."""
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex:
        raise argument_error(
            f"Cannot use ReduceOp.{op_name(op)} with non-integral dtype {tensor.dtype}", "op"
        )
    return BITWISE[op_name(op)]


def is_bitwise(op: Any) -> bool:
    return op_name(op) in BITWISE


def _buffer(tensor: torch.Tensor) -> Any:
    """A NumPy or CuPy array sharing memory with a contiguous tensor."""
    try:
        buf, back = as_buffer(tensor)
    except Exception as exc:  # e.g. bfloat16 CUDA tensors with a CuPy before 14
        raise argument_error(str(exc)) from None
    assert back is None, "a contiguous tensor is used in place"
    return buf


def cuda_ready(tensors: list[torch.Tensor]) -> Callable[[], None]:
    """A function that waits until the work queued on the caller's CUDA streams before this
    call (which writes ``tensors``) is done: the library reads them from another thread."""
    events = []
    for device in {t.device for t in tensors if t.is_cuda}:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        events.append(event)

    def wait() -> None:
        for event in events:
            event.synchronize()

    return wait


def one_list(lists: Any, what: str) -> list[torch.Tensor]:
    """The one tensor list of ``lists`` (torch passes a list per device; this backend takes one)."""
    if not isinstance(lists, list | tuple) or len(lists) != 1:
        raise argument_error(f"{what}: the hoplite backend takes one tensor list per process")
    return list(lists[0])


def per_member(tensors: Any, size: int, what: str) -> list[torch.Tensor]:
    """``tensors`` checked to be one tensor for each of a group's ``size`` members."""
    if not isinstance(tensors, list | tuple) or len(tensors) != size:
        count = len(tensors) if isinstance(tensors, list | tuple) else type(tensors).__name__
        raise argument_error(f"{what} must hold {size} tensors (the group's size), got {count}")
    return [check(t, what) for t in tensors]


def check_whole(
    what: str, whole: tuple[str, torch.Tensor], part: tuple[str, torch.Tensor], size: int
) -> None:
    """Raise unless ``whole`` holds ``size`` parts like ``part`` (each named, for the error)."""
    (big, w), (small, p) = whole, part
    if w.numel() != p.numel() * size or w.dtype != p.dtype:
        raise argument_error(
            f"{what}: {big} has {w.numel()} {w.dtype} elements, not "
            f"{size} x the {small}'s {p.numel()} {p.dtype}"
        )


def split_rows(t: torch.Tensor, sizes: list[int], size: int, what: str) -> list[Any]:
    """``t``'s bytes cut along its first dimension into ``sizes`` rows (equal parts if empty),
    one part for each of a group's ``size`` members."""
    rows = t.shape[0] if t.dim() else 1
    sizes = list(sizes) or ([rows // size] * size if rows % size == 0 else [])
    if len(sizes) != size or sum(sizes) != rows:
        raise argument_error(
            f"all_to_all_single: {what} split sizes {sizes} do not cut its {rows} rows into {size} parts"
        )
    flat = as_bytes(t)
    row_bytes = flat.size // rows if rows else 0
    cuts = [0]
    for n in sizes:
        cuts.append(cuts[-1] + n * row_bytes)
    return [flat[cuts[j] : cuts[j + 1]] for j in range(size)]
