"""The erasure code and the placement: Reed-Solomon through pyeclib (:mod:`.codec`), the delta kernels that
update parity in place (:mod:`.kernels`, backends by name), and the pure function that places rows, stripes and
dense replicas on servers (:mod:`.layout`)."""
