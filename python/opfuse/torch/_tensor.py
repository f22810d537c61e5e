"""torch <-> opfuse tensors through DLPack, without copies."""
from __future__ import annotations

from typing import Optional

import torch

from .. import DType, _C

_TORCH_DTYPES = {
    DType.F32: torch.float32, DType.F16: torch.float16, DType.BF16: torch.bfloat16,
    DType.E4M3: torch.float8_e4m3fn, DType.E5M2: torch.float8_e5m2, DType.E2M1: torch.uint8,
    DType.E8M0: getattr(torch, "float8_e8m0fnu", torch.uint8), DType.I32: torch.int32,
    DType.I64: torch.int64, DType.U8: torch.uint8,
}
_FROM_TORCH = {v: k for k, v in _TORCH_DTYPES.items() if k not in (DType.E2M1, DType.U8)}
_FROM_TORCH[torch.uint8] = DType.U8
# Element types torch exports through DLPack only as raw bytes in some versions.
_RAW = {torch.float8_e4m3fn, torch.float8_e5m2, getattr(torch, "float8_e8m0fnu", None)}


def to_opf(t: torch.Tensor, dtype: Optional[DType] = None, ctx=None) -> "_C.Tensor":
    """A plain opfuse tensor over t's memory: t must be a contiguous CPU or
    CUDA tensor (with ctx: on the context's GPU, and torch's pending work on
    it ordered before the context's stream)."""
    if t.device.type not in ("cpu", "cuda"):
        raise _C.UnsupportedError(f"tensor on {t.device}: opfuse takes CPU and CUDA tensors")
    if not t.is_contiguous():
        raise _C.InvalidArgError("tensor is not contiguous: pass t.contiguous()")
    dt = _FROM_TORCH.get(t.dtype) if dtype is None else DType(dtype)
    if dt is None:
        raise _C.DtypeError(f"torch dtype {t.dtype} has no opfuse dtype")
    t = t.detach()
    if t.dtype in _RAW:
        t = t.view(torch.uint8)
    return _C.from_dlpack(t, int(dt), ctx)


def component(t: "_C.Tensor", comp: int = 0) -> Optional[torch.Tensor]:
    """A torch view of one component of an opfuse tensor (None when absent)."""
    view = t.component(comp, raw=True)
    if view is None:
        return None
    raw = torch.from_dlpack(view)
    spec = t.spec
    if spec["scaling"] == 0 and comp == 0:
        dt = DType(spec["dtype"])
    else:
        from .. import t_layout
        dt = DType(t_layout(t)[comp][0])
    want = _TORCH_DTYPES[dt]
    return raw if raw.dtype == want else raw.view(want)


def to_torch(t: "_C.Tensor") -> torch.Tensor:
    """A torch view of a plain opfuse tensor."""
    return component(t, 0)
