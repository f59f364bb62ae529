"""An import-only stand-in for torchvision, for the SGLang tests (nox -s sglang).

PyPI's torchvision does not load beside the CPU build of torch (``torchvision::nms does
not exist``), yet ``sglang.srt.configs`` imports it, and transformers imports a few of
its names once it sees it. Nothing here runs an image operation: a test that reached
one would fail loudly on the missing attribute.
"""

__version__ = "0.0.0+kvtier.stub"
