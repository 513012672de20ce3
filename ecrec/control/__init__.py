"""The control plane: the coordinator (:mod:`.coordinator` and its parts), where it keeps its state
(:mod:`.stores`: a file, or etcd), the servers' leases (:mod:`.lease`), a small etcd v3 client (:mod:`.etcd`)
and a local etcd cluster for ``ecrec-server local --store etcd`` and the tests (:mod:`.etcd_local`)."""
