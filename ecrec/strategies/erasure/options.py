"""The options of strategy ``ecrec`` and the check of its layout: typed, validated once, here.

Light on purpose (no pyeclib, no server-side imports): the coordinator validates a cluster's
options through the strategy's spec (``ecrec.strategies.builtin``) before any server starts.
"""

from __future__ import annotations

from collections.abc import Mapping
import dataclasses
from dataclasses import dataclass

from ecrec.coding.codec import SUPPORTED_BACKENDS, check_code
from ecrec.config import MAX_SECONDS, option
from ecrec.strategies.spec import options_to_strings, parse_options


#: the largest frame of the fast rebuild's streams a survivor sends (a request asking for more is refused)
MAX_FRAME_BYTES = 64 << 20
#: the most a count or size option may be (gRPC's message limit: a batch or group past it is never one message)
MOST_COUNT = 2**31 - 1
#: how survivors send those frames and a replacement reads rows on demand (``rebuild_transport``), and owners send
#: their direct parity frames (``parity_transport``)
TRANSPORTS = ("socket", "grpc")
#: whether small groups' batches are relayed by the workers (``relay``)
RELAYS = ("auto", "on", "off")


@dataclass(frozen=True)
class ErasureOptions:
    """``--option KEY=VALUE`` of strategy ``ecrec``."""

    backend: str = option("isa_l_rs_vand", f"pyeclib code: one of {', '.join(SUPPORTED_BACKENDS)}")
    rebuild_batch_rows: int = option(32768, "rows rebuilt per background batch (the fast path: rows of this server per "
                                            "round of streamed reads)")
    rebuild_frame_bytes: int = option(1 << 20, "bytes per message of the fast rebuild's streams (frames of whole "
                                               f"blocks; at most {MAX_FRAME_BYTES >> 20} MiB)")
    rebuild_transport: str = option("socket", "how survivors send the fast rebuild's frames: 'socket' (a TCP "
                                              "connection to a port the replacement opens for each stream, on its "
                                              "serving host; more than twice gRPC's rate; and the rows a request "
                                              "rebuilds on demand read over parity channels) or 'grpc' (the reply "
                                              "stream, ReadRows calls; always on TLS clusters)")
    rebuild_nice: int = option(19, "OS priority (nice, 0-19) of the threads that rebuild in the background on the "
                                   "replacement and of the survivors' threads that send its frames over a "
                                   "connection: where they share cores with training, training goes first (a "
                                   "request that needs a lock such a thread holds waits for it at that priority); "
                                   "0: the same priority as everything else")
    rebuild_pause_s: float = option(0.002, "pause of the background rebuild between batches (s)")
    rebuild_duty: float = option(1.0, "share of wall time the background rebuild may work, in (0, 1]")
    rebuild_duty_training: float = option(1.0, "... while training requests come in (the rows a step touches are "
                                               "rebuilt on demand first); in (0, 1]")
    rebuild_slowdown: float = option(0.0, "while training requests come in, pace the background rebuild by "
                                          "measurement so that training's rate (the pushes reaching the "
                                          "replacement) stays within 1 + this of its rate while the rebuild "
                                          "rests (0.1: at least ~91 %; measured in short rests every few "
                                          "seconds); 0: no pacing, rebuild_duty_training applies")
    heartbeat_s: float = option(2.0, "an owner idle this long confirms its acknowledged batches to its parity servers, "
                                     "which then trim their logs (s; while it trains, its batches carry that)")
    relay_timeout_s: float = option(0.25, "a batch the workers did not relay within this is sent directly by its owner (s)")
    coalesce_pushes: int = option(64, "consecutive pushes an owner coalesces into one batch per parity server (where "
                                      "steps are short, coalesce_s closes a group first)")
    coalesce_bytes: int = option(4 << 20, "... until the pushes hold this many bytes of deltas")
    coalesce_stagger: bool = option(True, "a server's first group (and its first after a pause or one-push "
                                          "groups) closes at (i + 1) / S of coalesce_bytes (index i of S servers), "
                                          "so that groups closed by size close in different steps on different "
                                          "servers, not all in one")
    coalesce_s: float = option(0.5, "... or the first of them is this old (s); while a server recovers, at the "
                                    "owner's next timer tick. A group no push came to for this long is sent directly")
    direct_bytes: int = option(1 << 20, "a group whose pushes hold at least this many bytes of deltas is built off "
                                        "the push path (the owner's closer thread) and its batches go to their "
                                        "parity servers directly, not through the worker")
    relay: str = option("auto", "whether a small group's batches go back in the push's reply for the worker to carry "
                                "to their parity servers on its next requests ('on'), or every group is built off "
                                "the push path and sent directly ('off'); 'auto': 'off' where the direct frames go "
                                "over parity channels (parity_transport=socket, no TLS: nothing serialized, sealed or "
                                "carried by the worker), 'on' where they would be gRPC calls")
    relay_max_bytes: int = option(1 << 20, "a batch larger than this goes to its parity server directly, not "
                                           "through the worker")
    max_unconfirmed: int = option(1024, "pushes an owner may have waiting for their parity before new pushes wait")
    max_batch_bytes: int = option(4 << 20, "largest direct ApplyParity message (bytes)")
    parity_transport: str = option("socket", "how an owner sends its direct parity frames: 'socket' (a TCP "
                                             "connection to each parity server, opened through an authenticated "
                                             "call; the frames written and read in place) or 'grpc' "
                                             "(ApplyParityFrames calls; always on TLS clusters)")
    rebuild_deadline_s: float = option(120.0, "a row that cannot be rebuilt for this long fails its request (s)")
    resolve_deadline_s: float = option(30.0, "a replacement waits this long for every live server to answer its "
                                             "resolution, then its promotion fails and is retried (s)")
    partial_parity_wait_s: float = option(30.0, "fault injection after_partial_parity: wait for the first batch (s)")

    def validate(self, strategy: str = "ecrec") -> "ErasureOptions":
        if self.backend not in SUPPORTED_BACKENDS:
            raise ValueError(f"strategy {strategy!r}: option backend={self.backend!r}: "
                             f"choose one of {list(SUPPORTED_BACKENDS)}")
        for key in ("rebuild_batch_rows", "max_unconfirmed", "max_batch_bytes", "coalesce_pushes", "coalesce_bytes",
                    "direct_bytes", "relay_max_bytes"):
            if getattr(self, key) < 1:
                raise ValueError(f"strategy {strategy!r}: {key} must be >= 1")
        for key in ("rebuild_transport", "parity_transport"):
            if getattr(self, key) not in TRANSPORTS:
                raise ValueError(f"strategy {strategy!r}: option {key}={getattr(self, key)!r}: "
                                 f"choose one of {list(TRANSPORTS)}")
        if self.relay not in RELAYS:
            raise ValueError(f"strategy {strategy!r}: option relay={self.relay!r}: choose one of {list(RELAYS)}")
        if not 0 <= self.rebuild_nice <= 19:
            raise ValueError(f"strategy {strategy!r}: rebuild_nice must be in [0, 19]")
        if not 1 <= self.rebuild_frame_bytes <= MAX_FRAME_BYTES:
            raise ValueError(f"strategy {strategy!r}: rebuild_frame_bytes must be in [1, {MAX_FRAME_BYTES}]")
        for key in ("rebuild_pause_s", "heartbeat_s", "coalesce_s", "rebuild_slowdown"):
            if getattr(self, key) < 0:
                raise ValueError(f"strategy {strategy!r}: {key} must be >= 0")
        for key in ("rebuild_deadline_s", "partial_parity_wait_s", "relay_timeout_s", "resolve_deadline_s"):
            if getattr(self, key) <= 0:
                raise ValueError(f"strategy {strategy!r}: {key} must be > 0")
        for key in ("rebuild_duty", "rebuild_duty_training"):
            if not 0 < getattr(self, key) <= 1:
                raise ValueError(f"strategy {strategy!r}: {key} must be in (0, 1]")
        # past these a wait overflowed (a server's timer thread died of it) or a size could never be one message
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name.endswith("_s") and value > MAX_SECONDS:
                raise ValueError(f"strategy {strategy!r}: {f.name} {value:g} must be at most {MAX_SECONDS:g} (seconds)")
            if isinstance(value, int) and not isinstance(value, bool) and value > MOST_COUNT:
                raise ValueError(f"strategy {strategy!r}: {f.name} {value:,} must be at most {MOST_COUNT:,}")
        return self


def parse(options: Mapping[str, str]) -> ErasureOptions:
    return parse_options("ecrec", ErasureOptions, options)


def layout_params(num_servers: int, k: int, m: int, options: Mapping[str, str]) -> tuple[int, int, dict[str, str]]:
    """Validates ``k``, ``m`` (an MDS code that fits the servers) and the options; returns them with every
    option spelled out, so all servers agree on the defaults."""
    if k < 1 or m < 1:
        raise ValueError(f"strategy 'ecrec' needs --k >= 1 and --m >= 1 (got k={k}, m={m})")
    if k + m > num_servers:
        raise ValueError(f"strategy 'ecrec': k + m = {k + m} exceeds the {num_servers} servers")
    parsed = parse(options)
    check_code(k, m, parsed.backend)
    return k, m, options_to_strings(parsed)
