"""ECRec: erasure-coded fault tolerance for recommendation-model training.

Embedding tables live on gRPC embedding servers (``ecrec.server``) coordinated by
``ecrec.coordinator``; a PyTorch training loop talks to them through
``ecrec.client``.  Fault-tolerance strategies (``ecrec.strategies`` and the CPR
baselines in ``baselines``) plug into the servers by name.
"""

__version__ = "0.1.0"
