"""Paper estimate of data-parallel scaling on 4 and 8 GPUs: FLOPs, gradient bytes, ring all-reduce time, efficiency.

Nothing runs on a GPU; the hardware figures below are assumptions, explained in docs/gpu.md.

    python -m scripts.gpu_estimate           # tables
    python -m scripts.gpu_estimate --json    # the same figures as JSON
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass

import paddle
from paddle import nn
from paddle.base import core

from paddle_mnist.config import PER_WORKER_BATCH
from paddle_mnist.network.models import build_model, count_parameters
from scripts.plain_loop import image_shape

Costs = list[tuple[int, list[str]]]  # per layer, in forward call order: (multiply-adds per image, its parameter names)
Buckets = list[list[tuple[str, int]]]  # in all-reduce order: [(parameter name, gradient bytes), ...]

BATCH = PER_WORKER_BATCH  # per GPU: the trainer's default
GRAD_BYTES = 4  # fp32 gradients: parameters stay fp32 under the trainer's --amp (auto_cast level O1)
GPUS = (4, 8)
MIB = 1024 * 1024  # DataParallel's "MB" is int(size * 1024 * 1024) bytes


@dataclass(frozen=True)
class Link:
    name: str
    bus_gb_s: float  # achieved NCCL all-reduce bus bandwidth on large messages, 1e9 bytes/s
    latency_us: dict[int, float]  # time of one tiny all-reduce, by GPU count


@dataclass(frozen=True)
class Rate:
    name: str
    tflops: float  # achieved forward+backward FLOP/s per GPU, counting conv and linear FLOPs only
    models: tuple[str, ...]  # the models it is applied to


LINKS = (
    Link("NVLink (H100 SXM)", 370.0, {4: 17.0, 8: 34.0}),
    Link("PCIe 4.0 x16", 20.0, {4: 25.0, 8: 45.0}),
    Link("PCIe 3.0 x16", 10.0, {4: 25.0, 8: 45.0}),
)
PADDLE_US_PER_BUCKET = 10.0  # Paddle's reducer per bucket: concat into one buffer, scale by 1/N, split back
HOST_US_PER_OP = 10.0  # eager dispatch + CUDA launch per op (5-7 us measured for tiny CPU ops here, plus launch)
OPS_PER_STEP = {"mnist_cnn": 47, "minigooglenet": 389, "cifar_cnn": 87}  # paddle.profiler, one CPU training step
MODELS = tuple(OPS_PER_STEP)  # the models estimated: those whose operators per step were counted
TUTORIAL = {"epoch_s_1gpu": 63.0, "epoch_s_4gpu": 16.0, "train_images": 50_000}
H100_TFLOPS = 20.0
BUFFERS = ((25, 1.0), (2, 1.0), (25, 0.25), (4, 0.25), (2, 0.25), (1, 0.25), (2, 0.1))  # (comm, last) MB
RECOMMENDED = (2, 0.25)


def layer_costs(model: nn.Layer, shape: tuple[int, int, int]) -> Costs:
    """Forward multiply-adds per image of each Conv2D, Linear and BatchNorm2D, with its trainable parameters."""
    costs: Costs = []

    def hook(layer, _inputs, out):
        per_image = int(out.size) // int(out.shape[0])
        if isinstance(layer, nn.Conv2D):
            macs = per_image * int(layer.weight.size) // int(layer.weight.shape[0])  # each output: Cin/g*kh*kw
        elif isinstance(layer, nn.Linear):
            macs = int(layer.weight.size)
        else:
            macs = per_image  # batch norm folded to one multiply-add per element
        costs.append((macs, [p.name for p in layer.parameters(include_sublayers=False) if p.trainable]))

    handles = [
        layer.register_forward_post_hook(hook)
        for layer in model.sublayers()
        if isinstance(layer, (nn.Conv2D, nn.Linear, nn.BatchNorm2D))
    ]
    model.eval()
    with paddle.no_grad():
        model(paddle.zeros([1, *shape]))
    for h in handles:
        h.remove()
    return costs


def buckets(model: nn.Layer, comm_mb: float, last_mb: float) -> Buckets:
    """DataParallel's gradient buckets, made by the grouping function it calls, in the order they are all-reduced."""
    params, seen = [], set()
    for layer in model.sublayers(include_self=True):  # the order DataParallel.init_reducer walks
        for p in layer.parameters(include_sublayers=False):
            if p.trainable and p.name not in seen:
                seen.add(p.name)
                params.append(p)
    groups = core.eager_assign_group_by_size(params, [False] * len(params), [int(last_mb * MIB), int(comm_mb * MIB)])
    return [[(params[i].name, int(params[i].size) * GRAD_BYTES) for i in g] for g in reversed(groups)]


def allreduce_s(nbytes: int, gpus: int, link: Link) -> float:
    """One bucket: NCCL's latency floor, Paddle's fuse/scale/split kernels, and 2(N-1)/N x bytes / bus bandwidth."""
    fixed_us = link.latency_us[gpus] + PADDLE_US_PER_BUCKET
    return fixed_us * 1e-6 + 2 * (gpus - 1) / gpus * nbytes / (link.bus_gb_s * 1e9)


def exposed_comm_s(costs: Costs, groups: Buckets, backward_s: float, gpus: int, link: Link) -> float:
    """Communication left after backward ends: buckets start when their last gradient is ready, one at a time."""
    total = sum(m for m, _ in costs) or 1
    ready, t = {}, 0.0
    for macs, names in reversed(costs):  # backward visits layers in reverse; time shared out by FLOPs
        t += backward_s * macs / total
        ready.update({n: t for n in names})
    end = 0.0
    for g in groups:
        start = max(end, max(ready.get(n, backward_s) for n, _ in g))
        end = start + allreduce_s(sum(b for _, b in g), gpus, link)
    return max(0.0, end - backward_s)


def estimate(name: str, rates: list[Rate]) -> dict:
    shape = image_shape(name)
    model = build_model(name, 10, shape)
    costs = layer_costs(model, shape)
    macs = sum(m for m, _ in costs)
    grad_bytes = count_parameters(model) * GRAD_BYTES
    fwd_flops = 2 * macs
    host_s = OPS_PER_STEP[name] * HOST_US_PER_OP * 1e-6
    batch_norms = sum(isinstance(x, nn.BatchNorm2D) for x in model.sublayers())
    plans = {f"{c},{last}": buckets(model, c, last) for c, last in BUFFERS}
    rows = []
    for rate in (r for r in rates if name in r.models):
        compute_s = BATCH * 3 * fwd_flops / (rate.tflops * 1e12)
        step_s = max(compute_s, host_s)  # dygraph: a step takes at least the host's time to issue its ops
        for link in LINKS:
            for n in GPUS:
                comm = allreduce_s(grad_bytes, n, link)
                exposed = {k: exposed_comm_s(costs, g, compute_s * 2 / 3, n, link) for k, g in plans.items()}
                rows.append(
                    {
                        "rate": rate.name,
                        "link": link.name,
                        "gpus": n,
                        "compute_ms": compute_s * 1e3,
                        "step_ms": step_s * 1e3,
                        "allreduce_ms": comm * 1e3,
                        "eff_no_overlap": step_s / (step_s + comm),
                        "eff_full_overlap": step_s / max(step_s, comm),
                        # exposed communication extends the GPU's work; a host-bound step has idle GPU time to hide it
                        "eff_buckets": {k: step_s / max(host_s, compute_s + e) for k, e in exposed.items()},
                        "exposed_us": {k: e * 1e6 for k, e in exposed.items()},
                        # --sync-bn: one small all-reduce per batch norm in forward and one in backward, not hidden
                        "sync_bn_ms": 2 * batch_norms * link.latency_us[n] * 1e-3,
                    }
                )
    return {
        "model": name,
        "params": count_parameters(model),
        "grad_bytes": grad_bytes,
        "fwd_gflops": fwd_flops / 1e9,
        "train_gflops": 3 * fwd_flops / 1e9,
        "host_floor_ms": host_s * 1e3,
        "batch_norms": batch_norms,
        "buckets": {k: [round(sum(b for _, b in g) / MIB, 3) for g in gs] for k, gs in plans.items()},
        "rows": rows,
    }


def tutorial_rate() -> Rate:
    """The tutorial GPU's achieved FLOP/s: MiniGoogLeNet's training FLOPs per image x its images per second."""
    images_s = TUTORIAL["train_images"] / TUTORIAL["epoch_s_1gpu"]
    shape = image_shape("minigooglenet")
    macs = sum(m for m, _ in layer_costs(build_model("minigooglenet", 10, shape), shape))
    return Rate("tutorial GPU", images_s * 3 * 2 * macs / 1e12, ("minigooglenet",))


def report(results: list[dict], rates: list[Rate]) -> None:
    key = f"{RECOMMENDED[0]},{RECOMMENDED[1]}"
    print("achieved rates: " + ", ".join(f"{r.name} {r.tflops:.2f} TFLOP/s" for r in rates))
    print(f"tutorial: {TUTORIAL['epoch_s_1gpu'] / TUTORIAL['epoch_s_4gpu']:.2f}x on 4 GPUs (63 s -> 16 s per epoch)")
    print(f"\n{'model':<14}{'params':>10}{'grad MB':>9}{'fwd GFLOP':>11}{'f+b GFLOP':>11}{'host ms':>9}")
    for r in results:
        g = r["grad_bytes"] / 1e6
        print(f"{r['model']:<14}{r['params']:>10,}{g:>9.3f}{r['fwd_gflops']:>11.4f}{r['train_gflops']:>11.4f}", end="")
        print(f"{r['host_floor_ms']:>9.2f}")
    print(f"\nper-GPU batch {BATCH}; eff = 1 GPU step / N GPU step; speedup = N x eff (buckets {key} MB)")
    head = f"{'model':<14}{'rate':<14}{'link':<19}{'N':>2}{'GPU ms':>8}{'step ms':>8}{'AR ms':>8}"
    print(head + f"{'no-ovl':>8}{'full':>7}{'dflt':>7}{'rec':>7}{'speedup':>8}")
    for r in results:
        for w in r["rows"]:
            print(f"{r['model']:<14}{w['rate']:<14}{w['link']:<19}{w['gpus']:>2}", end="")
            print(f"{w['compute_ms']:>8.2f}{w['step_ms']:>8.2f}", end="")
            print(f"{w['allreduce_ms']:>8.3f}{w['eff_no_overlap']:>8.1%}{w['eff_full_overlap']:>7.1%}", end="")
            b = w["eff_buckets"]
            print(f"{b['25,1.0']:>7.1%}{b[key]:>7.1%}{w['gpus'] * b[key]:>7.2f}x")
    print("\nDataParallel(comm_buffer_size, last_comm_buffer_size) in MB: all-reduce time left after backward (us)")
    print("at the H100 rate on 8 GPUs; bucket sizes in MiB, in all-reduce order")
    print(f"{'model':<14}{'buffers':<9}" + "".join(f"{x.name.split(' (')[0]:>13}" for x in LINKS) + "  buckets")
    for r in results:
        rows = [w for w in r["rows"] if w["rate"] == "H100 assumed" and w["gpus"] == 8]
        for k, sizes in r["buckets"].items():
            print(f"{r['model']:<14}{k:<9}" + "".join(f"{w['exposed_us'][k]:>13.0f}" for w in rows) + f"  {sizes}")
    print("\n--sync-bn adds 2 all-reduces per batch norm per step on the critical path (latency-bound):")
    for r in (r for r in results if r["batch_norms"]):
        for w in (w for w in r["rows"] if w["rate"] == "H100 assumed"):
            eff = w["step_ms"] / (w["step_ms"] / w["eff_buckets"][key] + w["sync_bn_ms"])
            print(f"  {r['model']} ({r['batch_norms']} BN) {w['link']:<19}{w['gpus']} GPUs: ", end="")
            print(f"+{w['sync_bn_ms']:.2f} ms per step, eff {eff:.1%}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    args = p.parse_args()
    rates = [tutorial_rate(), Rate("H100 assumed", H100_TFLOPS, tuple(MODELS))]
    results = [estimate(name, rates) for name in MODELS]
    if args.json:
        assumptions = {"links": [asdict(x) for x in LINKS], "rates": [asdict(x) for x in rates]}
        assumptions.update(batch=BATCH, host_us_per_op=HOST_US_PER_OP, paddle_us_per_bucket=PADDLE_US_PER_BUCKET)
        print(json.dumps({"assumptions": assumptions, "models": results}, indent=1))
    else:
        report(results, rates)
    return 0


if __name__ == "__main__":
    sys.exit(main())
