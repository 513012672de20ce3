"""The SDK a PyTorch training loop uses: :class:`Cluster` (tables, pulls, pushes, snapshots),
:class:`EmbeddingBag` and :class:`EmbeddingBagCollection` (called like ``torch.nn.EmbeddingBag`` and TorchRec's
collection), and :mod:`.model_state` (the servers' optimizer state in ``torch.optim``'s shape)."""

from ecrec import forwarding
from ecrec.client.cluster import Cluster, ClusterDataLoss, ClusterError, Replacement  # noqa: F401  (the public names)
from ecrec.client.steps import StepPartlyApplied  # noqa: F401
from ecrec.client.modules import EmbeddingBag, EmbeddingBagCollection  # noqa: F401


#: where the names of this package's modules are found by their package's name, as earlier releases had them
#: in one module (``ecrec.client.READ_PAYLOAD_BYTES`` keeps working)
__getattr__ = forwarding(__name__, ('ecrec.client.cluster', 'ecrec.client.modules', 'ecrec.client.rows'))
