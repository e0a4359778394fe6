"""Context parallel's all-gather attention (toolkit/strategies/dims/context.py): the split of a sequence over cp
ranks, and the loss and gradients of a model computed on that split against plain transformers on the whole
sequence (tests/reference/context_parallel.py, real processes under torchrun on gloo)."""

import json
import subprocess
import sys

import pytest
import torch
from conftest import REPO, toolkit_env

from toolkit.strategies.dims.context import padded_length, rank_positions, split_batch


@pytest.mark.parametrize("cp", [2, 4])
def test_the_ranks_hold_every_place_once_with_the_same_causal_work(cp):
    length = padded_length(13, cp=cp)
    held = [rank_positions(length, cp=cp, rank=r) for r in range(cp)]
    assert length % (2 * cp) == 0 and length >= 13
    assert sorted(torch.cat(held).tolist()) == list(range(length))
    # a causal query at place p attends to p + 1 keys: two mirrored chunks give every rank the same sum
    work = {int((positions + 1).sum()) for positions in held}
    assert len(work) == 1, work


def test_a_rank_keeps_the_label_of_its_chunk_s_last_token():
    # the label of place p is the token at p + 1: shifted over the whole sequence before the split, so the last
    # token of rank 0's first chunk (place 1 of 4, cp 2) keeps the first token of rank 1's chunk as its label
    ids = torch.tensor([[5, 6, 7, 8]])
    share = split_batch(ids, torch.ones_like(ids), ids.clone(), cp=2, rank=0, group=None)
    assert share.input_ids.tolist() == [[5, 8]] and share.position_ids.tolist() == [[0, 3]]
    assert share.shifted_labels.tolist() == [[6, -100]]
    other = split_batch(ids, torch.ones_like(ids), ids.clone(), cp=2, rank=1, group=None)
    assert other.input_ids.tolist() == [[6, 7]] and other.shifted_labels.tolist() == [[7, 8]]


@pytest.mark.parametrize("cp", [2, 4])
def test_allgather_attention_gives_the_whole_sequence_s_loss_and_gradients(tmp_path, cp):
    out = tmp_path / "cp.json"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(cp),
                           "--log-dir", str(tmp_path / "logs"), str(REPO / "tests" / "reference" / "context_parallel.py"),
                           str(out)], cwd=REPO, env=toolkit_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-6000:]
    result = json.loads(out.read_text())
    split, whole = result["loss"]
    assert result["local_length"] == padded_length(13, cp=cp) // cp
    assert split == pytest.approx(whole, rel=1e-5)
    # fp32, a sum in another order: the compare verdict's fp32 bound, against the largest gradient
    assert result["max_grad_diff"] <= 1e-5 + 1e-5 * result["max_grad"], result
