"""The embedding server process (``ecrec-server serve``): its state, its gRPC service, its registration and
lease; a standby's memory reserve.  Only the command line imports it; strategies see a server through
``ecrec.strategies.base.StrategyHost``."""

from ecrec import forwarding

#: where the names of this package's modules are found by their package's name, as earlier releases had them
#: in one module (``from ecrec.server import EmbeddingServer`` keeps working)
__getattr__ = forwarding(__name__, ('ecrec.server.process', 'ecrec.server.state', 'ecrec.server.service', 'ecrec.server.requests', 'ecrec.server.applied', 'ecrec.server.counters'))
