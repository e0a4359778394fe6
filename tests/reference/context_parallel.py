"""Run under torchrun by tests/test_context_parallel.py: context parallel's attention methods
(toolkit.strategies.dims.context) against plain transformers on the whole sequence, in every rank's process, one
case after another (one process start for all of them).

    torchrun --nproc_per_node CP tests/reference/context_parallel.py OUT.json CASE[,CASE...] [OPTION...]

Each case is a method with options after `+` (`allgather`, `ring+left`). For each, every rank builds the same tiny
Llama (grouped-query attention) from a config with one seed; a batch with padding and a length that 2·cp does not
divide. The reference: the plain model (sdpa) on the whole batch, the loss summed over its tokens (logits[:, :-1]
against labels[:, 1:]), backward. The cp arm: a copy under the case's method, each rank on its share (split_batch),
its loss summed over its tokens, backward; the loss sums and every parameter's gradient summed over the ranks (what
data parallel over the cp ranks would reduce). The ring method's batch pads every row on the right, as the toolkit's
collator does; the others have a row padded on the left.

Options: `window`: a Mistral whose sliding window (4) is shorter than the sequence, in place of the Llama; `untold`: a
Qwen2-MoE whose window its attention function is never given; `left` (ring): a row padded on the left, which ring,
attending without a mask, refuses; `bf16`: both models in bf16; `cuda`: every rank on the one GPU, in bf16
(benchmarks/gpu_checks.sh). Options after the cases apply to every case.
Rank 0 writes {case: {"loss": [cp, reference], "max_grad_diff": ..., "max_grad": ..., "worst": name, "local_length":
...} or {"refused": the one line}} as JSON to OUT.json."""

import copy
import json
import sys

import torch
import torch.distributed as dist


def main() -> None:
    from toolkit.strategies.dims import context

    dist.init_process_group("gloo")
    context.register()
    results = {case: one_case(case.split("+")[0], set(case.split("+")[1:]) | set(sys.argv[3:]))
               for case in sys.argv[2].split(",")}
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as out:
            json.dump(results, out)
    dist.destroy_process_group()


def one_case(method: str, options: set[str]) -> dict:
    """One method's loss and gradients against the plain model's, or the one line it refused with."""
    import transformers

    from toolkit.errors import RecipeError
    from toolkit.strategies.dims import context

    rank, cp = dist.get_rank(), dist.get_world_size()
    # `cuda`: every rank on the one GPU (gloo moves CUDA tensors; NCCL takes one rank a GPU), the models in bf16
    device = torch.device("cuda" if "cuda" in options else "cpu")
    dtype = torch.bfloat16 if "cuda" in options or "bf16" in options else torch.float32
    shapes = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, attn_implementation="sdpa")
    torch.manual_seed(0)
    if "window" in options:  # Mistral's sliding window, shorter than the sequence: a query sees its last 4 keys
        reference = transformers.MistralForCausalLM(transformers.MistralConfig(**shapes, sliding_window=4))
    elif "untold" in options:  # Qwen2-MoE's window is in its mask, never handed to its attention function
        reference = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            **shapes, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
            num_experts_per_tok=2, use_sliding_window=True, sliding_window=4, max_window_layers=0))
    else:
        reference = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shapes))
    reference = reference.to(device, dtype)
    model = copy.deepcopy(reference)
    model.set_attn_implementation(context.ATTENTIONS[method])

    generator = torch.Generator().manual_seed(1)
    length, lengths = 13, [13, 9, 4]  # 13 is not a multiple of 2·cp
    input_ids = torch.randint(1, 64, (len(lengths), length), generator=generator)
    attention_mask = (torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]).long()
    if method != "ring" or "left" in options:  # ring: padded on the right, as the toolkit's batches
        attention_mask[2] = attention_mask[2].flip(0)  # rows 1 padded on the right, 2 on the left: its padding keys
    #   come before its tokens, where only the padding mask (not causality) keeps them out
    input_ids = input_ids * attention_mask
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[2, int(attention_mask[2].argmax())] = -100  # the left-padded row's first token: predicted from a padding
    #   position, whose output each attention makes its own way (a query with no key to attend to)

    input_ids, attention_mask, labels = input_ids.to(device), attention_mask.to(device), labels.to(device)
    logits = reference(input_ids=input_ids, attention_mask=attention_mask).logits.float()
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(),
                                                 ignore_index=-100, reduction="sum")
    expected.backward()

    share = context.split_batch(input_ids, attention_mask, labels, cp=cp, rank=rank, group=dist.group.WORLD)
    try:
        with context.sequence(share.sequence):
            local = model(input_ids=share.input_ids, position_ids=share.position_ids).logits.float()
            loss = torch.nn.functional.cross_entropy(local.flatten(0, 1), share.shifted_labels.flatten(),
                                                     ignore_index=-100, reduction="sum")
            loss.backward()
    except RecipeError as refused:  # what a rank says in one line (every rank alike)
        return {"refused": str(refused)}
    total = loss.detach().clone()
    dist.all_reduce(total)
    worst, max_diff, max_grad = "", 0.0, 0.0
    for (name, mine), (_, plain) in zip(model.named_parameters(), reference.named_parameters()):
        grad = mine.grad.float()
        dist.all_reduce(grad)
        diff = (grad - plain.grad.float()).abs().max().item()
        max_grad = max(max_grad, plain.grad.float().abs().max().item())
        if diff > max_diff:
            worst, max_diff = name, diff
    return {"loss": [total.item(), expected.item()], "max_grad_diff": max_diff, "max_grad": max_grad,
            "worst": worst, "local_length": share.input_ids.shape[1]}


if __name__ == "__main__":
    main()
