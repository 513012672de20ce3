"""Running and watching a cluster: local clusters of processes (:mod:`.local`), ``ecrec-server status``
(:mod:`.status`), Prometheus metrics (:mod:`.metrics`), log lines (:mod:`.logs`) and terminal output
(:mod:`.console`)."""
