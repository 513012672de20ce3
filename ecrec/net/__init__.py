"""How processes talk: gRPC channels, servers and status mapping (:mod:`.transport`), TLS and the shared token
(:mod:`.security`), the server key's MACs (:mod:`.seal`), calls to peers with deadlines, reports and retries
(:mod:`.peers`), and reading the cluster map (:mod:`.cluster_map`)."""
