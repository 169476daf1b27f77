"""The box's network, built with ``ip`` and ``tc`` from a ``BoxLayout`` ([Note: the box's network]).

Everything lives in the box's own namespaces, created directly there (``ip link add ... netns``), so
the machine's root namespace never holds a box interface and removing the namespaces removes every
veth, bridge, IFB, TUN device and qdisc with them.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ..errors import BoxSetupError
from .layout import BoxLayout, NodeLayout

__all__ = ["NETNS_DIR", "region_subnets", "build", "add_namespaces", "delete_namespace", "netns_pids", "list_namespaces",
           "route_through_delay_line", "shaping", "TcClass", "NODE_IF", "TUN_IN", "TUN_OUT", "IFB", "run"]

NETNS_DIR = Path("/run/netns")
#: The node's interface (in its namespace); its peer in the router namespace is ``n<k>`` (k: the node's index).
NODE_IF = "eth0"
#: The delay line's TUN devices and the IFB device of the shared links, in the router namespace.
TUN_IN, TUN_OUT, IFB = "dl-in", "dl-out", "ifb0"
#: Routing table of the packets the router hands to the delay line.
_DELAY_TABLE = 100
#: Rate of traffic no link of the cluster shapes (to the router itself, ARP), bits/s.
_UNSHAPED_BITS = 10_000_000_000
#: htb minor of shared link i's class on a node's eth0 or the router's port to a node: 0x100 + i (the
#: per-peer classes are 0x10 + j).
_CAP_MINOR = 0x100


# [Note: the box's network]
# One namespace per node and one router namespace, zbox-<id>. The router holds one bridge per
# region (datacenter), br<r> with 10.<r+1>.0.1/16; node k's veth pair runs from eth0 in its namespace
# (10.<r+1>.x.y/32) to n<k> on its region's bridge. Nodes route the box's subnets (nothing else: no
# DNS server or internet is reachable, and trying fails at once) through their region's router address, so every packet between two nodes -- of one region too -- is forwarded by the
# router (redirects off): the one place where all flows meet, which the latency and the shared links
# need. Shaping, all on egress, so nothing needs an ingress policer:
#   * a node's NIC (nic_bytes_per_s) and its per-pair links: htb on its eth0, a root class at the NIC
#     rate with one child per peer node (ceil = that pair's link rate, rate = the NIC rate / peers, so
#     peers share the NIC max-min fairly), a u32 filter per peer address; without a NIC the root is
#     the sum of the pair rates. Incoming traffic shares the NIC rate again: htb on the router's n<k>.
#   * a shared link (the WAN between regions): the router redirects every packet entering it from a
#     node (ingress on each n<k>, mirred) through ifb0, whose htb has one class per shared link and
#     direction (u32 on source and destination addresses), the rest unshaped. A direction whose
#     sending side is one node (a per-node cap, as a cloud caps an instance's traffic to another
#     region) is a class on that node's eth0 between the root and the peer classes of its receiving
#     side; one whose receiving side is one node, a class on the router's n<k> (u32 on the source).
#     So a flow may cross one shared link at each of the three places (SharedDirection.at).
#   * latency: with netem, a netem leaf under each per-peer class; without it, policy routing hands
#     every packet from a bridge to the delay line's TUN device dl-in (table 100), and what it writes
#     into dl-out is routed on to the destination ([Note: latency without netem] in box.py).
# Names are short because interface names hold 15 characters.


def run(argv: list[str], *, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """Run a system command; ``BoxSetupError`` naming it and its stderr when it fails (``check``)."""
    try:
        r = subprocess.run(argv, input=input, capture_output=True, text=True)
    except FileNotFoundError:
        raise BoxSetupError(f"`{argv[0]}` is not installed; the box needs iproute2 (ip, tc) and util-linux "
                            f"(nsenter, unshare)") from None
    if check and r.returncode:
        what = " ".join(argv) + (f" <<< {input.strip()!r}" if input and len(input) < 400 else "")
        raise BoxSetupError(f"`{what}` failed (exit {r.returncode}): {r.stderr.strip() or r.stdout.strip()}")
    return r


def _ip(netns: str | None, lines: list[str]) -> None:
    run(["ip", *(["-n", netns] if netns else []), "-batch", "-"], input="\n".join(lines) + "\n")


def _tc(netns: str, lines: list[str]) -> None:
    if lines:
        run(["tc", "-n", netns, "-batch", "-"], input="\n".join(lines) + "\n")


def _sysctl(netns: str, settings: dict[str, object]) -> None:
    run(["nsenter", f"--net={NETNS_DIR / netns}", "--", "sysctl", "-qw",
         *(f"{k}={v}" for k, v in settings.items())])


def _bits(bytes_per_s: float) -> str:
    return f"{max(8, round(bytes_per_s * 8))}bit"


def region_subnets(layout: BoxLayout) -> list[str]:
    """The box's subnets, one /16 per region (10.<r+1>.0.0/16); nothing else is routed to the router, so a
    packet for an address outside the box (the machine's DNS server) fails at once."""
    return [f"10.{r + 1}.0.0/16" for r in range(len(_regions(layout)))]


def router_address(layout: BoxLayout, node: NodeLayout) -> str:
    """The router's address on ``node``'s region bridge."""
    return ".".join(node.address.split(".")[:2] + ["0", "1"])


def _regions(layout: BoxLayout) -> list[str]:
    return list(dict.fromkeys(n.region for n in layout.nodes))


def add_namespaces(layout: BoxLayout) -> None:
    """Create the router's and every node's namespace, with the sysctls that must precede their interfaces."""
    _ip(None, [f"netns add {layout.router_netns}"] + [f"netns add {n.netns}" for n in layout.nodes])
    off6 = {"net.ipv6.conf.all.disable_ipv6": 1, "net.ipv6.conf.default.disable_ipv6": 1}
    _sysctl(layout.router_netns, {
        "net.ipv4.ip_forward": 1, **off6,
        "net.ipv4.conf.all.rp_filter": 0, "net.ipv4.conf.default.rp_filter": 0,  # dl-out carries nodes' sources
        "net.ipv4.conf.all.send_redirects": 0, "net.ipv4.conf.default.send_redirects": 0,  # keep flows on the router
    })
    for n in layout.nodes:
        _sysctl(n.netns, {**off6, "net.ipv4.conf.all.accept_redirects": 0,
                          "net.ipv4.conf.default.accept_redirects": 0, **dict(layout.tcp_sysctls)})


def build(layout: BoxLayout, *, netem: bool) -> None:
    """Bridges, veths, addresses, routes and qdiscs of ``layout`` (namespaces made by ``add_namespaces``);
    ``netem``: the per-pair delays as netem leaves (else the caller starts the delay line)."""
    r_ns = layout.router_netns
    regions = _regions(layout)
    lines = ["link set lo up"]
    for r, region in enumerate(regions):
        lines += [f"link add br{r} type bridge", f"addr add 10.{r + 1}.0.1/16 dev br{r}", f"link set br{r} up"]
    _ip(r_ns, lines)
    _ip(None, [f"link add {NODE_IF} netns {n.netns} type veth peer name n{k} netns {r_ns}"
               for k, n in enumerate(layout.nodes)])
    _ip(r_ns, [f"link set n{k} master br{regions.index(n.region)} up" for k, n in enumerate(layout.nodes)])
    for n in layout.nodes:
        gw = router_address(layout, n)
        _ip(n.netns, ["link set lo up", f"addr add {n.address}/32 dev {NODE_IF}", f"link set {NODE_IF} up",
                      f"route add {gw}/32 dev {NODE_IF} scope link",
                      *(f"route add {net} via {gw} dev {NODE_IF}" for net in region_subnets(layout))])
        _tc(n.netns, _node_egress(layout, n, netem=netem))
    router_tc = []
    address = {n.name: n.address for n in layout.nodes}
    for k, n in enumerate(layout.nodes):
        caps = [(i, d) for i, d in enumerate(layout.shared) if d.at == f"ingress:{n.name}"]
        if n.nic_bytes_per_s is not None:  # what the node receives shares its NIC too
            nic = _bits(n.nic_bytes_per_s)
            router_tc += [f"qdisc add dev n{k} root handle 1: htb default {3 if caps else 1}",
                          f"class add dev n{k} parent 1: classid 1:1 htb rate {nic} ceil {nic} quantum 1514"]
            if caps:  # (1:1 then has children: the rest of the NIC's traffic gets a leaf of its own)
                router_tc.append(f"class add dev n{k} parent 1:1 classid 1:3 htb rate {nic} ceil {nic} quantum 1514")
        elif caps:
            router_tc += [f"qdisc add dev n{k} root handle 1: htb default 2",
                          f"class add dev n{k} parent 1: classid 1:2 htb rate {_UNSHAPED_BITS}bit quantum 1514"]
        for i, d in caps:  # a shared link whose receiving side is this one node: a class on its port
            minor, parent = f"{_CAP_MINOR + i:x}", "1:1" if n.nic_bytes_per_s is not None else "1:"
            rate = min(d.bytes_per_s, n.nic_bytes_per_s or d.bytes_per_s)
            router_tc.append(f"class add dev n{k} parent {parent} classid 1:{minor} htb rate {_bits(rate)} "
                             f"ceil {_bits(rate)} quantum 1514")
            router_tc += [f"filter add dev n{k} parent 1: protocol ip prio 1 u32 match ip src {address[a]}/32 "
                          f"flowid 1:{minor}" for a in d.src]
    ifb = [(i, d) for i, d in enumerate(layout.shared) if d.at == "ifb"]
    if ifb:
        _ip(r_ns, [f"link add {IFB} type ifb", f"link set {IFB} txqueuelen 1000", f"link set {IFB} up"])
        router_tc += [f"qdisc add dev {IFB} root handle 1: htb default 2",
                      f"class add dev {IFB} parent 1: classid 1:2 htb rate {_UNSHAPED_BITS}bit quantum 1514"]
        for i, d in ifb:
            minor = f"{16 + i:x}"
            router_tc.append(f"class add dev {IFB} parent 1: classid 1:{minor} htb rate {_bits(d.bytes_per_s)} "
                             f"ceil {_bits(d.bytes_per_s)} quantum 1514")
            router_tc += [f"filter add dev {IFB} parent 1: protocol ip prio 1 u32 match ip src {address[a]}/32 "
                          f"match ip dst {address[b]}/32 flowid 1:{minor}" for a in d.src for b in d.dst]
        for k in range(len(layout.nodes)):
            router_tc += [f"qdisc add dev n{k} handle ffff: ingress",
                          f"filter add dev n{k} parent ffff: protocol ip prio 1 u32 match u32 0 0 "
                          f"action mirred egress redirect dev {IFB}"]
    _tc(r_ns, router_tc)


def _node_egress(layout: BoxLayout, node: NodeLayout, *, netem: bool) -> list[str]:
    """htb on a node's eth0: the NIC (or the sum of its pair links) as root, a class per peer node; a shared
    link whose sending side is this one node (a per-node cap) is a class between the two, over the peer
    classes of its receiving side."""
    out = [p for p in layout.pairs if p.src == node.name]
    address = {n.name: n.address for n in layout.nodes}
    root = node.nic_bytes_per_s if node.nic_bytes_per_s is not None else sum(p.bytes_per_s for p in out)
    dev = NODE_IF
    lines = [f"qdisc add dev {dev} root handle 1: htb default 2",
             f"class add dev {dev} parent 1: classid 1:1 htb rate {_bits(root)} ceil {_bits(root)} quantum 1514",
             f"class add dev {dev} parent 1: classid 1:2 htb rate {_UNSHAPED_BITS}bit quantum 1514"]
    cap_of: dict[str, tuple[str, float, int]] = {}  # peer -> (its cap class, the cap's rate, peers under it)
    for i, d in enumerate(layout.shared):
        if d.at == f"egress:{node.name}":
            minor, rate = f"{_CAP_MINOR + i:x}", min(d.bytes_per_s, root)
            lines.append(f"class add dev {dev} parent 1:1 classid 1:{minor} htb rate {_bits(rate)} "
                         f"ceil {_bits(rate)} quantum 1514")
            under = [p.dst for p in out if p.dst in d.dst]
            cap_of.update({peer: (f"1:{minor}", rate, len(under)) for peer in under})
    for j, p in enumerate(out):
        minor = f"{16 + j:x}"
        parent, top, share = cap_of.get(p.dst, ("1:1", root, len(out)))
        ceil = min(p.bytes_per_s, top)
        rate = min(ceil, top / share) if node.nic_bytes_per_s is not None or p.dst in cap_of else ceil
        lines += [f"class add dev {dev} parent {parent} classid 1:{minor} htb rate {_bits(rate)} ceil {_bits(ceil)} "
                  f"quantum 1514",
                  f"filter add dev {dev} parent 1: protocol ip prio 1 u32 match ip dst {address[p.dst]}/32 "
                  f"flowid 1:{minor}"]
        if netem and p.delay_s:
            lines.append(f"qdisc add dev {dev} parent 1:{minor} handle {minor}: netem delay "
                         f"{round(p.delay_s * 1e6)}us limit 100000")
    return lines


def route_through_delay_line(layout: BoxLayout) -> None:
    """Once the delay line made dl-in and dl-out: every packet a bridge brings to the router goes to dl-in."""
    r_ns = layout.router_netns
    lines = [f"link set {TUN_IN} txqueuelen 10000", f"link set {TUN_IN} up", f"link set {TUN_OUT} up",
             *(f"route add {net} dev {TUN_IN} table {_DELAY_TABLE}" for net in region_subnets(layout))]
    lines += [f"rule add iif br{r} lookup {_DELAY_TABLE} pref 100" for r in range(len(_regions(layout)))]
    _ip(r_ns, lines)


@dataclass(frozen=True, slots=True, kw_only=True)
class TcClass:
    """An htb class as the kernel reports it (``tc class show``): rates in bits/s, each with the resolution
    ``tc`` printed it at (a rate is printed as an integer of bit, Kbit, Mbit or Gbit)."""

    netns: str
    dev: str
    classid: str
    parent: str | None
    rate_bits: float
    ceil_bits: float
    resolution_bits: float
    #: Bytes the class has sent since it was made (``tc -s``).
    sent_bytes: int


_UNITS = {"bit": 1.0, "Kbit": 1e3, "Mbit": 1e6, "Gbit": 1e9, "Tbit": 1e12}
_CLASS = re.compile(r"class htb (\S+) (?:parent (\S+)|root).*? rate (\d+)(\w+) ceil (\d+)(\w+).*?\n\s*Sent (\d+) bytes")


def shaping(netns: str, dev: str) -> list[TcClass]:
    """The htb classes installed on ``dev`` in ``netns``, read back with ``tc -s class show``."""
    text = run(["tc", "-s", "-n", netns, "class", "show", "dev", dev]).stdout
    out = []
    for m in _CLASS.finditer(text):
        classid, parent, rate, ru, ceil, cu, sent = m.groups()
        out.append(TcClass(netns=netns, dev=dev, classid=classid, parent=parent, rate_bits=int(rate) * _UNITS[ru],
                           ceil_bits=int(ceil) * _UNITS[cu], resolution_bits=max(_UNITS[ru], _UNITS[cu]),
                           sent_bytes=int(sent)))
    return out


def list_namespaces() -> list[str]:
    """Every named network namespace (``ip netns list``)."""
    return [line.split()[0] for line in run(["ip", "netns", "list"]).stdout.splitlines() if line.strip()]


def netns_pids(netns: str) -> set[int]:
    """The processes in network namespace ``netns`` (``ip netns pids``; none where it does not exist)."""
    r = run(["ip", "netns", "pids", netns], check=False)
    return {int(p) for p in r.stdout.split()} if r.returncode == 0 else set()


def delete_namespace(netns: str) -> None:
    """Remove ``netns`` and with it its interfaces and qdiscs (absent: nothing to do)."""
    if (NETNS_DIR / netns).exists():
        run(["ip", "netns", "del", netns])
