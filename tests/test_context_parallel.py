"""Context parallel (`parallel.cp`, toolkit/strategies/dims/context.py): the split of a sequence over cp ranks; the
loss and gradients of a model computed on that split against plain transformers on the whole sequence
(tests/reference/context_parallel.py, real processes under torchrun on gloo); whole runs against a single process;
and what it cannot run, refused in one line."""

import json
import subprocess
import sys

import pytest
import torch
from conftest import REPO, assert_matches_single, metrics, run_cli, toolkit_env, write_recipe

from toolkit.config.files import recipe_from_dict
from toolkit.errors import RecipeError
from toolkit.strategies import validate_strategy
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


@pytest.mark.parametrize("cp", [2, 4])
def test_the_chunks_are_those_torch_s_ring_attention_is_written_for(cp):
    """The ring method runs torch's ring attention on the toolkit's split (dims/ring.py): which blocks a step skips
    or halves assumes torch's head-tail layout, rank r holding chunks r and 2·cp-1-r in that order."""
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer

    length = padded_length(13, cp=cp)
    ours = torch.cat([rank_positions(length, cp=cp, rank=r) for r in range(cp)])
    torch_s = _HeadTailLoadBalancer(length, cp, "cpu")._generate_indices().flatten()
    assert ours.tolist() == torch_s.tolist()


def test_a_rank_keeps_the_label_of_its_chunk_s_last_token():
    # the label of place p is the token at p + 1: shifted over the whole sequence before the split, so the last
    # token of rank 0's first chunk (place 1 of 4, cp 2) keeps the first token of rank 1's chunk as its label
    ids = torch.tensor([[5, 6, 7, 8]])
    share = split_batch(ids, torch.ones_like(ids), ids.clone(), cp=2, rank=0, group=None)
    assert share.input_ids.tolist() == [[5, 8]] and share.position_ids.tolist() == [[0, 3]]
    assert share.shifted_labels.tolist() == [[6, -100]]
    other = split_batch(ids, torch.ones_like(ids), ids.clone(), cp=2, rank=1, group=None)
    assert other.input_ids.tolist() == [[6, 7]] and other.shifted_labels.tolist() == [[7, 8]]


# every case of tests/reference/context_parallel.py at each cp, one torchrun each (a process start is most of a case)
REFERENCE_CASES = {2: "allgather,ulysses,ring,allgather+window,ulysses+window,allgather+untold", 4: "allgather,ring"}


@pytest.fixture(scope="module")
def reference_cases(tmp_path_factory):
    """cp -> {case: its result}, each cp's cases run once under torchrun on gloo."""
    done_by_cp: dict[int, dict] = {}

    def get(cp: int) -> dict:
        if cp not in done_by_cp:
            folder = tmp_path_factory.mktemp(f"cp{cp}")
            out = folder / "cp.json"
            done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                                   str(cp), "--log-dir", str(folder / "logs"),
                                   str(REPO / "tests" / "reference" / "context_parallel.py"), str(out),
                                   REFERENCE_CASES[cp]], cwd=REPO, env=toolkit_env(), capture_output=True, text=True,
                                  timeout=600)
            assert done.returncode == 0, done.stderr[-6000:]
            done_by_cp[cp] = json.loads(out.read_text())
        return done_by_cp[cp]
    return get


# the tiny Llama has 2 KV heads: ulysses splits them, so at most over 2 ranks. `window`: a Mistral whose sliding
# window (4 keys) is shorter than the sequence (13): each layer's window reaches the cp attention's mask (before: the
# whole causal past, silently: the loss sum 95.440 against 95.467, a gradient 1.26 off where the largest is 4.01)
@pytest.mark.parametrize("method, cp, model", [("allgather", 2, ""), ("allgather", 4, ""), ("ulysses", 2, ""),
                                               ("allgather", 2, "window"), ("ulysses", 2, "window"), ("ring", 2, ""),
                                               ("ring", 4, "")])
def test_each_method_gives_the_whole_sequence_s_loss_and_gradients(reference_cases, method, cp, model):
    result = reference_cases(cp)[method + (f"+{model}" if model else "")]
    split, whole = result["loss"]
    assert result["local_length"] == padded_length(13, cp=cp) // cp
    assert split == pytest.approx(whole, rel=1e-5)
    # fp32, a sum in another order: the compare verdict's fp32 bound, against the largest gradient
    assert result["max_grad_diff"] <= 1e-5 + 1e-5 * result["max_grad"], result


# 2 ranks of one sequence each, micro 4 × accum 2 (one data shard), activation checkpointing: the recompute in
# backward runs the attention again inside the sequence's context
CP2 = ("parallel.cp=2", "batch.micro_batch_size=4", "batch.grad_accum_steps=2", "train.activation_checkpointing=true")
CP2_DP2 = ("parallel.cp=2", "parallel.dp_shard=2", "batch.micro_batch_size=4")  # 4 ranks: 2 shards × 2 cp ranks
CP2_ULYSSES = ("parallel.cp=2", "parallel.cp_method=ulysses")
CP2_TP2 = ("parallel.cp=2", "parallel.tp=2")  # 4 ranks: heads split over tp, each tp rank's sequences over cp
# 4 ranks: HSDP, 2 replica groups (each reads its own data shard), each an FSDP over its 2 cp ranks
CP2_REP2 = ("parallel.cp=2", "parallel.dp_replicate=2", "batch.micro_batch_size=4")
CP2_RING = (*CP2, "parallel.cp_method=ring")  # the recompute runs the ring again in backward
CP2_DP2_RING = (*CP2_DP2, "parallel.cp_method=ring")
CP2_TP2_RING = (*CP2_TP2, "parallel.cp_method=ring")  # each tp rank's heads passed round its cp group


@pytest.mark.parametrize("name, nproc, overrides", [("cp2", 2, CP2), ("cp2-dp2", 4, CP2_DP2),
                                                    ("cp2-ulysses", 2, CP2_ULYSSES), ("cp2-tp2", 4, CP2_TP2),
                                                    ("cp2-rep2", 4, CP2_REP2), ("cp2-ring", 2, CP2_RING),
                                                    ("cp2-dp2-ring", 4, CP2_DP2_RING),
                                                    ("cp2-tp2-ring", 4, CP2_TP2_RING)])
def test_context_parallel_trains_as_one_process(llama_runs, name, nproc, overrides):
    # tiny-llama's samples pad to lengths 4 does not divide: the split pads them further, masked
    reference = llama_runs.get("single-m8")
    run = llama_runs.get(name, nproc=nproc, overrides=overrides)
    assert_matches_single(run, reference)
    # the final evaluation counts each token once: the cp group's first rank counts, every rank adds its loss
    assert metrics(run)[-1]["eval_loss"] == pytest.approx(metrics(reference)[-1]["eval_loss"], rel=1e-5)
    info = json.loads((run / "run.json").read_text())
    assert info["strategy"] == "fsdp" and info["parallel"]["cp"] == 2
    method = next((m for m in ("ulysses", "ring") if m in name), "allgather")
    assert f"each sequence split over the 2 ranks of cp, attention by {method}" in info["layout"]


def recipe(parallel, **sections):
    return recipe_from_dict({"model": {"path": "/m", "task": "causal-lm"}, "data": {"train": "t.jsonl"},
                             "parallel": parallel, "batch": {"global_batch_size": 8, "micro_batch_size": 1},
                             **sections})


@pytest.mark.parametrize("parallel, sections, world_size, words", [
    ({"cp": 2}, {"model": {"path": "/m", "task": "sequence-classification", "num_labels": 2}}, 2,
     "context parallel splits a causal LM's sequences; model.task is sequence-classification"),
    ({"cp": 2, "tp": 2, "dp_shard": 2}, {}, 8, "parallel: dp_shard × cp × tp together is not tested yet"),
    ({"cp": 2, "tp": 2}, {"strategy": {"sequence_parallel": True}}, 4,
     "strategy.cp_degree (context parallel) is tested with dp_shard, tp_degree and replicate_degree, not with"),
    ({"cp": 2, "dp_replicate": 2, "tp": 2}, {}, 8, "parallel: dp_replicate × cp × tp together is not tested yet"),
    ({}, {"strategy": {"name": "fsdp", "cp_degree": 2, "replicate_degree": 2, "tp_degree": 2}}, 8,
     "strategy.cp_degree with both strategy.replicate_degree and tp_degree is not tested yet"),
    ({}, {"strategy": {"name": "fsdp", "cp_degree": 2, "replicate_degree": 2}}, 2,
     "strategy.cp_degree 2 × replicate_degree 2 does not divide world size 2; use a world size that is a multiple of 4"),
    ({}, {"strategy": {"name": "fsdp", "cp_degree": 2, "replicate_degree": 2, "sync_every": 2}}, 4,
     "strategy.cp_degree with local SGD over HSDP's replica groups is not tested yet"),
    ({}, {"strategy": {"name": "fsdp", "cp_degree": 0}}, 2, "strategy.cp_degree must be >= 1, got 0"),
    ({"cp": 3}, {}, 4, "parallel: cp 3 does not divide the 4 ranks"),  # one degree: no "cp 3 = 3"
    ({"cp": 2, "tp": 2}, {}, 6, "parallel: cp 2 × tp 2 = 4 does not divide the 6 ranks"),
    ({"cp": 2}, {"train": {"compile": True}}, 2, "train.compile is not available with context parallel yet"),
])
def test_what_context_parallel_cannot_run_is_refused_in_one_line(parallel, sections, world_size, words):
    with pytest.raises(RecipeError) as refused:
        validate_strategy(recipe(parallel, **sections), world_size=world_size)
    assert str(refused.value).startswith(words) and "\n" not in str(refused.value), str(refused.value)


def test_an_unknown_method_is_refused():
    with pytest.raises(RecipeError, match="parallel.cp_method: unknown value"):
        recipe({"cp": 2, "cp_method": "flash"})


def _ring_sequence(valid: list[list[int]]):
    """The cp context of rank 0 of 2 over a [batch, 4] batch whose padding mask is `valid` (no process group: the
    refusals come before any collective)."""
    ids = torch.ones(len(valid), 4, dtype=torch.long)
    return split_batch(ids, torch.tensor(valid), ids.clone(), cp=2, rank=0, group=None).sequence


@pytest.mark.parametrize("valid, kwargs, words", [
    ([[0, 1, 1, 1]], {}, "parallel.cp_method ring attends without a padding mask, which needs each sample's padding "
                         "after its tokens; a batch here has padding before them; use parallel.cp_method allgather"),
    ([[1, 1, 1, 1]], {"sliding_window": 3}, "parallel.cp_method ring attends over the whole causal past, and Module "
                                            "attends within a sliding window of 3 positions, fewer than a "
                                            "sample's 4 tokens"),
    ([[1, 1, 1, 0]], {"dropout": 0.1}, "parallel.cp_method ring attends without dropout, and Module drops attention "
                                       "weights at 0.1; set model.dropout 0.0"),
    ([[1, 1, 1, 0]], {"s_aux": torch.zeros(2)}, "context parallel attends with the flash kernel, which leaves out "
                                                "what Module hands its attention as s_aux"),
])
def test_what_ring_cannot_follow_is_refused_in_one_line(valid, kwargs, words):
    from toolkit.strategies.dims import context

    query = torch.zeros(len(valid), 2, 2, 4)
    with context.sequence(_ring_sequence(valid)), pytest.raises(RecipeError) as refused:
        context.ring_attention(torch.nn.Module(), query, query, query, None, **kwargs)
    assert str(refused.value).startswith(words) and "\n" not in str(refused.value), str(refused.value)


def test_ring_s_kernel_repeats_grouped_heads_as_the_kernel_that_takes_them():
    """CUDA's flash kernel is handed keys and values repeated to the query heads (Kernel.expand), their gradients
    summed back: the same wrapper over the CPU's kernel, which takes grouped heads itself, gives its results."""
    from toolkit.strategies.dims.ring import Kernel

    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(2, heads, 6, 8, generator=generator, dtype=torch.float64) for heads in (4, 2, 2))
    native, expanded = Kernel(name="cpu-flash", expand=False), Kernel(name="cpu-flash", expand=True)
    out, lse = native.forward(query, key, value, is_causal=True, scale=None)
    out_x, lse_x = expanded.forward(query, key, value, is_causal=True, scale=None)
    assert torch.allclose(out, out_x, rtol=0, atol=1e-12) and torch.allclose(lse, lse_x, rtol=0, atol=1e-12)
    grad = torch.randn(out.shape, generator=generator, dtype=torch.float64)
    grads = native.backward(grad_out=grad, query=query, key=key, value=value, out=out, logsumexp=lse,
                            is_causal=True, scale=None)
    grads_x = expanded.backward(grad_out=grad, query=query, key=key, value=value, out=out, logsumexp=lse,
                                is_causal=True, scale=None)
    assert [g.shape for g in grads_x] == [query.shape, key.shape, value.shape]
    for mine, theirs in zip(grads_x, grads):
        assert torch.allclose(mine, theirs, rtol=0, atol=1e-12)
    # and both against plain autograd of the math
    leaves = [t.clone().requires_grad_() for t in (query, key, value)]
    plain = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
    plain.backward(grad)
    for mine, leaf in zip(grads_x, leaves):
        assert torch.allclose(mine, leaf.grad, rtol=0, atol=1e-10)


def test_ring_takes_torch_s_ring_attention_only_in_the_form_it_calls():
    """torch's ring templates took a device mesh first in earlier versions (torch 2.6's `_templated_ring_attention(
    mesh, seq_dim, op, ...)`, and before that `(mesh, op, ...)`): such a torch is refused before launch, not a
    TypeError at the first step."""
    import types

    from torch.distributed.tensor.experimental._context_parallel import _attention

    from toolkit.strategies.dims.ring import usable

    assert usable(_attention)

    def mesh_first(mesh, seq_dim, op, query, key, value, is_causal=False, **kwargs):
        return ()
    older = types.SimpleNamespace(**{name: getattr(_attention, name) for name in ("_cp_options", "_RotateMethod",
                                                                                   "_templated_ring_attention")},
                                  _templated_ring_attention_backward=mesh_first)
    assert not usable(older)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ring_refuses_a_device_without_its_kernel(dtype):
    """Off the CPU and CUDA (an xpu, mps) the line said the device had the kernel for bf16 only, also in bf16."""
    from toolkit.strategies.dims.ring import kernel_for

    with pytest.raises(RecipeError, match=r"^parallel.cp_method ring attends with the flash kernels of the CPU and of "
                                          r"CUDA, and this run's device is meta; "):
        kernel_for(torch.zeros(1, device="meta", dtype=dtype))


@pytest.mark.parametrize("config, words", [
    # ALiBi in BLOOM's own attention: no AttentionInterface for the cp methods to take the place of (before: refused
    # only at setup, after validate said ok)
    ("{model_type: bloom, vocab_size: 30522, hidden_size: 32, n_layer: 2, n_head: 4}",
     "context parallel needs a model whose attention transformers lets the toolkit replace (AttentionInterface); "
     "BloomForCausalLM does not"),
    # Gemma 2 soft-caps its attention logits, which sdpa cannot (before: a ValueError traceback at the first step)
    ("{model_type: gemma2, vocab_size: 30522, hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 4, "
     "num_key_value_heads: 2, intermediate_size: 64, head_dim: 8}",
     "context parallel attends with sdpa, which has no attention logit soft-capping"),
])
def test_a_model_whose_attention_context_parallel_cannot_take_is_refused_in_one_line(config, words, tmp_path,
                                                                                    tiny_llama_dir, capsys):
    from test_cli_errors import _assert_one_line_exit_2
    from toolkit.cli import main

    path = write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=tmp_path / "out")
    code = main(["validate", str(path), "--nproc", "2", "--set", "parallel.cp=2", "--set", "model.path=null",
                 "--set", f"model.config={config}", "--set", f"model.tokenizer={tiny_llama_dir}"])
    _assert_one_line_exit_2(code, capsys, words, tmp_path / "out")


@pytest.mark.parametrize("window, refused", [(4, True), (64, False)])
def test_ring_refuses_a_sliding_window_shorter_than_the_sequences(window, refused, tmp_path, tiny_llama_dir, capsys):
    """Ring attends over the whole causal past: a Mistral whose window (4) is shorter than data.max_length (64) is
    refused before launch; one whose window the sequences fit in (Mistral 7B v0.1's 4,096 under 4,096 tokens) is
    no window, and runs."""
    from test_cli_errors import _assert_one_line_exit_2
    from toolkit.cli import main

    path = write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=tmp_path / "out")
    config = ("{model_type: mistral, vocab_size: 30522, hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 4, "
              f"num_key_value_heads: 2, intermediate_size: 64, sliding_window: {window}}}")
    code = main(["validate", str(path), "--nproc", "2", "--set", "parallel.cp=2", "--set", "parallel.cp_method=ring",
                 "--set", "data.max_length=64", "--set", "model.path=null", "--set", f"model.config={config}",
                 "--set", f"model.tokenizer={tiny_llama_dir}"])
    if refused:
        _assert_one_line_exit_2(code, capsys, "parallel.cp_method ring attends over the whole causal past, and the "
                                "model's layers attend within a sliding window of 4 positions, fewer than "
                                "data.max_length 64; use parallel.cp_method allgather", tmp_path / "out")
    else:
        assert code == 0, capsys.readouterr()


def test_a_window_in_the_mask_but_not_in_the_attention_is_refused(reference_cases):
    """Qwen2-MoE builds a sliding-window mask but never hands its attention function the window: the cp attention,
    which builds its own mask, would attend over the whole causal past. The forward's masks say the window
    (transformers' local_size), its attention calls do not: refused after the first forward, in one line."""
    refused = reference_cases(2)["allgather+untold"]["refused"]
    assert refused.startswith("context parallel: the model masks its attention to 4 positions (a sliding window or "
                              "attention chunks) without telling the attention function") and "\n" not in refused


def test_attention_sinks_are_refused_not_left_out():
    """sdpa, which the cp methods attend with, takes no attention sinks (GPT-OSS's s_aux): refused where they reach
    it, the first step (a RecipeError: one line), where sdpa would have attended without them."""
    from toolkit.strategies.dims import context

    query = torch.zeros(1, 2, 3, 4)
    allowed = torch.ones(1, 1, 3, 3, dtype=torch.bool)
    with pytest.raises(RecipeError, match=r"^context parallel attends with sdpa, which leaves out what Module hands "
                                          r"its attention as s_aux \(attention sinks: GPT-OSS\)"):
        context._sdpa(torch.nn.Module(), query, query, query, allowed, dropout=0.0, scaling=None,
                      s_aux=torch.zeros(2))
    out, _ = context._sdpa(torch.nn.Module(), query, query, query, allowed, dropout=0.0, scaling=None, s_aux=None)
    assert out.shape == (1, 3, 2, 4)


def test_a_context_parallel_mistake_exits_2_before_any_rank_starts(tmp_path, tiny_llama_dir):
    path = write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=tmp_path / "out")
    done = run_cli("validate", str(path), "--nproc", "8", "--set", "parallel.cp=2", "--set", "parallel.tp=2")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not (tmp_path / "out").exists()
    done = run_cli("validate", str(path), "--nproc", "2", "--set", "parallel.cp=2")
    assert done.returncode == 0 and "# parallel: fsdp (cp 2)" in done.stdout.splitlines(), done.stdout
    # ulysses splits the heads: the tiny Llama's 2 KV heads over 4 ranks cannot be
    done = run_cli("validate", str(path), "--nproc", "4", "--set", "parallel.cp=4", "--set",
                   "parallel.cp_method=ulysses")
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "toolkit: error: parallel.cp_method ulysses splits the attention heads over the 4 cp ranks, but the model "
        "has 4 attention and 2 key/value heads; use a cp that divides 2, or parallel.cp_method allgather"]


@pytest.mark.parametrize("dropout, words", [
    ("null", "parallel.cp_method ring attends without dropout, and the model drops attention weights at 0.1 "
           "(config.attention_dropout); set model.dropout 0.0 or use parallel.cp_method allgather"),
    ("0.0", None),  # the run's dropout off: ring runs
])
def test_ring_refuses_attention_dropout_before_any_rank_starts(dropout, words, tmp_path, tiny_llama_dir, capsys):
    """A Llama whose config drops attention weights: refused by validate, where it was refused only at the first
    step of every rank (the attention call's own check, which stays)."""
    from test_cli_errors import _assert_one_line_exit_2
    from toolkit.cli import main

    path = write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=tmp_path / "out")
    config = ("{model_type: llama, vocab_size: 30522, hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 4, "
              "num_key_value_heads: 2, intermediate_size: 64, attention_dropout: 0.1}")
    args = ["validate", str(path), "--nproc", "2", "--set", "parallel.cp=2", "--set", "parallel.cp_method=ring",
            "--set", "model.path=null", "--set", f"model.config={config}", "--set", f"model.tokenizer={tiny_llama_dir}",
            "--set", f"model.dropout={dropout}"]  # null: the model's own rates
    code = main(args)
    if words:
        _assert_one_line_exit_2(code, capsys, words, tmp_path / "out")
    else:
        assert code == 0, capsys.readouterr()


@pytest.mark.parametrize("precision, refused", [("fp32", True), ("bf16", False)])
def test_ring_refuses_fp32_where_the_run_is_on_cuda_before_any_rank_starts(precision, refused, monkeypatch):
    """CUDA's flash kernel takes 16-bit inputs: an fp32 run on a machine with a GPU is refused by the recipe check
    (it was refused at the first step, by kernel_for). A CPU machine runs ring in fp32 (its flash kernel takes it)."""
    from transformers import LlamaConfig

    from toolkit.strategies.dims.context import check_ring

    config = LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    check_ring(config, max_length=64, precision=precision)  # this machine: no GPU, fp32 is the CPU kernel's too
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    if not refused:
        check_ring(config, max_length=64, precision=precision)
        return
    with pytest.raises(RecipeError, match=r"^parallel.cp_method ring attends with CUDA's flash kernel, which takes "
                                          r"bf16 and fp16 only, not fp32: set precision bf16, or use parallel"):
        check_ring(config, max_length=64, precision=precision)
