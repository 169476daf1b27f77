"""The cluster a plan runs on: GPU datasheet numbers (``specs``) and the
validated description of GPUs, nodes, datacenters and links (``cluster``)."""

from zorse_fx.cluster.cluster import GPU, Cluster, Link
from zorse_fx.cluster.specs import GPUSpec, gpu_spec, known_gpu_types

__all__ = ["Cluster", "GPU", "GPUSpec", "Link", "gpu_spec", "known_gpu_types"]
