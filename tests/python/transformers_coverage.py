"""Coverage of fusedce.transformers.apply() over every class of the installed transformers'
causal-LM and seq2seq-LM auto mappings: each class is built from a shrunk random config
(nothing downloaded), trained for one accumulated step (two micro-batches, labels with -100,
num_items_in_batch, shift_labels on the second where the model takes extra keyword arguments)
with and without apply(), and the losses and every parameter gradient are compared.

Each class ends in one row:

- fused_linear: the loss came from fusedce.linear_cross_entropy (no logits);
- logits: from fusedce.cross_entropy over the model's logits (through the causal-LM loss
  function, or through the TokenCrossEntropyLoss of a model computing its own cross-entropy);
- untouched: fusedce computed nothing; the model's own loss ran, as without apply();
- not buildable: no tiny config could be built, the model fails one step without apply(), or
  it cannot take a step on its own (NO_STEP; the reason is in the row); these say nothing about
  fusedce;
- failing: with apply() the step raised, or its loss or a gradient differs.

The tiny configs come from a generic shrinker (sizes of the config and of every sub-config,
per-layer lists, multi-head latent attention, special token ids) and, where a config's own
validation ties values together, the few per-family values of FAMILY; INPUTS holds the inputs of
the models that take more than token ids and labels.

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
    "shared_expert_intermediate_size": 32, "shared_experts_intermediate_size": 32,
    "expert_intermediate_size": 32, "index_head_dim": 16, "index_n_heads": 2, "index_topk": 4,
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


_LAYER_COUNTS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "decoder_layers")

# Config class name -> keyword arguments (or a function of the shrunk ones returning some) for the
# families whose configs the generic shrinking leaves inconsistent.
SUB_CONFIG_ERRORS = []  # (config, sub-config, error) of the sub-configs left unshrunk

FAMILY = {
    # Hybrids: keep an attention layer among the shrunk ones (their caches need one).
    "BambaConfig": {"attn_layer_indices": [1]},
    "JambaConfig": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2,
              "expert_layer_offset": 1},
    "GraniteMoeHybridConfig": {"layer_types": ["linear_attention", "attention"]},
    "Lfm2MoeConfig": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    "ZambaConfig": {"num_hidden_layers": 5, "attn_layer_period": 2, "attn_layer_offset": 1,
              "layers_block_type": None, "attention_hidden_size": 128, "attention_head_dim": 32,
              "mamba_dt_rank": 8},
    "DoryConfig": {"num_hidden_layers": 3, "n_input_layers": 1, "n_recurrent_layers": 1,
             "n_output_layers": 1, "layer_types": ["sliding_attention", "full_attention",
                                                   "sliding_attention"]},
    # Sizes tied to others by the config's validation.
    "Mamba2Config": {"num_heads": 8, "head_dim": 16, "n_groups": 1, "state_size": 16,
               "time_step_rank": 8, "chunk_size": 8},
    "ZayaConfig": {"num_experts_per_tok": 1},
    # xLSTM's cached state update is in place: its backward fails with use_cache.
    "xLSTMConfig": {"embedding_dim": 64, "num_blocks": 2, "chunk_size": 4, "qk_dim_factor": 1.0,
                    "mode": "train", "use_cache": False},
    "DbrxConfig": {"attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0}},
    "CohereCompassTextConfig": {"rope_parameters": {"full_attention": {"rope_type": "default",
                                                                   "rope_theta": 10000.0}}},
    "ReformerConfig": {"is_decoder": True, "axial_pos_shape": [3, 4], "axial_pos_embds_dim": [32, 32],
                 "attention_head_size": 16, "attn_layers": ["local", "lsh"],
                 "local_attn_chunk_length": 4, "lsh_attn_chunk_length": 4, "num_buckets": 2,
                 "feed_forward_size": 128,
                 # Its reversible layers draw fresh seeds (torch.seed()) in training: no
                 # dropout and a fixed hashing seed make a step reproducible.
                 "hash_seed": 0, "hidden_dropout_prob": 0.0,
                 "local_attention_probs_dropout_prob": 0.0, "lsh_attention_probs_dropout_prob": 0.0},
    "Qwen4ExpTextConfig": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16,
                       "indexer_budget": 4, "indexer_compress_ratio": 2, "hc_lowrank": 8,
                       "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                       "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                       "ple_embed_dim": 32},
    "Gemma3nTextConfig": {"num_kv_shared_layers": 0, "vocab_size_per_layer_input": VOCAB,
                     "hidden_size_per_layer_input": 16, "laurel_rank": 8},
    "Gemma4TextConfig": {"vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 16,
                    "global_head_dim": 32},
    # Blt's forward makes a cache from its top-level config, which has no layer count.
    "BltConfig": {"encoder_hash_byte_group_vocab": 64, "use_cache": False},
    "BltLocalEncoderConfig": {"hidden_size_global": 64},
    "BltLocalDecoderConfig": {"hidden_size_global": 64},
    "MusicgenDecoderConfig": {"num_codebooks": 1},
    "MusicgenMelodyDecoderConfig": {"num_codebooks": 1},
    "Dots3NoteTextConfig": {"swa_num_attention_heads": 4, "swa_num_key_value_heads": 4,
                            "swa_q_lora_rank": 16, "swa_kv_lora_rank": 16, "swa_head_dim": 16,
                            "swa_qk_nope_head_dim": 8, "swa_v_head_dim": 16},
    "VibeVoiceAcousticTokenizerEncoderConfig": {"num_filters": 4, "depths": [1] * 7},
    "Nemotron3DiarizationHeadConfig": {"audio_hidden_size": 64},
    "GitVisionConfig": {"image_size": 8, "patch_size": 4},
}


def _held(config):
    """The attributes a config holds, by their own names and by the aliases of its
    attribute_map (read without triggering a heterogeneous config's per-layer check)."""
    return set(vars(config)) | set(getattr(type(config), "attribute_map", {}) or {})


def _layer_lists(default, layers):
    """The per-layer lists of `default` (one entry per layer: layer_types, mlp_layer_types,
    ...) cut to `layers` entries that keep, in order, the first layer of every kind the full
    list has (a hybrid model keeps an attention layer), and more if there are more kinds."""
    full = next((vars(default)[k] for k in _LAYER_COUNTS if isinstance(vars(default).get(k), int)), None)
    out = {}
    for key, value in vars(default).items():
        if not (full and isinstance(value, list) and len(value) == full):
            continue
        if not all(isinstance(v, (str, int, float, bool)) or v is None for v in value):
            continue
        if len(set(value)) == full > layers:
            continue  # a list of layer indices (Lfm2's full_attn_idxs), not of kinds
        firsts = sorted({v: i for i, v in reversed(list(enumerate(value)))}.values())
        extra = [i for i in range(full) if i not in firsts][:max(0, layers - len(firsts))]
        out[key] = [value[i] for i in sorted(firsts + extra)]
    return out


def _shrunk_kwargs(config_class, level):
    """Keyword arguments that shrink `config_class`'s defaults: the sizes of SHRINK (and
    `level`), every sub-config (nested text, vision and audio configs: shrunk the same way),
    per-layer lists cut to the new layer count, then the family's own FAMILY entries. Read-only
    properties (a head_dim derived from the others) are left to be derived."""
    from transformers import PreTrainedConfig

    default = config_class()
    held = _held(default)
    shrink = {**SHRINK, **level}
    kwargs = {k: v for k, v in shrink.items()
              if k in held and not isinstance(getattr(config_class, k, None), property)}
    layers = next((kwargs[k] for k in _LAYER_COUNTS if k in kwargs), None)
    if layers is not None:
        for key, value in _layer_lists(default, layers).items():
            # A per-layer size (Gemma 3n's intermediate_size) takes the shrunk size.
            kwargs[key] = [kwargs[key]] * len(value) if key in kwargs else value
            for k in _LAYER_COUNTS:
                if k in kwargs:
                    kwargs[k] = max(kwargs[k], len(value))
    for name, value in vars(default).items():
        if isinstance(value, PreTrainedConfig):
            try:
                kwargs[name] = _tiny(type(value), level)
            except Exception as e:  # noqa: BLE001  the parent's own default stays
                SUB_CONFIG_ERRORS.append((config_class.__name__, name, f"{type(e).__name__}: {e}"))
    if "vocab_size" in kwargs:  # special token ids validated against the vocabulary
        free = iter(range(kwargs["vocab_size"] - 1, 0, -1))
        for key, value in vars(default).items():
            if _special(key) and isinstance(value, int) and value >= kwargs["vocab_size"] - 32:
                kwargs[key] = next(free)
    if vars(default).get("per_layer_config"):
        kwargs["per_layer_config"] = {}  # per-layer overrides are of the full sizes
    if "qk_rope_head_dim" in kwargs:
        # Multi-head latent attention: as many key/value heads as query heads, and head_dim
        # is the rotary part's (the rotary embedding is sized by it).
        kwargs["num_key_value_heads"] = kwargs.get("num_attention_heads", 4)
        if "head_dim" in kwargs:
            kwargs["head_dim"] = kwargs["qk_rope_head_dim"]
    fix = FAMILY.get(config_class.__name__, {})
    kwargs.update(fix(kwargs) if callable(fix) else fix)
    return kwargs


def _tiny(config_class, level):
    return config_class(**_shrunk_kwargs(config_class, level))


def _special(key):
    return key.endswith("token_id") or key.endswith("token_ids") or key.endswith("token_index")


def _fix_token_ids(config, seen=None):
    """Special token ids of the full vocabulary moved into the shrunk one, at its top (the
    random inputs stay below VOCAB - 32)."""
    seen = seen if seen is not None else set()
    if id(config) in seen:
        return
    seen.add(id(config))
    vocab = vars(config).get("vocab_size") or VOCAB
    free = iter(range(vocab - 1, vocab - 32, -1))
    for key, value in list(vars(config).items()):
        special = _special(key)
        if special and isinstance(value, int) and value >= vocab - 32:
            setattr(config, key, next(free))
        elif special and isinstance(value, list) and all(isinstance(v, int) for v in value):
            setattr(config, key, [next(free) if v >= vocab - 32 else v for v in value])
        elif hasattr(value, "to_dict") and hasattr(value, "model_type"):
            _fix_token_ids(value, seen)


def tiny_config(model_class, level=None):
    config = _tiny(model_class.config_class, level or {})
    _fix_token_ids(config)
    for key in ("pad_token_id", "decoder_start_token_id"):
        if getattr(config, key, None) is None:
            setattr(config, key, 0)
    config._attn_implementation = "eager"
    return config


def _text_inputs(model, ids, labels):
    return {"input_ids": ids, "labels": labels}


def _with_image(model, ids, labels):
    """Git's loss skips its image tokens, so it is always called with an image."""
    vision = model.config.vision_config
    g = torch.Generator().manual_seed(2)
    pixels = torch.randn(ids.shape[0], vision.num_channels, vision.image_size, vision.image_size,
                         generator=g)
    return {"input_ids": ids, "labels": labels, "pixel_values": pixels}


def _with_audio(model, ids, labels):
    """Voxtral Realtime's text is aligned with its audio frames: it needs both."""
    config = model.config
    frames = ids.shape[1] * config.audio_length_per_tok
    g = torch.Generator().manual_seed(3)
    features = torch.randn(ids.shape[0], config.audio_config.num_mel_bins, frames, generator=g)
    return {"input_ids": ids, "labels": labels, "input_features": features}


# Model class name -> the inputs of a step, for the models that take more than token ids and
# labels (Musicgen's labels have a codebook axis).
INPUTS = {
    "GitForCausalLM": _with_image,
    "VoxtralRealtimeForConditionalGeneration": _with_audio,
    "MusicgenForCausalLM": lambda model, ids, labels: {"input_ids": ids, "labels": labels[..., None]},
    "MusicgenMelodyForCausalLM": lambda model, ids, labels: {"input_ids": ids,
                                                             "labels": labels[..., None]},
}
# Model class name -> why it cannot take a training step on its own.
NO_STEP = {
    name: "a draft model for Gemma 4's speculative decoding: its forward takes the target "
          "model's key/value states and computes no loss"
    for name in ("Gemma4AssistantForCausalLM", "Gemma4UnifiedAssistantForCausalLM")
}
# Model class name -> what a freshly built model needs before its first call.
PREPARE = {
    "XmodForCausalLM": lambda model: model.set_default_language("en_XX"),
}


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
    PREPARE.get(model_class.__name__, lambda m: None)(model)
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
        inputs = INPUTS.get(type(model).__name__, _text_inputs)(model, ids, labels)
        loss = model(**inputs, **kw).loss
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


def _applied_step(fct, model, batches, extras, fused_linear):
    """step() under apply(): (losses and gradients, serving(model), the spy's counts and whether
    the model computes its own CrossEntropyLoss)."""
    fct.apply(fused_linear=fused_linear)
    try:
        with _Spy(fct) as spy, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ours = step(model, batches, extras)
        spy.own_cross_entropy = fct._computes_own_cross_entropy(type(model))
        return ours, fct.serving(model), spy
    finally:
        fct.revert()


def check_class(model_class, fused_linear=True):
    """(outcome, detail) of one class; outcome as the module docstring lists them."""
    import fusedce.transformers as fct

    if model_class.__name__ in NO_STEP:
        return "not buildable", NO_STEP[model_class.__name__]
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
        msg = next((line.strip() for line in str(e).splitlines() if line.strip()), "")[:120]
        return "not buildable", f"{where}: {type(e).__name__}: {msg}"
    try:
        ours, how, spy = _applied_step(fct, model, batches, extras, fused_linear)
    except Exception as e:  # noqa: BLE001
        return "failing", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    try:
        compare(ours, theirs)
    except AssertionError as e:
        # A model that changes itself in its first call (BigBird switches to full attention
        # for short inputs, Reformer fixes its hashing) is compared from its second call on;
        # one whose later calls differ too is not deterministic.
        again = step(model, batches, extras)
        try:
            compare(again, theirs)
            return "failing", f"differs: {str(e)[:400]}"
        except AssertionError:
            pass
        try:
            compare(step(model, batches, extras), again)
        except AssertionError:
            return "not buildable", "differs from itself without fusedce (not deterministic)"
        try:
            ours, how, spy = _applied_step(fct, model, batches, extras, fused_linear)
            compare(ours, again)
        except AssertionError as e:
            return "failing", f"differs (compared from the second call): {str(e)[:400]}"
        except Exception as e:  # noqa: BLE001
            return "failing", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
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
    if outcome == "logits" and spy.own_cross_entropy:
        detail = "its own CrossEntropyLoss, served by TokenCrossEntropyLoss"
    elif outcome == "logits" and model in fct._declined:
        detail = f"declined the fused loss: {fct._declined[model]}"
    elif outcome == "logits" and not fct._fusable_head(model):
        detail = f"its output embedding is a {type(model.get_output_embeddings()).__name__}, " \
                 "not a plain nn.Linear"
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
