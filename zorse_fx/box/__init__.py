"""The box: a heterogeneous cluster emulated on one Linux machine with the kernel's own tools
(network namespaces, veth, bridges, htb, cgroups), so that plans meet real processes over real,
shaped links ([Note: the box] in ``box.py``).

``layout`` decides every number from a cluster file (``plan_box``: quotas, rates, delays, the scale
factor), ``net`` and ``cgroups`` build it, ``state`` records it in ``/run/zorse_box/<id>.json``,
``delay_line`` makes latency where the kernel has no netem, ``rank_enter`` puts a torchrun worker
into its rank's cgroup, and ``Box`` ties them together.
"""

from .box import Box, check_machine, gc, netem_available, remove_box
from .layout import BoxLayout, BoxOptions, plan_box

__all__ = ["Box", "BoxLayout", "BoxOptions", "plan_box", "check_machine", "gc", "netem_available", "remove_box"]
