"""What one graph input must be, checked before every run (cheaply for the same tensor again)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..codec.tensors import dtype_from_name
from ..errors import InvalidRequestError


@dataclass(frozen=True, slots=True)
class ArgCheck:
    """What one graph input must be: a tensor of this dtype and rank with these fixed sizes, or a scalar."""

    kind: str  # "tensor", "scalar" or "any"
    dtype: torch.dtype | None = None
    rank: int = 0
    fixed: tuple = ()  # ((dim, size), ...): the sizes that are not symbolic
    shape: tuple | None = None  # every size, when none is symbolic (one comparison checks them all)

    def check(self, i: int, v) -> None:
        if self.kind == "tensor" and type(v) is torch.Tensor and v.dtype == self.dtype and (
                v.shape == self.shape if self.shape is not None else
                len(v.shape) == self.rank and all(v.shape[d] == n for d, n in self.fixed)):
            return  # the common case, in as few steps as possible
        if self.kind == "any":
            return
        if self.kind == "scalar":
            if isinstance(v, torch.Tensor):
                raise InvalidRequestError(f"argument {i} must be a scalar")
            return
        if not isinstance(v, torch.Tensor):
            raise InvalidRequestError(f"argument {i} must be a tensor")
        shape = v.shape
        if v.dtype != self.dtype or len(shape) != self.rank or any(shape[d] != n for d, n in self.fixed):
            raise InvalidRequestError(f"argument {i}: expected {self.dtype} of rank {self.rank} with sizes "
                                      f"{dict(self.fixed)}, got {v.dtype}{list(shape)}")

    @classmethod
    def of(cls, meta: dict) -> ArgCheck:
        """The check for a placeholder of the graph document."""
        if meta.get("kind") == "tensor":
            shape = list(meta.get("shape") or [])
            fixed = tuple((i, d) for i, d in enumerate(shape) if isinstance(d, int))
            full = tuple(shape) if len(fixed) == len(shape) else None
            return cls("tensor", dtype_from_name(str(meta.get("dtype"))), len(shape), fixed, full)
        return cls("scalar" if meta.get("kind") == "scalar" else "any")
