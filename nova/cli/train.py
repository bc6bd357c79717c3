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

The run keeps its outputs safe: it will not start over a directory that holds
another run's checkpoint (``--resume`` or ``--force`` say which is meant),
Ctrl-C saves the last completed step before exiting, and ``best.pt`` keeps the
step with the lowest val loss, which a run that overfits says it is leaving behind.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import shlex
import time
from pathlib import Path
from typing import Callable

import torch

from nova.cli import checkpoint
from nova.cli.errors import RunFailed, UsageError
from nova.cli.interrupt import StopRequest
from nova.cli.progress import ProgressBar
from nova.cli.train_config import (  # noqa: F401  (TrainConfig and friends are importable from here too)
    CONFIG_FIELDS, FIXED_ON_RESUME, TrainConfig, add_arguments, available_cores, load_data, pick_device,
    resolve_config,
)
from nova.data.dataset import UNIFORM_LOSS, TextDataset
from nova.data.tokenizer import decode, encode
from nova.models import GPT

HELP = "train a small byte-level GPT (built-in corpus or --data FILE) and report its loss"

StepFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# Evaluations reuse the same windows, so a rise in val loss is the model's doing,
# not the sample's; the 1% margin keeps the last-steps wobble of a converged run
# from being reported as overfitting.
OVERFIT_MARGIN = 0.01
# One evaluation above the best can be a wobble (a small val split is noisy); two in a row is a trend.
RISES_TO_WARN = 2

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
    try:
        return nova.compile(model, optimizer, precision=cfg.precision, backend=cfg.backend)
    except ValueError as e:  # compile() checks only its arguments: a backend that does not fit the device
        raise UsageError(f"--backend {cfg.backend} --device {device}: {e}") from None


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


def run(args: argparse.Namespace) -> int:
    given = {k: v for k, v in vars(args).items() if k in CONFIG_FIELDS}
    metrics = train(given, resume=args.resume, force=args.force)
    return 130 if metrics["interrupted"] else 0  # 128 + SIGINT, the shell's convention


def best_val(history: dict) -> tuple[float, int] | None:
    """(loss, step) of the lowest val loss after step 0: what best.pt holds."""
    trained = [(loss, step) for step, loss in history["val"] if step > 0]
    return min(trained) if trained else None


def train(given: dict, resume: bool = False, force: bool = False) -> dict:
    """Run (or resume) training; return the metrics that are also written to metrics.json."""
    wall_start = time.monotonic()
    out = Path(given.get("out", TrainConfig.out))
    ckpt_path, best_path = out / checkpoint.LAST, out / checkpoint.BEST
    saved = None
    if resume:
        saved = checkpoint.load_for("--resume", ckpt_path)
    elif ckpt_path.exists() and not force:
        raise UsageError(f"{ckpt_path} already exists: continue that run with --resume, "
                         f"or start over with --force (which replaces it), or pick another --out")
    cfg = resolve_config(given, saved["config"] if saved else None)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file, not a directory")

    torch.set_num_threads(cfg.threads or available_cores())
    device = pick_device(cfg.device)
    text, data = load_data(cfg)
    # Resuming on different text would silently continue a different run.
    data_digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    if saved is not None:
        if saved["meta"]["data_sha256"] != data_digest:
            raise UsageError(f"the training text differs from the checkpoint's ({cfg.data or 'built-in corpus'} changed)")
        if saved["step"] > cfg.steps:
            raise UsageError(f"the checkpoint is at step {saved['step']}, beyond --steps {cfg.steps}")

    torch.manual_seed(cfg.seed)
    model_cfg = cfg.model_config()
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
    if saved is None:
        best_path.unlink(missing_ok=True)  # the replaced run's best is not this run's

    def save_checkpoint(path: Path, step: int, rng: dict) -> None:
        # the nova engine checks a step on the device and reports it at the next call:
        # a checkpoint must not record a step that failed
        getattr(step_fn, "check", lambda: None)()
        checkpoint.save(path, model=model, optimizer=optimizer, step=step, config=dataclasses.asdict(cfg),
                        rng=rng, history=history, meta={"data_sha256": data_digest})

    print(f"nova train: {model.num_params() / 1e6:.2f}M params, engine {cfg.engine}"
          + (f" (backend {cfg.backend}, {cfg.precision})" if cfg.engine == "nova" else f" ({cfg.precision})")
          + f", device {device}, {torch.get_num_threads()} threads, {cfg.steps} steps of "
          f"{cfg.batch_size}x{cfg.block_size} tokens")
    if start == 0:
        history["val"].append([0, evaluate(model, data, cfg, device)])

    train_time, timed_tokens, first_step_s = 0.0, 0, None
    end = min(cfg.steps, cfg.stop_at) if cfg.stop_at else cfg.steps
    best, rises, warned_rise = best_val(history), 0, False
    bar = ProgressBar(cfg.steps)
    # `done` steps are complete and `rng` is every RNG stream as it was right
    # after the last of them: an interrupt saves exactly that, and a resume
    # then repeats the interrupted step with the same batch and dropout masks.
    done, rng = start, checkpoint.rng_state(data_gen)
    interrupted, last_saved = False, (start if saved is not None else None)  # the step checkpoint.pt holds
    with StopRequest() as stop:
        try:
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
                    kept = f"; {ckpt_path} holds step {last_saved}" if last_saved is not None else ""
                    raise RunFailed(f"loss became {loss} at step {step + 1}: the run diverged (try a lower --lr){kept}")
                history["train"].append([step + 1, loss])
                done, rng = step + 1, checkpoint.rng_state(data_gen)
                tok_s = timed_tokens / train_time if train_time > 0 else None
                bar.update(done, loss, tok_s)
                if done % cfg.eval_interval == 0 or done == cfg.steps:
                    val = evaluate(model, data, cfg, device)
                    history["val"].append([done, val])
                    note = ""
                    if best is None or val < best[0]:
                        best, rises = (val, done), 0
                        save_checkpoint(best_path, done, rng)
                    elif val > best[0] * (1 + OVERFIT_MARGIN):
                        note, rises = f"  (best {best[0]:.4f} at step {best[1]})", rises + 1
                    bar.clear()
                    print(f"step {done:5d}/{cfg.steps}  train {loss:.4f}  val {val:.4f}  lr {lr:.2e}{note}", flush=True)
                    if rises >= RISES_TO_WARN and not warned_rise:
                        warned_rise = True
                        print(f"note: val loss is rising above its best ({best[0]:.4f} at step {best[1]}): the model "
                              f"is starting to memorise the training text (overfitting); {best_path} keeps the "
                              "best model. More text, fewer --steps or --dropout 0.1 help.", flush=True)
                if done % cfg.ckpt_interval == 0 or done == end:
                    save_checkpoint(ckpt_path, done, rng)
                    last_saved = done
                if stop.requested:
                    interrupted = True
                    break
        except KeyboardInterrupt:
            # A step cut short wrote nothing back on the nova engine (its results are
            # applied only once the whole program has run); `done` is still exact.
            interrupted = True
        bar.close()
        if interrupted and last_saved != done:
            save_checkpoint(ckpt_path, done, rng)

    metrics = {
        "engine": cfg.engine,
        "config": dataclasses.asdict(cfg),
        "model": dataclasses.asdict(model_cfg),
        "num_params": model.num_params(),
        "steps_done": done,
        "interrupted": interrupted,
        "train_loss": history["train"],
        "val_loss": history["val"],
        "initial_val_loss": history["val"][0][1],
        "final_val_loss": history["val"][-1][1],
        "best_val_loss": best[0] if best else None,
        "best_val_step": best[1] if best else None,
        # the last evaluation is clearly above the best one: best.pt is the model to use
        "overfitting": bool(best and history["val"][-1][1] > best[0] * (1 + OVERFIT_MARGIN)),
        "uniform_loss": UNIFORM_LOSS,
        "unigram_entropy": data.unigram_entropy(),
        "bits_per_byte": history["val"][-1][1] / math.log(2),
        "tokens_per_s": timed_tokens / train_time if train_time > 0 else None,
        "first_step_s": first_step_s,
        "wall_s": time.monotonic() - wall_start,
        "sample": None,
    }
    if done < cfg.steps:
        how = "interrupted" if interrupted else "stopped"
        print(f"{how} at step {done} of {cfg.steps}; wrote {ckpt_path}, {out / 'metrics.json'}, {out / 'loss.png'}")
        print(f"continue with: nova train --out {shlex.quote(str(out))} --resume")
    else:
        metrics["sample"] = sample(model, cfg, device)
    write_outputs(out, metrics)
    if done == cfg.steps:
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
    if metrics.get("best_val_step") is not None:
        ax.plot([metrics["best_val_step"]], [metrics["best_val_loss"]], "*", ms=10, c="C1", label="best val (best.pt)")
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
    if m["best_val_loss"] is not None:
        print(f"best val    {m['best_val_loss']:.4f} at step {m['best_val_step']}, kept in {out / checkpoint.BEST}")
    if m["overfitting"]:
        print(f"overfitting the val loss rose from {m['best_val_loss']:.4f} (step {m['best_val_step']}) to "
              f"{m['final_val_loss']:.4f}: the model memorised the training text; use {checkpoint.BEST}, or train "
              "on more text, for fewer --steps or with --dropout 0.1")
    print(f"speed       {rate} (first step {first}, kept out), wall {m['wall_s']:.1f} s")
    print("sample      " + m["sample"].replace("\n", "\n            "))
    print(f"wrote       {out / 'metrics.json'}, {out / 'loss.png'}, {out / checkpoint.LAST}, {out / checkpoint.BEST}")
    print(f"sample with nova sample --out {shlex.quote(str(out))} --prompt TEXT")
