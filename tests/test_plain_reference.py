"""The toolkit's first steps against a hand-written PyTorch loop on the same global batches.

Independent of the loop: each batch of 8 is padded as one, the loss is transformers' own mean over
label tokens, the optimizer a plain AdamW. The toolkit runs each batch as 4 micro-batches of 2.
"""

import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import TRAIN, exported_weights, launch, losses, write_recipe
from toolkit.config.recipe import BatchPlan
from toolkit.data.splits import GlobalBatchSampler


def test_accumulated_steps_match_plain_pytorch(tmp_path, tiny_llama_dir):
    out = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=out,
                          optim={"warmup_steps": 0, "schedule": "constant", "max_grad_norm": None,
                                 "weight_decay": 0.0},
                          batch={"micro_batch_size": 2, "grad_accum_steps": 4},
                          train={"max_steps": 3, "consistency_check_every": None})
    launch(recipe, nproc=1)

    texts = [json.loads(line)["text"] for line in open(TRAIN)]
    plan = BatchPlan(world_size=1, micro_batch_size=8, grad_accum_steps=1, global_batch_size=8)
    sampler = GlobalBatchSampler(num_samples=len(texts), plan=plan, rank=0, seed=0)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    reference = []
    for step in range(3):
        batch = tokenizer([texts[i] for i in sampler.global_batch(step)], truncation=True, max_length=32,
                          padding=True, return_tensors="pt")
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        loss = model(**batch, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        reference.append(loss.item())

    torch.testing.assert_close(torch.tensor(losses(out)), torch.tensor(reference), rtol=1e-5, atol=0)
    weights = exported_weights(out)
    for name, param in model.named_parameters():
        torch.testing.assert_close(weights[name], param.detach(), rtol=1e-5, atol=1e-5)
