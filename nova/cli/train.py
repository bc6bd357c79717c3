"""``nova train``: train a small byte-level GPT and show that the loss falls.

The loop is engine-agnostic: it only calls ``step(x, y) -> loss``. With
``--engine nova`` that function is ``nova.compile(model, optimizer)``, which
updates the model's parameters and ``optimizer.state`` in place; with
``--engine eager`` it is plain PyTorch (backward + ``optimizer.step()``), the
baseline to compare against. A failure of the nova engine propagates: there is
no silent fallback to eager.

Resuming from a checkpoint continues the exact same run: parameters,
optimizer state, the step counter and every RNG stream are restored, so the
following losses equal those of an uninterrupted run.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from nova.cli import checkpoint
from nova.cli.errors import UsageError
from nova.cli.progress import ProgressBar
from nova.data.dataset import UNIFORM_LOSS, DataError, TextDataset, load_text
from nova.data.tokenizer import VOCAB_SIZE, decode, encode
from nova.models import GPT, GPTConfig

HELP = "train a small byte-level GPT (built-in corpus or --data FILE) and report its loss"

StepFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class TrainConfig:
    """Every setting of a run. The defaults are the no-flag run, sized for a 3-minute
    budget on 2 CPU cores. Measured on 2 idle cores: 57 s with --engine eager,
    100 s with the nova engine on its reference backend; val loss 5.56 -> 0.30
    nats/byte, against a unigram entropy of 3.04."""

    data: str | None = None  # None: the built-in corpus
    steps: int = 600
    batch_size: int = 32
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    lr: float = 2e-3
    min_lr_ratio: float = 0.1  # the cosine decays to lr * min_lr_ratio
    warmup_steps: int | None = None  # None: 10% of the steps, at most 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99  # 0.99 rather than 0.999: short runs need the second moment to adapt fast
    precision: str = "fp32"
    backend: str = "auto"
    engine: str = "nova"
    device: str = "auto"
    seed: int = 1337
    eval_interval: int = 50
    eval_batches: int = 8
    ckpt_interval: int = 100
    stop_at: int | None = None
    threads: int | None = None  # None: every core this process may run on
    out: str = "runs/train"

    def warmup(self) -> int:
        return self.warmup_steps if self.warmup_steps is not None else max(1, min(100, self.steps // 10))


# Settings that define the model, data stream or optimizer: a resumed run must keep them.
FIXED_ON_RESUME = (
    "data", "batch_size", "block_size", "n_layer", "n_head", "n_embd", "dropout",
    "lr", "min_lr_ratio", "warmup_steps", "weight_decay", "beta1", "beta2", "seed",
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    # default=SUPPRESS: only flags the user typed reach the namespace, so a
    # resumed run can tell "given" from "default" and keep the checkpoint's values.
    S = argparse.SUPPRESS
    d = TrainConfig()
    p.add_argument("--data", metavar="FILE", default=S, help="UTF-8 text file to train on (default: built-in corpus)")
    p.add_argument("--steps", type=int, default=S, help=f"optimizer steps (default {d.steps})")
    p.add_argument("--batch-size", type=int, default=S, help=f"sequences per step (default {d.batch_size})")
    p.add_argument("--block-size", type=int, default=S, help=f"tokens per sequence (default {d.block_size})")
    p.add_argument("--n-layer", type=int, default=S, help=f"transformer blocks (default {d.n_layer})")
    p.add_argument("--n-head", type=int, default=S, help=f"attention heads (default {d.n_head})")
    p.add_argument("--n-embd", type=int, default=S, help=f"model width (default {d.n_embd})")
    p.add_argument("--dropout", type=float, default=S, help=f"dropout probability (default {d.dropout})")
    p.add_argument("--lr", type=float, default=S, help=f"peak learning rate (default {d.lr})")
    p.add_argument("--precision", choices=["fp32", "tf32", "bf16"], default=S, help="default fp32")
    # No choices= here: nova.compile validates the backend name, so new backends need no CLI change.
    p.add_argument("--backend", default=S, help="nova backend: auto (default), reference, ...")
    p.add_argument("--engine", choices=["nova", "eager"], default=S,
                   help="nova: the compiled step (default); eager: plain PyTorch, for comparison")
    p.add_argument("--device", default=S, help="cpu, cuda, ... (default: cuda if available, else cpu)")
    p.add_argument("--seed", type=int, default=S, help=f"seed for init, data order and dropout (default {d.seed})")
    p.add_argument("--eval-interval", type=int, default=S, help=f"steps between val evaluations (default {d.eval_interval})")
    p.add_argument("--ckpt-interval", type=int, default=S, help=f"steps between checkpoints (default {d.ckpt_interval})")
    p.add_argument("--stop-at", type=int, default=S, metavar="STEP",
                   help="stop after this step as if interrupted (checkpoint written); the LR schedule still spans --steps")
    p.add_argument("--threads", type=int, default=S,
                   help="CPU threads for torch (default: available cores; on a busy machine use fewer, "
                   "as OpenMP threads that spin-wait for a shared core slow every kernel several-fold)")
    p.add_argument("--out", metavar="DIR", default=S, help=f"output directory (default {d.out})")
    p.add_argument("--resume", action="store_true", help="continue from DIR/checkpoint.pt")


def resolve_config(given: dict, saved: dict | None) -> TrainConfig:
    """The run's settings: defaults, then the checkpoint's (if resuming), then the flags given."""
    if saved is None:
        cfg = TrainConfig(**given)
    else:
        # --stop-at belongs to one invocation: a resumed run does not inherit it.
        cfg = TrainConfig(**{**saved, "stop_at": None})
        for key in FIXED_ON_RESUME:
            if key in given and given[key] != saved[key]:
                raise UsageError(f"--{key.replace('_', '-')} cannot change on resume "
                                 f"(checkpoint has {saved[key]!r}, got {given[key]!r})")
        cfg = dataclasses.replace(cfg, **given)
    if cfg.steps < 1 or cfg.batch_size < 1 or cfg.block_size < 1 or cfg.eval_interval < 1 or cfg.ckpt_interval < 1:
        raise UsageError("--steps, --batch-size, --block-size, --eval-interval and --ckpt-interval must be >= 1")
    return cfg


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to cfg.lr, then cosine decay to cfg.lr * min_lr_ratio at the last step."""
    warmup = cfg.warmup()
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, cfg.steps - 1 - warmup))
    min_lr = cfg.lr * cfg.min_lr_ratio
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - min_lr)


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    # Decay only matrices (linear and embedding weights); decaying biases and
    # LayerNorm gains only pulls them toward 0 with no regularising benefit.
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))


def eager_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, precision: str, device: torch.device) -> StepFn:
    """The plain PyTorch step that nova.compile replaces (no gradient clipping, as there)."""
    if precision == "tf32":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = model(x, y)
        loss.backward()
        optimizer.step()
        return loss.detach()

    return step


def make_step(cfg: TrainConfig, model, optimizer, device) -> StepFn:
    if cfg.engine == "eager":
        return eager_step(model, optimizer, cfg.precision, device)
    import nova

    if not hasattr(nova, "compile"):
        raise RuntimeError("nova.compile is not available in this build of nova; run with --engine eager")
    return nova.compile(model, optimizer, precision=cfg.precision, backend=cfg.backend)


@torch.no_grad()
def evaluate(model, data: TextDataset, cfg: TrainConfig, device) -> float:
    """Mean val loss over a fixed set of windows (same ones every time, so the
    curve shows the model changing, not the sample), in eager mode."""
    g = torch.Generator().manual_seed(cfg.seed + 1)
    model.eval()
    try:
        total = 0.0
        for _ in range(cfg.eval_batches):
            x, y = data.batch("val", cfg.batch_size, cfg.block_size, g)
            total += model(x.to(device), y.to(device)).item()
    finally:
        model.train()
    return total / cfg.eval_batches


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def available_cores() -> int:
    # sched_getaffinity respects taskset/cpusets; os.cpu_count() does not.
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def run(args: argparse.Namespace) -> int:
    given = {k: v for k, v in vars(args).items() if k in {f.name for f in dataclasses.fields(TrainConfig)}}
    train(given, resume=args.resume)
    return 0


def train(given: dict, resume: bool = False) -> dict:
    """Run (or resume) training; return the metrics that are also written to metrics.json."""
    wall_start = time.monotonic()
    out = Path(given.get("out", TrainConfig.out))
    ckpt_path = out / "checkpoint.pt"
    saved = None
    if resume:
        if not ckpt_path.is_file():
            raise UsageError(f"--resume: no checkpoint at {ckpt_path}")
        saved = checkpoint.load(ckpt_path)
    cfg = resolve_config(given, saved["config"] if saved else None)

    torch.set_num_threads(cfg.threads or available_cores())
    device = pick_device(cfg.device)
    try:
        text = load_text(cfg.data)
        data = TextDataset.from_text(text, cfg.block_size)
    except DataError as e:
        raise UsageError(str(e)) from None
    # Resuming on different text would silently continue a different run.
    data_digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    if saved is not None:
        if saved["meta"]["data_sha256"] != data_digest:
            raise UsageError(f"the training text differs from the checkpoint's ({cfg.data or 'built-in corpus'} changed)")
        if saved["step"] > cfg.steps:
            raise UsageError(f"the checkpoint is at step {saved['step']}, beyond --steps {cfg.steps}")

    torch.manual_seed(cfg.seed)
    model_cfg = GPTConfig(vocab_size=VOCAB_SIZE, block_size=cfg.block_size, n_layer=cfg.n_layer,
                          n_head=cfg.n_head, n_embd=cfg.n_embd, dropout=cfg.dropout)
    model = GPT(model_cfg).to(device)
    optimizer = make_optimizer(model, cfg)
    data_gen = torch.Generator().manual_seed(cfg.seed)
    history: dict[str, list] = {"train": [], "val": []}  # [step, loss] pairs
    start = 0
    if saved is not None:
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        checkpoint.set_rng_state(saved["rng"], data_gen)
        history = saved["history"]
        start = saved["step"]
        print(f"resumed from {ckpt_path} at step {start}")
    # The step binds to the restored parameters and optimizer state.
    step_fn = make_step(cfg, model, optimizer, device)

    def save_checkpoint(step: int) -> None:
        checkpoint.save(ckpt_path, model=model, optimizer=optimizer, step=step, config=dataclasses.asdict(cfg),
                        rng=checkpoint.rng_state(data_gen), history=history, meta={"data_sha256": data_digest})

    print(f"nova train: {model.num_params() / 1e6:.2f}M params, engine {cfg.engine}"
          + (f" (backend {cfg.backend}, {cfg.precision})" if cfg.engine == "nova" else f" ({cfg.precision})")
          + f", device {device}, {torch.get_num_threads()} threads, {cfg.steps} steps of "
          f"{cfg.batch_size}x{cfg.block_size} tokens")
    if start == 0:
        history["val"].append([0, evaluate(model, data, cfg, device)])

    train_time, timed_tokens, first_step_s = 0.0, 0, None
    end = min(cfg.steps, cfg.stop_at) if cfg.stop_at else cfg.steps
    bar = ProgressBar(cfg.steps)
    for step in range(start, end):
        lr = lr_at(step, cfg)
        for group in optimizer.param_groups:  # the compiled step reads these every call
            group["lr"] = lr
        x, y = data.batch("train", cfg.batch_size, cfg.block_size, data_gen)
        x, y = x.to(device), y.to(device)
        t0 = time.monotonic()
        loss = step_fn(x, y).item()  # .item() also waits for the device, so the timing is honest
        dt = time.monotonic() - t0
        if first_step_s is None:
            first_step_s = dt  # includes compilation for the nova engine: kept out of tokens/s
        else:
            train_time += dt
            timed_tokens += cfg.batch_size * cfg.block_size
        if not math.isfinite(loss):
            bar.close()
            raise RuntimeError(f"loss became {loss} at step {step + 1}")
        done = step + 1
        history["train"].append([done, loss])
        tok_s = timed_tokens / train_time if train_time > 0 else None
        bar.update(done, loss, tok_s)
        if done % cfg.eval_interval == 0 or done == cfg.steps:
            val = evaluate(model, data, cfg, device)
            history["val"].append([done, val])
            bar.clear()
            print(f"step {done:5d}/{cfg.steps}  train {loss:.4f}  val {val:.4f}  lr {lr:.2e}", flush=True)
        if done % cfg.ckpt_interval == 0 or done == end:
            save_checkpoint(done)
    bar.close()

    metrics = {
        "engine": cfg.engine,
        "config": dataclasses.asdict(cfg),
        "model": dataclasses.asdict(model_cfg),
        "num_params": model.num_params(),
        "steps_done": end,
        "train_loss": history["train"],
        "val_loss": history["val"],
        "initial_val_loss": history["val"][0][1],
        "final_val_loss": history["val"][-1][1],
        "uniform_loss": UNIFORM_LOSS,
        "unigram_entropy": data.unigram_entropy(),
        "bits_per_byte": history["val"][-1][1] / math.log(2),
        "tokens_per_s": timed_tokens / train_time if train_time > 0 else None,
        "first_step_s": first_step_s,
        "wall_s": time.monotonic() - wall_start,
        "sample": None,
    }
    if end < cfg.steps:
        print(f"stopped at step {end} of {cfg.steps}; checkpoint in {ckpt_path}, continue with --resume")
    else:
        metrics["sample"] = sample(model, cfg, device)
    write_outputs(out, metrics)
    if end == cfg.steps:
        report(metrics, out)
    return metrics


def sample(model: GPT, cfg: TrainConfig, device, prompt: str = "Once upon a time", n: int = 160) -> str:
    g = torch.Generator(device=device).manual_seed(cfg.seed)
    idx = encode(prompt)[None, -cfg.block_size :].to(device)
    model.eval()
    try:
        ids = model.generate(idx, n, temperature=0.8, top_k=40, generator=g)
    finally:
        model.train()
    return decode(ids[0])


def write_outputs(out: Path, metrics: dict) -> None:
    text = json.dumps(metrics, indent=1)
    checkpoint.atomic_write(out / "metrics.json", lambda f: f.write(text.encode()))
    checkpoint.atomic_write(out / "loss.png", lambda f: plot_losses(metrics, f))


def plot_losses(metrics: dict, f) -> None:
    # The object API (no pyplot) renders with Agg without switching the global
    # matplotlib backend of whatever process imported us.
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.2), dpi=120)
    ax = fig.add_subplot()
    tr = metrics["train_loss"]
    if tr:
        ax.plot([s for s, _ in tr], [v for _, v in tr], lw=0.8, alpha=0.6, label="train")
    va = metrics["val_loss"]
    ax.plot([s for s, _ in va], [v for _, v in va], "o-", ms=3, label="val")
    ax.axhline(metrics["uniform_loss"], ls="--", c="gray", lw=0.8, label="uniform (ln 256)")
    ax.axhline(metrics["unigram_entropy"], ls=":", c="gray", lw=0.8, label="unigram entropy")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / byte)")
    ax.set_title(f"nova train ({metrics['engine']}): {metrics['num_params'] / 1e6:.2f}M-param GPT")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(f, format="png")


def report(m: dict, out: Path) -> None:
    rate = f"{m['tokens_per_s']:,.0f} tokens/s" if m["tokens_per_s"] else "- tokens/s"
    first = f"{m['first_step_s']:.2f} s" if m["first_step_s"] is not None else "-"
    print()
    print(f"val loss    {m['initial_val_loss']:.4f} -> {m['final_val_loss']:.4f} nats/byte")
    print(f"baselines   uniform ln(256) = {m['uniform_loss']:.4f}, unigram entropy = {m['unigram_entropy']:.4f}")
    print(f"bits/byte   {m['bits_per_byte']:.3f}")
    print(f"speed       {rate} (first step {first}, kept out), wall {m['wall_s']:.1f} s")
    print("sample      " + m["sample"].replace("\n", "\n            "))
    print(f"wrote       {out / 'metrics.json'}, {out / 'loss.png'}, {out / 'checkpoint.pt'}")
