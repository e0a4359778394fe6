"""Expert parallel (`parallel.ep`, toolkit/strategies/dims/expert.py): tiny mixture-of-experts models (Qwen3-MoE
and Mixtral, 4 experts, top-2) trained with their experts split over ranks, against a single process (real processes
under torchrun on gloo); the memory plan's state bytes against what the ranks measured; and what it cannot run,
refused in one line before any rank starts."""

import json

import pytest
from conftest import TRAIN, assert_matches_single, metrics, run_cli, write_recipe

from toolkit.config.files import recipe_from_dict
from toolkit.errors import RecipeError
from toolkit.strategies import validate_strategy

# the global batch of 8 over the data shards: 2 ranks × micro 4, 4 ranks × micro 2 (each its own shard)
EP2 = ("parallel.ep=2", "batch.micro_batch_size=4")
EP2_4 = ("parallel.ep=2", "batch.micro_batch_size=2")  # 4 ranks: 2 hold experts 0-1, 2 hold 2-3, each pair shards them


@pytest.mark.parametrize("fixture, name, nproc, overrides", [
    ("moe_runs", "ep2", 2, EP2), ("moe_runs", "ep2-4ranks", 4, EP2_4), ("mixtral_runs", "ep2", 2, EP2)])
def test_expert_parallel_trains_as_one_process(request, fixture, name, nproc, overrides):
    runs = request.getfixturevalue(fixture)
    reference = runs.get("single-m8")
    run = runs.get(name, nproc=nproc, overrides=overrides)
    assert_matches_single(run, reference)
    assert metrics(run)[-1]["eval_loss"] == pytest.approx(metrics(reference)[-1]["eval_loss"], rel=1e-5)
    info = json.loads((run / "run.json").read_text())
    assert info["strategy"] == "fsdp" and info["parallel"]["ep"] == 2 and info["parallel"]["dp_shard"] == nproc
    assert "each MoE layer's experts split over 2 ranks" in info["layout"]
    # the plan's bytes per rank (each rank's half of the experts, sharded over the ranks holding the same ones;
    # the dense weights over all) against the distinct storages the ranks measured after their first step
    assert info["memory_prediction"]["model_state_bytes"] == info["model_state_bytes"]
    # the routing: each rank counts the choices of its own tokens, the sum over ranks is the single process's count
    assert [m["expert_tokens"] for m in metrics(run)] == [m["expert_tokens"] for m in metrics(reference)]
    assert info["experts"] == json.loads((reference / "run.json").read_text())["experts"]
    # each layer routes every token that is not padding to 2 experts: the data's own count, from the loop
    assert all(sum(layer) == 2 * m["tokens"] for m in metrics(run) for layer in m["expert_tokens"])


def test_the_collective_counter_counts_the_token_all_to_alls(moe_runs):
    # per MoE layer and micro-batch, rank 0 hands four all-to-alls hidden-size fp32 rows: its own (token, expert)
    # pairs out and, in backward, their gradients back; the rows its experts 0-1 received back and, in backward,
    # theirs out. Its pairs are at most all of the step's, its experts' rows exactly the global counts of 0 and 1.
    run = moe_runs.get("ep2", nproc=2, overrides=EP2)
    info = json.loads((run / "run.json").read_text())
    comm = info["comm_per_step"]
    counts = next(m for m in metrics(run) if m["step"] == comm["step"])["expert_tokens"]
    row = 32 * 4  # the tiny model's hidden size, fp32
    received = sum(layer[0] + layer[1] for layer in counts)
    every_pair = sum(sum(layer) for layer in counts)
    assert 2 * row * received < comm["bytes_by_op"]["all_to_all_single"] <= 2 * row * (received + every_pair)
    assert comm["calls_by_op"]["all_to_all_single"] == 4 * len(counts)  # one micro-batch: 4 per layer
    single = json.loads((moe_runs.get("single-m8") / "run.json").read_text())["comm_per_step"]
    assert "all_to_all_single" not in single["bytes_by_op"]


def test_context_parallel_on_a_moe_model_counts_the_tokens_single_does(moe_runs):
    # cp splits each sequence (padded further to a multiple of 4) and passes the model no attention mask: the
    # counter takes each rank's tokens from its share of the batch, so the padding stays out of the counts
    reference, run = moe_runs.get("single-m8"), moe_runs.get("cp2", nproc=2, overrides=("parallel.cp=2",))
    assert_matches_single(run, reference)
    assert [m["expert_tokens"] for m in metrics(run)] == [m["expert_tokens"] for m in metrics(reference)]


def test_each_rank_holds_half_the_experts(moe_runs):
    # independent of the plan: the whole model's parameter bytes (single) and its experts' share, from the exported
    # weights' names; with ep 2 over 2 ranks each rank holds half of every experts weight (efsdp 1: no further
    # sharding) and half of every dense weight (FSDP over both; every dense dim 0 here is even)
    from conftest import exported_weights

    weights = exported_weights(moe_runs.get("single-m8"))
    experts = sum(t.numel() * 4 for n, t in weights.items() if ".experts." in n)
    dense = sum(t.numel() * 4 for n, t in weights.items() if ".experts." not in n)
    assert experts > 0 and dense > 0
    info = json.loads((moe_runs.get("ep2", nproc=2, overrides=EP2) / "run.json").read_text())
    assert [rank["params_bytes"] for rank in info["model_state_bytes"]] == [(experts + dense) // 2] * 2


def recipe(parallel, model_dir, **sections):
    return recipe_from_dict({"model": {"path": str(model_dir), "task": "causal-lm"}, "data": {"train": "t.jsonl"},
                             "parallel": parallel, "batch": {"global_batch_size": 8, "micro_batch_size": 1},
                             **sections})


@pytest.mark.parametrize("parallel, sections, world_size, words", [
    ({"ep": 3}, {}, 3, "parallel.ep 3 does not divide the model's 4 experts per layer; use an ep that divides 4"),
    ({"ep": 2}, {}, 3, "parallel.ep 2 does not divide the 3 ranks"),
    ({"ep": 2, "tp": 2}, {}, 4, "parallel.ep is tested with dp_shard alone, not beside tp 2 yet; drop it or "
                                "parallel.ep"),
    ({"ep": 2, "dp_replicate": 2}, {}, 2, "parallel.ep is tested with dp_shard alone, not beside dp_replicate 2 yet"),
    # one process: no dp_shard ranks to borrow (said as "all degrees 1 (ep 2 of them)" before)
    ({"ep": 2}, {}, 1, "parallel.ep 2 borrows its ranks from dp_shard, which is 1 in a world of 1 rank(s); run it on "
                       "a multiple of 2 ranks (toolkit launch --nproc 2) or drop parallel.ep"),
    ({"ep": 2}, {"train": {"compile": True}}, 2, "train.compile is not available with expert parallel yet"),
    ({}, {"strategy": {"name": "fsdp", "ep_degree": 2, "replicate_degree": 2}}, 4,
     "strategy.ep_degree (expert parallel) is tested with dp_shard alone"),
    ({}, {"strategy": {"name": "fsdp", "ep_degree": 0}}, 2, "strategy.ep_degree must be >= 1, got 0"),
])
def test_what_expert_parallel_cannot_run_is_refused_in_one_line(tiny_moe_dir, parallel, sections, world_size, words):
    with pytest.raises(RecipeError) as refused:
        validate_strategy(recipe(parallel, tiny_moe_dir, **sections), world_size=world_size)
    assert str(refused.value).startswith(words) and "\n" not in str(refused.value), str(refused.value)


def test_the_router_loss_is_transformers_own_on_each_batch(tmp_path, tiny_moe_aux_dir):
    # independent of the loop: transformers' loss with labels is the token mean plus router_aux_loss_coef times its
    # load-balancing loss on the same batch (padding masked); the toolkit takes a whole batch of 8 as one
    # micro-batch and adds the router's loss it returns
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from conftest import TRAIN, launch, losses
    from toolkit.config.recipe import BatchPlan
    from toolkit.data.splits import GlobalBatchSampler

    out = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_moe_aux_dir, output_dir=out,
                          optim={"warmup_steps": 0, "schedule": "constant", "max_grad_norm": None,
                                 "weight_decay": 0.0}, train={"max_steps": 3, "consistency_check_every": None})
    launch(recipe, nproc=1)
    texts = [json.loads(line)["text"] for line in open(TRAIN)]
    sampler = GlobalBatchSampler(num_samples=len(texts), plan=BatchPlan(world_size=1, micro_batch_size=8,
                                 grad_accum_steps=1, global_batch_size=8), rank=0, seed=0)
    tokenizer = AutoTokenizer.from_pretrained(tiny_moe_aux_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_moe_aux_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    reference, routers = [], []
    for step in range(3):
        batch = tokenizer([texts[i] for i in sampler.global_batch(step)], truncation=True, max_length=32,
                          padding=True, return_tensors="pt")
        out_ = model(**batch, labels=batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100))
        out_.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        reference.append(out_.loss.item())
        routers.append(0.1 * out_.aux_loss.item())
    assert min(routers) > 1e-4  # the router's share is well above the tolerance below: a dropped one would show
    assert losses(out) == pytest.approx(reference, rel=1e-5)


# with the router loss on, the layouts that cut the global batch into the same micro-batches (4 + 4) agree
AUX_SINGLE = ("batch.micro_batch_size=4", "batch.grad_accum_steps=2")


@pytest.mark.parametrize("name, nproc, overrides", [("ddp", 2, ("strategy.name=ddp", "batch.micro_batch_size=4")),
                                                    ("ep2", 2, EP2), ("hf-native-ep2", 2, (
                                                        "strategy.name=hf_native", "strategy.ep_degree=2",
                                                        "batch.micro_batch_size=4"))])
def test_the_router_loss_is_the_same_under_every_layout(aux_runs, name, nproc, overrides):
    assert_matches_single(aux_runs.get(name, nproc=nproc, overrides=overrides),
                          aux_runs.get("single-m4a2", overrides=AUX_SINGLE))


@pytest.fixture(scope="module")
def aux_runs(tmp_path_factory, tiny_moe_aux_dir):
    from conftest import Runs

    root = tmp_path_factory.mktemp("moe-aux-runs")
    return Runs(root, write_recipe(root / "recipe.yaml", model_dir=tiny_moe_aux_dir, output_dir=root / "unused"))


def test_expert_parallel_on_a_dense_model_exits_2_before_any_rank_starts(tmp_path, tiny_llama_dir):
    path = write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=tmp_path / "out")
    done = run_cli("validate", str(path), "--nproc", "2", "--set", "parallel.ep=2")
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "toolkit: error: parallel.ep shards a mixture-of-experts model's experts; llama is dense (no experts, no "
        "expert-parallel plan); drop parallel.ep"], done.stderr
    assert not (tmp_path / "out").exists()


# a checkpoint written with the experts split over the ranks resumes whole, and one written whole resumes split:
# the checkpoint holds every expert's weights and Adam state under the model's own names (DCP reshards them)
CHECKPOINTED = {"ep2": ("parallel.ep=2",), "fsdp": ("strategy.name=fsdp",), "single": (),
                "hf-native-ep2": ("strategy.name=hf_native", "strategy.ep_degree=2")}


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory, tiny_moe_dir):
    from conftest import launch
    from test_checkpoints import checkpointed_recipe

    root = tmp_path_factory.mktemp("moe-checkpoints")
    recipe = checkpointed_recipe(root, tiny_moe_dir, final=False)
    full = {}

    def run(name: str, nproc: int, *, resume_from: str | None = None):
        if not resume_from and name in full:  # an uninterrupted run is made once and shared
            return full[name]
        out = root / (f"{resume_from}-to-{name}" if resume_from else f"full-{name}")
        if resume_from:
            from test_checkpoints import crashed

            crashed(full[resume_from], out)
        launch(recipe, nproc=nproc, overrides=(*CHECKPOINTED[name], f"output_dir={out}"),
               extra=("--resume",) if resume_from else ())
        if not resume_from:
            full[name] = out
        return out
    return run


@pytest.mark.parametrize("source, target, target_ranks", [("ep2", "single", 1), ("fsdp", "ep2", 2),
                                                          ("ep2", "hf-native-ep2", 2)])
def test_expert_parallel_checkpoints_resume_across_layouts(moe_checkpoints, source, target, target_ranks):
    from test_checkpoints import assert_continues

    reference = moe_checkpoints(source, 2)
    resumed = moe_checkpoints(target, target_ranks, resume_from=source)
    assert_continues(resumed, reference, rtol=1e-5)


def test_experts_too_narrow_for_the_grouped_gemm_are_one_line_before_anything_is_written(tmp_path):
    """transformers runs a MoE model's experts with torch's grouped GEMM (its input cast to the weights' dtype),
    which refuses rows that are not a multiple of 16 bytes: experts 66 wide stopped every rank in its first forward
    with a traceback, after the output folder was written. Now one line, exit 2, before anything is: in `toolkit
    train` (the rank's own checks) and `toolkit validate`. 68 wide runs with fp32 weights (272-byte rows: fp32, and
    bf16 in one process, whose weights stay fp32 under autocast), and is refused where the weights are 2 bytes:
    fsdp in bf16 (136 bytes: its ranks stopped there, measured) and model.load_dtype bf16."""
    from conftest import MINILM

    def recipe(width: int, precision: str, **more):
        config = {"model_type": "mixtral", "vocab_size": 30522, "hidden_size": 32, "intermediate_size": width,
                  "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
                  "num_local_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 64}
        name = f"mixtral-{width}-{precision}-{len(list(tmp_path.iterdir()))}"
        path = tmp_path / f"{name}.yaml"
        path.write_text(json.dumps({
            "model": {"config": config, "tokenizer": MINILM, "task": "causal-lm", **more.pop("model", {})},
            "data": {"train": str(TRAIN), "eval": None, "text_column": "text", "max_length": 32},
            "batch": {"micro_batch_size": 4}, "precision": precision, "train": {"max_steps": 1},
            "output_dir": str(tmp_path / f"out-{name}"), **more}))
        return str(path)

    done = run_cli("train", recipe(66, "fp32"))
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip() == (
        "toolkit: error: model.config: the experts' down_proj of model.layers.0.mlp.experts is 66 wide, which torch's "
        "grouped GEMM (transformers' experts) cannot run with float32 weights; make the model's hidden and expert "
        "intermediate sizes multiples of 4")
    assert not any(path.name.startswith("out-") for path in tmp_path.iterdir())
    for refused in (recipe(68, "bf16", strategy={"name": "fsdp"}), recipe(68, "fp32", model={"load_dtype": "bf16"})):
        done = run_cli("validate", refused)
        assert done.returncode == 2 and "is 68 wide" in done.stderr and "bfloat16 weights" in done.stderr \
            and "multiples of 8" in done.stderr, done.stderr[-3000:]
    for runs in (recipe(68, "fp32"), recipe(68, "bf16"), recipe(72, "bf16", strategy={"name": "fsdp"})):
        done = run_cli("validate", runs)
        assert done.returncode == 0, done.stderr[-3000:]
