"""The host side of each GPU, for offload ([C-offload] in ``solve/objective.py``):
its link to host memory, and the host memory and memory bandwidth of its node.

A cluster file gives them per node (``zorse_fx.cluster.cluster``)::

    nodes:
      - name: node0
        gpus: [{type: V100-16GB, count: 8}]
        host_memory_GiB: 488                   # needed for offload on this node
        host_memory_bandwidth_GBps: 204.8      # optional, default below
        host_link: {bandwidth_GBps: 12}        # optional: per GPU, per direction

Without ``host_memory_GiB`` a node offers no host memory and the planner
never offloads there (a machine's RAM is not something to guess: the OS, the
data loader and pinned buffers share it). The defaults, each from a public
source (copied from ``reference/gpu_specs.csv`` and the standards it cites):

* host link: PCIe x16 per direction, by the GPU's generation of PCIe
  (``PCIE_X16_BYTES_PER_S``: the PCI-SIG line rates of 8 / 16 / 32 GT/s per
  lane with 128b/130b encoding, x16 lanes: 15.75 / 31.5 / 63.0 GB/s; the
  reference table's ``host_link_bidir_GBps`` 32 / 64 / 128 are both
  directions, rounded), and the generation by GPU class
  (``ARCH_PCIE_GENERATION``, the reference table's ``host_link`` column: every
  Pascal, Volta and Turing row is Gen3 x16, Ampere, Ada and CDNA2 Gen4,
  Hopper, Blackwell and CDNA3 Gen5). A cluster-declared GPU type has no class:
  Gen3, the slowest. These are line rates: pinned copies reach less (by how
  much is not measured here), so an offloaded plan's transfers are priced
  optimistically -- give ``host_link`` where measured.
* host memory bandwidth: ``DEFAULT_HOST_MEMORY_BANDWIDTH_BYTES_PER_S`` =
  204.8 GB/s, one socket of eight DDR4-3200 channels (JEDEC DDR4-3200:
  3200 MT/s x 8 B = 25.6 GB/s per channel; AMD EPYC 7002/7003 have eight),
  shared by the node's GPUs: the CPU optimizer step is priced as memory
  bound at it (an upper bound on the speed of ``torch.optim.AdamW`` on a CPU;
  bench/README.md "Offload" says what was and was not measured).
"""

from __future__ import annotations

__all__ = ["PCIE_X16_BYTES_PER_S", "ARCH_PCIE_GENERATION", "DEFAULT_HOST_MEMORY_BANDWIDTH_BYTES_PER_S",
           "default_host_link_bytes_per_s"]

#: PCIe generation -> x16 bandwidth per direction, bytes/s (PCI-SIG line rate x 128/130 x 16 lanes / 8 bits).
PCIE_X16_BYTES_PER_S = {3: 8e9 * 128 / 130 * 16 / 8, 4: 16e9 * 128 / 130 * 16 / 8, 5: 32e9 * 128 / 130 * 16 / 8}
#: GPU class (``gpu_specs.csv`` ``arch``) -> PCIe generation of its host link (reference/gpu_specs.csv ``host_link``).
ARCH_PCIE_GENERATION = {
    "pascal": 3, "volta": 3, "turing": 3,
    "ampere-ga100": 4, "ampere-ga10x": 4, "ampere-ga10x-geforce": 4, "ada": 4, "ada-geforce": 4, "cdna2": 4,
    "hopper": 5, "blackwell": 5, "cdna3": 5,
}
#: One socket of 8 DDR4-3200 channels (JEDEC: 25.6 GB/s each), bytes/s.
DEFAULT_HOST_MEMORY_BANDWIDTH_BYTES_PER_S = 8 * 3200e6 * 8


def default_host_link_bytes_per_s(arch: str | None) -> float:
    """PCIe x16 bandwidth per direction (bytes/s) of a GPU of class ``arch``
    (None or unknown: Gen3, the slowest of the table)."""
    return PCIE_X16_BYTES_PER_S[ARCH_PCIE_GENERATION.get(arch or "", 3)]
