"""The embedding server process (``ecrec-server serve``): its state, its gRPC service, its registration and
lease; a standby's memory reserve.  Only the command line imports it; strategies see a server through
``ecrec.strategies.base.StrategyHost``."""


#: where the names of this package's modules are found by their package's name, as earlier releases had them
#: in one module (``from ecrec.server import EmbeddingServer`` keeps working)
_FORWARD = ('ecrec.server.process', 'ecrec.server.state', 'ecrec.server.service', 'ecrec.server.requests', 'ecrec.server.applied', 'ecrec.server.counters')


def __getattr__(name: str):
    import importlib

    for module in _FORWARD:
        value = getattr(importlib.import_module(module), name, _MISSING)
        if value is not _MISSING:
            return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_MISSING = object()
