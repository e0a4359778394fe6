"""Step time of a layout on a cluster, predicted from the model's shapes, the layout's collectives and a hardware
profile: compute, communication and what hides it, a pipeline's bubble, the optimizer step, offload traffic.

Each rule is written once, here, with its source:
- compute: a step's FLOPs (toolkit/cost/flops.py) at the profile's fitted efficiency (else MATMUL_EFFICIENCY) of
  its dense peak in the recipe's precision, or at the matmul FLOP/s `toolkit calibrate` measured, attention at
  the rate it measured for the sequence length;
- a collective: the ring algorithm's bytes and steps (collectives.wire_time_s) at the bandwidth of the links its
  group crosses (link_bandwidth: NVLink within a node; across nodes one NIC per rank of the group in a node),
  at BUS_EFFICIENCY of their datasheet bandwidth (or the bus bandwidth calibrate measured); on a group of one
  rank (ZeRO at world size 1 still calls one per gradient bucket) its local copies and, on a CPU, a fixed cost a
  call (local_call_s);
- overlap (Collective.overlap):
    compute   FSDP2 and ZeRO-3 gather the next unit while one computes and reduce its gradients while the next
              one's backward runs (FSDP2's implicit prefetch, torchtitan; ZeRO-3's prefetch bucket): all of it
              hidden behind forward and backward compute except the first gather and the last reduction;
    backward  DDP's buckets (Li et al., "PyTorch Distributed", VLDB 2020) and ZeRO-1/2's overlap_comm reduce
              while backward runs: hidden behind backward compute except the last bucket;
    attention context parallel's ring passes keys and values on while the rank attends to the block it holds
              (torch's _templated_ring_attention): hidden behind the attention's compute (forward, backward and a
              recompute's forward), the first pass of each kind as exposed as the first gather above;
    nothing   exposed in full; and so is everything on a profile whose collectives share the compute's cores
              (Hardware.overlaps_communication: calibrate's cpu profile, gloo);
- pipeline: each rank computes its stages; idle its schedule's bubble (pipeline/schedules.theoretical_bubble) of
  its micro-batches' time (compute, and on a CPU profile the loss and the ops' host time);
- a collective that runs one step in `every` (local SGD's sync): 1/every of its time in each step;
- encoding (Collective.codec_flops, codec_bytes: PowerSGD's products and error feedback): its FLOPs at the fp32
  matmul rate and its bytes at the memory bandwidth, all exposed (DDP runs the hook between backward's buckets);
- the loss (a causal LM's cross-entropy over its logits, forward and backward): memory-bound passes a GEMM rate
  does not count, at the seconds per logit calibrate measured (a CPU profile; on a GPU the fitted efficiency
  covers them), on every rank that computes the logits (each TP rank computes them all, or its 1/tp of the
  vocabulary's under strategy.loss_parallel);
- the other ops (Work.ops_per_micro_batch: norms, activations, views, the optimizer's hooks not included): a fixed
  host time each, measured by calibrate on the model's own block (cost/op_cost.py; a CPU profile, where at small
  shapes it is half a step); on a GPU the host runs ahead of the device, uncharged;
- host time around a collective's calls (Collective.host_s: ZeRO-3's hooks), exposed where the host also
  computes (a profile without overlaps_communication: a CPU); on a GPU the host runs ahead of the device, uncharged;
- optimizer step: memory-bound, AdamW reads a parameter, its gradient and two moments and writes three;
- offload: gradients to the host and parameters back over PCIe each step, the update at HOST_ADAM_BYTES_PER_S.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from torch import nn

from toolkit.config.parallel import MESH_ORDER, Degrees
from toolkit.cost.collectives import Collective, wire_time_s
from toolkit.cost.flops import model_flops
from toolkit.cost.hardware import Hardware

# fitted on published runs by benchmarks/scale_prediction.py (its leave-one-source-out error beside the fit)
MATMUL_EFFICIENCY = 0.5  # achieved / dense peak FLOP/s of a training step, where neither calibration nor a fit says
BUS_EFFICIENCY = 0.8  # achieved / datasheet bandwidth of a collective's link, uncalibrated
HOST_ADAM_BYTES_PER_S = 20e9  # a GPU's share of its host's memory bandwidth for an offloaded AdamW (estimate)


@dataclass(frozen=True, kw_only=True)
class Cluster:
    hardware: Hardware
    num_nodes: int
    gpus_per_node: int

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.gpus_per_node


@dataclass(frozen=True, kw_only=True)
class Cost:
    what: str  # "compute", "all-gather parameters over dp_shard (network)", "pipeline bubble", ...
    seconds: float  # its whole time
    exposed_s: float  # what it adds to the step


@dataclass(frozen=True, kw_only=True)
class StepTime:
    step_time_s: float
    tokens_per_step: int  # the global batch's tokens
    tokens_per_s_per_gpu: float
    mfu: float  # the model's FLOPs (no recompute) per second per GPU over the dense peak
    costs: list[Cost] = field(default_factory=list)

    def largest(self, count: int = 3) -> list[str]:
        """The `count` largest exposed costs as 'what 31 %' of the step."""
        ranked = sorted(self.costs, key=lambda c: c.exposed_s, reverse=True)[:count]
        return [f"{c.what} {100 * c.exposed_s / self.step_time_s:.0f} %" for c in ranked if c.exposed_s > 0]


@dataclass(frozen=True, kw_only=True)
class Work:
    """What one rank does in a step, from the layout (toolkit/plan/scale.py work_for_shapes builds it)."""
    degrees: Degrees
    global_tokens: int  # the global batch's tokens (samples × sequence length)
    seq_len: int
    precision: str  # bf16 | fp16 | fp32
    checkpointing: str  # none | full | selective (train.activation_checkpointing)
    num_micro_batches: int  # per rank per step (a pipeline's schedule runs them)
    bubble: float = 0.0  # a pipeline's idle fraction of the step, its schedule's (pipeline/schedules.py)
    collectives: list[Collective]  # the rank's, with the loop's
    optimizer_bytes: int  # what the rank's optimizer step reads and writes
    offloaded_bytes: int  # parameters and gradients crossing PCIe each step (0 without offload)
    vocab_split: bool = False  # the output layer and the loss split over the tp ranks (strategy.loss_parallel)
    # a pipeline rank as its split cuts it: (its stages' share of the blocks, its share of the head: 1 or 0, or
    # under strategy.split_head its rows'); None: an even 1/pp of the blocks beside the head
    pipeline_rank: tuple[float, float] | None = None
    # the ops each micro-batch dispatches on the rank beside its matmuls and attention kernels
    # (memory/activations.py traced_ops): a fixed host time each where a profile measured one (a CPU)
    ops_per_micro_batch: int = 0


def predict(model: nn.Module, work: Work, cluster: Cluster, *, compute_efficiency: float | None = None,
            bus_efficiency: float = BUS_EFFICIENCY) -> StepTime:
    """The step time of the rank `work` describes (plan/scale.py busiest_work: a pipeline's slowest rank).
    `compute_efficiency`: default the profile's fitted one, else MATMUL_EFFICIENCY (a calibrated profile's measured
    matmul FLOP/s win over both)."""
    d, hw = work.degrees, cluster.hardware
    efficiency = compute_efficiency or hw.compute_efficiency or MATMUL_EFFICIENCY
    flops = model_flops(model, seq_len=work.seq_len, checkpointing=work.checkpointing)
    shard_tokens = work.global_tokens / (d.world_size / (d.tp * d.cp * d.pp))  # one data shard's tokens
    # a rank computes its share of the blocks (1/tp of each split layer, 1/cp of the sequence, 1/pp of the
    # stack) and, on the last stage, the head: replicated over tp (every TP rank computes the full logits), or its
    # 1/tp of the vocabulary's under strategy.loss_parallel
    head_share = d.tp if work.vocab_split else 1
    blocks = flops.block_matmul + flops.attention + flops.recompute
    # a pipeline rank's stages, by the split (the default balances a tp rank's FLOPs: the head's stage holds fewer
    # blocks); without one, 1/pp of the blocks beside the head
    share, head = work.pipeline_rank or (1 / d.pp, 1.0)
    rank_flops = shard_tokens / d.cp * (blocks * share / d.tp + head * flops.head_matmul / head_share)
    # attention at the rate calibrate measured for this sequence length, where it did; the rest as matmuls
    attention = shard_tokens / d.cp * flops.attention * share / d.tp * (4 / 3 if work.checkpointing == "full" else 1)
    attention_rate = _attention_flops_per_s(hw, work.seq_len)
    if attention_rate is None:
        compute_s = rank_flops / _flops_per_s(hw, work.precision, efficiency)
        attention_s = attention / _flops_per_s(hw, work.precision, efficiency)
    else:
        attention_s = attention / attention_rate
        compute_s = (rank_flops - attention) / _flops_per_s(hw, work.precision, efficiency) + attention_s
    forward_s = compute_s * (1 / 3) * (flops.total - flops.recompute) / flops.total
    backward_s = compute_s - forward_s
    costs = [Cost(what="compute", seconds=compute_s, exposed_s=compute_s)]
    loss_rate = hw.measured.loss_seconds_per_logit
    if loss_rate and flops.logits and head:  # measured: the loss's passes over the logits (a pipeline's last stage)
        loss_s = shard_tokens / d.cp * flops.logits / head_share * loss_rate * head
        costs.append(Cost(what="loss over the logits", seconds=loss_s, exposed_s=loss_s))
    per_op = hw.measured.seconds_per_op
    if per_op and work.ops_per_micro_batch:  # a CPU: each op's Python, autograd and dispatch, beside its arithmetic
        ops_s = work.ops_per_micro_batch * work.num_micro_batches * per_op
        costs.append(Cost(what="ops outside the matmuls (host time each)", seconds=ops_s, exposed_s=ops_s))
    if d.pp > 1:  # idle in proportion to the time its micro-batches take: their compute, loss and ops
        idle = sum(c.seconds for c in costs) * work.bubble / (1 - work.bubble)
        costs.append(Cost(what="pipeline bubble", seconds=idle, exposed_s=idle))
    costs += _communication(work.collectives, d, cluster, forward_s=forward_s, backward_s=backward_s,
                            attention_s=attention_s, bus_efficiency=bus_efficiency)
    host_s = sum(c.host_s / c.every for c in work.collectives)
    if host_s and not hw.overlaps_communication:
        costs.append(Cost(what="host time around the collectives", seconds=host_s, exposed_s=host_s))
    bandwidth = hw.measured.memory_bandwidth_bytes_per_s or hw.memory_bandwidth_bytes_per_s  # device memory
    for c in work.collectives:  # encoding what a collective sends: on the critical path, its compute and memory
        if c.codec_flops or c.codec_bytes:
            codec_s = (c.codec_flops / _flops_per_s(hw, "fp32", efficiency) + c.codec_bytes / bandwidth) / c.every
            costs.append(Cost(what=f"encoding {c.what}", seconds=codec_s, exposed_s=codec_s))
    if not work.offloaded_bytes:  # on the device, at its memory bandwidth
        step_s = work.optimizer_bytes / bandwidth
        costs.append(Cost(what="optimizer step", seconds=step_s, exposed_s=step_s))
    else:
        pcie = work.offloaded_bytes / hw.host_link.bandwidth_bytes_per_s
        host = work.optimizer_bytes / HOST_ADAM_BYTES_PER_S
        costs.append(Cost(what="offload over PCIe and host AdamW", seconds=pcie + host, exposed_s=pcie + host))
    total = sum(c.exposed_s for c in costs)
    per_gpu = work.global_tokens / total / d.world_size
    mfu = per_gpu * flops.model_flops / hw.peak(work.precision)
    return StepTime(step_time_s=total, tokens_per_step=work.global_tokens, tokens_per_s_per_gpu=per_gpu, mfu=mfu,
                    costs=costs)


def _attention_flops_per_s(hw: Hardware, length: int) -> float | None:
    """The measured attention rate at `length` (interpolated on log length), None where calibrate measured none."""
    rates = hw.measured.attention_flops_per_s
    return _interpolated(rates, length) if rates else None


def _interpolated(points_by_key: dict[str, float], at: float) -> float:
    """A measured rate at `at`, from rates measured at some sizes (or lengths): linear in log size between the
    nearest two, the nearest one outside their range."""
    points = sorted((float(k), v) for k, v in points_by_key.items())
    if at <= points[0][0]:
        return points[0][1]
    for (a, rate_a), (b, rate_b) in zip(points, points[1:]):
        if at <= b:
            t = (math.log(at) - math.log(a)) / (math.log(b) - math.log(a))
            return rate_a + t * (rate_b - rate_a)
    return points[-1][1]


def _flops_per_s(hw: Hardware, precision: str, efficiency: float) -> float:
    """The step's compute rate: the fitted efficiency of the peak (it covers the step's non-GEMM work too), capped
    by the GEMM rate calibrate measured, an upper bound (a CPU profile's peak is that rate, its efficiency 1)."""
    fitted = hw.peak(precision) * efficiency
    measured = hw.measured
    if measured.matmul_flops_per_s and measured.matmul_dtype == precision:
        return min(measured.matmul_flops_per_s, fitted)
    return fitted


def ranks_per_node(group: str, size: int, degrees: Degrees, gpus_per_node: int) -> int:
    """How many of a group's `size` ranks share a node: all of them where the group fits in one (the ranks lie in
    MESH_ORDER, tp innermost, so a group's ranks are `stride` apart, stride the product of the dimensions inside
    it), else the node's GPUs over the stride."""
    if group == "world":
        stride = 1
    elif group in ("dp_shard", "dp_shard_cp"):  # FSDP shards over dp_shard × cp as one dimension (its size says so)
        stride = degrees.tp
    else:
        stride = 1
        for name in MESH_ORDER[MESH_ORDER.index(group) + 1:] if group in MESH_ORDER else ():
            stride *= getattr(degrees, name)
    if stride * size <= gpus_per_node:
        return size
    return max(1, gpus_per_node // stride)


def link_bandwidth(hw: Hardware, *, size: int, per_node: int, bus_efficiency: float) -> tuple[float, float, str]:
    """(bytes/s, latency, where) of a collective's ring over `size` ranks, `per_node` of them in each node. Within
    a node: the GPU's NVLink share (or the bus bandwidth calibrate measured). Across nodes NCCL runs one ring per
    NIC (its channels), so a node's `per_node` ranks send through as many NICs at once: the ring moves at the
    lesser of the in-node link and per_node × one NIC (a replica group of one rank per node: one NIC)."""
    inside = hw.measured.bus_bandwidth_bytes_per_s or hw.intra_node.bandwidth_bytes_per_s * bus_efficiency
    if per_node >= size:
        return inside, hw.intra_node.latency_s, "in node"
    across = per_node * hw.inter_node.bandwidth_bytes_per_s * bus_efficiency
    return min(inside, across), hw.inter_node.latency_s, "network"


def _communication(collectives: list[Collective], degrees: Degrees, cluster: Cluster, *, forward_s: float,
                   backward_s: float, attention_s: float, bus_efficiency: float) -> list[Cost]:
    hw = cluster.hardware
    timed: list[tuple[Collective, float, str]] = []
    memory = hw.measured.memory_bandwidth_bytes_per_s or hw.memory_bandwidth_bytes_per_s
    for c in collectives:
        if not c.calls:  # none made (ZeRO-3's gathers on one rank: its host time is still charged, below)
            continue
        if c.group_size <= 1 and c.kind != "send":  # a call on one rank (ZeRO at world size 1): nothing on a link
            timed.append((c, local_call_s(c, memory_bytes_per_s=memory, host_computes=not hw.overlaps_communication)
                          / c.every, "in rank"))
            continue
        per_node = ranks_per_node(c.group, c.group_size, degrees, cluster.gpus_per_node)
        bandwidth, latency, where = link_bandwidth(hw, size=c.group_size, per_node=per_node,
                                                   bus_efficiency=bus_efficiency)
        measured = (hw.measured.bus_bandwidth_by_kind or {}).get(c.kind)
        if measured and where == "in node":  # the collective's own rate at its message size, where measured
            bandwidth = _interpolated(measured, c.payload_bytes / max(c.calls, 1))
        # one step in `every` (local SGD's sync): a step's mean share
        timed.append((c, wire_time_s(c, bandwidth_bytes_per_s=bandwidth, latency_s=latency) / c.every, where))
    costs = []
    # each kind hides behind the compute it runs beside; the two windows share backward's time, since a layout has
    # one kind or the other (FSDP2 and ZeRO-3 prefetch through both passes; DDP and ZeRO-1/2 reduce in backward); a
    # ring's passes hide behind the attention alone, which the gathers' window also holds: both counted there, as
    # two streams of transfers, each beside the compute
    window = {"compute": forward_s + backward_s, "backward": backward_s, "attention": attention_s}
    if not hw.overlaps_communication:  # gloo on CPU cores: nothing hides behind compute
        window = dict.fromkeys(window, 0.0)
    for overlap, hidden_by in window.items():
        group = [(c, s, where) for c, s, where in timed if c.overlap == overlap]
        total = sum(s for _, s, _ in group)
        # what the window cannot hold, and at least the first gather (the last bucket) of each, which has nothing
        # to hide behind
        edges = sum(s / max(c.calls, 1) for c, s, _ in group)
        exposed = min(total, max(total - hidden_by, edges))
        for c, s, where in group:
            share = exposed * s / total if total else 0.0
            costs.append(Cost(what=_name(c, where), seconds=s, exposed_s=share))
    costs += [Cost(what=_name(c, where), seconds=s, exposed_s=s) for c, s, where in timed if c.overlap == "nothing"]
    return costs


ONE_RANK_CALL_S = 0.22e-3  # a collective call on a one-rank gloo group, beyond its payload's passes (see below)


def local_call_s(c: Collective, *, memory_bytes_per_s: float, host_computes: bool) -> float:
    """A collective's calls on a group of one rank: nothing crosses a link, but each call still copies and averages
    its payload, three passes over it at the memory bandwidth, and where the host computes (a CPU) pays the
    library's fixed cost of a call. Fitted on this CPU (ZeRO-3 at world size 1, `python
    benchmarks/zero3_host_time.py --nproc 1`, time inside its 1-rank reduce-scatters, 2026-12-06): llama-tiny 23 ms
    a step for 62 calls of 37 MB, minilm-sst 67 for 96 of 182 MB give 0.22 ms a call and 3.0 passes; the other
    two cases then come within 10 % (minilm at micro 8: 133 ms predicted, 138 measured; moe-tiny 23, 21). On a
    GPU the passes alone, at its memory bandwidth: NCCL's cost of a call on one GPU has not been measured here."""
    return 3 * c.payload_bytes / memory_bytes_per_s + (c.calls * ONE_RANK_CALL_S if host_computes else 0.0)


def _name(c: Collective, where: str) -> str:
    group = "dp_shard × cp" if c.group == "dp_shard_cp" else c.group  # FSDP's one dimension of the two, under cp
    return f"{c.kind.replace('_', '-')} {c.what} over {group} ({where})"
