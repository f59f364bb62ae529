"""GPU <-> primary copies: the worker, its copy engines and their layout."""

from kvtier.worker.engines import (
    COMPLETED,
    CopyEngine,
    CopyEvent,
    CpuCopyEngine,
    ThreadedCopyEngine,
)
from kvtier.worker.layout import ColumnLayout, PageMap, PageRun
from kvtier.worker.worker import GroupSplit, OffloadingWorker

__all__ = [
    "COMPLETED",
    "ColumnLayout",
    "CopyEngine",
    "CopyEvent",
    "CpuCopyEngine",
    "GroupSplit",
    "OffloadingWorker",
    "PageMap",
    "PageRun",
    "ThreadedCopyEngine",
]
