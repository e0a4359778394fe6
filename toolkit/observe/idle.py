"""Each rank's idle fraction of a step over the step's whole span across the ranks that run it together: a
pipeline's ranks each time their own schedule call, but the step lasts until the last of them finishes, and a rank
that finished early waits for it at the step's first collective after. Measured over its own call alone, the last
stage of a GPipe or 1F1B pipeline (done one backward before the first stage) read 0.03 idle where the schedule's
theory, over the span, is (p-1)/(m+p-1) = 0.11.

A rank's measurements (run.json strategy_measurements) may carry `step_windows`: per steady step, (start, end,
work, p2p) in seconds of the host's wall clock, where work is the time it computed and p2p the time it posted
sends and receives; `span_group` names the ranks that step together (a pipeline replica) and `host` the clock the
times read (the running kernel's boot id: containers on one machine share it, two machines do not). Where every
rank of a group is on one host and has the same number of windows, each rank's `bubble_measured` and
`p2p_measured` become the median over steps of 1 - (work + p2p) / span and p2p / span,
span = the group's last end - its first start; otherwise (ranks on several hosts: clocks that do not agree) they
stay the rank's own. The windows, groups and hosts themselves are dropped from what is written."""

from __future__ import annotations

import socket
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any, cast

Window = tuple[float, float, float, float]  # start, end, work, p2p


def idle_over_span(per_rank: list[dict[str, Any] | None]) -> list[dict[str, Any] | None]:
    """Every rank's measurements with its idle and p2p fractions over its group's step spans (the module says
    how), `step_windows` left out."""
    groups: dict[Any, list[int]] = defaultdict(list)
    for rank, measured in enumerate(per_rank):
        if measured and measured.get("step_windows") is not None:
            groups[measured.get("span_group")].append(rank)
    out: list[dict[str, Any] | None] = [dict(m) if m is not None else None for m in per_rank]
    for ranks in groups.values():
        mine = [cast(dict, out[r]) for r in ranks]
        windows: list[list[Window]] = [m["step_windows"] for m in mine]
        if len({m.get("host") for m in mine}) == 1 and len({len(w) for w in windows}) == 1 and windows[0]:
            spans = [max(w[k][1] for w in windows) - min(w[k][0] for w in windows) for k in range(len(windows[0]))]
            for measured, own in zip(mine, windows):
                steps = [(work, p2p, span) for (_, _, work, p2p), span in zip(own, spans) if span > 0]
                if steps:
                    measured["bubble_measured"] = statistics.median(max(0.0, 1.0 - (work + p2p) / span)
                                                                    for work, p2p, span in steps)
                    measured["p2p_measured"] = statistics.median(p2p / span for _, p2p, span in steps)
    for measured in out:
        if measured:
            for key in ("step_windows", "span_group", "host"):
                measured.pop(key, None)
    return out


def clock_id() -> str:
    """Which wall clock this process reads: the running kernel's boot id (processes in containers of one machine
    share it; two machines, even of one hostname, do not), else the hostname."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return socket.gethostname()
