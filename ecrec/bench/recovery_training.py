"""``ecrec-bench recovery --during-training``: a worker trains through the failure; training time lost.

The worker looks up every table of the recovery benchmark (embedding bags, ``--ids-per-sample`` uniform ids
per sample and table), feeds the sum to a linear head (registered on the servers, replicated like any dense
tensor) and pushes; step ``n`` always trains on the same batch, so a rolled-back step replays exactly.
``full`` and ``cpr`` are driven by ``baselines.driver.CheckpointDriver`` (initial checkpoint at the start,
intervals from the Young/Daly model or the PLS target at ``--mtbf-hours``).  One step record per step:
``{step, start, end, samples}``; the JSON keeps them all (``step_records``), with the cluster's events.

:func:`lost_training` turns the records into the training time lost to the failure: over the window from
the kill to the end of training, the wall time minus the time the *new* work done in it (steps past the
furthest step reached before the kill) takes at the pre-failure rate.  That is, in one number, the paused
time, the replayed steps' time and the integral of the throughput deficit while recovering; it is also
split into those three parts.
"""

from __future__ import annotations

import math
import time

import numpy as np

from ecrec.tables.spec import TableSpec


def first_event(local, kind: str, index: int, since: float) -> float | None:
    """Wall time of the first ``kind`` event of ``index`` at or after ``since`` in the map's events, or None."""
    return next((e.wall_time for e in local.cluster_map().events
                 if e.kind == kind and e.index == index and e.wall_time >= since), None)


def lost_training(records: list[dict], kill_time: float,
                  recovering_from: float | None = None, recovering_until: float | None = None) -> dict:
    """Training time lost to a failure at ``kill_time``, from step records (``step``, ``start``, ``end``,
    ``samples``; in the order run, a rolled-back step appears again).

    - ``rate_before``: samples/s over the steps that ended before the kill (time in steps);
    - ``lost_training_s``: ``(end - kill) - new samples / rate_before``, where new samples are those of steps
      past the furthest step reached before the kill, ``end`` the last record's end (a step
      under way at the kill counts whole: the window then starts at its start);
    - ``replayed_s``: time in steps at or below that furthest step (redone after a rollback);
    - ``paused_s``: time from the kill until the first step that started after it began, plus the first
      step's excess over the median step before (detection, promotion, reload, the first on-demand rebuild);
    - ``deficit_s``: the rest (slower steps while recovering);
    - ``throughput_ratio``: new samples per second while recovering, from ``recovering_from`` (the promotion;
      default the kill) to ``recovering_until`` (full redundancy), at least 2 s, over ``rate_before``;
      ``longest_step_s`` after the kill; ``median_step_s`` before.
    """
    before = [r for r in records if r["end"] <= kill_time]
    after = [r for r in records if r["end"] > kill_time]
    if not before or not after:
        raise ValueError("lost_training needs steps before and after the failure")
    durations_before = np.array([r["end"] - r["start"] for r in before])
    rate = sum(r["samples"] for r in before) / max(float(durations_before.sum()), 1e-9)
    median = float(np.median(durations_before))
    end = after[-1]["end"]
    furthest = max(r["step"] for r in before)
    new = replayed = 0.0
    high = furthest
    for r in after:
        if r["step"] > high:
            new += r["samples"]
            high = r["step"]
        else:
            replayed += r["end"] - r["start"]
    window_start = min(kill_time, after[0]["start"])  # a step under way at the kill counts whole
    lost = (end - window_start) - new / rate
    first = after[0]
    paused = max(0.0, first["start"] - kill_time) + max(0.0, (first["end"] - max(first["start"], kill_time)) - median)
    start = max(recovering_from or kill_time, kill_time)
    until = max(recovering_until or start, start + 2.0)
    in_new, high = 0.0, furthest
    for r in after:
        if r["step"] > high:
            high = r["step"]
            if start < r["end"] <= until:
                in_new += r["samples"]
    window = min(until, end) - start
    paused = min(paused, max(lost - replayed, 0.0))
    return {"rate_before": rate, "median_step_s": median, "lost_training_s": lost, "replayed_s": replayed,
            "paused_s": paused, "deficit_s": lost - replayed - paused,
            "throughput_ratio": (in_new / window) / rate if window > 0 else None,
            "longest_step_s": max(r["end"] - r["start"] for r in after), "window_s": end - kill_time}


class _Worker:
    """The benchmark's training loop (see the module docstring)."""

    def __init__(self, strategy: str, args, cluster, names: list[str]):
        import torch

        from ecrec.client import EmbeddingBagCollection

        torch.manual_seed(args.seed)
        torch.set_num_threads(1)
        self.args, self.cluster, self.names = args, cluster, names
        self.bags = EmbeddingBagCollection(cluster, names, mode="sum")
        self.head = torch.nn.Linear(args.dim * len(names), 1)
        cluster.register_dense(self.head, optimizer="sgd", lr=0.01)
        self.driver = None
        if strategy in ("full", "cpr"):
            from baselines.driver import CheckpointDriver

            self.driver = CheckpointDriver(cluster, mtbf_s=args.mtbf_hours * 3600)
            self.driver.start(0)
        self.step = 0
        self.records: list[dict] = []

    def batch(self, step: int):
        import torch

        rng = np.random.default_rng((self.args.seed, step))
        b, n = self.args.batch_size, self.args.ids_per_sample
        inputs = []
        for _ in self.names:
            ids = torch.from_numpy(rng.integers(0, self.args.rows, b * n))
            inputs.append((ids, torch.arange(0, b * n, n)))
        labels = torch.from_numpy(rng.integers(0, 2, b).astype(np.float32))
        return inputs, labels

    def train_one(self) -> None:
        import torch

        step = self.step
        t0 = time.time()
        inputs, labels = self.batch(step)
        pooled = self.bags(inputs)
        logits = self.head(torch.cat(pooled, dim=1)).squeeze(1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)
        loss.backward()
        result = self.cluster.step()
        resume = self.driver.after_step(step, result) if self.driver is not None else None
        self.records.append({"step": step, "start": t0, "end": time.time(), "samples": len(labels),
                             "rewind_to": resume})
        self.step = resume if resume is not None else step + 1


class IntervalDoesNotFit(ValueError):
    """A checkpointing strategy's interval is too long for a failure at each of its phases within ``--max-s``."""


def train_through_failure(strategy: str, args, local, cluster, names: list[str], measure_memory,
                          progress) -> dict:
    """Trains ``--before-s``, then meets ``--failures`` kills of ``--fail-server``, each at its own phase of the
    checkpoint interval for ``full`` and ``cpr`` (``(i + 0.5) / n``: the interval measured whole, not
    modelled), each after the previous one is over (redundant again, ``--after-s`` trained, a new standby
    started and warm); returns the lost-training figures per failure and their mean, and a timeline.
    ``measure_memory()`` (the servers' memory, just before the first kill) and ``progress(text)`` come from
    the caller."""
    from ecrec.bench.lost_training import failure_phases

    worker = _Worker(strategy, args, cluster, names)
    for _ in range(10):  # warm-up: first calls, compiled paths
        worker.train_one()
    worker.records.clear()
    interval = _interval(strategy, args, worker, cluster)
    phases = failure_phases(args.failures)
    if interval is not None and interval["interval_s"] * (1 + max(phases)) > args.max_s:
        raise IntervalDoesNotFit(
            f"{strategy}'s checkpoint interval at --mtbf-hours {args.mtbf_hours:g} is {interval['interval_s']:.1f} s: "
            f"a failure at each phase of it needs up to {interval['interval_s'] * (1 + max(phases)):.0f} s of training "
            f"before the kill, more than --max-s {args.max_s:g}; pass a shorter --mtbf-hours (the cost per day is "
            f"still reported at --cost-mtbf-hours) or a longer --max-s")
    t_start = time.time()
    while time.time() - t_start < args.before_s:
        worker.train_one()
    out = measure_memory()
    index = args.fail_server
    failures, since = [], -math.inf
    for n, phase in enumerate(phases):
        if n:
            _next_standby(local, worker, progress)
            t0 = time.time()  # the rate of this failure: steps after the previous window
            while time.time() - t0 < max(1.0, args.before_s / 2):
                worker.train_one()
        kill_at = _kill_time(strategy, worker, cluster, index, phase) if interval is not None else time.time()
        while time.time() < kill_at:
            worker.train_one()
        failures.append(_one_failure(strategy, args, local, worker, index, since, progress,
                                     phase if interval is not None else None))
        since = worker.records[-1]["end"]
    out["failures"] = failures
    for key in ("lost_training_s", "paused_s", "replayed_s", "deficit_s", "throughput_ratio", "redundant_s",
                "go_on_s", "promotion_s", "samples_per_s_before", "median_step_s", "window_s"):
        values = [f[key] for f in failures if f.get(key) is not None]
        out[key] = float(np.mean(values)) if values else None
        if key == "lost_training_s" and values:
            out["lost_training_s_range"] = [float(min(values)), float(max(values))]
    out["longest_step_s"] = max(f["longest_step_s"] for f in failures)
    out["steps"] = len(worker.records)
    if interval is not None:
        out["interval"] = interval
        out["checkpoint_interval_s"] = interval["interval_s"]
    if worker.driver is not None:
        report = worker.driver.report()
        out["o_save_s"], out["o_load_s"] = report.get("o_save_s"), report.get("o_load_s")
        out["steps_redone"] = report.get("steps_redone")
        out["lost_updates"] = report.get("lost_updates")
    elif strategy == "ecrec":
        out["lost_updates"] = 0  # every acknowledged push survives (tests/test_ecrec_recovery.py, the nemesis)
    else:
        out["lost_updates"] = None  # none: every update the killed server held, not counted by this benchmark
    # the mean over failures at stratified phases of the interval: the expectation, measured (no model)
    out["expected_lost_s"] = out["lost_training_s"]
    out["timeline"] = _timeline(worker.records, failures[0]["kill_time"])
    out.update(saved_records(worker.records, local, [f["kill_time"] for f in failures], strategy))
    return out


def _interval(strategy: str, args, worker: "_Worker", cluster) -> dict | None:
    """The checkpoint interval the strategy's model chose at ``--mtbf-hours`` (``ecrec.bench.cost`` reads it)."""
    if worker.driver is None:
        return None
    mtbf_s = args.mtbf_hours * 3600.0
    driver = worker.driver
    if strategy == "full":
        return {"how": "Daly", "formula": driver.opts.formula, "o_save_s": driver.o_save_s, "mtbf_s": mtbf_s,
                "interval_s": driver.full_interval_s}
    reply = cluster.strategy_call("timers", {}, indices=[args.fail_server])[args.fail_server]
    if not reply.get("interval_s"):
        return None  # no timer: the kills come without a phase
    return {"how": "PLS", "target_pls": args.target_pls, "servers": args.servers, "mtbf_s": mtbf_s,
            "interval_s": float(reply["interval_s"])}


def _kill_time(strategy: str, worker: "_Worker", cluster, index: int, phase: float) -> float:
    """When (``time.time()``) to kill for a failure at ``phase`` of the interval: ``full``, that far past the
    driver's next save; ``cpr``, that far into the failed server's timer interval (at least a step away)."""
    if strategy == "full":
        driver = worker.driver
        saves = driver.saves
        while driver.saves == saves:  # the next save: the interval's start, measured rather than predicted
            worker.train_one()
        return time.time() + phase * driver.full_interval_s
    reply = cluster.strategy_call("timers", {}, indices=[index])[index]
    now = time.time()
    if not reply.get("interval_s") or reply.get("next_full_in_s") is None:
        return now  # no timer running (saves driven elsewhere): the kill comes now, without a phase
    period = float(reply["interval_s"])
    at = now + reply["next_full_in_s"] - period + phase * period
    while at < now + 0.05:
        at += period
    return at


def _next_standby(local, worker: "_Worker", progress, timeout_s: float = 120.0) -> None:
    """Starts a standby for the next failure and trains until the map lists it (it compiled its kernels
    before it registered) and its table memory is ready."""
    from ecrec.bench.processes import wait_standby_reserve
    from ecrec.wire import cluster_pb2

    local.start_server(standby=True)
    deadline = time.time() + timeout_s
    while not any(s.state == cluster_pb2.STANDBY for s in local.cluster_map().servers):
        if time.time() > deadline:
            raise RuntimeError(f"no standby registered {timeout_s:.0f} s after it was started")
        worker.train_one()
    wait_standby_reserve(worker.cluster)
    progress("a standby for the next failure is ready")


#: the replacement's counters a failure's report keeps (``rebuild_parts``): what its rebuild took, by part -- the
#: whole rebuild (s), the fast path (s) and its wait for the survivors' streams (s), the rows it installed, data and
#: parity rows rebuilt, the requests that rebuilt their rows on demand first and their time (s), the reads of
#: members answered over parity channels and through gRPC, and with ``rebuild_slowdown`` the pacer's last duty and
#: its probes
REBUILD_PARTS = ("rebuild_s", "bulk_s", "bulk_wait_s", "bulk_rows_rebuilt", "rows_rebuilt", "parity_rows_rebuilt",
                 "on_demand_calls", "on_demand_rounds", "on_demand_s", "reads_over_channel", "reads_over_grpc",
                 "rebuild_duty", "rebuild_probes")


def rebuild_parts(cluster, index: int) -> dict:
    """What the replacement at ``index`` reports of its rebuild (:data:`REBUILD_PARTS`; absent: not counted)."""
    try:
        stats = cluster.strategy_call("stats", indices=[index])[index]
    except Exception as exc:  # noqa: BLE001 - a report without the parts, said so
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {key: float(stats[key]) for key in REBUILD_PARTS if key in stats}


#: a survivor's counters behind the fast path's CPU by part (:func:`rebuild_cpu`), from its threads' clocks: its
#: delivery threads' CPU, the part of it gathering the frames' rows, the part settling them at the last closed group
#: (rows changed since the copy read again, the open group taken out) and reading the confirmed bound for them
#: (``seal``), and the bytes streamed; the replacement's own are ``bulk_receive_cpu_s``,
#: ``bulk_decode_cpu_s``, ``bulk_install_cpu_s`` and ``bulk_round_cpu_s`` (decode, install and the checks around them)
STREAM_COUNTERS = ("stream_cpu_s", "stream_read_cpu_s", "stream_seal_cpu_s", "stream_bytes")
#: a remainder (send, checks) below this (s) means the counters do not balance (a stream abandoned midway): said so
UNBALANCED_S = 0.01


def stream_counters(cluster, indices) -> dict[int, dict]:
    """The survivors' stream counters now (:data:`STREAM_COUNTERS`); a server that does not answer is left out
    (:func:`rebuild_cpu` names it)."""
    out = {}
    for index in indices:
        try:
            stats = cluster.strategy_call("stats", indices=[index])[index]
        except Exception:  # noqa: BLE001 - named in the report (unread_servers), not swallowed
            continue
        out[index] = {key: float(stats.get(key, 0.0)) for key in STREAM_COUNTERS}
    return out


def rebuild_cpu(before: dict[int, dict], after: dict[int, dict], replacement: dict, row_bytes: int,
                survivors: list[int] | None = None) -> dict:
    """The fast path's CPU by part (s; ms per MB it rebuilt and per MB the survivors streamed): the survivors'
    counters from ``before`` to ``after`` (:func:`stream_counters` at the kill and once the replacement is
    redundant), the replacement's own (``replacement``: its stats, which start at its promotion).  A survivor of
    ``survivors`` missing from either reading is named (``unread_servers``: its part is not in the figures), a
    remainder that comes out negative is reported as 0 and flagged (``unbalanced``), and the transport the frames
    took (``transport``: on the gRPC reply stream the client's receiving runs on gRPC's own threads, not counted)."""
    read = [i for i in after if i in before]
    def moved(key: str) -> float:
        return sum(after[i][key] - before[i][key] for i in read)
    gather, seal = moved("stream_read_cpu_s"), moved("stream_seal_cpu_s")
    receive = float(replacement.get("bulk_receive_cpu_s", 0.0))
    decode = float(replacement.get("bulk_decode_cpu_s", 0.0))
    install = float(replacement.get("bulk_install_cpu_s", 0.0))
    send = moved("stream_cpu_s") - gather - seal
    checks = float(replacement.get("bulk_round_cpu_s", 0.0)) - decode - install
    parts = {"survivors_gather_cpu_s": gather, "survivors_seal_cpu_s": seal, "survivors_send_cpu_s": max(0.0, send),
             "replacement_receive_cpu_s": receive, "replacement_decode_cpu_s": decode,
             "replacement_install_cpu_s": install, "replacement_checks_cpu_s": max(0.0, checks)}
    rebuilt_mb = float(replacement.get("bulk_rows_rebuilt", 0.0)) * row_bytes / 1e6
    out = dict(parts)
    out["total_cpu_s"] = sum(parts.values())
    out["rebuilt_mb"] = rebuilt_mb
    out["streamed_mb"] = moved("stream_bytes") / 1e6
    bytes_read = float(replacement.get("bulk_bytes_read", 0.0))
    over_socket = float(replacement.get("bulk_bytes_over_socket", 0.0))
    out["transport"] = ("socket" if bytes_read and over_socket >= bytes_read else
                        "grpc" if bytes_read and not over_socket else "mixed" if bytes_read else None)
    unread = sorted(set(survivors or ()) - set(read))
    if unread:
        out["unread_servers"] = unread
    if send < -UNBALANCED_S or checks < -UNBALANCED_S:
        out["unbalanced"] = True
    if rebuilt_mb:
        out["ms_per_mb"] = {key[:-len("_cpu_s")]: 1e3 * value / rebuilt_mb for key, value in parts.items()}
        out["ms_per_mb"]["total"] = 1e3 * out["total_cpu_s"] / rebuilt_mb
    if out["streamed_mb"]:
        out["ms_per_mb_streamed"] = 1e3 * out["total_cpu_s"] / out["streamed_mb"]
    return out


def rebuild_cpu_of(cluster, index: int, before: dict[int, dict], survivors: list[int], args) -> dict:
    """:func:`rebuild_cpu` of the replacement at ``index`` now (its rebuild over), the survivors' counters
    ``before`` taken at the kill; ``{"error": ...}`` when the replacement's counters cannot be read."""
    try:
        replacement = cluster.strategy_call("stats", indices=[index])[index]
    except Exception as exc:  # noqa: BLE001 - a report without the parts, said so
        return {"error": f"{type(exc).__name__}: {exc}"}
    row_bytes = TableSpec("x", 1, args.dim, optimizer=args.optimizer).row_bytes
    return rebuild_cpu(before, stream_counters(cluster, survivors), replacement, row_bytes, survivors)


def describe_cpu(cpu: dict) -> str:
    """One line of :func:`rebuild_cpu`."""
    if "error" in cpu:
        return f"the fast path's CPU could not be read ({cpu['error']})"
    per = cpu.get("ms_per_mb")
    if not per:
        return "no rows through the fast path"
    survivors = ", ".join(f"{label} {per['survivors_' + label]:.2f}" for label in ("gather", "seal", "send"))
    replacement = ", ".join(f"{label} {per['replacement_' + label]:.2f}"
                            for label in ("receive", "decode", "install", "checks"))
    text = (f"fast path CPU {cpu['total_cpu_s']:.2f} s for {cpu['rebuilt_mb']:,.0f} MB rebuilt, {per['total']:.2f} "
            f"ms/MB (survivors: {survivors}; replacement: {replacement})")
    if cpu.get("streamed_mb"):
        text += f"; {cpu['streamed_mb']:,.0f} MB streamed, {cpu['ms_per_mb_streamed']:.2f} ms/MB"
    if cpu.get("transport") in ("grpc", "mixed"):
        text += "; frames on the gRPC reply stream: receiving on gRPC's own threads is not counted"
    if cpu.get("unread_servers"):
        text += f"; servers {cpu['unread_servers']} did not answer: their parts are missing"
    if cpu.get("unbalanced"):
        text += "; the counters do not balance (a stream abandoned midway?): send or checks shown as 0"
    return text


def describe_parts(parts: dict) -> str:
    """One line of :func:`rebuild_parts`."""
    if "error" in parts:
        return f"its counters could not be read ({parts['error']})"
    out = [f"{parts.get('rebuild_s', float('nan')):.2f} s in all"]
    if "bulk_s" in parts:
        out.append(f"fast path {parts['bulk_s']:.2f} s ({parts.get('bulk_wait_s', 0.0):.2f} s waiting for streams)")
    if parts.get("on_demand_calls"):
        calls = parts["on_demand_calls"]
        rounds = (f", {parts['on_demand_rounds'] / calls:.2f} rounds of reads each" if "on_demand_rounds" in parts
                  else "")
        out.append(f"on demand {int(calls)} requests, {parts.get('on_demand_s', 0.0) / calls * 1e3:.1f} ms each{rounds}")
        reads = parts.get("reads_over_channel", 0.0) + parts.get("reads_over_grpc", 0.0)
        if reads:
            out.append(f"{int(parts.get('reads_over_channel', 0.0))} of {int(reads)} reads over parity channels")
    if "rebuild_duty" in parts:
        out.append(f"paced: duty {parts['rebuild_duty']:.2f} after {int(parts.get('rebuild_probes', 0))} probes")
    return "; ".join(out)


def _one_failure(strategy: str, args, local, worker: "_Worker", index: int, since: float, progress,
                 phase: float | None) -> dict:
    """Kills ``index`` now and trains until it is redundant again plus ``--after-s`` and past the furthest step
    reached before the kill (a rollback's replay counted whole); the failure's figures (:func:`lost_training`
    over the steps after ``since``)."""
    furthest = max(r["step"] for r in worker.records)  # the window closes only once training is past it
    survivors = [i for i in range(worker.cluster.layout.num_servers) if i != index]
    streamed = stream_counters(worker.cluster, survivors) if strategy == "ecrec" else {}
    t_kill = time.time()
    local.kill(local.pid_of_index(index))
    seen = len(worker.driver.events) if worker.driver is not None else 0
    progress(f"killed server {index} after {len(worker.records)} steps"
             + (f" ({phase:.2f} of the checkpoint interval)" if phase is not None else ""))
    redundant = None
    last_check = 0.0
    while time.time() - t_kill < args.max_s:
        worker.train_one()
        now = time.time()
        if redundant is None and now - last_check > 0.25:
            last_check = now
            redundant = first_event(local, "redundant", index, t_kill)
            if redundant is not None and worker.driver is not None and len(worker.driver.events) > seen:
                redundant = max(redundant, t_kill + worker.driver.events[-1].seconds)
        if redundant is not None and now > max(redundant, t_kill) + args.after_s and worker.step > furthest + 1:
            break
    if worker.step <= furthest + 1:
        progress(f"--max-s {args.max_s:g} ended the window before training passed step {furthest} again: the "
                 "figures of this failure miss the rest of its replay")
    if worker.driver is not None:
        worker.driver.settle()  # the lost samples counted now, between steps: no step of the window pays for them
    promoted = first_event(local, "promoted", index, t_kill)
    records = [r for r in worker.records if r["start"] >= since]
    figures = lost_training(records, t_kill, recovering_from=promoted, recovering_until=redundant)
    figures["samples_per_s_before"] = figures.pop("rate_before")
    figures.update(kill_time=t_kill, phase=phase, redundant_s=redundant - t_kill if redundant is not None else None,
                   go_on_s=next(r["end"] for r in worker.records if r["end"] > t_kill) - t_kill,
                   promotion_s=promoted - t_kill if promoted else None)
    if strategy == "ecrec":
        figures["rebuild_parts"] = rebuild_parts(worker.cluster, index)
        progress("rebuild: " + describe_parts(figures["rebuild_parts"]))
        figures["rebuild_cpu"] = rebuild_cpu_of(worker.cluster, index, streamed, survivors, args)
        if redundant is None:  # --max-s ended the window first: the parts so far
            figures["rebuild_cpu"]["before_redundancy"] = True
        progress("rebuild: " + describe_cpu(figures["rebuild_cpu"])
                 + ("; read before the replacement was redundant" if redundant is None else ""))
    if worker.driver is not None and len(worker.driver.events) > seen:
        event = worker.driver.events[-1]
        figures["lost_updates"] = event.lost_updates
        figures["steps_redone"] = (event.step + 1 - event.resume_step) if event.resume_step is not None else None
    return figures


def saved_records(records: list[dict], local, kill_times, strategy: str) -> dict:
    """Every step (``ecrec.bench.accounting.STEP_FIELDS``), the cluster's events and the kills, for the JSON,
    and the failures' figures as ``compare`` accounts them (``accounting``: each at the rate just before its
    kill, under ``failures``, and their mean and range; ``kill_times``: one time or several)."""
    from ecrec.bench.accounting import failure_accounts, failure_summary, step_columns
    from ecrec.strategies import get_spec

    kill_times = [kill_times] if isinstance(kill_times, (int, float)) else list(kill_times)
    events = [dict(kind=e.kind, index=e.index, wall_time=e.wall_time) for e in local.cluster_map().events]
    kind = get_spec(strategy).kind
    kills = [{"time": t} for t in kill_times]
    accounts = failure_accounts(records, events, kills, kind)
    rates = [a["samples_per_s_before"] for a in accounts if a.get("samples_per_s_before") is not None]
    summary = dict(failure_summary(accounts), failures=accounts,
                   samples_per_s_before=float(np.mean(rates)) if rates else None)
    return {"step_records": step_columns(records), "events": events, "kills": kills, "accounting": summary}


def _timeline(records: list[dict], kill_time: float, bucket_s: float = 0.25) -> dict:
    ends = np.array([r["end"] - kill_time for r in records])
    samples = np.array([r["samples"] for r in records])
    edges = np.arange(ends.min() - bucket_s, ends.max() + bucket_s, bucket_s)
    counts, _ = np.histogram(ends, bins=edges, weights=samples)
    return {"t": [float(x) for x in edges[1:]], "samples_per_s": [float(c / bucket_s) for c in counts]}
