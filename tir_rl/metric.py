"""A metric value that declares how it combines across ranks.

A step's metrics are computed on each rank's share of the batch and must then equal what one
process computes on the whole batch (`distributed.all_reduce_metrics`). That depends on what
a value is: a count adds up, a mean over tokens is weighted by each rank's token count, a
maximum takes the largest. The code that computes a metric knows which; it says so by
returning a `Metric`, a float (everywhere else it is just its value) that carries its
`ReduceOp` and, for means and extremes, the count it is taken over.
"""

from __future__ import annotations

from enum import StrEnum


class ReduceOp(StrEnum):
    """How a scalar is combined across ranks."""

    SUM = "sum"
    MEAN = "mean"
    MAX = "max"
    MIN = "min"


class Metric(float):
    """A float that knows how it combines across ranks.

    Attributes:
        reduce: SUM (counts), MEAN, MAX or MIN.
        over: for MEAN, MAX and MIN, the key (in the same row) of the count the value is
            taken over: a MEAN weighs each rank's value by its count, and a rank whose count
            is 0 contributes nothing. None: every rank holding the key counts the same.
    """

    reduce: ReduceOp
    over: str | None

    def __new__(cls, value: float, reduce: ReduceOp, over: str | None = None) -> Metric:
        """`value`, combined across ranks by `reduce` (weighted by the count `over`)."""
        obj = super().__new__(cls, value)
        obj.reduce = reduce
        obj.over = over
        return obj

    def __reduce__(self) -> tuple[type, tuple[float, ReduceOp, str | None]]:
        return (Metric, (float(self), self.reduce, self.over))  # pickles across ranks

    def __repr__(self) -> str:
        over = f" over {self.over}" if self.over else ""
        return f"Metric({float(self)!r}, {self.reduce.value}{over})"

    @classmethod
    def count(cls, value: float) -> Metric:
        """A count: summed across ranks."""
        return cls(value, ReduceOp.SUM)

    @classmethod
    def mean(cls, value: float, over: str | None) -> Metric:
        """A mean over the units counted by key `over`."""
        return cls(value, ReduceOp.MEAN, over)

    @classmethod
    def max(cls, value: float, over: str | None) -> Metric:
        """A maximum over the units counted by key `over`."""
        return cls(value, ReduceOp.MAX, over)

    @classmethod
    def min(cls, value: float, over: str | None) -> Metric:
        """A minimum over the units counted by key `over`."""
        return cls(value, ReduceOp.MIN, over)
