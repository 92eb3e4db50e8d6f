"""Where the ranks of a launched stage meet: the port node 0 listens on and the address every
node dials, chosen (`free_port`) or checked (`rendezvous_problems`, at the door) before any
stage of a command runs, so that a busy port or a name that does not resolve is one line,
not a traceback from the rendezvous or a launcher waiting forever."""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

FIRST_PORT = 10000  # `free_port` draws from here up to the ephemeral range (lower ones are more often services')
RESOLVE_TIMEOUT_S = 10.0  # a name server that answers nothing: the door gives up and says so


def free_port() -> int:
    """A TCP port nobody listens on now, for a one-node rendezvous. It is drawn below the kernel's
    range of ephemeral ports where that range is known: a port from `bind(0)` comes from that range,
    so any process's next outgoing connection may take it before the launcher listens on it."""
    low = ephemeral_low()
    if low is not None and low - FIRST_PORT >= 1024:
        draw = random.SystemRandom()  # the OS's randomness: processes forked alike draw apart
        for _ in range(64):
            port = draw.randrange(FIRST_PORT, low)
            if port_free(port):
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_free(port: int) -> bool:
    """Whether `port` can be bound on all addresses, as the rendezvous store listens."""
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def ephemeral_low() -> int | None:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def resolves(host: str, timeout_s: float = RESOLVE_TIMEOUT_S) -> bool | None:
    """Whether `host` resolves to an address (None: no answer within `timeout_s`). The lookup runs
    in a daemon thread: `getaddrinfo` itself takes no timeout."""
    answer: list[bool] = []

    def look() -> None:
        try:
            socket.getaddrinfo(host, None)
            answer.append(True)
        except (OSError, UnicodeError):
            answer.append(False)

    thread = threading.Thread(target=look, daemon=True)
    thread.start()
    thread.join(timeout_s)
    return answer[0] if answer else None


def rendezvous_problems(trainer, launches: bool) -> list[str]:
    """`trainer.master_addr` and `trainer.master_port` where this command will launch ranks
    (`launches`): the address must resolve, and on node 0, which listens, a port given must be
    free now (null draws a free one)."""
    if not launches:
        return []
    problems, addr = [], str(trainer.master_addr)
    found = resolves(addr)
    if found is False:
        problems.append(f"trainer.master_addr={addr!r}: the name does not resolve to an address; give node 0's "
                        "address or host name (127.0.0.1 on one node)")
    elif found is None:
        problems.append(f"trainer.master_addr={addr!r}: no answer from the name service within "
                        f"{RESOLVE_TIMEOUT_S:.0f} s; give node 0's IP address")
    port = trainer.master_port
    if port is not None and int(trainer.node_rank) == 0 and not port_free(int(port)):
        problems.append(f"trainer.master_port={port}: another process listens on it on this machine (an earlier "
                        "run?); give a free port, or trainer.master_port=null to draw one")
    return problems
