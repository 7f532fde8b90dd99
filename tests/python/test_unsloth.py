"""fusedce.compat.unsloth: fast_cross_entropy_loss against Unsloth's math written with PyTorch in
float64 (scaling, then soft-capping, -100 ignored, the sum over tokens divided by the count of
labelled tokens or by n_items), loss and gradient, float32 and bfloat16, vocabularies above
65536, sequences with every label ignored; patch_loss_functions() routes transformers'
causal-LM loss through fusedce."""

import pytest
import torch
import torch.nn.functional as F

from conftest import DTYPES, assert_within_budget, error_scales, loss_and_grad, make_problem
from fusedce.compat.unsloth import (fast_cross_entropy_loss, patch_loss_functions,
                                    unpatch_loss_functions)


def unsloth_reference(logits, labels, logit_softcapping=0, logit_scaling=0, n_items=None,
                      compute_dtype=torch.float64):
    """Unsloth's fast_cross_entropy_loss written with PyTorch ops in `compute_dtype` (float64:
    the reference; float32: what Unsloth's float32 kernel computes, whose error sets the
    budget)."""
    z = logits.to(compute_dtype)
    if logit_scaling:
        z = z * logit_scaling
    if logit_softcapping:
        z = logit_softcapping * torch.tanh(z / logit_softcapping)
    per_token = F.cross_entropy(z.reshape(-1, z.shape[-1]), labels.reshape(-1), ignore_index=-100,
                                reduction="none")
    if n_items is None:
        n_items = torch.count_nonzero(labels != -100)
    return per_token.sum() / n_items


def check(logits, labels, *, n_items=None, **options):
    """fusedce's loss and gradient against the float64 reference, within the project's error
    budget (twice the float32 computation's own error plus rounding floors)."""
    ours = loss_and_grad(lambda x: fast_cross_entropy_loss(x, labels, n_items=n_items, **options), logits)
    ref = loss_and_grad(lambda x: unsloth_reference(x, labels, n_items=n_items, **options), logits.double())
    theirs = loss_and_grad(lambda x: unsloth_reference(x, labels, n_items=n_items,
                                                       compute_dtype=torch.float32, **options), logits)
    assert ours[0].dtype == torch.float32 and ours[0].dim() == 0
    assert ours[1].dtype == logits.dtype
    n = n_items if n_items is not None else max(int((labels != -100).sum()), 1)
    loss_scale, grad_scale = error_scales(logits, labels, reduction="sum",
                                          logit_scale=options.get("logit_scaling") or 1.0,
                                          softcap=options.get("logit_softcapping") or None)
    assert_within_budget(ours[0], theirs[0], ref[0], what="loss", scale=loss_scale / n)
    assert_within_budget(ours[1], theirs[1], ref[1], what="grad", scale=grad_scale / n,
                         out_dtype=logits.dtype)
    return ours


OPTIONS = [
    {},
    {"logit_softcapping": 8.0},
    {"logit_scaling": 0.5},
    {"logit_softcapping": 8.0, "logit_scaling": 1.7},
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: "-".join(o) or "plain")
@pytest.mark.parametrize("vocab", [1000, 70001])
def test_matches_float64(dtype, options, vocab):
    batch, seq = (2, 3) if vocab > 65536 else (3, 17)
    logits, labels = make_problem((batch, seq), vocab, dtype, seed=vocab)
    check(logits, labels, **options)


@pytest.mark.parametrize("dtype", DTYPES)
def test_n_items_divides_the_sum(dtype):
    logits, labels = make_problem((4, 9), 513, dtype, seed=3)
    check(logits, labels, n_items=100)
    check(logits, labels, n_items=torch.tensor(57), logit_softcapping=5.0)
    # The sum over the batch, whatever divides it: n_items = the labelled count is the default.
    count = int((labels != -100).sum())
    assert fast_cross_entropy_loss(logits, labels, n_items=count).item() == \
        fast_cross_entropy_loss(logits, labels).item()


def test_sequences_with_every_label_ignored():
    logits, labels = make_problem((3, 8), 300, seed=5)
    labels[1] = -100  # a whole sequence masked (padding), the others partly
    _, grad = check(logits, labels)
    assert torch.count_nonzero(grad[1]) == 0
    # Every label ignored: 0 / 0 = NaN as in Unsloth, and 0 with an n_items from elsewhere.
    labels[:] = -100
    assert torch.isnan(fast_cross_entropy_loss(logits, labels))
    loss, grad = loss_and_grad(lambda x: fast_cross_entropy_loss(x, labels, n_items=10), logits)
    assert loss.item() == 0.0 and torch.count_nonzero(grad) == 0


def test_zero_means_off():
    logits, labels = make_problem((2, 5), 200, seed=7)
    plain = fast_cross_entropy_loss(logits, labels)
    assert fast_cross_entropy_loss(logits, labels, logit_softcapping=None, logit_scaling=None) == plain
    assert fast_cross_entropy_loss(logits, labels, logit_softcapping=4.0) != plain


def test_bad_inputs_name_the_argument():
    logits, labels = make_problem((2, 5), 200, seed=7)
    with pytest.raises(ValueError, match="logits must have shape"):
        fast_cross_entropy_loss(logits.reshape(10, 200), labels)
    with pytest.raises(ValueError, match="labels must have shape"):
        fast_cross_entropy_loss(logits, labels.reshape(10))
    with pytest.raises(ValueError, match="logit_softcapping must be 0"):
        fast_cross_entropy_loss(logits, labels, logit_softcapping=-3.0)
    with pytest.raises(TypeError, match="logit_scaling must be a number"):
        fast_cross_entropy_loss(logits, labels, logit_scaling="2")
    with pytest.raises(TypeError, match="n_items must be None"):
        fast_cross_entropy_loss(logits, labels, n_items="7")


def test_patch_loss_functions_routes_transformers_causal_lm_loss():
    transformers = pytest.importorskip("transformers")
    from transformers.loss import loss_utils

    import fusedce.transformers as fct

    original = loss_utils.LOSS_MAPPING["ForCausalLM"]
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[1, 7:] = -100
    theirs = model(input_ids=ids, labels=labels).loss
    patch_loss_functions()
    try:
        assert loss_utils.LOSS_MAPPING["ForCausalLM"] is fct.causal_lm_loss
        out = model(input_ids=ids, labels=labels)
        # Unsloth's patched loss: fast_cross_entropy_loss over the logits, labels shifted left.
        shifted = torch.cat([labels[:, 1:], torch.full((2, 1), -100)], dim=1)
        expected = fast_cross_entropy_loss(out.logits, shifted)
        torch.testing.assert_close(out.loss, expected, rtol=1e-6, atol=0)
        torch.testing.assert_close(out.loss, theirs, rtol=1e-5, atol=1e-6)
        # Gradient accumulation: transformers passes num_items_in_batch, Unsloth's n_items.
        out = model(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(40))
        expected = fast_cross_entropy_loss(out.logits, shifted, n_items=40)
        torch.testing.assert_close(out.loss, expected, rtol=1e-6, atol=0)
    finally:
        unpatch_loss_functions()
    assert loss_utils.LOSS_MAPPING["ForCausalLM"] is original
