"""The demo's setup: the lab servers' allocator, scale and ranks around the indexer's shape."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from telemetry.model.indexer.shape import REFERENCE_SHAPE, IndexerShape, shape_arguments


@dataclass(frozen=True)
class DemoSetup:
    """The lab servers' settings: the indexer's shape (default: the user's A/B profile), scaled to fit here."""

    allocator: str
    scale: float
    time_scale: float
    ranks: int = 2
    shape: IndexerShape = REFERENCE_SHAPE

    def serve_args(self) -> list[str]:
        # repr() of a float reads back as the same float: the servers get exactly this setup.
        return ["--ranks", str(self.ranks), "--allocator", self.allocator, *shape_arguments(self.shape),
                "--scale", repr(self.scale), "--time-scale", repr(self.time_scale)]

    def as_dict(self) -> dict[str, Any]:
        return {"allocator": self.allocator, "scale": self.scale, "time_scale": self.time_scale, "ranks": self.ranks,
                **self.shape.as_dict()}


__all__ = ["DemoSetup"]
