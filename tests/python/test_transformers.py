"""fusedce.transformers.apply(): tiny causal LMs (Llama, Qwen2, Gemma2 with its final logit
softcap, Cohere with its logit scale, Phi with a biased lm_head; built from configs, nothing
downloaded) train with the same loss and gradients as with transformers' own loss, in a
hand-written loop with gradient accumulation (num_items_in_batch), with precomputed shift_labels
and under Trainer; both with fused_linear (the loss from lm_head's call, no logits) and over
the logits (fused_linear=False). apply(metrics=True): bit-identical loss and gradients, and the
token accuracy and entropy that Trainer logs against float64 values from the micro-batches."""

import copy
import inspect
import sys
import types

import pytest
import torch

import fusedce
import fusedce.transformers as fct
from conftest import DEVICES

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel  # noqa: E402
from transformers.loss import loss_utils  # noqa: E402

VOCAB = 1000
FAMILIES = ["llama", "qwen2", "gemma2", "cohere", "phi"]


def tiny_model(family="llama", seed=0, dtype=torch.float32):
    """A two-layer model of `family` from a config; Gemma2 keeps its default final logit
    softcap (30), Cohere gets a logit scale of 0.5 (its default, 1/16, would make the test
    weak), Phi has a bias in lm_head."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=64, attn_implementation="eager")
    config = {
        "llama": lambda: tf.LlamaConfig(num_key_value_heads=2, **common),
        "qwen2": lambda: tf.Qwen2Config(num_key_value_heads=2, **common),
        "gemma2": lambda: tf.Gemma2Config(num_key_value_heads=2, head_dim=16, **common),
        "cohere": lambda: tf.CohereConfig(num_key_value_heads=2, logit_scale=0.5, bos_token_id=1,
                                          eos_token_id=2, pad_token_id=0, **common),
        "phi": lambda: tf.PhiConfig(**common),
    }[family]()
    model_class = {"llama": tf.LlamaForCausalLM, "qwen2": tf.Qwen2ForCausalLM,
                   "gemma2": tf.Gemma2ForCausalLM, "cohere": tf.CohereForCausalLM,
                   "phi": tf.PhiForCausalLM}[family]
    torch.manual_seed(seed)
    return model_class(config).to(dtype)


def tiny_llama(seed=0, dtype=torch.float32):
    return tiny_model("llama", seed, dtype)


def batch(b, s, seed, pad_from=None):
    """input_ids and labels (B, S); labels of the positions from `pad_from[i]` on are -100, as a
    collator pads them."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (b, s), generator=g)
    labels = ids.clone()
    if pad_from is not None:
        for i, p in enumerate(pad_from):
            labels[i, p:] = -100
    return ids, labels


@pytest.fixture(params=[True, False], ids=["fused_linear", "logits"])
def applied(request):
    fct.apply(fused_linear=request.param)
    yield request.param
    fct.revert()


@pytest.fixture
def spy(monkeypatch):
    """The loss calls fusedce made: the logits' dtype for cross_entropy, ("linear", hidden's
    dtype) for linear_cross_entropy."""
    calls = []
    real, real_linear = fct.cross_entropy, fct.linear_cross_entropy

    def counting(*args, **kwargs):
        calls.append(args[0].dtype)
        return real(*args, **kwargs)

    def counting_linear(*args, **kwargs):
        calls.append(("linear", args[0].dtype))
        return real_linear(*args, **kwargs)

    monkeypatch.setattr(fct, "cross_entropy", counting)
    monkeypatch.setattr(fct, "linear_cross_entropy", counting_linear)
    return calls


def expected_calls(fused, dtype=torch.float32, n=1):
    return [("linear", dtype) if fused else dtype] * n


def loss_and_grads(model, micro_batches, num_items_in_batch=None, **extra):
    model.zero_grad(set_to_none=True)
    losses = []
    for ids, labels in micro_batches:
        kw = {} if num_items_in_batch is None else {"num_items_in_batch": num_items_in_batch}
        loss = model(input_ids=ids, labels=labels, **kw, **extra).loss
        loss.backward()
        losses.append(loss.detach())
    # a compiled model names its parameters "_orig_mod.<name>"
    return torch.stack(losses), {n.removeprefix("_orig_mod."): p.grad.clone()
                                 for n, p in model.named_parameters()}


def assert_same_training_signal(a, b, rtol=2e-5, atol=1e-7, scale_atol=1e-5):
    """Losses and every gradient equal up to float32 rounding. The fused linear loss sums the
    logits' dot products in another order than the model's matmul, so entries near 0 of a
    gradient differ by a few units of rounding of that gradient's largest entries: the
    absolute tolerance of each gradient is scale_atol times its largest entry (observed: under
    1e-6 times it)."""
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    torch.testing.assert_close(loss_a, loss_b, rtol=rtol, atol=atol)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        tol = max(atol, scale_atol * grads_b[name].abs().max().item())
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=rtol, atol=tol, msg=name)


def test_apply_and_revert_swap_the_loss():
    original = loss_utils.ForCausalLMLoss
    model = tiny_llama()
    assert model.loss_function is original
    fct.apply()
    fct.apply()  # idempotent
    try:
        assert PreTrainedModel.__dict__["__call__"] is fct._model_call  # fused_linear by default
        fct.apply(fused_linear=False)
        assert "__call__" not in PreTrainedModel.__dict__
        fct.apply(fused_linear=True)
        assert fct.is_applied()
        assert model.loss_function is fct.causal_lm_loss
        assert loss_utils.LOSS_MAPPING["ForCausalLM"] is fct.causal_lm_loss
        assert loss_utils.LOSS_MAPPING["ForConditionalGeneration"] is fct.causal_lm_loss
        assert loss_utils.ForCausalLMLoss is fct.causal_lm_loss
        assert tiny_llama().loss_function is fct.causal_lm_loss  # models made after apply()
    finally:
        fct.revert()
    assert not fct.is_applied()
    assert "__call__" not in PreTrainedModel.__dict__
    assert "forward" not in model.lm_head.__dict__
    assert loss_utils.ForCausalLMLoss is original
    assert loss_utils.LOSS_MAPPING["ForCausalLM"] is original
    assert model.loss_function is original


@pytest.mark.parametrize("family", FAMILIES)
def test_loss_and_gradients_match(applied, spy, family):
    model = tiny_model(family)
    data = [batch(2, 16, seed=1, pad_from=[16, 9])]
    ours = loss_and_grads(model, data)
    # fusedce computed the loss: from lm_head's input and weight (fused_linear), or from the
    # logits as they are
    assert spy == expected_calls(applied)
    fct.revert()
    theirs = loss_and_grads(model, data)
    fct.apply(fused_linear=applied)
    assert_same_training_signal(ours, theirs)


def test_apply_passes_its_memory_options_to_every_fused_loss(monkeypatch):
    # apply()'s chunk_budget_bytes, low_memory and skip_ignored reach every fused linear loss
    # call, and revert() forgets them; loss and gradients stay transformers' own (a budget of a
    # few rows forces several chunks; the second sequence's padding gives skip_ignored rows).
    names = ("chunk_budget_bytes", "low_memory", "skip_ignored")
    seen = []
    real = fct.linear_cross_entropy

    def recording(*args, **kwargs):
        seen.append({k: kwargs.get(k) for k in names})
        return real(*args, **kwargs)

    monkeypatch.setattr(fct, "linear_cross_entropy", recording)
    model = tiny_model("llama", seed=4)
    data = [batch(2, 16, seed=7, pad_from=[16, 5])]
    theirs = loss_and_grads(model, data)
    options = dict(chunk_budget_bytes=3 * VOCAB * 4, low_memory=True, skip_ignored=True)
    fct.apply(**options)
    try:
        ours = loss_and_grads(model, data)
    finally:
        fct.revert()
    assert seen == [options]
    assert_same_training_signal(ours, theirs)
    # The default budget is the head weight's bytes; None is linear_cross_entropy's own default,
    # and so is "head" with low_memory (whose bound a larger buffer would break).
    head_bytes = model.lm_head.weight.numel() * model.lm_head.weight.element_size()
    for options, budget in ((dict(), head_bytes), (dict(chunk_budget_bytes=None), None),
                            (dict(low_memory=True), None)):
        fct.apply(**options)
        try:
            loss_and_grads(model, data)
        finally:
            fct.revert()
        assert seen[-1] == dict(chunk_budget_bytes=budget, low_memory=options.get("low_memory", False),
                                skip_ignored=False), options


@pytest.mark.parametrize("budget", [0, -1, 1.5, True, 2**63, "weights"])
def test_apply_refuses_a_bad_chunk_budget(budget):
    with pytest.raises(ValueError, match="fusedce.transformers.apply: chunk_budget_bytes"):
        fct.apply(chunk_budget_bytes=budget)
    assert not fct.is_applied()


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_gradient_accumulation_with_num_items_in_batch(applied, spy, family):
    # Two micro-batches with different numbers of real tokens, normalised by the count over both,
    # as Trainer does it: the same as one batch's mean, and the same as transformers' loss.
    model = tiny_model(family, seed=3)
    micro = [batch(2, 12, seed=5, pad_from=[12, 4]), batch(2, 12, seed=6, pad_from=[7, 10])]
    num_items = sum((labels[..., 1:] != -100).sum() for _, labels in micro)
    ours = loss_and_grads(model, micro, num_items_in_batch=num_items)
    assert spy == expected_calls(applied, n=2)
    fct.revert()
    theirs = loss_and_grads(model, micro, num_items_in_batch=num_items)
    fct.apply(fused_linear=applied)
    assert_same_training_signal(ours, theirs)

    whole = (torch.cat([m[0] for m in micro]), torch.cat([m[1] for m in micro]))
    loss_whole, grads_whole = loss_and_grads(model, [whole])
    assert_same_training_signal((ours[0].sum(), ours[1]), (loss_whole[0], grads_whole))


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_shift_labels(applied, spy, family):
    # Precomputed shift_labels (padding-free collators) are the targets as they are.
    model = tiny_model(family, seed=2)
    ids, labels = batch(2, 10, seed=4, pad_from=[10, 7])
    shift = torch.cat([labels[:, 1:], torch.full((2, 1), -100)], 1)
    shift[0, 2] = -100
    ours = loss_and_grads(model, [(ids, labels)], shift_labels=shift)
    assert spy == expected_calls(applied)
    fct.revert()
    theirs = loss_and_grads(model, [(ids, labels)], shift_labels=shift)
    fct.apply(fused_linear=applied)
    assert_same_training_signal(ours, theirs)


def test_fused_linear_never_makes_the_logits(spy):
    # With labels and gradients the output's logits are an empty (B, S, 0) stand-in; without
    # labels, or without gradients (evaluation), the logits are made as usual.
    model = tiny_model("gemma2", seed=5)
    ids, labels = batch(2, 8, seed=3)
    fct.apply()
    try:
        out = model(input_ids=ids, labels=labels)
        assert out.logits.shape == (2, 8, 0)
        assert spy == expected_calls(True)
        assert "forward" not in model.lm_head.__dict__  # the head is disarmed after the call
        assert model(input_ids=ids).logits.shape == (2, 8, VOCAB)
        with torch.no_grad():
            evaluated = model(input_ids=ids, labels=labels)
        assert evaluated.logits.shape == (2, 8, VOCAB)
        assert spy == expected_calls(True) + [torch.float32]
        torch.testing.assert_close(evaluated.loss, out.loss.detach(), rtol=1e-5, atol=1e-6)
    finally:
        fct.revert()


def test_an_undeclared_logit_transform_falls_back_to_the_logits(spy):
    # A model whose logits are transformed otherwise than its config says declines the fused
    # loss: the call runs again over the logits from the same random state (attention dropout
    # on, so a different state would give another loss), with a warning, and gives exactly
    # transformers' loss and gradients; later calls go straight to the logits.
    model = tiny_model("cohere")
    model.config.logit_scale = 0.25  # the model keeps multiplying by 0.5
    model.config.attention_dropout = 0.3
    model.train()
    data = [batch(2, 8, seed=1, pad_from=[8, 5])]
    fct.apply()
    try:
        torch.manual_seed(0)
        with pytest.warns(UserWarning, match=r"transforms its logits by \[scale 0.5\].*logit_scale=0.25"):
            first = loss_and_grads(model, data)
        assert "forward" not in model.lm_head.__dict__
        assert fct.serving(model) == "logits"
        assert spy == [("linear", torch.float32), torch.float32]
        torch.manual_seed(0)
        second = loss_and_grads(model, data)
        assert spy[2:] == [torch.float32]
    finally:
        fct.revert()
    torch.manual_seed(0)
    theirs = loss_and_grads(model, data)
    assert_same_training_signal(first, theirs)
    assert_same_training_signal(second, theirs)


def test_a_declining_model_runs_its_forward_once(spy, monkeypatch):
    # The model reads its logits' shape in a hook of lm_head (the marker cannot answer that)
    # and keeps a count of its forward passes in a buffer: the call declines within itself
    # (the logits are made real where the hook reads them), the buffer moves by one per call,
    # and the loss and gradients are transformers' own. (Running the call again, as an earlier
    # fallback did, moved the buffer twice.)
    monkeypatch.setattr(fct, "_warned", set())  # the warning comes once per class and process
    model = tiny_llama(seed=7)
    model.config.attention_dropout = 0.2
    model.train()
    model.register_buffer("forwards", torch.zeros((), dtype=torch.int64))
    def count(module, inputs):
        model.forwards.add_(1)

    widths = []

    def read_width(module, inputs, output):
        widths.append(output.shape[-1])

    model.model.embed_tokens.register_forward_pre_hook(count)
    model.lm_head.register_forward_hook(read_width)
    data = [batch(2, 8, seed=4, pad_from=[8, 6])]
    fct.apply()
    try:
        torch.manual_seed(1)
        with pytest.warns(UserWarning, match="reads shape of its logits"):
            ours = loss_and_grads(model, data)
        assert model.forwards.item() == 1
        assert widths == [VOCAB]
        assert fct.serving(model) == "logits"
    finally:
        fct.revert()
    torch.manual_seed(1)
    theirs = loss_and_grads(model, data)
    assert model.forwards.item() == 2
    assert_same_training_signal(ours, theirs)


# Models that compute their own cross-entropy (never self.loss_function), causal and
# encoder-decoder: apply() serves their CrossEntropyLoss over the logits (TokenCrossEntropyLoss),
# with the loss and gradients they compute without it.
OWN_LOSS = ["T5ForConditionalGeneration", "BartForConditionalGeneration", "BartForCausalLM",
            "TrOCRForCausalLM", "WhisperForCausalLM", "PLBartForCausalLM"]


@pytest.mark.parametrize("fused_linear", [True, False], ids=["fused_linear", "logits"])
@pytest.mark.parametrize("name", OWN_LOSS)
def test_models_with_their_own_loss_are_served_over_the_logits(name, fused_linear):
    import transformers_coverage as cov

    outcome, detail = cov.check_class(getattr(transformers, name), fused_linear=fused_linear)
    assert (outcome, detail) == ("logits", "its own CrossEntropyLoss, served by "
                                           "TokenCrossEntropyLoss")


def test_own_cross_entropy_is_swapped_and_restored():
    from transformers.models.bart import modeling_bart

    assert modeling_bart.CrossEntropyLoss is torch.nn.CrossEntropyLoss
    original_init = PreTrainedModel.__dict__["__init__"]
    fct.apply()
    try:
        assert modeling_bart.CrossEntropyLoss is fct.TokenCrossEntropyLoss
        assert modeling_bart.BCEWithLogitsLoss is torch.nn.BCEWithLogitsLoss
        assert inspect.signature(PreTrainedModel.__init__) == inspect.signature(original_init)
    finally:
        fct.revert()
    assert modeling_bart.CrossEntropyLoss is torch.nn.CrossEntropyLoss
    assert PreTrainedModel.__dict__["__init__"] is original_init


def test_a_module_imported_after_apply_is_served_when_its_model_is_built(monkeypatch):
    # transformers imports its modeling modules lazily: one imported after apply() binds torch's
    # CrossEntropyLoss, and gets TokenCrossEntropyLoss when a model of it is built.
    module = types.ModuleType("transformers.models.late.modeling_late")
    module.CrossEntropyLoss = torch.nn.CrossEntropyLoss
    fct.apply(fused_linear=False)
    try:
        monkeypatch.setitem(sys.modules, module.__name__, module)  # imported now
        late = type("LateForCausalLM", (LlamaForCausalLM,), {"__module__": module.__name__})
        assert module.CrossEntropyLoss is torch.nn.CrossEntropyLoss
        late(tiny_llama().config)
        assert module.CrossEntropyLoss is fct.TokenCrossEntropyLoss
    finally:
        fct.revert()
    assert module.CrossEntropyLoss is torch.nn.CrossEntropyLoss


STANDARD_CALLS = [  # (logits dtype, CrossEntropyLoss keyword arguments)
    (torch.float32, {}), (torch.float32, {"reduction": "sum"}),
    (torch.float32, {"reduction": "none"}), (torch.float32, {"ignore_index": 3}),
    (torch.float32, {"label_smoothing": 0.1}), (torch.bfloat16, {}), (torch.float16, {}),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,options", STANDARD_CALLS)
def test_token_cross_entropy_loss_serves_standard_calls(spy, dtype, options, device):
    x, t = fusedce_problem(dtype)
    t[t == -100] = options.get("ignore_index", -100)
    x, t = x.to(device), t.to(device)
    ours, our_grad = loss_and_grad(fct.TokenCrossEntropyLoss(**options), x, t)
    theirs, their_grad = loss_and_grad(torch.nn.CrossEntropyLoss(**options), x, t)
    assert spy == [dtype]
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
    tol = {"rtol": 2e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    torch.testing.assert_close(ours.float(), theirs.float(), **tol)
    torch.testing.assert_close(our_grad.float(), their_grad.float(), **tol)


def _probabilities(x, t):
    return x, torch.softmax(torch.randn(x.shape), -1).to(x.dtype)


OTHER_CALLS = {  # name -> (CrossEntropyLoss keyword arguments, (logits, target) -> call's inputs)
    "class weights": ({"weight": torch.rand(VOCAB) + 0.5}, None),
    "float64": ({}, lambda x, t: (x.double(), t)),
    "(N, C, d) logits": ({}, lambda x, t: (x.reshape(4, 6, VOCAB).transpose(1, 2), t.reshape(4, 6))),
    # torch reads (B, T, V) logits as (N, C, d1): T classes at VOCAB positions
    "unflattened (B, T, V)": ({}, lambda x, t: (x.reshape(1, 24, VOCAB),
                                                torch.arange(VOCAB)[None] % 24)),
    "class probabilities": ({}, _probabilities),
    "int32 target": ({}, lambda x, t: (x, t.int())),
    "empty batch": ({}, lambda x, t: (x[:0], t[:0])),
    "a single row (C,)": ({}, lambda x, t: (x[0], t[0])),
}


@pytest.mark.parametrize("name", OTHER_CALLS)
def test_token_cross_entropy_loss_leaves_other_calls_to_torch(spy, name):
    options, inputs = OTHER_CALLS[name]
    x, t = fusedce_problem(torch.float32)
    if inputs is not None:
        x, t = inputs(x, t)

    def outcome(loss):
        try:
            return loss_and_grad(loss, x, t)
        except Exception as e:  # noqa: BLE001  the same error as torch's
            return type(e), str(e)

    ours = outcome(fct.TokenCrossEntropyLoss(**options))
    theirs = outcome(torch.nn.CrossEntropyLoss(**options))
    assert spy == []
    if isinstance(theirs[0], type):
        assert ours == theirs
    else:  # bit-identical: torch's own forward (NaN where every target is ignored)
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def fusedce_problem(dtype, n=24, seed=4):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, VOCAB, generator=g) * 3).to(dtype)
    t = torch.randint(0, VOCAB, (n,), generator=g)
    t[::5] = -100
    t[1] = 3
    return x, t


def loss_and_grad(loss_module, x, t):
    x = x.detach().clone().requires_grad_(True)
    loss = loss_module(x, t)
    loss.sum().backward()
    return loss.detach(), x.grad


@pytest.mark.parametrize("name,inputs", [
    ("BartForSequenceClassification", lambda ids: {"labels": ids[:, 0] % 2}),
    ("T5ForQuestionAnswering", lambda ids: {"start_positions": ids[:, 0] % 10,
                                            "end_positions": ids[:, 1] % 14}),
])
def test_classification_heads_keep_their_loss(spy, name, inputs):
    # The classification heads of the same modules make the same standard call: served, with
    # the loss and gradients they compute without apply() (T5's answer positions past the
    # sequence are clamped to its ignore_index, 12 here). The span heads' bias gradients are 0
    # up to rounding (each row's softmax minus one-hot sums to 0): an absolute tolerance.
    import transformers_coverage as cov

    model = cov.build(getattr(transformers, name))
    ids = batch(2, 12, seed=9)[0] % (cov.VOCAB - 32) + 3
    ids[:, -1] = model.config.eos_token_id  # Bart classifies at its last <eos>
    kwargs = {"input_ids": ids, **inputs(ids)}
    if name.startswith("T5"):
        kwargs["decoder_input_ids"] = ids

    def run():
        model.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        loss = model(**kwargs).loss
        loss.backward()
        return loss.detach()[None], {n: p.grad.clone() for n, p in model.named_parameters()
                                     if p.grad is not None}

    fct.apply()
    try:
        ours = run()
    finally:
        fct.revert()
    assert spy and all(dtype == torch.float32 for dtype in spy)
    assert_same_training_signal(ours, run(), atol=1e-6)


def test_compiled_model_with_its_own_cross_entropy(spy):
    # torch.compile traces TokenCrossEntropyLoss's choice of path and fusedce's loss.
    import transformers_coverage as cov

    torch._dynamo.reset()
    model = cov.build(transformers.BartForCausalLM).eval()  # no dropout: compiled RNG differs
    compiled = torch.compile(model, backend="aot_eager")
    micro = cov.micro_batches()
    fct.apply()
    try:
        loss, grads = cov.step(compiled, micro, extras=False)
    finally:
        fct.revert()
    assert spy and all(dtype == torch.float32 for dtype in spy)
    ours = loss, {name.removeprefix("_orig_mod."): grad for name, grad in grads.items()}
    assert_same_training_signal(ours, cov.step(model, micro, extras=False))
    torch._dynamo.reset()


def test_own_cross_entropy_metrics():
    # A model computing its own cross-entropy adds its token metrics too (Bart's causal LM does
    # not shift its labels: every non-ignored label is scored).
    import transformers_coverage as cov

    model = cov.build(transformers.BartForCausalLM)
    ids, labels = cov.micro_batches()[0]
    fct.apply(metrics=True)
    try:
        fct.reset_token_metrics()
        out = model(input_ids=ids, labels=labels)
        metrics = fct.token_metrics(model, reset=True)
    finally:
        fct.revert()
    logits = out.logits.detach().double().reshape(-1, out.logits.shape[-1])
    flat = labels.reshape(-1)
    kept = flat != -100
    probs = torch.softmax(logits[kept], -1)
    assert metrics["tokens"] == int(kept.sum())
    assert metrics["token_accuracy"] == pytest.approx(
        (logits[kept].argmax(-1) == flat[kept]).double().mean().item())
    assert metrics["entropy"] == pytest.approx(
        -(probs * probs.log()).sum(-1).mean().item(), rel=1e-5)


def test_model_that_passes_other_logits_to_its_loss_falls_back(spy):
    # lm_head's output is not what reaches the loss (a bias added on the way, as Bart's
    # final_logits_bias): the fused loss is declined and the model's own loss is the answer.
    model = tiny_llama(seed=6)
    bias = torch.randn(VOCAB) * 0.1
    model.lm_head.register_forward_hook(lambda mod, inp, out: out + bias)
    data = [batch(2, 8, seed=2, pad_from=[8, 3])]
    fct.apply()
    try:
        with pytest.warns(UserWarning, match="applies"):
            ours = loss_and_grads(model, data)
        assert fct.serving(model) == "logits"
    finally:
        fct.revert()
    assert_same_training_signal(ours, loss_and_grads(model, data))


@pytest.mark.parametrize("fused_linear", [True, False], ids=["fused_linear", "logits"])
def test_compiled_model(spy, fused_linear):
    # A model compiled before apply(): the compiled module holds the model's call as it was
    # (without the wrapped PreTrainedModel.__call__), so the loss comes from fusedce over the
    # logits, with transformers' loss and gradients.
    torch._dynamo.reset()
    model = tiny_llama(seed=7)
    compiled = torch.compile(model, backend="aot_eager")
    micro = [batch(2, 12, seed=5, pad_from=[12, 4]), batch(2, 12, seed=6, pad_from=[7, 10])]
    num_items = sum((labels[..., 1:] != -100).sum() for _, labels in micro)
    fct.apply(fused_linear=fused_linear)
    try:
        ours = loss_and_grads(compiled, micro, num_items_in_batch=num_items)
    finally:
        fct.revert()
    assert torch.float32 in spy
    theirs = loss_and_grads(model, micro, num_items_in_batch=num_items)
    assert_same_training_signal(ours, theirs)
    torch._dynamo.reset()


def capturing_backend():
    """An aot_eager backend that keeps every forward and backward graph it compiles."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=capture, bw_compiler=capture), graphs


def logits_sized(gm):
    """The nodes of a compiled graph whose value has the logits' layout (..., VOCAB)."""
    return [node.name for node in gm.graph.nodes
            if isinstance(node.meta.get("val"), torch.Tensor) and node.meta["val"].dim() >= 2
            and node.meta["val"].shape[-1] == VOCAB]


def compiled_steps(compiled):
    """Training steps of a compiled model: two accumulated micro-batches (labels with -100,
    num_items_in_batch) twice, then with precomputed shift_labels."""
    micro = [batch(2, 12, seed=5, pad_from=[12, 4]), batch(2, 12, seed=6, pad_from=[7, 10])]
    num_items = sum((labels[..., 1:] != -100).sum() for _, labels in micro)
    ids, labels = batch(2, 10, seed=4, pad_from=[10, 7])
    shift = torch.cat([labels[:, 1:], torch.full((2, 1), -100)], 1)
    shift[0, 2] = -100
    return [loss_and_grads(compiled, micro, num_items_in_batch=num_items),
            loss_and_grads(compiled, micro, num_items_in_batch=num_items),
            loss_and_grads(compiled, [(ids, labels)], num_items_in_batch=int((shift != -100).sum()),
                           shift_labels=shift)]


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2"])
def test_compiled_model_trains_fused(family):
    # torch.compile(model) after apply() (default fullgraph=False): the first training call
    # runs eagerly and plans the model; every later call runs the compiled graphs, whose
    # forward holds the fused linear op and which never form (N, V) logits, neither in the
    # forward nor in the backward. Loss and every gradient equal the uncompiled model's
    # without apply(), with -100 labels, num_items_in_batch, shift_labels and Gemma 2's
    # final soft-cap.
    torch._dynamo.reset()
    backend, graphs = capturing_backend()
    model = tiny_model(family, seed=7)
    fct.apply()
    try:
        compiled = torch.compile(model, backend=backend)
        ours = compiled_steps(compiled)
        assert fct.serving(model) == "fused_linear"
    finally:
        fct.revert()
        torch._dynamo.reset()
    assert "forward" not in model.lm_head.__dict__  # revert() leaves a plain nn.Linear
    for got, expected in zip(ours, compiled_steps(model)):
        assert_same_training_signal(got, expected)
    codes = [gm.code for gm in graphs]
    # one forward per compiled call signature (with and without shift_labels), each fused
    assert sum("fusedce.lce_fwd_bwd" in code for code in codes) == 2
    assert not any("fusedce.ce_fwd" in code for code in codes)  # the loss over the logits
    assert all(logits_sized(gm) == [] for gm in graphs)


def test_compiled_model_trains_fused_with_inductor(monkeypatch):
    # The same with torch.compile's default backend (inductor): the second step runs
    # fusedce's fused op and no matrix product with the vocabulary in its shapes.
    torch._dynamo.reset()
    model = tiny_llama(seed=7)
    micro = [batch(2, 12, seed=5, pad_from=[12, 4]), batch(2, 12, seed=6, pad_from=[7, 10])]
    num_items = sum((labels[..., 1:] != -100).sum() for _, labels in micro)
    fct.apply()
    try:
        compiled = torch.compile(model)
        loss_and_grads(compiled, micro, num_items_in_batch=num_items)  # plans, then compiles
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                    record_shapes=True) as profile:
            ours = loss_and_grads(compiled, micro, num_items_in_batch=num_items)
    finally:
        fct.revert()
        torch._dynamo.reset()
    assert_same_training_signal(ours, loss_and_grads(model, micro, num_items_in_batch=num_items))
    events = [(e.name, e.input_shapes) for e in profile.events()]
    assert sum(name == "fusedce::lce_fwd_bwd" for name, _ in events) == 2
    products = [(name, shapes) for name, shapes in events
                if name in ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear")]
    assert products  # the layers' products are seen
    assert not [p for p in products if any(VOCAB in shape for shape in p[1])]


def test_compiled_model_that_declines_takes_the_logits_path(monkeypatch):
    # A model that declines the fused loss in its first (eager) call keeps the logits path
    # compiled: the loss over the logits in the graph, and transformers' loss and gradients.
    monkeypatch.setattr(fct, "_warned", set())  # the warning comes once per class and process
    torch._dynamo.reset()
    backend, graphs = capturing_backend()
    model = tiny_llama(seed=6)
    bias = torch.randn(VOCAB) * 0.1
    model.lm_head.register_forward_hook(lambda mod, inp, out: out + bias)
    fct.apply()
    try:
        compiled = torch.compile(model, backend=backend)
        with pytest.warns(UserWarning, match="applies"):
            ours = compiled_steps(compiled)
        assert fct.serving(model) == "logits"
    finally:
        fct.revert()
        torch._dynamo.reset()
    for got, expected in zip(ours, compiled_steps(model)):
        assert_same_training_signal(got, expected)
    codes = [gm.code for gm in graphs]
    assert any("fusedce.ce_fwd" in code for code in codes)
    assert not any("fusedce.lce" in code for code in codes)


def test_compiled_call_checks_the_loss_arguments():
    # A planned compiled call returns lm_head's loss only for the call's own labels, shift
    # labels, num_items_in_batch, vocabulary and the empty logits of lm_head's rows.
    head = torch.nn.Linear(4, 7, bias=False)
    plan = fct._Plan(head, 1.0, None)
    labels, loss = torch.zeros(2, 3, dtype=torch.long), torch.tensor(1.5)

    def planned_call():
        call = fct._CompiledCall(plan, "Model", labels, {"num_items_in_batch": 5})
        call.loss, call.rows = loss, (2, 3)
        return call

    assert planned_call().consume(torch.empty(2, 3, 0), labels, 7, None, 5) is loss
    for logits, other, vocab, shift, items in [
            (torch.empty(2, 3, 0), labels.clone(), 7, None, 5),
            (torch.empty(2, 3, 0), labels, 7, labels, 5),
            (torch.empty(2, 3, 0), labels, 7, None, 6),
            (torch.empty(2, 3, 0), labels, 8, None, 5),
            (torch.empty(2, 2, 0), labels, 7, None, 5),
            (torch.empty(2, 3, 7), labels, 7, None, 5)]:
        with pytest.raises(RuntimeError, match="other arguments than in its first training call"):
            planned_call().consume(logits, other, vocab, shift, items)


def test_module_compile_takes_the_logits_path():
    # model.compile() compiles the model's forward while its (wrapped) call stays eager: the
    # armed lm_head, traced, gives its logits, and the loss comes from fusedce over them.
    torch._dynamo.reset()
    model = tiny_llama(seed=7)
    fct.apply()
    try:
        model.compile(backend="aot_eager")
        ours = compiled_steps(model)
    finally:
        fct.revert()
        model._compiled_call_impl = None
        torch._dynamo.reset()
    for got, expected in zip(ours, compiled_steps(model)):
        assert_same_training_signal(got, expected)


def test_compiled_model_metrics_on_the_fused_path():
    # apply(metrics=True) with a model compiled after apply(): the fused call's metrics of the
    # planning call and of the compiled calls, against the logits' float64 values.
    torch._dynamo.reset()
    model = predictive_head(tiny_llama(seed=7))
    compiled = None
    micro = [repeating_batch(2, 12, seed=5, pad_from=[12, 4]),
             repeating_batch(2, 12, seed=6, pad_from=[7, 10])]
    num_items = sum((labels[..., 1:] != -100).sum() for _, labels in micro)
    fct.apply(metrics=True)
    try:
        compiled = torch.compile(model, backend="aot_eager")
        fct.reset_token_metrics()
        for _ in range(2):
            ours = loss_and_grads(compiled, micro, num_items_in_batch=num_items)
        got = fct.token_metrics(compiled)
        assert fct.serving(model) == "fused_linear"
    finally:
        fct.revert()
        torch._dynamo.reset()
    assert_same_training_signal(ours, loss_and_grads(model, micro, num_items_in_batch=num_items))
    with torch.no_grad():
        hits, entropy, tokens = sum(reference_sums(model(input_ids=ids).logits, torch.eye(VOCAB), labels)
                                    for ids, labels in micro).tolist()
    assert got["tokens"] == 2 * tokens == 2 * num_items
    assert got["token_accuracy"] == hits / tokens
    assert got["entropy"] == pytest.approx(entropy / tokens, rel=1e-5)


@pytest.mark.parametrize("num_items", [None, 9, "tensor"])
def test_loss_function_matches_for_causal_lm_loss(num_items):
    # The loss function alone, against the installed transformers' ForCausalLMLoss, including
    # precomputed shift_labels (padding-free collators) and a bfloat16 model's logits.
    g = torch.Generator().manual_seed(7)
    n = torch.tensor(9) if num_items == "tensor" else num_items
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randn(3, 8, 50, generator=g).to(dtype)
        labels = torch.randint(0, 50, (3, 8), generator=g)
        labels[0, 5:] = -100
        shift = torch.randint(0, 50, (3, 8), generator=g)
        for kw in ({"labels": labels}, {"labels": None, "shift_labels": shift}):
            a = fct.causal_lm_loss(logits, vocab_size=50, num_items_in_batch=n, **kw)
            b = loss_utils.ForCausalLMLoss(logits, vocab_size=50, num_items_in_batch=n, **kw)
            assert a.dtype == b.dtype == torch.float32
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_bfloat16_model(spy):
    # transformers upcasts a bfloat16 model's logits to float32 for its loss; fusedce reads them
    # in bfloat16 and computes in float32: the same loss, with no float32 copy of the logits.
    # (Under no_grad fused_linear leaves the logits path on: evaluation may want the logits.)
    model = tiny_llama(seed=4, dtype=torch.bfloat16)
    ids, labels = batch(2, 10, seed=8, pad_from=[10, 6])
    with torch.no_grad():
        fct.apply()
        try:
            ours = model(input_ids=ids, labels=labels).loss
        finally:
            fct.revert()
        theirs = model(input_ids=ids, labels=labels).loss
    assert spy == [torch.bfloat16]
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def _train(tmp_path, steps=3, plant=None):
    """Trainer on a tiny Llama for `steps` steps of plain SGD (no momentum, no weight decay),
    recording every parameter's gradient as the optimizer receives it (after accumulation and
    clipping). Comparing those judges the training signal itself; comparing the parameters after
    Adam steps would judge Adam's amplification of rounding noise in near-zero gradient entries
    (and so the library versions). `plant(model)` may plant a bug before training. Returns the
    logged losses and the per-step gradients."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class Tokens(torch.utils.data.Dataset):
        def __init__(self):
            self.items = [batch(1, 12, seed=100 + i, pad_from=[12 - (i % 5)]) for i in range(16)]

        def __len__(self):
            return len(self.items)

        def __getitem__(self, i):
            ids, labels = self.items[i]
            return {"input_ids": ids[0], "labels": labels[0]}

    grads = []

    class RecordGradients(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})

    model = tiny_llama(seed=9)
    if plant is not None:
        plant(model)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, max_steps=steps, learning_rate=0.1,
                             optim="sgd", weight_decay=0.0, logging_steps=1, report_to=[],
                             use_cpu=True, save_strategy="no", seed=0, dataloader_num_workers=0,
                             disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[RecordGradients()])
    assert trainer.model_accepts_loss_kwargs and trainer._loss_shifts_labels
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return losses, grads


def assert_same_updates(ours, theirs, steps=3):
    """The logged losses agree to float32 rounding, and so does every parameter's gradient at
    every step, each against its own scale (as assert_same_training_signal judges them)."""
    assert len(ours[0]) == len(theirs[0]) == steps and len(ours[1]) == len(theirs[1]) == steps
    torch.testing.assert_close(torch.tensor(ours[0]), torch.tensor(theirs[0]), rtol=1e-5, atol=1e-6)
    for step, (a, b) in enumerate(zip(ours[1], theirs[1])):
        assert a.keys() == b.keys()
        for name, grad in b.items():
            assert grad.abs().max() > 0, f"{name} has no gradient at step {step}"
            torch.testing.assert_close(a[name], grad, rtol=2e-5, atol=1e-5 * grad.abs().max().item(),
                                       msg=lambda m: f"step {step}, {name}: {m}")


@pytest.mark.parametrize("fused_linear", [True, False], ids=["fused_linear", "logits"])
def test_trainer(tmp_path, spy, fused_linear):
    fct.apply(fused_linear=fused_linear)
    try:
        ours = _train(tmp_path / "fusedce")
    finally:
        fct.revert()
    assert spy == expected_calls(fused_linear, n=3 * 2)  # every micro-batch's loss from fusedce
    assert_same_updates(ours, _train(tmp_path / "transformers"))


def test_trainer_comparison_fails_a_one_percent_gradient_error(tmp_path):
    """The comparison above can fail: lm_head.weight's gradient 1% too large, nothing else
    changed, is caught at the first step (through the clipping, which rescales every gradient
    by the global norm, the first mismatch can show in another parameter)."""
    def plant(model):
        model.lm_head.weight.register_hook(lambda g: g * 1.01)

    reference = _train(tmp_path / "reference")
    planted = _train(tmp_path / "planted", plant=plant)
    with pytest.raises(AssertionError, match="step 0"):
        assert_same_updates(planted, reference)


# ---- apply(metrics=True): token accuracy and entropy ------------------------------------------


def repeating_batch(b, s, seed, pad_from=None):
    """input_ids and labels (B, S) where each token repeats the previous one with probability
    1/2, as batch() pads them. With predictive_head() about half the targets are hit, so the
    accuracy differs from micro-batch to micro-batch (a tiny random model hits 1 in VOCAB)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (b, s), generator=g)
    for t in range(1, s):
        ids[:, t] = torch.where(torch.rand(b, generator=g) < 0.5, ids[:, t - 1], ids[:, t])
    labels = ids.clone()
    for i, p in enumerate(pad_from or []):
        labels[i, p:] = -100
    return ids, labels


def predictive_head(model, scale=10.0):
    """lm_head := scale * the input embedding (untied): the last hidden state of a tiny model
    is mostly its token's embedding, so the argmax predicts the current token again."""
    with torch.no_grad():
        model.lm_head.weight.copy_(model.model.embed_tokens.weight * scale)
    return model


def reference_sums(hidden, weight, labels, scale=1.0, softcap=None):
    """(hits, entropy sum, tokens) of the causal-LM targets in float64 from lm_head's input
    and weight: the metrics computed independently of fusedce."""
    z = hidden.double() @ weight.double().T * scale
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    z, target = z[:, :-1], labels[:, 1:]
    scored = target != -100
    logp = torch.log_softmax(z, -1)
    entropy = -(logp.exp() * logp).sum(-1)
    hits = (z.argmax(-1) == target) & scored
    return torch.tensor([hits.sum().item(), entropy[scored].sum().item(), scored.sum().item()],
                        dtype=torch.float64)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_metrics_leave_loss_and_gradients_bit_identical(applied, family):
    # The same loss and gradients, to the bit, with and without metrics; the metrics are those
    # of the model's own logits (Gemma2's soft-capped ones) over the non-ignored targets.
    model = predictive_head(tiny_model(family, seed=3))
    micro = [repeating_batch(2, 12, seed=5, pad_from=[12, 4]),
             repeating_batch(2, 12, seed=6, pad_from=[7, 10])]
    num_items = sum((labels[..., 1:] != -100).sum() for _, labels in micro)
    without = loss_and_grads(model, micro, num_items_in_batch=num_items)
    fct.apply(fused_linear=applied, metrics=True)
    fct.reset_token_metrics()
    with_metrics = loss_and_grads(model, micro, num_items_in_batch=num_items)
    assert torch.equal(with_metrics[0], without[0])
    for name, grad in without[1].items():
        assert torch.equal(with_metrics[1][name], grad), name
    got = fct.token_metrics(model)

    fct.revert()
    expected = torch.zeros(3, dtype=torch.float64)
    with torch.no_grad():
        for ids, labels in micro:
            logits = model(input_ids=ids).logits  # transformers' own, soft-capped for Gemma2
            expected += reference_sums(logits, torch.eye(VOCAB), labels)
    hits, entropy, tokens = expected.tolist()
    assert got["tokens"] == tokens == num_items
    assert 0.2 < got["token_accuracy"] == hits / tokens < 0.8
    assert got["entropy"] == pytest.approx(entropy / tokens, rel=1e-5)
    assert fct.token_metrics() == got  # the only model that collected anything


def test_metrics_collection_rules():
    # Losses computed with gradients go to training's sums, under no_grad to evaluation's;
    # owned by the outermost model call; zeroed by reset; gone with revert(), which leaves the
    # sums.
    model = predictive_head(tiny_llama(seed=2))
    other = tiny_llama(seed=4)
    ids, labels = repeating_batch(2, 10, seed=1, pad_from=[10, 6])
    tokens = (labels[:, 1:] != -100).sum().item()
    fct.apply(fused_linear=False)
    assert "__call__" not in PreTrainedModel.__dict__
    fct.apply(fused_linear=False, metrics=True)  # metrics need the call wrapper for ownership
    try:
        assert PreTrainedModel.__dict__["__call__"] is fct._model_call
        fct.reset_token_metrics()
        model(input_ids=ids, labels=labels).loss.backward()
        with torch.no_grad():
            model(input_ids=ids, labels=labels)
        other(input_ids=ids, labels=labels)
        assert fct.token_metrics(model)["tokens"] == tokens
        assert fct.token_metrics(model, evaluation=True)["tokens"] == tokens
        assert fct.token_metrics(other, evaluation=True)["tokens"] == 0
        fct.reset_token_metrics(evaluation=True)
        assert fct.token_metrics(model, evaluation=True)["tokens"] == 0
        assert fct.token_metrics(other)["tokens"] == tokens
        assert fct.token_metrics()["tokens"] == 2 * tokens
        # a loss computed outside any model call counts for every model
        fct.causal_lm_loss(torch.randn(2, 10, 7, requires_grad=True), torch.randint(0, 7, (2, 10)), 7)
        assert fct.token_metrics(model, reset=True)["tokens"] == tokens + 18
        assert fct.token_metrics(model)["tokens"] == 0
        assert fct.token_metrics(other)["tokens"] == tokens
    finally:
        fct.revert()
    assert "__call__" not in PreTrainedModel.__dict__
    model(input_ids=ids, labels=labels).loss.backward()
    assert fct.token_metrics(other)["tokens"] == tokens
    assert fct.token_metrics(model)["tokens"] == 0
    fct.reset_token_metrics()


def _train_with_metrics(tmp_path, fused_linear, first=True, plant=None):
    """Trainer on a tiny Llama with a predictive head, 3 steps of 2 accumulated micro-batches
    of 2 sequences with different numbers of scored tokens, logging every step and evaluating
    after every step, with a MetricsCallback: first among the callbacks (add_metrics_callback),
    or, not `first`, last (Trainer's callbacks argument). Returns the training logs
    and, for each log, the metrics computed in float64 from lm_head's input and weight of that
    step's training micro-batches, captured by hooks."""
    from transformers import Trainer, TrainingArguments

    class Tokens(torch.utils.data.Dataset):
        def __init__(self, n, seed):
            self.items = [repeating_batch(1, 12, seed=seed + i, pad_from=[12 - (3 * i) % 10])
                          for i in range(n)]

        def __len__(self):
            return len(self.items)

        def __getitem__(self, i):
            ids, labels = self.items[i]
            return {"input_ids": ids[0], "labels": labels[0]}

    model = predictive_head(tiny_llama(seed=9))
    captured = []  # per training micro-batch: [labels, hidden, weight]
    evaluated = []  # the same per evaluation micro-batch

    def take_labels(module, args, kwargs):
        (captured if torch.is_grad_enabled() else evaluated).append([kwargs["labels"]])

    def take_hidden(module, args):
        (captured if torch.is_grad_enabled() else evaluated)[-1] += [
            args[0].detach().clone(), module.weight.detach().clone()]

    model.register_forward_pre_hook(take_labels, with_kwargs=True)
    model.lm_head.register_forward_pre_hook(take_hidden)
    if plant is not None:
        plant()
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2,
                             per_device_eval_batch_size=2, gradient_accumulation_steps=2,
                             max_steps=3, learning_rate=0.1, optim="sgd", weight_decay=0.0,
                             logging_steps=1, eval_strategy="steps", eval_steps=1, report_to=[],
                             use_cpu=True, save_strategy="no", seed=0, dataloader_num_workers=0,
                             disable_tqdm=True)
    fct.apply(fused_linear=fused_linear, metrics=True)
    try:
        trainer = Trainer(model=model, args=args, train_dataset=Tokens(16, 100),
                          eval_dataset=Tokens(4, 200),
                          callbacks=None if first else [fct.MetricsCallback()])
        if first:
            callback = fct.add_metrics_callback(trainer)
            assert trainer.callback_handler.callbacks[0] is callback
            assert isinstance(callback, fct.MetricsCallback)
        else:
            # after the report_to integrations (none here)
            assert any(isinstance(c, fct.MetricsCallback) for c in trainer.callback_handler.callbacks)
        trainer.train()
    finally:
        fct.revert()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(captured) == 6 and all(len(c) == 3 for c in captured)
    expected = []
    for step in range(3):
        sums = sum(reference_sums(h, w, labels) for labels, h, w in captured[2 * step:2 * step + 2])
        hits, entropy, tokens = sums.tolist()
        expected.append({"token_accuracy": hits / tokens, "entropy": entropy / tokens})
    # evaluation after every step: 4 sequences in 2 micro-batches
    eval_logs = [h for h in trainer.state.log_history if "eval_loss" in h]
    assert len(evaluated) == 6 and all(len(c) == 3 for c in evaluated)
    for step, log in enumerate(eval_logs):
        sums = sum(reference_sums(h, w, labels) for labels, h, w in evaluated[2 * step:2 * step + 2])
        hits, entropy, tokens = sums.tolist()
        logs.append(log)
        expected.append({"eval_token_accuracy": hits / tokens, "eval_entropy": entropy / tokens})
    return logs, expected


def assert_logged_metrics(logs, expected):
    """Training logs then evaluation logs, 3 of each."""
    assert len(logs) == len(expected) == 6
    for i, (log, want) in enumerate(zip(logs, expected)):
        prefix, step = ("", i) if i < 3 else ("eval_", i - 3)
        assert log[prefix + "token_accuracy"] == want[prefix + "token_accuracy"], f"step {step}"
        assert log[prefix + "entropy"] == pytest.approx(want[prefix + "entropy"], rel=1e-5), \
            f"step {step}"


@pytest.mark.parametrize("fused_linear,first", [(True, True), (False, False)],
                         ids=["fused_linear-first", "logits-last"])
def test_trainer_logs_token_metrics(tmp_path, fused_linear, first):
    # token_accuracy and entropy of each log are sums over both micro-batches of the step
    # divided by their token count (evaluation in between adds to its own sums), equal to
    # those computed from the captured hidden states in float64, and eval_token_accuracy and
    # eval_entropy of each evaluation those of its two micro-batches; in
    # trainer.state.log_history wherever the callback is.
    logs, expected = _train_with_metrics(tmp_path, fused_linear, first)
    assert_logged_metrics(logs, expected)
    assert len({log["token_accuracy"] for log in logs[:3]}) == 3
    assert len({log["eval_entropy"] for log in logs[3:]}) == 3


def test_trainer_metrics_comparison_fails_per_micro_batch_means(tmp_path, monkeypatch):
    """The comparison above can fail: averaging each micro-batch's accuracy and entropy (a
    mean of means, not weighted by their token counts) is caught."""
    def mean_of_means(self, num_correct, entropy_sum, tokens):
        if self.tokens is None:
            self.num_correct, self.entropy_sum, self.tokens = torch.zeros(3, dtype=torch.float64)
        self.num_correct = self.num_correct + num_correct / tokens
        self.entropy_sum = self.entropy_sum + entropy_sum / tokens
        self.tokens = self.tokens + 1

    logs, expected = _train_with_metrics(
        tmp_path, True, plant=lambda: monkeypatch.setattr(fct.TokenSums, "add", mean_of_means))
    with pytest.raises(AssertionError, match="step 0"):
        assert_logged_metrics(logs, expected)


def test_compiled_model_metrics():
    # Under torch.compile the loss comes from the logits path and its metrics are unowned
    # (token_metrics of any model includes them): the same values as the model's own logits
    # give, and the loss and gradients of the eager model without metrics.
    torch._dynamo.reset()
    model = predictive_head(tiny_llama(seed=7))
    compiled = torch.compile(model, backend="aot_eager")
    micro = [repeating_batch(2, 12, seed=5, pad_from=[12, 4]),
             repeating_batch(2, 12, seed=6, pad_from=[7, 10])]
    num_items = sum((labels[..., 1:] != -100).sum() for _, labels in micro)
    fct.apply(metrics=True)
    try:
        fct.reset_token_metrics()
        ours = loss_and_grads(compiled, micro, num_items_in_batch=num_items)
        got = fct.token_metrics(compiled)
    finally:
        fct.revert()
        torch._dynamo.reset()
    assert_same_training_signal(ours, loss_and_grads(model, micro, num_items_in_batch=num_items))
    with torch.no_grad():
        hits, entropy, tokens = sum(reference_sums(model(input_ids=ids).logits, torch.eye(VOCAB), labels)
                                    for ids, labels in micro).tolist()
    assert got["tokens"] == tokens == num_items
    assert got["token_accuracy"] == hits / tokens
    assert got["entropy"] == pytest.approx(entropy / tokens, rel=1e-5)


def test_metrics_callback_sums_over_ranks(monkeypatch):
    # Under DDP every rank logs the sums over all ranks, divided once. Here this rank scored 4
    # tokens, 3 right, entropy sum 1.5, and the other rank's all_reduce contribution is 8
    # tokens, 4 right, entropy sum 3: 7 / 12 and 4.5 / 12 (not the mean of 3/4 and 4/8).
    import types

    from transformers import TrainerControl, TrainerState
    from transformers.training_args import ParallelMode

    reduced = []

    def all_reduce(tensor):
        reduced.append(tensor.clone())
        tensor += torch.tensor([4.0, 3.0, 8.0], dtype=tensor.dtype)

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    fct.reset_token_metrics()
    fct._unowned.add(torch.tensor(3), torch.tensor(1.5), torch.tensor(4))
    args = types.SimpleNamespace(parallel_mode=ParallelMode.DISTRIBUTED, device=torch.device("cpu"))
    state = TrainerState(global_step=1, log_history=[{"loss": 1.0, "step": 1}])
    logs = {"loss": 1.0}
    fct.MetricsCallback().on_log(args, state, TrainerControl(), logs=logs, model=torch.nn.Linear(1, 1))
    assert len(reduced) == 1 and reduced[0].tolist() == [3.0, 1.5, 4.0]
    want = {"loss": 1.0, "token_accuracy": 7 / 12, "entropy": 4.5 / 12}
    assert logs == want and state.log_history[-1] == {**want, "step": 1}
    assert fct.token_metrics()["tokens"] == 0


def test_metrics_callback_without_metrics_warns_once_and_adds_nothing():
    import types

    from transformers import TrainerControl, TrainerState
    from transformers.training_args import ParallelMode

    fct.reset_token_metrics()
    callback = fct.MetricsCallback()
    args = types.SimpleNamespace(parallel_mode=ParallelMode.NOT_PARALLEL, device=torch.device("cpu"))
    state = TrainerState(global_step=1, log_history=[{"loss": 1.0, "step": 1}])
    logs = {"loss": 1.0}
    with pytest.warns(UserWarning, match=r"apply\(metrics=True\)"):
        callback.on_log(args, state, TrainerControl(), logs=logs, model=torch.nn.Linear(1, 1))
    callback.on_log(args, state, TrainerControl(), logs=logs, model=torch.nn.Linear(1, 1))
    assert logs == {"loss": 1.0} and state.log_history == [{"loss": 1.0, "step": 1}]
