"""Coverage of fusedce.transformers.apply() over every class of the installed transformers'
causal-LM and seq2seq-LM auto mappings: each class is built from a shrunk random config
(nothing downloaded), trained for one accumulated step (two micro-batches, labels with -100,
num_items_in_batch, shift_labels on the second where the model takes extra keyword arguments)
with and without apply(), and the losses and every parameter gradient are compared.

Each class ends in one row:

- fused_linear: the loss came from fusedce.linear_cross_entropy (no logits);
- logits: from fusedce.cross_entropy over the model's logits;
- untouched: fusedce computed nothing; the model's own loss ran, as without apply();
- not buildable: no tiny config could be built, or the model fails one step without apply()
  (the reason is in the row); these say nothing about fusedce;
- failing: with apply() the step raised, or its loss or a gradient differs.

Run as a script for the table: ``python tests/python/transformers_coverage.py [Class ...]``.
"""

import inspect
import random
import sys
import time
import traceback
import warnings

import numpy as np
import torch

VOCAB = 320
SEQ = 12
MAX_PARAMS = 16_000_000

# Attribute -> shrunk value, applied to a config and every sub-config that has the attribute.
SHRINK = {
    "vocab_size": VOCAB, "hidden_size": 64, "d_model": 64, "n_embd": 64, "embed_dim": 64,
    "word_embed_proj_dim": 64, "intermediate_size": 128, "ffn_dim": 128, "d_ff": 128,
    "n_inner": 128, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32, "expert_intermediate_size": 32,
    "num_hidden_layers": 2, "num_layers": 2, "n_layer": 2, "n_layers": 2, "encoder_layers": 2,
    "decoder_layers": 2, "num_decoder_layers": 2, "num_encoder_layers": 2,
    "num_attention_heads": 4, "n_head": 4, "n_heads": 4, "num_heads": 4,
    "encoder_attention_heads": 4, "decoder_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "d_kv": 16, "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4,
    "moe_num_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 1,
    "topk_group": 1, "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8, "v_head_dim": 16, "first_k_dense_replace": 1,
    "max_position_embeddings": 64, "n_positions": 64, "n_ctx": 64, "rotary_dim": 8,
}
# Tried in turn: hybrid models need more than two layers to keep one of each layer type.
LEVELS = [{}, {"num_hidden_layers": 4, "num_layers": 4, "n_layer": 4, "decoder_layers": 4}]


def _shrunk_kwargs(config_class, level):
    """Keyword arguments that shrink `config_class`'s defaults, sub-configs included (read-only
    properties, such as a head_dim derived from the others, are left to be derived)."""
    default = config_class()
    shrink = {**SHRINK, **level}
    kwargs = {k: v for k, v in shrink.items()
              if hasattr(default, k) and not isinstance(getattr(config_class, k, None), property)}
    for name, sub_class in (getattr(config_class, "sub_configs", None) or {}).items():
        if isinstance(sub_class, type) and getattr(default, name, None) is not None:
            try:
                kwargs[name] = sub_class(**_shrunk_kwargs(sub_class, level)).to_dict()
            except Exception:  # noqa: BLE001  the parent's own defaults stay
                pass
    return kwargs


def _fix_token_ids(config, seen=None):
    """Special token ids of the full vocabulary moved into the shrunk one, at its top (the
    random inputs stay below VOCAB - 32)."""
    seen = seen if seen is not None else set()
    if id(config) in seen:
        return
    seen.add(id(config))
    vocab = getattr(config, "vocab_size", None) or VOCAB
    free = iter(range(vocab - 1, vocab - 32, -1))
    for key, value in list(vars(config).items()):
        special = key.endswith("token_id") or key.endswith("token_ids") or key.endswith("token_index")
        if special and isinstance(value, int) and value >= vocab - 32:
            setattr(config, key, next(free))
        elif special and isinstance(value, list) and all(isinstance(v, int) for v in value):
            setattr(config, key, [next(free) if v >= vocab - 32 else v for v in value])
        elif hasattr(value, "to_dict") and hasattr(value, "model_type"):
            _fix_token_ids(value, seen)


def tiny_config(model_class, level=None):
    config_class = model_class.config_class
    config = config_class(**_shrunk_kwargs(config_class, level or {}))
    _fix_token_ids(config)
    for key in ("pad_token_id", "decoder_start_token_id"):
        if getattr(config, key, None) is None:
            setattr(config, key, 0)
    config._attn_implementation = "eager"
    return config


def build(model_class, seed=0, level=None):
    """A tiny random model of `model_class` in train mode (dropout on)."""
    config = tiny_config(model_class, level)
    with torch.device("meta"):
        meta = model_class(config)
    n = sum(p.numel() for p in meta.parameters())
    if n > MAX_PARAMS:
        raise RuntimeError(f"{n / 1e6:.1f}M parameters after shrinking")
    torch.manual_seed(seed)
    model = model_class(config)
    return model.float().train()


def micro_batches(seed=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for pad_from in ([SEQ, 7], [9, SEQ]):
        ids = torch.randint(3, VOCAB - 32, (2, SEQ), generator=g)
        labels = ids.clone()
        for i, p in enumerate(pad_from):
            labels[i, p:] = -100
        out.append((ids, labels))
    return out


def _takes_kwargs(model):
    return any(p.kind is inspect.Parameter.VAR_KEYWORD
               for p in inspect.signature(model.forward).parameters.values())


def step(model, batches, extras):
    """One accumulated step from the same random state: the loss of each micro-batch and every
    parameter's gradient."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1234)
    random.seed(1234)
    np.random.seed(1234)  # BigBird's random attention blocks
    num_items = sum(int((labels[..., 1:] != -100).sum()) for _, labels in batches)
    losses = []
    for i, (ids, labels) in enumerate(batches):
        kw = {}
        if extras:
            kw["num_items_in_batch"] = torch.tensor(num_items)
            if i == 1:
                shift = torch.cat([labels[:, 1:], torch.full((labels.shape[0], 1), -100)], 1)
                shift[0, 2] = -100
                kw["shift_labels"] = shift
        loss = model(input_ids=ids, labels=labels, **kw).loss
        if loss.dim() > 0:
            loss = loss.mean()
        loss.backward()
        losses.append(loss.detach().float())
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return torch.stack(losses), grads


def compare(ours, theirs, rtol=2e-5, scale_atol=1e-5):
    (loss_a, grads_a), (loss_b, grads_b) = ours, theirs
    torch.testing.assert_close(loss_a, loss_b, rtol=rtol, atol=1e-6)
    if grads_a.keys() != grads_b.keys():
        raise AssertionError(f"gradients of other parameters: {sorted(grads_a.keys() ^ grads_b.keys())}")
    for name, grad in grads_b.items():
        tol = max(1e-7, scale_atol * grad.abs().max().item())
        torch.testing.assert_close(grads_a[name], grad, rtol=rtol, atol=tol, msg=lambda m: f"{name}: {m}")


class _Spy:
    """Counts the fusedce calls of fusedce.transformers."""

    def __init__(self, fct):
        self.fct, self.linear, self.logits = fct, 0, 0

    def __enter__(self):
        fct = self.fct
        self.real = fct.cross_entropy, fct.linear_cross_entropy

        def ce(*a, **k):
            self.logits += 1
            return self.real[0](*a, **k)

        def lce(*a, **k):
            self.linear += 1
            return self.real[1](*a, **k)

        fct.cross_entropy, fct.linear_cross_entropy = ce, lce
        return self

    def __exit__(self, *exc):
        self.fct.cross_entropy, self.fct.linear_cross_entropy = self.real


def check_class(model_class, fused_linear=True):
    """(outcome, detail) of one class; outcome as the module docstring lists them."""
    import fusedce.transformers as fct

    batches = micro_batches()
    theirs = None
    for level in LEVELS:
        try:
            model = build(model_class, level=level)
        except Exception as e:  # noqa: BLE001
            error = "config/build", e
            continue
        for extras in ((True, False) if _takes_kwargs(model) else (False,)):
            try:
                theirs = step(model, batches, extras)
                break
            except Exception as e:  # noqa: BLE001
                error = "fails without fusedce", e
        if theirs is not None:
            break
    if theirs is None:
        where, e = error
        msg = str(e).splitlines()[0][:120] if str(e) else ""
        return "not buildable", f"{where}: {type(e).__name__}: {msg}"
    fct.apply(fused_linear=fused_linear)
    try:
        with _Spy(fct) as spy, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ours = step(model, batches, extras)
        how = fct.serving(model)
    except Exception as e:  # noqa: BLE001
        return "failing", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    finally:
        fct.revert()
    try:
        compare(ours, theirs)
    except AssertionError as e:
        try:
            compare(step(model, batches, extras), theirs)
        except AssertionError:
            return "not buildable", "differs from itself without fusedce (not deterministic)"
        return "failing", f"differs: {str(e)[:400]}"
    if spy.linear and how == "fused_linear":
        outcome = "fused_linear"
    elif spy.logits:
        outcome = "logits"
    elif spy.linear:
        return "failing", "the fused loss ran, but the model is not reported as fused_linear"
    else:
        outcome = "untouched"
    if outcome != how and not (outcome == "logits" and how == "untouched"):
        return "failing", f"served {outcome} while serving() says {how}"
    detail = "" if extras else "without num_items_in_batch/shift_labels (forward takes no **kwargs)"
    if outcome == "logits" and model in fct._declined:
        detail = f"declined the fused loss: {fct._declined[model]}"
    return outcome, detail


def mapping_classes():
    """{class name: kind} over the causal-LM and seq2seq-LM auto mappings."""
    from transformers.models.auto import modeling_auto as auto

    names = {}
    for name in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        names.setdefault(name, "causal")
    for name in auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES.values():
        names.setdefault(name, "seq2seq")
    return dict(sorted(names.items()))


def resolve(name):
    import transformers

    try:
        return getattr(transformers, name)
    except Exception:  # noqa: BLE001
        return None


OUTCOMES = ["fused_linear", "logits", "untouched", "not buildable", "failing"]


def run(names=None, out=sys.stdout):
    classes = mapping_classes()
    if names:
        classes = {n: classes.get(n, "causal") for n in names}
    rows = []
    for name, kind in classes.items():
        t0 = time.perf_counter()
        cls = resolve(name)
        if cls is None:
            outcome, detail = "not buildable", "not importable"
        else:
            outcome, detail = check_class(cls)
        rows.append((name, kind, outcome, detail, time.perf_counter() - t0))
        if out is not None:
            print(f"{name:50s} {kind:8s} {outcome:14s} {time.perf_counter() - t0:5.1f}s  "
                  f"{detail.splitlines()[0] if detail else ''}", file=out, flush=True)
    return rows


def summary(rows):
    """Markdown counts per kind and outcome."""
    lines = ["| mapping | " + " | ".join(OUTCOMES) + " | total |",
             "|---|" + "---|" * (len(OUTCOMES) + 1)]
    for kind in ("causal", "seq2seq"):
        counts = [sum(1 for r in rows if r[1] == kind and r[2] == o) for o in OUTCOMES]
        lines.append(f"| {kind} | " + " | ".join(map(str, counts)) + f" | {sum(counts)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    torch.set_num_threads(1)
    rows = run(sys.argv[1:] or None)
    print()
    print(summary(rows))
    for r in rows:
        if r[2] == "failing":
            print("\n" + r[0] + ": " + r[3])
