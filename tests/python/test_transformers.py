"""fusedce.transformers.apply(): a tiny LlamaForCausalLM (built from a config, nothing
downloaded) trains with the same loss and gradients as with transformers' own loss, in a
hand-written loop with gradient accumulation (num_items_in_batch) and under Trainer."""

import copy

import pytest
import torch

import fusedce
import fusedce.transformers as fct

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.loss import loss_utils  # noqa: E402

VOCAB = 1000


def tiny_llama(seed=0, dtype=torch.float32):
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, attn_implementation="eager")
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(dtype)


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


@pytest.fixture
def applied():
    fct.apply()
    yield
    fct.revert()


@pytest.fixture
def spy(monkeypatch):
    calls = []
    real = fct.cross_entropy

    def counting(*args, **kwargs):
        calls.append(args[0].dtype)
        return real(*args, **kwargs)

    monkeypatch.setattr(fct, "cross_entropy", counting)
    return calls


def loss_and_grads(model, micro_batches, num_items_in_batch=None):
    model.zero_grad(set_to_none=True)
    losses = []
    for ids, labels in micro_batches:
        kw = {} if num_items_in_batch is None else {"num_items_in_batch": num_items_in_batch}
        loss = model(input_ids=ids, labels=labels, **kw).loss
        loss.backward()
        losses.append(loss.detach())
    return torch.stack(losses), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same_training_signal(a, b, rtol=2e-5, atol=1e-7):
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    torch.testing.assert_close(loss_a, loss_b, rtol=rtol, atol=atol)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=rtol, atol=atol, msg=name)


def test_apply_and_revert_swap_the_loss():
    original = loss_utils.ForCausalLMLoss
    model = tiny_llama()
    assert model.loss_function is original
    fct.apply()
    fct.apply()  # idempotent
    try:
        assert fct.is_applied()
        assert model.loss_function is fct.causal_lm_loss
        assert loss_utils.LOSS_MAPPING["ForCausalLM"] is fct.causal_lm_loss
        assert loss_utils.LOSS_MAPPING["ForConditionalGeneration"] is fct.causal_lm_loss
        assert loss_utils.ForCausalLMLoss is fct.causal_lm_loss
        assert tiny_llama().loss_function is fct.causal_lm_loss  # models made after apply()
    finally:
        fct.revert()
    assert not fct.is_applied()
    assert loss_utils.ForCausalLMLoss is original
    assert loss_utils.LOSS_MAPPING["ForCausalLM"] is original
    assert model.loss_function is original


def test_llama_loss_and_gradients_match(applied, spy):
    model = tiny_llama()
    data = [batch(2, 16, seed=1, pad_from=[16, 9])]
    ours = loss_and_grads(model, data)
    assert spy == [torch.float32]  # fusedce computed the loss, from the logits as they are
    fct.revert()
    theirs = loss_and_grads(model, data)
    fct.apply()
    assert_same_training_signal(ours, theirs)


def test_gradient_accumulation_with_num_items_in_batch(applied, spy):
    # Two micro-batches with different numbers of real tokens, normalised by the count over both,
    # as Trainer does it: the same as one batch's mean, and the same as transformers' loss.
    model = tiny_llama(seed=3)
    micro = [batch(2, 12, seed=5, pad_from=[12, 4]), batch(2, 12, seed=6, pad_from=[7, 10])]
    num_items = sum((labels[..., 1:] != -100).sum() for _, labels in micro)
    ours = loss_and_grads(model, micro, num_items_in_batch=num_items)
    assert len(spy) == 2
    fct.revert()
    theirs = loss_and_grads(model, micro, num_items_in_batch=num_items)
    fct.apply()
    assert_same_training_signal(ours, theirs)

    whole = (torch.cat([m[0] for m in micro]), torch.cat([m[1] for m in micro]))
    loss_whole, grads_whole = loss_and_grads(model, [whole])
    torch.testing.assert_close(ours[0].sum(), loss_whole[0], rtol=2e-5, atol=1e-7)
    for name, g in ours[1].items():
        torch.testing.assert_close(g, grads_whole[name], rtol=2e-5, atol=1e-7, msg=name)


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


def test_bfloat16_model(applied, spy):
    # transformers upcasts a bfloat16 model's logits to float32 for its loss; fusedce reads them
    # in bfloat16 and computes in float32: the same loss, with no float32 copy of the logits.
    model = tiny_llama(seed=4, dtype=torch.bfloat16)
    ids, labels = batch(2, 10, seed=8, pad_from=[10, 6])
    with torch.no_grad():
        ours = model(input_ids=ids, labels=labels).loss
        fct.revert()
        theirs = model(input_ids=ids, labels=labels).loss
        fct.apply()
    assert spy == [torch.bfloat16]
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def _train(tmp_path, steps=3):
    from transformers import Trainer, TrainingArguments

    class Tokens(torch.utils.data.Dataset):
        def __init__(self):
            self.items = [batch(1, 12, seed=100 + i, pad_from=[12 - (i % 5)]) for i in range(16)]

        def __len__(self):
            return len(self.items)

        def __getitem__(self, i):
            ids, labels = self.items[i]
            return {"input_ids": ids[0], "labels": labels[0]}

    model = tiny_llama(seed=9)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, max_steps=steps, learning_rate=1e-3,
                             logging_steps=1, report_to=[], use_cpu=True, save_strategy="no",
                             seed=0, dataloader_num_workers=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens())
    assert trainer.model_accepts_loss_kwargs and trainer._loss_shifts_labels
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_trainer(tmp_path, spy):
    fct.apply()
    try:
        ours = _train(tmp_path / "fusedce")
    finally:
        fct.revert()
    assert len(spy) == 3 * 2  # every micro-batch's loss came from fusedce
    theirs = _train(tmp_path / "transformers")
    assert len(ours[0]) == 3
    torch.testing.assert_close(torch.tensor(ours[0]), torch.tensor(theirs[0]), rtol=1e-5, atol=1e-6)
    for name in ours[1]:
        torch.testing.assert_close(ours[1][name], theirs[1][name], rtol=1e-5, atol=1e-6, msg=name)
