"""Snapshots of a whole cluster in ``torch.distributed.checkpoint`` (DCP) format: the client plans and checks
them (:mod:`.cluster`), every server writes its own part (:mod:`.part`), both through the file format of
:mod:`.files`.

    cluster.save("/backups/step-1000")                    # = ecrec.snapshot.save(cluster, path)
    cluster.load(ecrec.snapshot.latest("/backups"))       # the newest complete one
"""

from ecrec.snapshot.cluster import (  # noqa: F401  (the public names)
    FORMAT, FORMATS, MANIFEST, Periodic, SnapshotError, latest, load, read_manifest, save,
)
