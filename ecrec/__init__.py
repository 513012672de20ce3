"""ECRec: erasure-coded fault tolerance for recommendation-model training.

Packages by role, bottom layer first (a module imports only from its own layer or below;
``tests/test_architecture.py`` keeps it so):

- ``ecrec.wire``: the generated gRPC stubs of ``proto/``; ``ecrec.errors``, ``ecrec.faults``: the project's
  exceptions and test-only fault injection
- ``ecrec.coding``: the Reed-Solomon code (pyeclib), its delta kernels, the placement of rows and parity
- ``ecrec.tables``: a table's spec and row format, the server-side optimizers, a server's shard of rows
- ``ecrec.net``: transport and security, the server key's seals, calls to peers, reading the cluster map
- ``ecrec.config``: every process's settings, one typed dataclass each
- ``ecrec.strategies``: fault-tolerance strategies by name (``ecrec``'s erasure code; CPR in ``baselines``)
- ``ecrec.control``: the coordinator (the map, failure detection, promotion, leadership), its stores, leases
- ``ecrec.snapshot``: whole-cluster snapshots in DCP format (the servers' parts and the client's plan)
- ``ecrec.server``: the embedding server process
- ``ecrec.client``: the SDK a training loop uses (``Cluster``, ``EmbeddingBag``, ``EmbeddingBagCollection``)
- ``ecrec.ops``: running and watching a cluster (local clusters, status, metrics, logs, terminal output)
- ``ecrec.cli``, ``ecrec.bench``, ``ecrec.workload``: the ``ecrec-server`` and ``ecrec-bench`` commands
"""

import importlib as _importlib
import importlib.abc as _abc
import importlib.util as _util
import os as _os
import sys as _sys

# gRPC's C core logs every connection event (GOAWAY, reconnects) at INFO on stderr, which buries our own logs
# and breaks --log-format json; errors still show.  A user's GRPC_VERBOSITY wins.
_os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

__version__ = "0.1.0"

#: module paths of earlier releases -> where the module lives now (imports of the old path keep working)
MOVED = {
    "ecrec.local": "ecrec.ops.local",
    "ecrec.model_state": "ecrec.client.model_state",
    "ecrec.status": "ecrec.ops.status",
    "ecrec.metrics": "ecrec.ops.metrics",
    "ecrec.console": "ecrec.ops.console",
    "ecrec.logs": "ecrec.ops.logs",
    "ecrec.courier": "ecrec.client.courier",
    "ecrec.warm_start": "ecrec.client.warm_start",
    "ecrec.coordinator": "ecrec.control.coordinator",
    "ecrec.state_store": "ecrec.control.stores",
    "ecrec.etcd": "ecrec.control.etcd",
    "ecrec.etcd_local": "ecrec.control.etcd_local",
    "ecrec.server_lease": "ecrec.control.etcd_lease",
    "ecrec.codec": "ecrec.coding.codec",
    "ecrec.layout": "ecrec.coding.layout",
    "ecrec.kernels": "ecrec.coding.kernels",
    "ecrec.optim": "ecrec.tables.optim",
    "ecrec.shards": "ecrec.tables.shards",
    "ecrec.security": "ecrec.net.security",
    "ecrec.transport": "ecrec.net.transport",
    "ecrec.seal": "ecrec.net.seal",
    "ecrec.peers": "ecrec.net.peers",
    "ecrec.cluster_map": "ecrec.net.cluster_map",
    "ecrec.snapshot_files": "ecrec.snapshot.files",
    "ecrec.snapshot_part": "ecrec.snapshot.part",
    "ecrec.reserve": "ecrec.server.reserve",
}


class _MovedModules(_abc.MetaPathFinder, _abc.Loader):
    """Answers an old module path of :data:`MOVED` (or a module below it) with the module at its new path: one
    module object under both names, its own ``__spec__`` kept."""

    @staticmethod
    def _target(name: str) -> str | None:
        for old, new in MOVED.items():
            if name == old or name.startswith(old + "."):
                return new + name[len(old):]
        return None

    def find_spec(self, name, path=None, target=None):
        return _util.spec_from_loader(name, self) if name.startswith("ecrec.") and self._target(name) else None

    def create_module(self, spec):
        module = _importlib.import_module(self._target(spec.name))
        spec.loader_state = module.__spec__  # the import system sets the old name's spec on it: put back after
        return module

    def exec_module(self, module):
        module.__spec__ = module.__spec__.loader_state


if not any(type(f).__name__ == "_MovedModules" for f in _sys.meta_path):
    _sys.meta_path.insert(0, _MovedModules())


def forwarding(package: str, modules: tuple[str, ...]):
    """A package's module ``__getattr__`` that finds a name in ``modules`` (imported on first use), as earlier
    releases had those names in one module: ``__getattr__ = forwarding(__name__, (...))``."""
    missing = object()

    def __getattr__(name: str):
        for module in modules:
            value = getattr(_importlib.import_module(module), name, missing)
            if value is not missing:
                return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
