"""One training run of the demo: the same model, data order and optimizer for both losses; only
the function that turns the final hidden states into the loss differs (LOSSES). cli.py runs each
in a fresh process, so the two start from bit-identical weights and their memory is measured
apart.
"""

import math
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

import fusedce

from .memory import PeakMemory
from .model import ModelConfig, TinyGPT
from .tokenizer import BytePairTokenizer


@dataclass
class RunConfig:
    device: str
    dtype: str  # "float32", or "bfloat16": autocast to bfloat16 (weights stay float32)
    model: ModelConfig
    batch_size: int
    steps: int
    lr: float
    seed: int
    sample_tokens: int
    prompt: str
    threads: int = 0  # torch.set_num_threads in the training process (0: torch's default)

    def to_dict(self):
        return asdict(self)


def torch_loss(model, hidden, target):
    """The usual way, as transformers' causal LMs take it: lm_head forms the (N, V) logits (in
    the autocast dtype), they are upcast to float32, and F.cross_entropy averages over rows."""
    logits = model.lm_head(hidden)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1))


def fusedce_loss(model, hidden, target):
    """The same loss from fusedce.linear_cross_entropy on the hidden states and lm_head.weight:
    the logits are formed tile by tile and never stored whole. A custom op is on none of
    autocast's lists, so under autocast we cast its inputs as autocast casts lm_head's."""
    weight = model.lm_head.weight
    if torch.is_autocast_enabled(hidden.device.type):
        dtype = torch.get_autocast_dtype(hidden.device.type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    return fusedce.linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), weight, target.reshape(-1))


LOSSES = {"torch": torch_loss, "fusedce": fusedce_loss}


def lr_at(step, steps, peak):
    """Linear warm-up over the first 10% of steps, then cosine decay to a tenth of the peak."""
    warm = max(1, steps // 10)
    if step < warm:
        return peak * (step + 1) / warm
    frac = (step - warm) / max(1, steps - warm)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))


def batch_at(data, batch_size, seq_len, generator):
    """Inputs and next-token targets (B, T) from random windows of `data`; the windows come from
    `generator` alone, so both runs see the same batches."""
    starts = torch.randint(0, data.numel() - seq_len, (batch_size,), generator=generator)
    idx = starts[:, None] + torch.arange(seq_len + 1)
    chunk = data[idx]
    return chunk[:, :-1], chunk[:, 1:]


def timing_warmup(steps):
    """Steps left out of tokens/s: the first ones pay for allocations and kernel selection."""
    return min(5, steps // 4)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Bar:
    """A progress bar on stderr for when tqdm is not installed."""

    def __init__(self, total, desc):
        self.total, self.desc, self.n, self.postfix = total, desc, 0, ""
        self._last = 0.0

    def update(self, n=1):
        self.n += n
        now = time.perf_counter()
        if now - self._last > 0.2 or self.n == self.total:
            self._last = now
            done = int(30 * self.n / max(1, self.total))
            bar = "#" * done + "." * (30 - done)
            sys.stderr.write(f"\r{self.desc}: {self.n}/{self.total} [{bar}] {self.postfix}")
            sys.stderr.flush()

    def set_postfix_str(self, s):
        self.postfix = s

    def close(self):
        sys.stderr.write("\n")
        sys.stderr.flush()


def progress_bar(total, desc):
    try:
        from tqdm import tqdm
    except ImportError:
        return _Bar(total, desc)
    return tqdm(total=total, desc=desc, unit="step", dynamic_ncols=True, file=sys.stderr)


def train_run(cfg, tokens, merges, loss_name):
    """Trains a fresh model with the loss LOSSES[loss_name]; returns the per-step losses,
    tokens per second, peak memory and a sample of generated text (a dict of plain values)."""
    device = torch.device(cfg.device)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    model = TinyGPT(cfg.model).to(device)  # initialised on the CPU: same weights on any device
    data = torch.tensor(tokens, dtype=torch.long)
    # Built before the memory baseline: constructing them imports modules (tqdm; torch's
    # compiler stack, for the optimizer) worth a hundred MB of RSS that are not the run's.
    opt = make_optimizer(model, cfg)
    bar = progress_bar(cfg.steps, loss_name)
    mem = PeakMemory(device)
    mem.start()
    losses, seconds, timed_steps = train_steps(model, opt, data, cfg, LOSSES[loss_name], bar)
    mem.stop()
    seen = torch.bincount(data, minlength=cfg.model.vocab) > 0
    return {
        "loss": loss_name,
        "losses": losses,
        "tokens_per_s": timed_steps * cfg.batch_size * cfg.model.seq_len / seconds,
        "timed_steps": timed_steps,
        "seconds": seconds,
        "peak_memory_bytes": mem.peak_bytes,
        "base_memory_bytes": mem.base_bytes,
        "memory_measure": mem.what,
        "params": sum(p.numel() for p in model.parameters()),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
        "threads": torch.get_num_threads(),
        "sample": sample_text(model, BytePairTokenizer(merges), seen.to(device), cfg),
    }


def make_optimizer(model, cfg):
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.01)


def train_steps(model, opt, data, cfg, loss_fn, bar):
    """cfg.steps steps of `opt` on batches drawn from `data`; returns the losses (floats), the
    seconds taken by the steps after timing_warmup, and how many those were."""
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    amp = cfg.dtype == "bfloat16"
    warmup = timing_warmup(cfg.steps)
    losses = []
    start = time.perf_counter()
    for step in range(cfg.steps):
        if step == warmup:
            _sync(device)
            start = time.perf_counter()
        x, y = batch_at(data, cfg.batch_size, cfg.model.seq_len, gen)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg.steps, cfg.lr)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            loss = loss_fn(model, model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        if step % 10 == 0 or step == cfg.steps - 1:  # .item() waits for the GPU: not every step
            bar.set_postfix_str(f"loss {losses[-1].item():.4f}")
        bar.update(1)
    _sync(device)
    seconds = time.perf_counter() - start
    bar.close()
    return torch.stack(losses).float().cpu().tolist(), seconds, cfg.steps - warmup


def sample_text(model, tok, allowed, cfg):
    """`cfg.sample_tokens` tokens sampled after `cfg.prompt` (temperature 0.8, a fixed seed),
    among the ids that occur in the training text."""
    model.eval()
    device = next(model.parameters()).device
    prompt = tok.encode(cfg.prompt) or tok.encode("\n")
    idx = torch.tensor([prompt], device=device)
    gen = torch.Generator().manual_seed(cfg.seed)
    out = model.generate(idx, cfg.sample_tokens, generator=gen, allowed=allowed)
    return tok.decode(out[0].tolist())
