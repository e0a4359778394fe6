"""The global-batch sampler: the samples of step k depend only on seed and global batch size."""

from toolkit.config.recipe import BatchPlan
from toolkit.data.splits import Collator, DataLayout, GlobalBatchSampler, eval_index_batches


def step_samples(world: int, micro: int, accum: int, step: int, seed: int = 0) -> list[int]:
    plan = BatchPlan(world_size=world, micro_batch_size=micro, grad_accum_steps=accum,
                     global_batch_size=world * micro * accum)
    out = []
    for rank in range(world):
        for batch in GlobalBatchSampler(num_samples=100, plan=plan, rank=rank, seed=seed).micro_batches(step):
            assert len(batch) == micro
            out.extend(batch)
    return out


def test_same_samples_per_step_for_any_split():
    for step in (0, 3, 11, 12, 30):  # 12 steps per epoch of 100 samples at global batch 8: crosses epochs
        reference = sorted(step_samples(1, 8, 1, step))
        assert len(set(reference)) == 8
        for world, micro, accum in [(1, 2, 4), (2, 4, 1), (2, 2, 2), (4, 1, 2), (8, 1, 1)]:
            assert sorted(step_samples(world, micro, accum, step)) == reference


def test_seed_changes_order_and_epochs_reshuffle():
    assert step_samples(1, 8, 1, 0, seed=0) != step_samples(1, 8, 1, 0, seed=1)
    assert step_samples(1, 8, 1, 0) != step_samples(1, 8, 1, 12)  # epoch 2 is a new permutation


def test_eval_batches_cover_every_sample_once_and_equal_counts_per_rank():
    seen, counts = [], set()
    for rank in range(3):
        batches = eval_index_batches(10, micro_batch_size=2, layout=DataLayout(rank=rank, size=3))
        counts.add(len(batches))
        seen.extend(i for indices, real in batches if real for i in indices)
    assert sorted(seen) == list(range(10)) and len(counts) == 1


def test_collator_masks_padding_out_of_the_loss():
    batch = Collator(pad_token_id=0, task="causal-lm")([{"input_ids": [5, 6, 7]}, {"input_ids": [8]}])
    assert batch["labels"].tolist() == [[5, 6, 7], [8, -100, -100]]
    assert batch["num_items"] == 2  # tokens 6 and 7 are predicted; the single-token row predicts nothing
    assert batch["num_tokens"] == 4


def test_eval_collates_one_forward_call_of_batches_at_a_time():
    """The eval split was collated whole before its first forward: every batch's ids, mask and labels (int64) held
    at once in each rank's memory, 1.2 GB for 100,000 samples of 512 tokens. A group of micro-batches (what one
    forward_only call takes) is collated at a time; the loss is the same mean over every sample."""
    from types import SimpleNamespace

    import torch

    from toolkit.process.dist import DistEnv
    from toolkit.train.evaluate import evaluate

    dataset = [{"input_ids": list(range(1, 2 + i % 5)), "label": i % 2} for i in range(23)]
    made, consumed, seen = [0], [0], []
    collator = Collator(pad_token_id=0, task="sequence-classification")

    def counting(samples):
        made[0] += 1
        return collator(samples)

    def forward_only(batches, *, loss_sum):
        assert made[0] == consumed[0] + len(batches) <= consumed[0] + 3  # only this call's batches exist
        consumed[0] += len(batches)
        total = torch.zeros((), dtype=torch.float64)
        for batch in batches:
            seen.extend(batch["labels"].tolist())
            total += loss_sum(torch.zeros(len(batch["labels"]), 2), batch).double()
        return total, sum(len(batch["labels"]) for batch in batches)

    strategy = SimpleNamespace(model=torch.nn.Linear(1, 1), forward_only=forward_only)
    recipe = SimpleNamespace(model=SimpleNamespace(task="sequence-classification"),
                             batch=SimpleNamespace(micro_batch_size=2), train=SimpleNamespace(tiled_loss=False))
    out = evaluate(strategy, dataset, collator=counting, recipe=recipe,
                   env=DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cpu")),
                   layout=DataLayout(rank=0, size=1), group=3)
    assert consumed[0] == made[0] == 12 and sorted(seen) == sorted(s["label"] for s in dataset)
    # zero logits over 2 classes: every sample's cross-entropy is log 2
    assert abs(out["eval_loss"] - torch.log(torch.tensor(2.0)).item()) < 1e-6
