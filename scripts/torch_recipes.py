"""Search cifar_fast's recipe on a GPU, in PyTorch: many short CIFAR-10 trainings side by side.

The trainer's record attempts (90% on CIFAR-10 in 30 minutes on two CPU cores) take 25-30 minutes each; a GPU
runs the same network and recipe in seconds. This script mirrors the trainer's `cifar_fast` (models.CifarFast,
whiten.py, the recipe in config.py: SGD momentum, linear warmup then linear decay, label smoothing, 2 px shifts
and flips, flip TTA) in PyTorch, and trains variants of it, several at once on one GPU, on the CIFAR-10 JPEG copy.
What it finds is a lead: a variant is adopted only after the trainer itself has run it on the CPU.

    python -m scripts.torch_recipes prepare ../shared/data/cifar10-jpeg/cifar10-jpeg.tar.gz /tmp/cifar.npz
    python -m scripts.torch_recipes search /tmp/cifar.npz --out runs.jsonl --budget 400 --workers 4

`--base airbench` makes airbench94's network and recipe (AIRBENCH) what `--variants` change: its pieces are knobs
of BASE, off there, so each can be tried alone or taken away (docs/results.md, "The frontier").

`prepare` needs Pillow; `search` needs only PyTorch and numpy. Phase 1 trains each change to the base recipe
alone (3 seeds); phase 2 combines the changes that helped, at several widths and epoch counts. Each run appends
one JSON line: the variant, the seed, the test accuracy after each epoch and the seconds from the run's start to
the end of that evaluation, the final accuracy with the variant's TTA, the training FLOPs and the seconds it took.
`time` trains the trainer's record recipe (RECORD) once on the CPU, threads from OMP_NUM_THREADS: the PyTorch side
of `python -m scripts.time_to_accuracy --torch-python PYTHON` (docs/results.md):

    OMP_NUM_THREADS=2 python -m scripts.torch_recipes time /tmp/cifar.npz --seed 1
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import math
import os
import sys
import tarfile
import time

import numpy as np

BASE = {
    "widths": (64, 128, 256),
    "stem": 32,
    "epochs": 10,
    "batch": 256,
    "lr": 0.2,
    "momentum": 0.9,
    "nesterov": False,
    "wd": 5e-4,
    "warmup": 0.5,
    "smoothing": 0.2,
    "whiten": True,
    "shift": 2,
    "flip": "random",  # or "alternate": each image flipped on every other epoch
    "tta": "flip",  # "none", "flip", or "shift": flip plus 1 px shifts
    "ema": 0.0,  # decay per step of an average of the weights, evaluated instead of them (0: off)
    "val": 0.1,  # share of the training images held out, as the trainer's folder --val-split does
    "act": "relu",
    "bn_momentum": 0.1,  # PyTorch's convention; Paddle's 0.9 is this
    "logit_scale": 1 / 8,
    # airbench94's pieces (Jordan, 2024), off in BASE; AIRBENCH below switches them all on
    "arch": "ours",  # "airbench": a frozen 2x2 whitening conv of 24 channels, GELU, groups conv-pool-BN-act-conv-BN-act
    "conv_bias": True,  # the convolutions before batch norm carry a bias
    "bn_scale": True,  # batch norm learns its scale; False: fixed at 1 (every conv weight is then scale-free)
    "bn_eps": 1e-5,
    "bias_lr": 1.0,  # batch norm biases train at this multiple of lr, with weight decay divided by it
    "dirac": False,  # each conv's first in-channels filters start as the identity
    "lookahead": False,  # every 5 steps the weights move to an average that ramps up over the run (airbench's)
    "schedule": "linear",  # "linear": warmup then linear decay to 0; "triangle": 0.2 -> 1 at 23% -> 0.07
    "pad": "zeros",  # how the training shifts pad: "zeros" (the trainer's) or "reflect"
    "whiten_bias_epochs": 0,  # arch airbench: epochs the whitening conv's bias trains (its weight never does)
    "whiten_width": 24,  # arch airbench: the whitening conv's channels (24: each of 12 directions and its negative)
    "order": "airbench",  # arch airbench: "ours" puts each group's pool after the first conv's BN and activation
}

# airbench94's recipe in this script's terms: its lr 11.5 and weight decay 0.0153 per 1024 examples of a summed loss
# with momentum 0.85 are a mean loss's lr 11.5 / (1 + 1 / 0.15) = 1.5 and weight decay 0.0153 / 7.67 / 1.5
AIRBENCH = {
    "arch": "airbench",
    "widths": (64, 256, 256),
    "epochs": 9.9,
    "batch": 1024,
    "lr": 1.5,
    "momentum": 0.85,
    "nesterov": True,
    "wd": 0.0153 / (1 + 1 / 0.15) / 1.5,
    "smoothing": 0.2,
    "flip": "alternate",
    "tta": "shift",
    "val": 0.0,
    "act": "gelu",
    "bn_momentum": 0.4,
    "logit_scale": 1 / 9,
    "conv_bias": False,
    "bn_scale": False,
    "bn_eps": 1e-12,
    "bias_lr": 64.0,
    "dirac": True,
    "lookahead": True,
    "schedule": "triangle",
    "pad": "reflect",
    "whiten_bias_epochs": 3,
}

# phase 1: each change alone, against BASE
CHANGES = {
    "val0": {"val": 0.0},
    "tta_shift": {"tta": "shift"},
    "ema99": {"ema": 0.99},
    "ema998": {"ema": 0.998},
    "nesterov": {"nesterov": True},
    "alt_flip": {"flip": "alternate"},
    "gelu": {"act": "gelu"},
    "shift4": {"shift": 4},
    "shift1": {"shift": 1},
    "ls0.1": {"smoothing": 0.1},
    "ls0.3": {"smoothing": 0.3},
    "lr0.1": {"lr": 0.1},
    "lr0.4": {"lr": 0.4},
    "batch512": {"batch": 512, "lr": 0.4},
    "batch128": {"batch": 128, "lr": 0.1},
    "wd1e-3": {"wd": 1e-3},
    "wd2.5e-4": {"wd": 2.5e-4},
    "bn0.4": {"bn_momentum": 0.4},
    "mom0.85": {"momentum": 0.85, "nesterov": True},
    "warmup1": {"warmup": 1.0},
    "stem64": {"stem": 64},
    "nowhiten": {"whiten": False},
    "ep12": {"epochs": 12},
    "w64-256-256_ep7": {"widths": (64, 256, 256), "epochs": 7},
    "w64-192-256_ep8": {"widths": (64, 192, 256), "epochs": 8},
    "w96-192-256_ep8": {"widths": (96, 192, 256), "epochs": 8},
    "w64-128-384_ep9": {"widths": (64, 128, 384), "epochs": 9},
}
SEEDS = (0, 1, 2)

# the trainer's record recipe (config.RECIPES["cifar_fast"] with the record command's --val-split 0 --tta-shift)
RECORD = {"lr": 0.4, "nesterov": True, "smoothing": 0.1, "val": 0.0, "epochs": 10, "tta": "shift"}


def train_flops(widths: tuple[int, ...], stem: int, side: int = 32, arch: str = "ours") -> float:
    """Multiply-adds x 2 x 3 (forward and backward) per image of the convolutions and the classifier."""
    if arch == "airbench":
        side -= 1
        macs, channels = side * side * 12 * stem, stem
    else:
        macs, channels = side * side * 3 * stem * 9, stem
    for width in widths:
        macs += side * side * channels * width * 9
        side //= 2
        macs += side * side * width * width * 9
        channels = width
    return 6.0 * (macs + channels * 10)


def prepare(archive: str, out: str, limit: int = 0) -> None:
    """Decode the archive's train/ and test/ class folders (every `limit`-th image of each split only, if given)."""
    from PIL import Image

    images: dict[str, list] = {"train": [], "test": []}
    labels: dict[str, list] = {"train": [], "test": []}
    with tarfile.open(archive) as tar:
        members = sorted((m for m in tar.getmembers() if m.isfile() and m.name.endswith(".jpg")), key=lambda m: m.name)
        classes = sorted({m.name.split("/")[1] for m in members})
        if limit:
            members = members[:: max(len(members) // limit, 1)]
        for m in members:
            split, name = m.name.split("/")[:2]
            with Image.open(io.BytesIO(tar.extractfile(m).read())) as image:
                images[split].append(np.asarray(image.convert("RGB"), np.uint8))
            labels[split].append(classes.index(name))
    np.savez(
        out,
        **{f"{s}_x": np.stack(images[s]).transpose(0, 3, 1, 2) for s in images},
        **{f"{s}_y": np.asarray(labels[s], np.int64) for s in labels},
    )
    print(f"{out}: {len(images['train'])} training and {len(images['test'])} test images, {len(classes)} classes")


@dataclasses.dataclass
class Task:
    name: str
    seed: int
    recipe: dict


def run(task: Task, data: dict, device: str) -> dict:
    import torch
    import torch.nn.functional as F
    from torch import nn

    began = time.perf_counter()  # before the data's split, its statistics and the whitening, as the trainer's time_s
    began_wall = time.time()
    r, seed = task.recipe, task.seed
    torch.manual_seed(seed)
    gen = np.random.default_rng(seed)
    x_all, y_all = data["train_x"], data["train_y"]
    held = np.zeros(len(y_all), bool)
    if r["val"]:
        for c in range(10):
            where = np.flatnonzero(y_all == c)
            held[where[: int(len(where) * r["val"])]] = True
    x_tr, y_tr = x_all[~held], y_all[~held]
    mean = x_tr.reshape(len(x_tr), 3, -1).mean(axis=(0, 2)) / 255
    std = x_tr.reshape(len(x_tr), 3, -1).std(axis=(0, 2)) / 255
    m = torch.tensor(mean, dtype=torch.float32, device=device).view(1, 3, 1, 1)
    s = torch.tensor(std, dtype=torch.float32, device=device).view(1, 3, 1, 1)
    xt = torch.tensor(x_tr, device=device)
    yt = torch.tensor(y_tr, device=device)
    xe = torch.tensor(data["test_x"], device=device)
    ye = torch.tensor(data["test_y"], device=device)

    act = nn.GELU if r["act"] == "gelu" else nn.ReLU
    airbench = r["arch"] == "airbench"

    def conv(cin: int, cout: int) -> nn.Conv2d:
        c = nn.Conv2d(cin, cout, 3, padding=1, bias=r["conv_bias"])
        if not airbench:  # airbench keeps PyTorch's default initialisation
            nn.init.normal_(c.weight, 0, math.sqrt(2 / (cin * 9)))  # Paddle's Conv2D default
        if c.bias is not None:
            nn.init.zeros_(c.bias)
        if r["dirac"]:
            with torch.no_grad():
                nn.init.dirac_(c.weight[: min(cin, cout)])
        return c

    def norm(cout: int) -> nn.BatchNorm2d:
        bn = nn.BatchNorm2d(cout, momentum=r["bn_momentum"], eps=r["bn_eps"])
        bn.weight.requires_grad = r["bn_scale"]
        return bn

    def module(cin: int, cout: int) -> nn.Sequential:
        return nn.Sequential(conv(cin, cout), norm(cout), act())

    if airbench:
        stem = nn.Conv2d(3, r["whiten_width"], 2, padding=0, bias=True)
        stem.weight.requires_grad = False
        layers, channels = [stem, act()], r["whiten_width"]
        for width in r["widths"]:
            if r["order"] == "ours":
                layers += [conv(channels, width), norm(width), act(), nn.MaxPool2d(2)]
            else:
                layers += [conv(channels, width), nn.MaxPool2d(2), norm(width), act()]
            layers += [conv(width, width), norm(width), act()]
            channels = width
    else:
        layers, channels = [module(3, r["stem"])], r["stem"]
        for width in r["widths"]:
            layers += [module(channels, width), nn.MaxPool2d(2), module(width, width)]
            channels = width
    fc = nn.Linear(channels, 10, bias=False)
    nn.init.xavier_uniform_(fc.weight)  # Paddle's Linear default
    model = nn.Sequential(*layers, nn.AdaptiveMaxPool2d(1), nn.Flatten(), fc).to(device)
    model = model.to(memory_format=torch.channels_last)

    if r["whiten"]:  # whiten.py: principal directions of kxk patches, sign-flipped repeats (3x3 ours, 2x2 airbench)
        k, width = (2, r["whiten_width"]) if airbench else (3, r["stem"])
        taken = np.linspace(0, len(x_tr) - 1, 5000 if airbench else 2000).round().astype(np.int64)
        patches = ((torch.tensor(x_tr[taken], device=device).float() / 255 - m) / s).unfold(2, k, 1).unfold(3, k, 1)
        patches = patches.permute(0, 2, 3, 1, 4, 5).reshape(-1, 3 * k * k).double()
        cov = torch.cov(patches.T)
        var, vec = torch.linalg.eigh(cov)
        order = torch.argsort(var, descending=True)
        w = vec[:, order].T / torch.sqrt(var[order].clamp(min=0) + 5e-4)[:, None]
        w = torch.cat([w, -w] * (-(-width // (6 * k * k))))[:width]
        with torch.no_grad():
            first = model[0] if airbench else model[0][0]
            first.weight.copy_(w.float().view(width, 3, k, k))
            if first.bias is not None:
                first.bias.zero_()

    steps_per_epoch = len(x_tr) // r["batch"]  # the trainer drops the last partial batch
    total = int(round(r["epochs"] * steps_per_epoch))
    warm = int(round(r["warmup"] * steps_per_epoch))
    biases = [
        p
        for name, p in model.named_parameters()
        if p.requires_grad
        and isinstance(dict(model.named_modules())[name.rsplit(".", 1)[0]], nn.BatchNorm2d)
        and name.endswith("bias")
    ]
    others = [p for p in model.parameters() if p.requires_grad and all(p is not q for q in biases)]
    opt = torch.optim.SGD(
        [
            {"params": others, "lr": r["lr"], "weight_decay": r["wd"], "scale": 1.0},
            {
                "params": biases,
                "lr": r["lr"] * r["bias_lr"],
                "weight_decay": r["wd"] / r["bias_lr"],
                "scale": r["bias_lr"],
            },
        ],
        lr=r["lr"],
        momentum=r["momentum"],
        nesterov=r["nesterov"],
    )

    def lr_at(step: int) -> float:
        if r["schedule"] == "triangle":
            return r["lr"] * float(np.interp(step, [0, int(0.23 * total), total], [0.2, 1.0, 0.07]))
        if step < warm:
            return r["lr"] * step / warm
        return r["lr"] * max(0.0, 1 - (step - warm) / max(total - warm, 1))

    ahead = {k: v.detach().clone() for k, v in model.state_dict().items()} if r["lookahead"] else None

    def look_ahead(decay: float) -> None:
        with torch.no_grad():
            for k, v in model.state_dict().items():
                if v.dtype.is_floating_point:
                    ahead[k].lerp_(v, 1 - decay)
                    v.copy_(ahead[k])

    ema = None
    if r["ema"]:
        ema = [t.detach().clone() for t in list(model.parameters()) + list(model.buffers())]

    def evaluate(tta: str) -> float:
        live = [t.detach().clone() for t in list(model.parameters()) + list(model.buffers())] if ema else None
        if ema:
            with torch.no_grad():
                for t, e in zip(list(model.parameters()) + list(model.buffers()), ema):
                    t.copy_(e)
        model.eval()
        correct = 0
        with torch.no_grad():
            for lo in range(0, len(ye), 1000):
                x = ((xe[lo : lo + 1000].float() / 255 - m) / s).contiguous(memory_format=torch.channels_last)
                views = [x]
                if tta in ("flip", "shift"):
                    views.append(x.flip(3))
                if tta == "shift":
                    padded = F.pad(x, (1, 1, 1, 1), mode="reflect")
                    for a, b in ((0, 0), (2, 2)):
                        v = padded[:, :, a : a + 32, b : b + 32]
                        views += [v, v.flip(3)]
                weights = [1.0] * len(views) if tta != "shift" else [0.25, 0.25] + [0.125] * 4
                logits = sum(w * model(v).float().softmax(1) for w, v in zip(weights, views))
                correct += (logits.argmax(1) == ye[lo : lo + 1000]).sum().item()
        model.train()
        if ema:
            with torch.no_grad():
                for t, keep in zip(list(model.parameters()) + list(model.buffers()), live):
                    t.copy_(keep)
        return correct / len(ye)

    start = time.perf_counter()
    step, accs, times = 0, [], []
    flip_mask = torch.tensor(gen.random(len(x_tr)) < 0.5, device=device)
    epoch = 0
    while step < total:
        order = torch.tensor(gen.permutation(len(x_tr)), device=device)
        for b in range(steps_per_epoch):
            if step >= total:
                break
            idx = order[b * r["batch"] : (b + 1) * r["batch"]]
            x = xt[idx]
            n = len(idx)
            if r["shift"]:
                p = r["shift"]
                padded = F.pad(x.float(), (p, p, p, p), mode="reflect") if r["pad"] == "reflect" else F.pad(x, (p,) * 4)
                oy = torch.randint(0, 2 * p + 1, (n,), device=device)
                ox = torch.randint(0, 2 * p + 1, (n,), device=device)
                rows = (oy[:, None] + torch.arange(32, device=device))[:, None, :, None]
                cols = (ox[:, None] + torch.arange(32, device=device))[:, None, None, :]
                x = padded[
                    torch.arange(n, device=device)[:, None, None, None],
                    torch.arange(3, device=device)[None, :, None, None],
                    rows,
                    cols,
                ]
            if r["flip"] == "random":
                flip = torch.rand(n, device=device) < 0.5
            else:
                flip = flip_mask[idx] ^ bool(epoch % 2)
            x = torch.where(flip[:, None, None, None], x.flip(3), x)
            x = ((x.float() / 255 - m) / s).contiguous(memory_format=torch.channels_last)
            for g in opt.param_groups:
                g["lr"] = lr_at(step) * g["scale"]
            if airbench:
                model[0].bias.requires_grad = epoch < r["whiten_bias_epochs"]
            logits = model(x) * r["logit_scale"]
            loss = F.cross_entropy(logits, yt[idx], label_smoothing=r["smoothing"])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if ahead is not None and step % 5 == 0:
                look_ahead(0.95**5 * (step / total) ** 3)
            if ema is not None:
                with torch.no_grad():
                    for t, e in zip(list(model.parameters()) + list(model.buffers()), ema):
                        if t.dtype.is_floating_point:
                            e.lerp_(t, 1 - r["ema"])
                        else:
                            e.copy_(t)
        epoch += 1
        accs.append(round(evaluate("none"), 4))
        times.append(round(time.perf_counter() - began, 1))
    if ahead is not None:
        look_ahead(1.0)
        accs[-1] = round(evaluate("none"), 4)
    final = round(evaluate(r["tta"]), 4)
    flops = train_flops(tuple(r["widths"]), r["whiten_width"] if airbench else r["stem"], arch=r["arch"])
    return {
        "name": task.name,
        "seed": seed,
        "final": final,
        "accs": accs,
        "times": times,  # seconds from the run's start to the end of each epoch's evaluation
        "train_images": int(total * r["batch"]),
        "train_tflop": round(flops * total * r["batch"] / 1e12, 1),
        "seconds": round(time.perf_counter() - start, 1),
        "total_s": round(time.perf_counter() - began, 1),
        "began_at": began_wall,  # the clock (time.time) when `times` start
        "recipe": {k: v for k, v in r.items() if BASE.get(k) != v},
    }


def worker(tasks, results, path: str, device: str) -> None:
    import torch

    torch.backends.cudnn.benchmark = True
    data = dict(np.load(path))
    while (task := tasks.get()) is not None:
        try:
            results.put(run(task, data, device))
        except Exception as error:  # a broken variant is reported, not fatal to the search
            results.put({"name": task.name, "seed": task.seed, "error": repr(error)})


def search(args: argparse.Namespace) -> int:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    tasks, results = ctx.Queue(), ctx.Queue()
    device = "cuda" if args.device == "auto" and _cuda() else ("cpu" if args.device == "auto" else args.device)
    procs = [ctx.Process(target=worker, args=(tasks, results, args.data, device)) for _ in range(args.workers)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + args.budget
    out = open(args.out, "a")
    done: list[dict] = []

    def phase(named: dict[str, dict], seeds) -> list[dict]:
        queued = 0
        for seed in seeds:
            for name, change in named.items():
                tasks.put(
                    Task(
                        name, seed, {**BASE, **(AIRBENCH if args.base == "airbench" else {}), **args.override, **change}
                    )
                )
                queued += 1
        got = []
        while len(got) < queued:
            left = deadline + args.grace - time.monotonic()
            if left <= 0:
                break
            try:
                res = results.get(timeout=min(left, 30))
            except Exception:
                continue
            got.append(res)
            out.write(json.dumps(res) + "\n")
            out.flush()
            print(json.dumps(res), flush=True)
        return got

    def mean_of(rows: list[dict], name: str) -> float | None:
        found = [r["final"] for r in rows if r["name"] == name and "final" in r]
        return sum(found) / len(found) if found else None

    if args.variants:  # named variants of BASE, and nothing else
        done += phase(args.variants, args.seeds)
        first = {}
    else:
        first = {"base": {}, **{k: v for k, v in CHANGES.items() if not args.only or k in args.only}}
        done += phase(first, args.seeds)
    base = mean_of(done, "base")
    helped = sorted(
        (name for name in first if name != "base" and (mean_of(done, name) or 0) > (base or 1) + 0.001),
        key=lambda name: -mean_of(done, name),
    )
    print(f"phase 1: base {base}; helped: {helped}", flush=True)
    if first and time.monotonic() < deadline and helped:
        kept = {}
        for name in helped:
            change = CHANGES[name]
            if "widths" in change or "epochs" in change:
                continue  # sizes are combined below, not stacked
            kept.update(change)
        second = {}
        for label, size in (
            ("w64-128-256", {}),
            ("w64-128-256_ep12", {"epochs": 12}),
            ("w64-192-256_ep8", {"widths": (64, 192, 256), "epochs": 8}),
            ("w64-256-256_ep7", {"widths": (64, 256, 256), "epochs": 7}),
            ("w96-192-256_ep8", {"widths": (96, 192, 256), "epochs": 8}),
        ):
            second[f"combined_{label}"] = {**kept, **size}
        print(f"phase 2: {kept}", flush=True)
        done += phase(second, args.seeds)
    for _ in procs:
        tasks.put(None)
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.terminate()
    return 0


def time_record(args: argparse.Namespace) -> int:
    """One run of RECORD (with --override) in this process, on the CPU: one JSON line, as search writes."""
    import torch

    data = dict(np.load(args.data))
    result = run(Task("record", args.seed, {**BASE, **RECORD, **args.override}), data, "cpu")
    result["threads"] = torch.get_num_threads()
    print(json.dumps(result), flush=True)
    return 0


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    verbs = parser.add_subparsers(dest="verb", required=True)
    prep = verbs.add_parser("prepare", help="decode the JPEG archive into one .npz of uint8 arrays")
    prep.add_argument("archive")
    prep.add_argument("out")
    prep.add_argument("--limit", type=int, default=0, help="about this many images in all (a rehearsal)")
    find = verbs.add_parser("search", help="train the variants, several at once")
    find.add_argument("data")
    find.add_argument("--out", default="runs.jsonl")
    find.add_argument("--budget", type=float, default=400, help="seconds after which no run is started")
    find.add_argument("--grace", type=float, default=60, help="seconds the last runs may take past the budget")
    find.add_argument("--workers", type=int, default=4)
    find.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    find.add_argument("--only", nargs="*", default=[], help="phase 1's changes to run (all when not given)")
    find.add_argument("--override", type=json.loads, default={}, help='JSON applied to every run, e.g. {"epochs":1}')
    find.add_argument("--device", default="auto")
    find.add_argument("--base", choices=("ours", "airbench"), default="ours", help="what --variants change")
    find.add_argument("--variants", type=json.loads, default=None, help='JSON {"name": {changes}, ...} to run alone')
    once = verbs.add_parser("time", help="train the trainer's record recipe once on the CPU (time_to_accuracy.py)")
    once.add_argument("data")
    once.add_argument("--seed", type=int, default=1)
    once.add_argument("--override", type=json.loads, default={}, help='JSON changes to RECORD, e.g. {"epochs": 11}')
    args = parser.parse_args(argv)
    if args.verb == "time":
        return time_record(args)
    if args.verb == "prepare":
        prepare(args.archive, args.out, args.limit)
        return 0
    return search(args)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
