"""The implementations measured: fusedce and every peer importable here. Peers are optional
imports, never vendored; one that cannot be loaded is kept with the reason, so the report says
why it has no numbers instead of leaving it out.

Every implementation is called the same way, mean reduction over non-ignored rows, ignore_index
-100:
  ce(logits (N, V), target (N,))                      -> scalar loss
  linear(hidden (N, H), weight (V, H), target (N,))   -> scalar loss
  logprobs(hidden, weight, tokens (N,), entropy)      -> (logprob (N,), entropy (N,) or None)
Call signatures follow each project's public documentation.
"""

import dataclasses
import importlib
import importlib.util
import os

import torch
import torch.nn.functional as F

FLASH_ATTN_ENV = "FUSEDCE_PEER_FLASH_ATTN_CE"


class Unavailable(Exception):
    """This implementation (or this kind of it) cannot run here; the message says why."""


@dataclasses.dataclass
class Peer:
    """An implementation: for each kind ('ce', 'linear') either a callable or the reason it is
    unavailable. A kind the project does not offer at all is simply absent (no row)."""

    id: str
    name: str
    fns: dict
    reasons: dict
    checked: bool = True  # False: a different computation, timed only (floor, all options)

    def offers(self, kind):
        return kind in self.fns or kind in self.reasons


def _loss_of(out):
    """Some peers return (loss, extra) or an output object; the loss is the first part."""
    if isinstance(out, (tuple, list)):
        return out[0]
    return getattr(out, "loss", out)


def _fusedce(device):
    import fusedce

    if device == "cuda" and not fusedce.with_cuda:
        raise Unavailable("this build of fusedce has no CUDA kernels")
    fns = {"ce": lambda x, t: fusedce.cross_entropy(x, t)}
    reasons = {}
    lce = getattr(fusedce, "linear_cross_entropy", None)
    if lce is None:
        reasons["linear"] = f"fusedce {fusedce.__version__} has no linear_cross_entropy yet"
    else:
        fns["linear"] = lambda h, w, t: lce(h, w, t)
    llp = getattr(fusedce, "linear_logprobs", None)
    if llp is None:
        reasons["logprobs"] = f"fusedce {fusedce.__version__} has no linear_logprobs yet"
    else:
        fns["logprobs"] = lambda h, w, t, entropy: (
            llp(h, w, t, return_entropy=True) if entropy else (llp(h, w, t), None))
    return fns, reasons


def _fusedce_linear_variant(doc, **options):
    """A loader for fusedce.linear_cross_entropy called with `options` (a row of its own)."""

    def load(device):
        import fusedce

        if device == "cuda" and not fusedce.with_cuda:
            raise Unavailable("this build of fusedce has no CUDA kernels")
        lce = getattr(fusedce, "linear_cross_entropy", None)
        if lce is None:
            raise Unavailable(f"fusedce {fusedce.__version__} has no linear_cross_entropy yet")
        return {"linear": lambda h, w, t: lce(h, w, t, **options)}, {}

    load.__doc__ = doc
    return load


_fusedce_skip = _fusedce_linear_variant(
    """skip_ignored=True: the products run over the non-ignored rows only (on a GPU at the price
    of one wait for their count); what a prompt-masked batch gains. The CPU backend always skips
    them, so the row shows the same call there.""", skip_ignored=True)

_fusedce_low_memory = _fusedce_linear_variant(
    """low_memory=True: all extra memory under 512 MiB, grad_weight formed slice by slice of the
    vocabulary from recomputed logits (about 4/3 of the default's flops on a GPU).""",
    low_memory=True)


# Rows of logits per chunk in quack's chunked linear cross-entropy (its default chunk_size).
QUACK_CHUNK_ROWS = 4096


def _fusedce_wide(device):
    """fusedce.linear_cross_entropy with a logit buffer for QUACK_CHUNK_ROWS rows (chunk_budget_bytes,
    5% over the logits for the per-row scratch beside them), the buffer quack's chunked loss takes:
    both at about the same memory, where the default's buffer is a float32 copy of the weight."""
    import fusedce

    if device == "cuda" and not fusedce.with_cuda:
        raise Unavailable("this build of fusedce has no CUDA kernels")

    def call(h, w, t):
        budget = QUACK_CHUNK_ROWS * w.shape[0] * w.element_size() * 21 // 20
        return fusedce.linear_cross_entropy(h, w, t, chunk_budget_bytes=budget)
    return {"linear": call}, {}


def _fusedce_all_options(device):
    """fusedce.linear_cross_entropy with every option that changes its work: a bias (with its
    gradient), label smoothing, z-loss, logit scale, soft-cap and the metrics. A different loss
    from the other rows', so it is timed, not checked here (the tests check it)."""
    import fusedce

    if device == "cuda" and not fusedce.with_cuda:
        raise Unavailable("this build of fusedce has no CUDA kernels")
    biases = {}

    def call(h, w, t):
        key = (w.shape[0], w.dtype, w.device)
        if key not in biases:
            g = torch.Generator(device="cpu").manual_seed(3)
            biases[key] = (0.5 * torch.randn(w.shape[0], generator=g)).to(w.device, w.dtype).requires_grad_(True)
        b = biases[key]
        b.grad = None
        loss, _ = fusedce.linear_cross_entropy(h, w, t, b, label_smoothing=0.1, z_loss=1e-4, logit_scale=0.9,
                                               softcap=30.0, return_metrics=True)
        return loss
    return {"linear": call}, {}


class _BareProducts(torch.autograd.Function):
    """The three matrix products of a linear cross-entropy's forward and backward at full size
    and nothing else (the logits stand in for their gradient): the floor a fused call is held to."""

    @staticmethod
    def forward(ctx, h, w):
        logits = h @ w.t()
        ctx.save_for_backward(h, w, logits)
        return logits.new_zeros((), dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad):
        h, w, dlogits = ctx.saved_tensors
        return dlogits @ w, dlogits.t() @ h


def _floor(device):
    """The floor: the three bare products (torch.matmul, cuBLAS) of the same shape, timed only."""
    return {"linear": lambda h, w, t: _BareProducts.apply(h, w)}, {}


def _fusedce_forced(keep):
    """A loader for fusedce.linear_logprobs with keep_logits forced to `keep` (the default,
    None, picks one of the two by the memory rule of fusedce.logit_room). True: the logits
    formed once in the input dtype and kept from forward to backward ((N, V) elements more
    memory), three matrix products instead of four; without a gradient (the forward row) the
    same logits, freed on return. False: the logits formed chunk by chunk, again in the
    backward."""

    def load(device):
        import fusedce

        if device == "cuda" and not fusedce.with_cuda:
            raise Unavailable("this build of fusedce has no CUDA kernels")
        llp = getattr(fusedce, "linear_logprobs", None)
        if llp is None:
            raise Unavailable(f"fusedce {fusedce.__version__} has no linear_logprobs yet")
        try:
            llp(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1, dtype=torch.int64), keep_logits=keep)
        except TypeError as e:
            raise Unavailable(f"fusedce {fusedce.__version__}: linear_logprobs has no keep_logits ({e})") from None
        return {"logprobs": lambda h, w, t, entropy: (
            llp(h, w, t, return_entropy=True, keep_logits=keep) if entropy
            else (llp(h, w, t, keep_logits=keep), None))}, {}

    return load


def _torch_ce(x, t):
    """As transformers' ForCausalLMLoss calls it: the logits upcast to float32 first."""
    return F.cross_entropy(x.float(), t)


def _torch_linear(h, w, t):
    return F.cross_entropy(F.linear(h, w).float(), t)


def _torch_logprobs(h, w, t, entropy):
    """The materialised path an RL trainer takes: F.linear, log_softmax in float32, gather, and
    the entropy from the same log-probabilities; 0 at ignored positions."""
    logp = torch.log_softmax(F.linear(h, w).float(), dim=-1)
    keep = t != -100
    lp = torch.where(keep, logp.gather(-1, t.clamp(min=0).unsqueeze(-1)).squeeze(-1), 0.0)
    if not entropy:
        return lp, None
    return lp, torch.where(keep, -(logp.exp() * logp).sum(-1), 0.0)


def _torch(device):
    return {"ce": _torch_ce, "linear": _torch_linear, "logprobs": _torch_logprobs}, {}


# Recompiles one compiled function may make in a benchmark process: each of its cases and jobs
# is a graph of its own (specialised, as a training run of fixed shapes gets), and past dynamo's
# limit (8 by default) torch.compile runs the Python function eagerly, which would time eager
# under torch.compile's name.
COMPILE_RECOMPILE_LIMIT = 256


def _torch_compile(device):
    import torch._dynamo

    cfg = torch._dynamo.config
    cfg.recompile_limit = max(cfg.recompile_limit, COMPILE_RECOMPILE_LIMIT)
    cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, COMPILE_RECOMPILE_LIMIT)
    return {"ce": torch.compile(_torch_ce, dynamic=False), "linear": torch.compile(_torch_linear, dynamic=False),
            "logprobs": torch.compile(_torch_logprobs, dynamic=False)}, {}


def _torch_lce(device):
    if not hasattr(F, "linear_cross_entropy") or not hasattr(torch.nn, "LinearCrossEntropyOptions"):
        raise Unavailable(f"torch {torch.__version__} has no F.linear_cross_entropy with chunking options")
    options = torch.nn.LinearCrossEntropyOptions()  # the chunked path; options=None is eager's

    return {"linear": lambda h, w, t: F.linear_cross_entropy(h, w, t, options=options)}, {}


def _liger(device):
    from liger_kernel.transformers import LigerCrossEntropyLoss, LigerFusedLinearCrossEntropyLoss

    ce, lin = LigerCrossEntropyLoss(), LigerFusedLinearCrossEntropyLoss()
    return {"ce": lambda x, t: _loss_of(ce(x, t)),
            "linear": lambda h, w, t: _loss_of(lin(w, h, t))}, {}


def _liger_sm90(device):
    """Liger-Kernel's SM90 path (CuTe DSL kernels: the products with the loss inside them),
    through its public entry LigerFusedLinearScaledCrossEntropyFunction, which returns per-token
    negative log-likelihoods and entropies and takes that path only on compute capability 9.0
    with the CuTe DSL installed (elsewhere it falls back to a PyTorch loop: no row then). The
    linear kind is the mean over the kept tokens; the log-probabilities are minus the NLL. Its
    default target check (one host wait a call) stays on: what its users get."""
    capability = torch.cuda.get_device_capability()
    if capability != (9, 0):
        raise Unavailable(f"its SM90 path needs compute capability 9.0, this GPU has {capability}")
    # the SM90 module itself: its import fails without the CuTe DSL, where the entry would fall back
    from liger_kernel.ops.cutedsl.ops.fused_scaled_cross_entropy_sm90 import (  # noqa: F401
        LigerFusedScaledCrossEntropySM90Function)
    from liger_kernel.ops.fused_linear_scaled_cross_entropy import LigerFusedLinearScaledCrossEntropyFunction

    def nll(h, w, t, entropy):
        return LigerFusedLinearScaledCrossEntropyFunction.apply(h, w, t, 1.0, -100, 1, entropy)

    def linear(h, w, t):
        return nll(h, w, t, False).sum() / (t != -100).sum()

    def logprobs(h, w, t, entropy):
        if entropy:
            out, ent = nll(h, w, t, True)
            return -out, ent
        return -nll(h, w, t, False), None

    return {"linear": linear, "logprobs": logprobs}, {}


def _cce(device):
    from cut_cross_entropy import linear_cross_entropy

    # Its Triton kernel needs a GPU; on the CPU the project's own torch.compile implementation.
    impl = {} if device == "cuda" else {"impl": "torch_compile"}
    return {"linear": lambda h, w, t: linear_cross_entropy(h, w, t, **impl)}, {}


def _quack(device):
    from quack.cross_entropy import cross_entropy

    fns = {"ce": lambda x, t: cross_entropy(x, t, ignore_index=-100, reduction="mean")}
    reasons = {}
    try:
        from quack.linear_cross_entropy import chunked_linear_cross_entropy
    except Exception as e:  # an older quack: cross-entropy only
        reasons["linear"] = f"{type(e).__name__}: {e}"
    else:
        fns["linear"] = lambda h, w, t: _loss_of(
            chunked_linear_cross_entropy(h, w, t, ignore_index=-100, reduction="mean"))
    return fns, reasons


def _unsloth(device):
    from unsloth.kernels.cross_entropy_loss import fast_cross_entropy_loss

    # takes (batch, seq, V) logits and (batch, seq) labels; mean over non-ignored tokens
    return {"ce": lambda x, t: fast_cross_entropy_loss(x.unsqueeze(0), t.unsqueeze(0))}, {}


def _flash_attn(device):
    """flash-attn's Triton cross-entropy (flash_attn/ops/triton/cross_entropy.py imports only
    torch and triton): loaded from the file named by $FUSEDCE_PEER_FLASH_ATTN_CE, or from an
    installed flash_attn."""
    path = os.environ.get(FLASH_ATTN_ENV)
    if path:
        if not os.path.isfile(path):
            raise Unavailable(f"${FLASH_ATTN_ENV}={path} is not a file")
        spec = importlib.util.spec_from_file_location("fusedce_bench_flash_attn_ce", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module("flash_attn.ops.triton.cross_entropy")
        except ImportError as e:
            raise Unavailable(f"{e}; or set ${FLASH_ATTN_ENV} to flash-attn's "
                              "flash_attn/ops/triton/cross_entropy.py") from None
    loss_fn = module.cross_entropy_loss

    def ce(x, t):
        losses = _loss_of(loss_fn(x, t))  # per row, 0 at ignored rows
        return losses.sum() / (t != -100).sum()

    return {"ce": ce}, {}


# id, display name, loader, kinds it offers, whether it runs on CUDA devices only
REGISTRY = [
    ("fusedce", "fusedce", _fusedce, ("ce", "linear", "logprobs"), False),
    ("fusedce-skip", "fusedce skip_ignored", _fusedce_skip, ("linear",), False),
    ("fusedce-lowmem", "fusedce low_memory", _fusedce_low_memory, ("linear",), False),
    ("fusedce-all", "fusedce all options", _fusedce_all_options, ("linear",), False),
    ("fusedce-wide", "fusedce 4096-row chunks", _fusedce_wide, ("linear",), False),
    ("fusedce-keep", "fusedce keep_logits", _fusedce_forced(True), ("logprobs",), False),
    ("fusedce-recompute", "fusedce keep_logits=False", _fusedce_forced(False), ("logprobs",), False),
    ("torch", "torch eager", _torch, ("ce", "linear", "logprobs"), False),
    ("torch-compile", "torch.compile", _torch_compile, ("ce", "linear", "logprobs"), False),
    ("torch-lce", "torch F.linear_cross_entropy", _torch_lce, ("linear",), False),
    ("liger", "liger-kernel", _liger, ("ce", "linear"), True),
    ("liger-sm90", "liger-kernel SM90", _liger_sm90, ("linear", "logprobs"), True),
    ("cce", "cut-cross-entropy", _cce, ("linear",), False),
    ("quack", "quack", _quack, ("ce", "linear"), True),
    ("floor", "floor (3 bare products)", _floor, ("linear",), False),
    ("unsloth", "unsloth", _unsloth, ("ce",), True),
    ("flash-attn", "flash-attn", _flash_attn, ("ce",), True),
]
PEER_IDS = [entry[0] for entry in REGISTRY]
# Timed, not checked against the reference: they compute something else on purpose.
UNCHECKED = {"fusedce-all", "floor"}


def load(ids, device):
    """The Peer of each id in `ids` (in the registry's order), loaded for `device`."""
    unknown = sorted(set(ids) - set(PEER_IDS))
    if unknown:
        raise ValueError(f"--peers: unknown {', '.join(unknown)}; choose from {', '.join(PEER_IDS)}")
    peers = []
    for pid, name, loader, kinds, gpu_only in REGISTRY:
        if pid not in ids:
            continue
        try:
            if gpu_only and device != "cuda":
                raise Unavailable("runs on CUDA devices only")
            fns, reasons = loader(device)
        except Unavailable as e:
            fns, reasons = {}, {k: str(e) for k in kinds}
        except Exception as e:  # an import that fails for any reason is reported, not raised
            fns, reasons = {}, {k: f"{type(e).__name__}: {e}".splitlines()[0] for k in kinds}
        peers.append(Peer(pid, name, fns, reasons, checked=pid not in UNCHECKED))
    return peers
