"""The SDK a PyTorch training loop uses: :class:`Cluster` (tables, pulls, pushes, snapshots),
:class:`EmbeddingBag` and :class:`EmbeddingBagCollection` (called like ``torch.nn.EmbeddingBag`` and TorchRec's
collection), and :mod:`.model_state` (the servers' optimizer state in ``torch.optim``'s shape)."""

from ecrec.client.cluster import Cluster, ClusterError, Replacement  # noqa: F401  (the public names)
from ecrec.client.modules import EmbeddingBag, EmbeddingBagCollection  # noqa: F401


#: where the names of this package's modules are found by their package's name, as earlier releases had them
#: in one module (``ecrec.client.READ_PAYLOAD_BYTES`` keeps working)
_FORWARD = ('ecrec.client.cluster', 'ecrec.client.modules', 'ecrec.client.rows')


def __getattr__(name: str):
    import importlib

    for module in _FORWARD:
        value = getattr(importlib.import_module(module), name, _MISSING)
        if value is not _MISSING:
            return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_MISSING = object()
