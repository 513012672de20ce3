"""The options of the checkpointing strategies (``full``, ``cpr``, ``cpr-mfu``, ``cpr-ssu``) and their specs.

Light on purpose: the coordinator validates options, and the checkpoint driver and the benchmarks
read them, through these specs without importing the server-side strategies (``baselines.cpr``).
What each option means is in ``baselines.cpr``'s docstring; the rules between them are here, once.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from functools import partial

from baselines import overhead
from baselines.storage import Storage
from ecrec.config import REQUIRED, option
from ecrec.strategies.spec import StrategySpec


@dataclass(frozen=True)
class CheckpointOptions:
    """``--option KEY=VALUE`` of the checkpointing strategies (which keys each accepts: :func:`allowed`)."""

    dir: str = option(REQUIRED, "checkpoint root: directory or fsspec URL (required)")
    interval_s: float | None = option(None, "seconds between full saves (explicit; overrides the model)")
    interval_steps: int | None = option(None, "steps between full saves, for driver-driven saves (explicit)")
    mtbf_s: float | None = option(None, "mean time between failures of the job, for the model")
    o_res_s: float = option(0.0, "reschedule cost per failure for the model")
    formula: str = option("daly", "daly or young: full recovery's optimum", choices=overhead.FORMULAS)
    keep: int = option(2, "complete full checkpoints kept per server (>= 2 for full)")
    files: str = option("per-table", "per-table (a file per table and dense tensor) or one (one data file, one fsync)",
                        choices=("per-table", "one"))
    bandwidth_mb_s: float | None = option(None, "cap the checkpoint store's bandwidth (MB/s each way), as a remote "
                                                "store's; default: none")
    target_pls: float | None = option(None, "partial variants: target portion of lost updates, in (0, 1)")
    recovery: str = option("partial", "partial variants: partial | full | auto")
    mfu_fraction: float = option(0.05, "cpr-mfu: fraction of a shard's rows in a partial save")
    mfu_interval_s: float | None = option(None, "cpr-mfu: seconds between partial saves (default interval / 4)")
    ssu_sample: int = option(1024, "cpr-ssu: max entries of each table's sample")
    ssu_interval_s: float | None = option(None, "cpr-ssu: seconds between partial saves (default interval / 4)")


COMMON = {"dir", "interval_s", "interval_steps", "mtbf_s", "o_res_s", "formula", "keep", "files", "bandwidth_mb_s"}
PARTIAL = COMMON | {"target_pls", "recovery"}


def _float(name: str, value, lo: float | None = 0.0, lo_open: bool = True, hi: float | None = None,
           hi_open: bool = False) -> float:
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"option {name}={value!r}: not a number") from None
    if not math.isfinite(x):
        raise ValueError(f"option {name}={value!r}: must be finite")
    if lo is not None and (x <= lo if lo_open else x < lo):
        raise ValueError(f"option {name}={value!r}: must be {'>' if lo_open else '>='} {lo}")
    if hi is not None and (x >= hi if hi_open else x > hi):
        raise ValueError(f"option {name}={value!r}: must be {'<' if hi_open else '<='} {hi}")
    return x


def _int(name: str, value, lo: int) -> int:
    try:
        x = int(str(value))
    except ValueError:
        raise ValueError(f"option {name}={value!r}: not an integer") from None
    if x < lo:
        raise ValueError(f"option {name}={value!r}: must be >= {lo}")
    return x


def allowed(variant: str | None, full_only: bool) -> set[str]:
    """The option keys a checkpointing strategy accepts."""
    keys = set(COMMON if full_only else PARTIAL)
    if variant == "mfu":
        keys |= {"mfu_fraction", "mfu_interval_s"}
    if variant == "ssu":
        keys |= {"ssu_sample", "ssu_interval_s"}
    return keys


def parse_options(strategy: str, variant: str | None, full_only: bool, options: dict) -> CheckpointOptions:
    """Validates string options; raises ValueError naming the bad option."""
    allowed_keys = allowed(variant, full_only)
    unknown = sorted(set(options) - allowed_keys)
    if unknown:
        raise ValueError(f"strategy {strategy!r}: unknown option(s) {unknown}; allowed: {sorted(allowed_keys)}")
    o = {k: str(v) for k, v in options.items()}
    if not o.get("dir"):
        raise ValueError(f"strategy {strategy!r} needs --option dir=<checkpoint directory or fsspec URL>")
    storage = Storage.open(o["dir"])  # an unknown URL scheme is reported here, on the coordinator
    if storage.process_local:  # the servers and the replacement are other processes: they would see nothing
        raise ValueError(f"option dir={o['dir']!r}: {storage.process_local}, but every server process writes its "
                         "own checkpoints and a replacement must read the failed server's; use a directory or a "
                         "URL every server reaches (file://, s3://, gs://...)")
    kw: dict = {"dir": o["dir"]}
    for key in ("interval_s", "mtbf_s", "mfu_interval_s", "ssu_interval_s", "bandwidth_mb_s"):
        if key in o:
            kw[key] = _float(key, o[key])
    if "o_res_s" in o:
        kw["o_res_s"] = _float("o_res_s", o["o_res_s"], lo=0.0, lo_open=False)
    if "interval_steps" in o:
        kw["interval_steps"] = _int("interval_steps", o["interval_steps"], 1)
    if "keep" in o:
        kw["keep"] = _int("keep", o["keep"], 2 if full_only else 1)
    if "files" in o:
        if o["files"] not in ("per-table", "one"):
            raise ValueError(f"option files={o['files']!r}: choose per-table or one")
        kw["files"] = o["files"]
    if "formula" in o:
        if o["formula"] not in overhead.FORMULAS:
            raise ValueError(f"option formula={o['formula']!r}: choose one of {overhead.FORMULAS}")
        kw["formula"] = o["formula"]
    if "target_pls" in o:
        kw["target_pls"] = _float("target_pls", o["target_pls"], lo=0.0, hi=1.0, hi_open=True)
    if "mfu_fraction" in o:
        kw["mfu_fraction"] = _float("mfu_fraction", o["mfu_fraction"], lo=0.0, hi=1.0)
    if "ssu_sample" in o:
        kw["ssu_sample"] = _int("ssu_sample", o["ssu_sample"], 1)
    if full_only:
        kw["recovery"] = "full"
        if not any(k in kw for k in ("interval_s", "interval_steps", "mtbf_s")):
            raise ValueError(f"strategy {strategy!r} needs an interval: --option interval_s=S, interval_steps=N, "
                             "or mtbf_s=S (Young/Daly optimum from the measured save cost)")
    else:
        modelled = "mtbf_s" in kw and "target_pls" in kw
        recovery = o.get("recovery", "auto" if modelled else "partial")
        if recovery not in ("partial", "full", "auto"):
            raise ValueError(f"option recovery={recovery!r}: choose partial, full or auto")
        if recovery == "auto" and not modelled:
            raise ValueError("option recovery=auto needs mtbf_s and target_pls (the overhead model)")
        kw["recovery"] = recovery
        if recovery == "full":
            if not any(k in kw for k in ("interval_s", "interval_steps", "mtbf_s")):
                raise ValueError(f"strategy {strategy!r} with recovery=full needs an interval: --option interval_s=S, "
                                 "interval_steps=N, or mtbf_s=S")
        elif "interval_s" not in kw and not modelled:
            raise ValueError(f"strategy {strategy!r} needs an interval: --option interval_s=S, or target_pls=P "
                             "with mtbf_s=S (interval = 2 * P * servers * mtbf_s)")
    return CheckpointOptions(**kw)


def layout_params(strategy: str, variant: str | None, full_only: bool, num_servers: int, k: int, m: int,
                  options: dict) -> tuple[int, int, dict]:
    """Checkpointing keeps no parity and spreads rows over every server; the options are kept as given, but a
    relative checkpoint directory, made absolute here (on the coordinator, in its working directory): every
    server, a replacement included, then reads and writes the same one, whatever its own working directory
    (:func:`_absolute_dir`; a map saved before keeps what it holds)."""
    if m:
        raise ValueError(f"strategy {strategy!r} keeps no parity (it checkpoints): do not pass --m")
    if k not in (0, num_servers):
        raise ValueError(f"strategy {strategy!r} spreads rows over all {num_servers} servers: do not pass --k")
    parse_options(strategy, variant, full_only, options)
    stored = {str(a): str(b) for a, b in options.items()}
    stored["dir"] = _absolute_dir(stored["dir"])
    return num_servers, 0, stored


def _absolute_dir(url: str) -> str:
    """A checkpoint directory every process reads the same: a local path (``~`` expanded), or a ``file://`` or
    ``local://`` URL's path, made absolute in this process's working directory; other URLs as given."""
    for scheme in ("file://", "local://"):
        if url.startswith(scheme):
            rest = url[len(scheme):]
            return url if rest.startswith("/") else scheme + os.path.abspath(os.path.expanduser(rest))
    if "://" in url:
        return url
    return os.path.abspath(os.path.expanduser(url))


def _spec(name: str, variant: str | None, full_only: bool, cls: str, summary: str, rank: int) -> StrategySpec:
    return StrategySpec(name=name, kind="checkpoint", summary=summary, options_type=CheckpointOptions,
                        server_class=f"baselines.cpr:{cls}", layout=partial(layout_params, name, variant, full_only),
                        parser=partial(parse_options, name, variant, full_only), rank=rank)


#: (variant, full_only) of each checkpointing strategy
VARIANTS = {"full": (None, True), "cpr": (None, False), "cpr-mfu": ("mfu", False), "cpr-ssu": ("ssu", False)}

FULL = _spec("full", None, True, "FullCheckpoint",
             "consistent checkpoints at step boundaries; a failure rolls every server and the workers' data back", 10)
CPR = _spec("cpr", None, False, "PartialRecovery",
            "partial recovery: only the failed shard reloads its last checkpoint; lost updates counted exactly", 20)
CPR_MFU = _spec("cpr-mfu", "mfu", False, "PartialRecoveryMFU", "cpr + most-frequently-updated rows saved more often", 21)
CPR_SSU = _spec("cpr-ssu", "ssu", False, "PartialRecoverySSU", "cpr + a bounded random sample of updated rows saved more often",
                  22)
