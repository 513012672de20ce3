"""Snapshots of a whole cluster in ``torch.distributed.checkpoint`` (DCP) format: the client plans and checks
them (:mod:`.cluster`), every server writes its own part (:mod:`.part`), both through the file format of
:mod:`.files`.

    cluster.save("/backups/step-1000")                    # = ecrec.snapshot.save(cluster, path)
    cluster.load(ecrec.snapshot.latest("/backups"))       # the newest complete one
"""

from ecrec import forwarding
from ecrec.snapshot.cluster import (  # noqa: F401  (the public names)
    FORMAT, FORMATS, MANIFEST, Periodic, SnapshotError, latest, load, read_manifest, save,
)


#: where the names of this package's modules are found by their package's name, as earlier releases had them
#: in one module (every name of the former ``ecrec/snapshot.py``)
__getattr__ = forwarding(__name__, ('ecrec.snapshot.cluster',))
