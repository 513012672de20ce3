"""The SDK a PyTorch training loop uses: :class:`Cluster` (tables, pulls, pushes, snapshots),
:class:`EmbeddingBag` and :class:`EmbeddingBagCollection` (called like ``torch.nn.EmbeddingBag`` and TorchRec's
collection), and :mod:`.model_state` (the servers' optimizer state in ``torch.optim``'s shape)."""

from ecrec.client.cluster import Cluster, ClusterError, Replacement  # noqa: F401  (the public names)
from ecrec.client.modules import EmbeddingBag, EmbeddingBagCollection  # noqa: F401
