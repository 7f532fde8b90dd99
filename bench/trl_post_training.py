#!/usr/bin/env python3
"""fusedce against TRL 1.16's own fused LM head, where RL post-training and SFT compute their
per-token log-probabilities. Three parts, each its own CSV:

  kernel  (logprobs_trl.csv) the head alone, fwd + bwd with the entropy, one row per shape x
          implementation: fusedce.linear_logprobs by default (keep_logits=None), with
          keep_logits=True and False; trl.kernels.ChunkedLogProbFunction with GRPO's outputs
          (log_probs, entropy) and with all five of its outputs (log_sum_sq_probs, mean_logits
          and is_top1 too, each of which fusedce also gives), beside fusedce.integrations.trl's
          head with those five; Liger-Kernel's SM90 fused scaled cross-entropy where it imports
          on an SM90 GPU (else a row saying why).
          Peak memory over the inputs, the largest difference of the log-probabilities, entropy
          and gradients from TRL's (log_probs, entropy) row of the same shape, and the median
          time (below).
  grpo    (grpo_step_trl.csv) one GRPO policy step as trl.GRPOTrainer computes it: a Qwen2-shaped
          model built from a config (random weights), fixed random prompts and completions and
          advantages (no generation), GRPOTrainer.compute_loss (the trainer's own loss, through
          the fused head add_fused_lm_head installed) and its backward; TRL alone and with
          fusedce.integrations.trl.apply(). Step time, peak memory, the loss and the gradients'
          largest difference from TRL's.
  sft     (sft_step_trl.csv) one SFT step: trl.SFTTrainer.compute_loss (its default loss, "nll"
          through TRL's fused head with entropy and is_top1 for its metrics) and its backward,
          against the model's own loss (model(input_ids, labels=...).loss, what SFT's "nll"
          equals) with fusedce.transformers.apply() (and with metrics=True, which also counts
          the entropy and argmax hits SFTTrainer logs; low_memory=True, the fused loss's extra
          memory within 512 MiB; skip_ignored=True, its products over the labelled positions
          only), and with plain transformers.

Run on a GPU from the repository root (the carried wheels installed to /tmp/site first):

    PYTHONPATH=$(python3 tests/python/build_tree.py <build>):/tmp/site \\
        python3 bench/trl_post_training.py --out bench/h200

Timing: the variants of one comparison (a shape's implementations, a part's steps) are checked
first, then timed in interleaved rounds (fusedce.bench.measure.time_rounds: every variant once a
round, the order rotated each round, each call alone on an idle GPU between CUDA events), so
the chip's clock and temperature drift reach every variant alike; median of --repeat rounds
after --warmup.

--smoke runs every part at tiny shapes (the CPU's default), for the test that keeps this script
working (tests/python/test_trl_bench.py). Only the modules a part needs are imported: the kernel
part needs trl.kernels (transformers' utils, no datasets); grpo and sft import TRL's trainers
(datasets, accelerate, pandas, pyarrow).

Work per row: 2 N H V FLOPs forward, 6 N H V for forward + backward with recomputed logits, 4 N H V
with kept ones (the kernel part's rates are left to the reader: the same shapes, the same run).
"""

import argparse
import atexit
import gc
import math
import os
import shutil
import sys
import tempfile
import time
import traceback

import torch

import fusedce
from fusedce.bench.measure import device_name, spread, sync, time_rounds
from fusedce.bench.rows import common_columns, gib, max_abs, max_rel, peak_memory, print_rows, write_csv

# trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE in TRL 1.16: the vocabulary chunk its trainers pass.
TRL_CHUNK = 32768
GRPO_OUTPUTS = ("log_probs", "entropy")
# Every optional output of TRL's head that fusedce also computes: all of them.
SHARED_OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")

# Qwen2.5-7B's and Gemma-shaped heads, and the grpo part's own (Qwen2.5-0.5B's width, 8 x 1024 tokens).
KERNEL_SHAPES = [(8192, 4096, 151936), (16384, 4096, 151936), (8192, 2048, 262144), (8192, 896, 151936)]
SMOKE_KERNEL_SHAPES = [(48, 32, 1000), (64, 16, 1531)]


class Skip(Exception):
    """This row cannot run here; the message says why."""


# ---- measurement ---------------------------------------------------------------------------------


def time_ready(ready, rows, a, device, activate=None):
    """Times the checked runs of one comparison (name -> run) in interleaved rounds
    (measure.time_rounds) and puts each one's median, p10 and p90 in its row (rows: name -> row).
    A run that fails while timed fails every row of the comparison: their rounds are shared."""
    try:
        times = time_rounds(ready, a.repeat, a.warmup, device, activate)
    except Exception as e:
        for name in ready:
            rows[name].update(status="failed", note=f"timing: {type(e).__name__}: {e}".splitlines()[0])
        return
    for name, t in times.items():
        median, p10, p90 = spread(t)
        rows[name].update(median_ms=median, p10_ms=p10, p90_ms=p90, runs=a.repeat)


# ---- kernel: the head alone ----------------------------------------------------------------------


def head_problem(n, hid, vocab, dtype, device, seed=0):
    """hidden (n, hid), weight (vocab, hid) in dtype, tokens (n,) mostly each row's likely token
    (a peaked, trained-looking policy), and the float32 weights of a GRPO-like objective over
    log-probabilities and entropy."""
    g = torch.Generator(device=device).manual_seed(seed)
    h = torch.randn(n, hid, generator=g, device=device)
    w = torch.randn(vocab, hid, generator=g, device=device) / math.sqrt(hid)
    likely = torch.randint(0, vocab, (n,), generator=g, device=device)
    w.index_add_(0, likely, 2.5 * h / h.norm(dim=1, keepdim=True))
    other = torch.randint(0, vocab, (n,), generator=g, device=device)
    tokens = torch.where(torch.rand(n, generator=g, device=device) < 0.7, likely, other)
    a = torch.randn(n, generator=g, device=device)
    c = torch.randn(n, generator=g, device=device) * 0.1
    return h.to(dtype), w.to(dtype), tokens, a, c


def _fusedce_impl(**kw):
    def call(h, w, t):
        return fusedce.linear_logprobs(h, w, t, return_entropy=True, **kw)
    return call


def _trl_impl(outputs):
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    def call(h, w, t):
        out = ChunkedLogProbFunction.apply(h, w, None, t, 1.0, TRL_CHUNK, None, 1.0, outputs)
        return out[0], out[1]
    return call


def _fusedce_trl_head_impl(outputs):
    from fusedce.integrations.trl import FusedceLogProbHead

    def call(h, w, t):
        out = FusedceLogProbHead.apply(h, w, None, t, 1.0, TRL_CHUNK, None, 1.0, outputs)
        return out[0], out[1]
    return call


def _liger_sm90_impl(device):
    """Liger-Kernel's SM90 path (CuTe DSL), through its public dispatching entry, only where that
    entry dispatches to it: an SM90 GPU and the SM90 module importable."""
    if device != "cuda":
        raise Skip("runs on CUDA devices only")
    if torch.cuda.get_device_capability() != (9, 0):
        raise Skip(f"its SM90 path needs compute capability 9.0, this GPU has {torch.cuda.get_device_capability()}")
    try:
        from liger_kernel.ops.cutedsl.ops.fused_scaled_cross_entropy_sm90 import (  # noqa: F401
            LigerFusedScaledCrossEntropySM90Function)
        from liger_kernel.ops.fused_linear_scaled_cross_entropy import LigerFusedLinearScaledCrossEntropyFunction
    except Exception as e:  # any import failure: not installed, no CuTe DSL, ...
        raise Skip(f"liger-kernel's SM90 path does not import: {type(e).__name__}: {e}".splitlines()[0]) from None

    def call(h, w, t):
        nll, entropy = LigerFusedLinearScaledCrossEntropyFunction.apply(h, w, t, 1.0, -100, 1, True)
        return -nll, entropy
    return call


def kernel_impls(device):
    """(id, outputs, loader) in the order run; TRL's GRPO row first: the others are compared to it."""
    return [
        ("trl", GRPO_OUTPUTS, lambda: _trl_impl(GRPO_OUTPUTS)),
        ("fusedce", GRPO_OUTPUTS, lambda: _fusedce_impl()),
        ("fusedce keep_logits=True", GRPO_OUTPUTS, lambda: _fusedce_impl(keep_logits=True)),
        ("fusedce keep_logits=False", GRPO_OUTPUTS, lambda: _fusedce_impl(keep_logits=False)),
        ("trl all shared outputs", SHARED_OUTPUTS, lambda: _trl_impl(SHARED_OUTPUTS)),
        ("fusedce TRL head, all shared outputs", SHARED_OUTPUTS, lambda: _fusedce_trl_head_impl(SHARED_OUTPUTS)),
        ("liger-kernel sm90", GRPO_OUTPUTS, lambda: _liger_sm90_impl(device)),
    ]


def kernel_part(a):
    device, dtype = a.device, a.dtype
    shapes = SMOKE_KERNEL_SHAPES if a.smoke else KERNEL_SHAPES
    if a.shapes:
        shapes = [tuple(int(x) for x in s.split("x")) for s in a.shapes.split(",")]
    rows = []
    for n, hid, vocab in shapes:
        h, w, t, ca, cc = head_problem(n, hid, vocab, dtype, device)
        leaves = [h.detach().requires_grad_(True), w.detach().requires_grad_(True)]
        ref, ready, shape_rows = None, {}, []
        for impl, outputs, load in kernel_impls(device):
            row = {"part": "kernel", "tokens": n, "hidden": hid, "vocab": vocab, "dtype": str(dtype).split(".")[-1],
                   "impl": impl, "outputs": "+".join(outputs), "chunk": TRL_CHUNK if "trl" in impl.lower() else None}
            shape_rows.append(row)
            try:
                fn = load()
            except Skip as e:
                row.update(status="skipped", note=str(e), **common_columns(device))
                continue
            except Exception as e:
                row.update(status="unavailable", note=f"{type(e).__name__}: {e}".splitlines()[0],
                           **common_columns(device))
                continue

            def run(_i, fn=fn):
                for x in leaves:
                    x.grad = None
                lp, ent = fn(*leaves, t)
                ((lp * ca).sum() + (ent * cc).sum()).backward()
                return lp, ent, leaves[0].grad, leaves[1].grad

            try:
                lp, ent, gh, gw = (x.detach() for x in run(0))  # the checked call (and the compile)
                sync(device)
                for x in leaves:  # the checked call's gradients are not the next call's inputs
                    x.grad = None
                over, beyond = peak_memory(run, device)
            except Exception as e:
                row.update(status="failed", note=f"{type(e).__name__}: {e}".splitlines()[0], **common_columns(device))
                continue
            if ref is None:
                ref = (lp.clone(), ent.clone(), gh.clone(), gw.clone())
            row.update(status="ok", median_ms=None, p10_ms=None, p90_ms=None, runs=None,  # time_ready's
                       peak_over_inputs_gib=gib(over), peak_beyond_outputs_gib=gib(beyond),
                       logprob_maxabs_vs_trl=max_abs(lp, ref[0]), entropy_maxabs_vs_trl=max_abs(ent, ref[1]),
                       grad_hidden_maxrel_vs_trl=max_rel(gh, ref[2]), grad_weight_maxrel_vs_trl=max_rel(gw, ref[3]),
                       **common_columns(device))
            ready[impl] = run
            del lp, ent, gh, gw
            for x in leaves:
                x.grad = None
        time_ready(ready, {r["impl"]: r for r in shape_rows}, a, device)
        for x in leaves:
            x.grad = None
        rows.extend(shape_rows)
        del h, w, t, leaves, ref
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


KERNEL_COLUMNS = ["tokens", "hidden", "vocab", "impl", "status", "median_ms", "peak_over_inputs_gib",
                  "logprob_maxabs_vs_trl", "entropy_maxabs_vs_trl", "grad_weight_maxrel_vs_trl", "note"]


# ---- a tiny Qwen2-shaped model, a tokenizer and a dataset built here (nothing downloaded) --------

WORDS = ["<pad>", "<eos>"] + [f"w{i}" for i in range(200)]


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    fast.padding_side = "left"
    return fast


def qwen2_model(a, device):
    """Qwen2.5-0.5B's width (hidden 896, 14 heads, 2 key-value heads, tied embeddings) with
    `a.layers` layers and `a.vocab` tokens, random weights, in `a.model_dtype`."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    if a.smoke:
        config = Qwen2Config(vocab_size=a.vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                             tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    else:
        config = Qwen2Config(vocab_size=a.vocab, hidden_size=896, intermediate_size=4864, num_hidden_layers=a.layers,
                             num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                             tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    return Qwen2ForCausalLM(config).to(device=device, dtype=a.model_dtype)


def step_sizes(a):
    """(sequences, prompt tokens, completion tokens) of one step."""
    return (2, 8, 16) if a.smoke else (a.completions, a.prompt_tokens, a.completion_tokens)


def scratch_dir(prefix):
    """A fresh folder for a trainer's output_dir (nothing is saved there), removed at exit."""
    tmp = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    return tmp


def trainer_args(a, device, tmp, **extra):
    return dict(output_dir=tmp, report_to=[], use_cpu=device != "cuda", bf16=device == "cuda", save_strategy="no",
                logging_steps=1, max_steps=1, seed=0, **extra)


def step_rows(part, variants, prepare, activate, model, a, device):
    """Checks and times each variant's step: activate(variant) puts the variant's global setting
    in place (TRL's head or fusedce's, a patched model), prepare(variant) -> (run(i) returning the
    loss and the gradients, a note). Each variant's loss and gradients are compared with the
    first's, its peak measured over the model's parameters and the inputs (no gradients held
    before the step), then the variants are timed in interleaved rounds (time_ready)."""
    rows, ready, ref = {}, {}, None
    for variant in variants:
        row = rows[variant] = {"part": part, "variant": variant, **step_shape(a)}
        try:
            activate(variant)
            run, note = prepare(variant)
            row["note"] = note
            loss, grads = run(0)
            loss = loss.item()
            grads = {k: g.detach().clone() for k, g in grads.items()}
            model.zero_grad(set_to_none=True)
            over, _ = peak_memory(lambda i: (run(i)[0],), device)
            model.zero_grad(set_to_none=True)
        except Exception as e:
            row.update(status="failed", note=f"{type(e).__name__}: {e}".splitlines()[0], **common_columns(device))
            continue
        if ref is None:
            ref = (loss, grads)
        worst = max((max_rel(grads[k], ref[1][k]) for k in ref[1] if k in grads), default=None)
        row.update(status="ok", median_ms=None, p10_ms=None, p90_ms=None, runs=None,  # time_ready's
                   peak_over_params_gib=gib(over),
                   peak_allocated_gib=gib(torch.cuda.max_memory_allocated()) if device == "cuda" else None,
                   loss=loss, loss_absdiff_vs_first=abs(loss - ref[0]), grad_maxrel_vs_first=worst,
                   **common_columns(device))
        ready[variant] = run
        del grads
    time_ready(ready, rows, a, device, activate)
    model.zero_grad(set_to_none=True)
    return list(rows.values())


def step_shape(a):
    seqs, prompt, completion = step_sizes(a)
    return {"sequences": seqs, "prompt_tokens": prompt, "completion_tokens": completion, "vocab": a.vocab,
            "hidden": 32 if a.smoke else 896, "layers": 2 if a.smoke else a.layers,
            "model_dtype": str(a.model_dtype).split(".")[-1]}


def _grads_of(model):
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


# ---- grpo: one policy step of trl.GRPOTrainer -----------------------------------------------------


def grpo_inputs(a, device):
    """What GRPOTrainer._generate_and_score_completions hands compute_loss, fixed and random:
    left-padded prompts, completions (a few end early: their tail masked), one advantage per
    completion (rewards normalised within the group), no old or reference log-probabilities
    (num_iterations 1, beta 0: TRL's defaults)."""
    seqs, prompt, completion = step_sizes(a)
    g = torch.Generator().manual_seed(1)
    prompt_ids = torch.randint(2, a.vocab, (seqs, prompt), generator=g)
    prompt_mask = torch.ones(seqs, prompt, dtype=torch.long)
    prompt_mask[0, : prompt // 4] = 0  # one left-padded prompt
    prompt_ids[prompt_mask == 0] = 0
    completion_ids = torch.randint(2, a.vocab, (seqs, completion), generator=g)
    lengths = torch.randint(completion // 2, completion + 1, (seqs,), generator=g)
    lengths[0] = completion
    completion_mask = (torch.arange(completion)[None, :] < lengths[:, None]).long()
    completion_ids[completion_mask == 0] = 0
    rewards = torch.rand(seqs, generator=g)
    advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
    inputs = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
              "completion_mask": completion_mask, "advantages": advantages,
              "num_items_in_batch": completion_mask.sum()}
    return {k: v.to(device) for k, v in inputs.items()}


def grpo_step(a):
    """One GRPO policy step as trl.GRPOTrainer computes it, built once: (run(i) -> (loss,
    gradients), the policy, the config). The trainer and the fixed inputs are those of
    grpo_inputs; run is Trainer.training_step without _prepare_inputs (generation): the loss under
    the trainer's autocast through whichever fused head TRL's module holds, then its backward."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    seqs, _, completion = step_sizes(a)
    args = GRPOConfig(**trainer_args(a, a.device, scratch_dir("fusedce_grpo_")), per_device_train_batch_size=seqs,
                      num_generations=seqs, max_completion_length=completion)
    prompts = Dataset.from_dict({"prompt": [" ".join(f"w{(7 * i + k) % 200}" for k in range(5)) for i in range(seqs)]})
    trainer = GRPOTrainer(model=qwen2_model(a, a.device), reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                          args=args, train_dataset=prompts, processing_class=tiny_tokenizer())
    policy = trainer.model
    if args.gradient_checkpointing and not getattr(policy, "is_gradient_checkpointing", False):
        # Trainer turns it on when train() starts; the step below skips train()
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs)
    if not hasattr(trainer, "current_gradient_accumulation_steps"):
        trainer.current_gradient_accumulation_steps = args.gradient_accumulation_steps  # set by train()
    policy.train()
    inputs = grpo_inputs(a, a.device)

    def run(_i=0):
        policy.zero_grad(set_to_none=True)
        with trainer.compute_loss_context_manager():
            loss = trainer.compute_loss(policy, dict(inputs))
        trainer.accelerator.backward(loss)
        return loss.detach(), _grads_of(policy)
    return run, policy, args


def grpo_part(a):
    import fusedce.integrations.trl as fused_trl
    import trl.trainer.utils as trl_utils

    if getattr(trl_utils, "_CHUNKED_LOGPROB_CHUNK_SIZE", TRL_CHUNK) != TRL_CHUNK:
        print(f"note: TRL's trainers pass a vocabulary chunk of {trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE}, "
              f"the kernel part {TRL_CHUNK}")
    run, policy, args = grpo_step(a)

    def activate(variant):
        if variant == "trl":
            fused_trl.revert()
        else:
            fused_trl.apply()

    try:
        rows = step_rows("grpo", ["trl", "trl + fusedce.integrations.trl"], lambda _variant: (run, None), activate,
                         policy, a, a.device)
    finally:
        fused_trl.revert()
    for row in rows:
        row.update(loss_type=args.loss_type, beta=args.beta, gradient_checkpointing=args.gradient_checkpointing)
    return rows


# ---- sft: one step of trl.SFTTrainer against the model's own loss on fusedce ----------------------


def sft_inputs(a, device):
    seqs, prompt, completion = step_sizes(a)
    length = prompt + completion
    g = torch.Generator().manual_seed(2)
    input_ids = torch.randint(2, a.vocab, (seqs, length), generator=g)
    attention_mask = torch.ones(seqs, length, dtype=torch.long)
    attention_mask[0, length - length // 4:] = 0  # one right-padded sequence
    input_ids[attention_mask == 0] = 0
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    return {k: v.to(device) for k, v in {"input_ids": input_ids, "attention_mask": attention_mask,
                                         "labels": labels}.items()}


def sft_part(a):
    device = a.device
    import fusedce.transformers as fused_tf
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    seqs, prompt, completion = step_sizes(a)
    tmp = scratch_dir("fusedce_sft_")
    args = SFTConfig(**trainer_args(a, device, tmp), per_device_train_batch_size=seqs,
                     max_length=prompt + completion)
    texts = Dataset.from_dict({"text": [" ".join(f"w{(3 * i + k) % 200}" for k in range(12)) for i in range(seqs)]})
    model = qwen2_model(a, device)
    trainer = SFTTrainer(model=model, args=args, train_dataset=texts, processing_class=tiny_tokenizer())
    policy = trainer.model
    if args.gradient_checkpointing and not getattr(policy, "is_gradient_checkpointing", False):
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs)
    policy.train()
    inputs = sft_inputs(a, device)
    num_items = (inputs["labels"][:, 1:] != -100).sum()

    # each fusedce variant's apply() options (memory against time: the same loss)
    applied = {"fusedce.transformers.apply()": {}, "fusedce.transformers.apply(metrics=True)": {"metrics": True},
               "fusedce.transformers.apply(low_memory=True)": {"low_memory": True},
               "fusedce.transformers.apply(skip_ignored=True)": {"skip_ignored": True}}

    def activate(variant):
        fused_tf.revert()
        if variant.startswith("fusedce.transformers"):
            fused_tf.apply(**applied[variant])

    def prepare(variant):
        note = None
        if variant.startswith("fusedce.transformers"):
            # served fused: the output's logits are fusedce's empty marker (with gradients on)
            with trainer.compute_loss_context_manager():
                served = policy(**inputs).logits.shape[-1] == 0
            note = "fused linear loss" if served else "DECLINED: the logits path"

        def run(_i):
            policy.zero_grad(set_to_none=True)
            with trainer.compute_loss_context_manager():
                if variant == "trl":  # SFTTrainer's own loss: TRL's fused head
                    loss = trainer.compute_loss(policy, dict(inputs), num_items_in_batch=num_items)
                else:  # the model's own causal-LM loss, as transformers (or fusedce under it) computes it
                    loss = policy(**inputs).loss
            trainer.accelerator.backward(loss)
            return loss.detach(), _grads_of(policy)
        return run, note

    variants = ["trl", *applied, "transformers (logits)"]
    try:
        rows = step_rows("sft", variants, prepare, activate, policy, a, device)
    finally:
        fused_tf.revert()
    for row in rows:
        row.update(loss_type=args.loss_type, gradient_checkpointing=args.gradient_checkpointing)
    return rows


STEP_COLUMNS = ["variant", "status", "median_ms", "peak_over_params_gib", "loss", "loss_absdiff_vs_first",
                "grad_maxrel_vs_first", "note"]


# ---- main ---------------------------------------------------------------------------------------

PARTS = {"kernel": ("logprobs_trl.csv", kernel_part, KERNEL_COLUMNS),
         "grpo": ("grpo_step_trl.csv", grpo_part, STEP_COLUMNS),
         "sft": ("sft_step_trl.csv", sft_part, STEP_COLUMNS)}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench/h200", help="folder for the CSV files (default bench/h200)")
    p.add_argument("--only", default="kernel,grpo,sft", help="comma-separated from kernel,grpo,sft")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, two runs: checks that every part runs")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16", help="the kernel part's inputs")
    p.add_argument("--shapes", help="the kernel part's NxHxV, comma-separated")
    p.add_argument("--vocab", type=int, help="the steps' vocabulary (default 151936; --smoke 1000)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--completions", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--completion-tokens", type=int, default=1024)
    p.add_argument("--model-dtype", choices=tuple(DTYPES), default="bfloat16")
    p.add_argument("--repeat", type=int, help="timed runs (default 10; --smoke 2)")
    p.add_argument("--warmup", type=int, help="untimed runs after the checked one (default 3; --smoke 0)")
    a = p.parse_args(argv)
    a.only = [x.strip() for x in a.only.split(",") if x.strip()]
    unknown = sorted(set(a.only) - set(PARTS))
    if unknown:
        p.error(f"--only: unknown {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no GPU")
    a.dtype = DTYPES[a.dtype]
    a.model_dtype = DTYPES[a.model_dtype]
    a.vocab = a.vocab or (1000 if a.smoke else 151936)
    a.repeat = a.repeat or (2 if a.smoke else 10)
    a.warmup = a.warmup if a.warmup is not None else (0 if a.smoke else 3)
    return a


def main(argv=None):
    a = parse_args(argv)
    print(f"fusedce {fusedce.__version__} (CUDA kernels: {fusedce.with_cuda}), torch {torch.__version__}, "
          f"{device_name(a.device)}")
    failed = False
    for name in a.only:
        file, part, columns = PARTS[name]
        started = time.time()
        try:
            rows = part(a)
        except ImportError as e:  # a part whose peer is not installed: said, not raised
            print(f"\n== {name}: skipped, {type(e).__name__}: {e}")
            continue
        except Exception:  # a part that breaks (a peer's version, say) leaves the others to run
            print(f"\n== {name}: failed")
            traceback.print_exc()
            failed = True
            continue
        for r in rows:  # the note column is part of the format, also where no row has one
            r.setdefault("note", "")
        write_csv(os.path.join(a.out, file), rows)
        print_rows(f"{name} ({time.time() - started:.0f} s) -> {os.path.join(a.out, file)}", rows, columns)
        failed |= any(r.get("status") == "failed" for r in rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
