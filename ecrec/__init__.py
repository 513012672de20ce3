"""ECRec: erasure-coded fault tolerance for recommendation-model training.

Embedding tables live on gRPC embedding servers (``ecrec.server``) coordinated by
``ecrec.coordinator``; a PyTorch training loop talks to them through
``ecrec.client``.  Fault-tolerance strategies (``ecrec.strategies`` and the CPR
baselines in ``baselines``) plug into the servers by name.
"""

import os as _os

# gRPC's C core logs every connection event (GOAWAY, reconnects) at INFO on stderr, which buries our own logs
# and breaks --log-format json; errors still show.  A user's GRPC_VERBOSITY wins.
_os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

__version__ = "0.1.0"
