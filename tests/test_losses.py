"""The loss sum against a plain-PyTorch computation: causal LM predicts token t+1 from tokens <= t."""

import pytest
import torch
import torch.nn.functional as F

from toolkit.data.losses import IGNORE_INDEX, micro_batch_loss_sum


def reference_causal_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Slice the logits (transformers' docs' way), in float64, as a loop over positions."""
    total = torch.zeros((), dtype=torch.float64)
    for row in range(labels.shape[0]):
        for pos in range(labels.shape[1] - 1):
            target = int(labels[row, pos + 1])
            if target != IGNORE_INDEX:
                total -= F.log_softmax(logits[row, pos].double(), dim=-1)[target]
    return total


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_loss_sum_and_gradient_equal_a_per_position_reference(dtype):
    torch.manual_seed(0)
    logits = torch.randn(3, 7, 11).to(dtype).requires_grad_()
    labels = torch.randint(0, 11, (3, 7))
    labels[0, 4:] = IGNORE_INDEX  # padding
    labels[2, 1] = IGNORE_INDEX  # a prompt token of instruction data
    got = micro_batch_loss_sum(logits, labels, "causal-lm")
    assert got.dtype == torch.float32 and got.shape == ()
    leaf = logits.detach().double().requires_grad_()
    want = reference_causal_sum(leaf, labels)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=0)
    got.backward()
    want.backward()
    # the last position predicts nothing: no gradient; the others' as the float64 reference's, to the fp32
    # rounding of softmax - one-hot (differences up to 6e-8 where a probability is near 0)
    assert not logits.grad[:, -1].any()
    torch.testing.assert_close(logits.grad.double(), leaf.grad.to(dtype).double(), rtol=1e-6, atol=1e-7)


def test_classification_loss_sum_equals_the_per_sample_reference():
    torch.manual_seed(0)
    logits, labels = torch.randn(5, 3), torch.tensor([0, 2, IGNORE_INDEX, 1, 1])
    want = -sum(F.log_softmax(logits[i].double(), -1)[labels[i]] for i in range(5) if labels[i] != IGNORE_INDEX)
    torch.testing.assert_close(micro_batch_loss_sum(logits, labels, "classification").double(), want, rtol=1e-6,
                               atol=0)
