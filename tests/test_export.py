"""The exported folder loads with plain transformers and gives the trained model's logits."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import write_recipe
from toolkit.config.files import load_recipe
from toolkit.process.dist import DistEnv
from toolkit.train.loop import train


def test_exported_model_loads_with_plain_transformers(tmp_path, tiny_llama_dir):
    out = tmp_path / "run"
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=out,
                                      train={"max_steps": 3}))
    result = train(recipe, DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cpu")))
    trained = result.strategy.state.export_module().eval()
    loaded = AutoModelForCausalLM.from_pretrained(out / "model").eval()
    assert (out / "model" / "model.safetensors").is_file() and not (out / ".model.partial").exists()
    ids = torch.tensor([[101, 2023, 3185, 2001, 2307, 102]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, trained(input_ids=ids).logits, rtol=0, atol=0)
    # and it really trained: the export is not the initial checkpoint
    initial = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    with torch.no_grad():
        assert not torch.equal(initial(input_ids=ids).logits, loaded(input_ids=ids).logits)
    assert (out / "recipe.yaml").is_file() and (out / "run.json").is_file()
    # every file as readable as the umask allows: safetensors creates its file 0600 whatever the umask
    modes = {p.name: p.stat().st_mode & 0o777 for p in (out / "model").iterdir()}
    assert set(modes.values()) == {0o666 & ~_umask()}, modes


def _umask() -> int:
    import os

    mask = os.umask(0)  # the test's own process: no other thread creates files now
    os.umask(mask)
    return mask


def test_tied_embedding_is_exported_once_and_reloads_tied(tmp_path, tiny_tied_llama_dir):
    from safetensors.torch import load_file

    out = tmp_path / "run"
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", model_dir=tiny_tied_llama_dir, output_dir=out,
                                      train={"max_steps": 2}))
    result = train(recipe, DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cpu")))
    names = set(load_file(str(out / "model" / "model.safetensors")))
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    loaded = AutoModelForCausalLM.from_pretrained(out / "model").eval()
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    ids = torch.tensor([[101, 2023, 3185, 2001, 2307, 102]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits,
                                   result.strategy.state.export_module().eval()(input_ids=ids).logits, rtol=0, atol=0)


def test_an_export_that_dies_midway_leaves_a_complete_model_in_place(tmp_path, tiny_llama_dir, monkeypatch):
    """A resumed run exports over the model/ a previous export wrote. Writing the new folder beside it and
    exchanging the two in one step leaves a complete model at model/ wherever the process dies; deleting the
    old folder first and renaming the new one after would leave none if it died in between (simulated: the
    rename dies)."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from toolkit.model import export
    out = tmp_path / "run"
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=out,
                                      train={"max_steps": 1}))
    env = DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    strategy = train(recipe, env).strategy
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    before = (out / "model" / "model.safetensors").read_bytes()

    class Died(Exception):
        pass

    def dies(*args, **kwargs):
        raise Died

    one_step = export._exchange
    for exchange in (one_step, lambda a, b: False):  # renameat2, and the fallback without it
        with torch.no_grad():  # what the later export writes: other weights
            for param in strategy.state.export_module().parameters():
                param.add_(1.0)
        monkeypatch.setattr(export, "_exchange", exchange)
        with monkeypatch.context() as patch:
            patch.setattr(Path, "rename", dies)
            try:
                export.export_model(strategy, tokenizer=tokenizer, out_dir=out, env=env)
            except Died:
                pass
        written = (out / "model" / "model.safetensors").read_bytes()  # complete: the old one or the new one
        assert written == before or exchange is one_step  # one step: nothing to die between, the export is done
        AutoModelForCausalLM.from_pretrained(out / "model")
        # the same export, completed: the new folder takes model/'s place and nothing is left beside it
        export.export_model(strategy, tokenizer=tokenizer, out_dir=out, env=env)
        after = (out / "model" / "model.safetensors").read_bytes()
        assert after != before and sorted(p.name for p in out.iterdir() if "model" in p.name) == ["model"]
        before = after


class _Tied(torch.nn.Module):
    """An embedding and an output head sharing one weight, as tied language models do."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(64, 8)
        self.inner = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 64, bias=False)
        self.head.weight = self.embed.weight


def _gather_worker(rank: int, init_file: str, results) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from toolkit.strategies.base import gathered_state_dict

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = _Tied()
    whole = {name: t.clone() for name, t in model.state_dict().items()}  # before sharding: the reference
    fully_shard(model.inner)
    fully_shard(model)
    assert all(p.to_local().numel() < whole[n].numel() for n, p in model.named_parameters())  # really sharded
    full = gathered_state_dict(model, DistEnv(rank=rank, local_rank=rank, world_size=2, device=torch.device("cpu")))
    if rank == 0:
        results["keys"] = sorted(full)
        results["tied_once"] = full["head.weight"] is full["embed.weight"]
        results["equal"] = all(torch.equal(full[n], t) for n, t in whole.items())
    else:
        results["other_rank"] = full
    dist.destroy_process_group()


def test_sharded_weights_are_gathered_whole_with_a_tied_weight_gathered_once(tmp_path):
    """The export's gather (FSDP2, TP): rank 0 gets every tensor whole under every name; a tied weight is one
    gathered tensor under both names, not a copy per name (rank 0 would hold two while it exports)."""
    import os

    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = mp.Manager().dict()
    mp.spawn(_gather_worker, args=(str(tmp_path / "init"), results), nprocs=2)
    assert results["keys"] == ["embed.weight", "head.weight", "inner.bias", "inner.weight"]
    assert results["tied_once"] and results["equal"] and results["other_rank"] is None


UNWRAP = """
import sys
from transformers import AutoModelForCausalLM
from toolkit.model.export import unwrapped_without_deepspeed
model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
with unwrapped_without_deepspeed():
    model.save_pretrained(sys.argv[2] + "/with")
print("deepspeed" in sys.modules)
model.save_pretrained(sys.argv[2] + "/without")
print("deepspeed" in sys.modules)
"""


def test_the_export_leaves_deepspeed_unimported_in_a_run_that_never_used_it(tmp_path, tiny_llama_dir):
    """save_pretrained asks accelerate to unwrap the model, which imports DeepSpeed (1.4 s) where installed; the
    export answers the same without it. Plain save_pretrained, after, shows the import the export avoids."""
    import subprocess
    import sys

    from conftest import toolkit_env

    done = subprocess.run([sys.executable, "-c", UNWRAP, str(tiny_llama_dir), str(tmp_path)], capture_output=True,
                          text=True, env=toolkit_env(), check=True)
    assert [line for line in done.stdout.splitlines() if line in ("True", "False")] == ["False", "True"]
    assert (tmp_path / "with" / "model.safetensors").read_bytes() == \
        (tmp_path / "without" / "model.safetensors").read_bytes()


def test_model_dropout_is_the_runs_alone_the_export_and_checkpoint_keep_the_models(tmp_path, tiny_bert_dir):
    """model.dropout 0.0 trains without dropout, but out_dir/model, the checkpoint's hf/ folder and `toolkit
    convert`'s folder carry model.path's own rates: a later fine-tune from them has the model's dropout."""
    import json

    from toolkit.cli import main

    out = tmp_path / "run"
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", model_dir=tiny_bert_dir, output_dir=out,
                                      task="sequence-classification", train={"max_steps": 1},
                                      checkpoint={"final": True}))
    assert recipe.model.dropout == 0.0
    result = train(recipe, DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cpu")))
    source = json.loads((tiny_bert_dir / "config.json").read_text())
    own = {key: value for key, value in source.items() if key.endswith(("dropout", "dropout_prob"))}
    assert own["hidden_dropout_prob"] == 0.1 and own["attention_probs_dropout_prob"] == 0.1  # could differ from 0.0
    assert all(getattr(result.strategy.state.export_module().config, key) == 0.0 for key in own)  # the run's own rate
    converted = tmp_path / "converted"
    assert main(["convert", str(out / "checkpoints" / "step-00000001"), str(converted)]) == 0
    for folder in (out / "model", out / "checkpoints" / "step-00000001" / "hf", converted):
        saved = json.loads((folder / "config.json").read_text())
        assert {key: saved.get(key) for key in own} == own, folder


@pytest.mark.parametrize("strategy,ranks", [("ddp", 2), ("hf_native", 2), ("ddp", 1)])
def test_a_rank_whose_strategy_runs_without_deepspeed_never_imports_it(strategy, ranks, tmp_path, tiny_llama_dir):
    """A rank imports DeepSpeed's comm module before its process group only where its strategy runs on DeepSpeed
    (process/dist.py init_distributed): imported later, its functions' default group would keep the group alive
    past destroy_process_group. So nothing else in such a rank may import it: not the export, not hf_native's
    save of its starting weights (both through accelerate's unwrap), not the group of one a `toolkit train` without
    a launcher makes for itself (ensure_process_group). Plain ranks (torchrun, not the tests' forked ones), or the
    one process, each printing what it imports (PYTHONPROFILEIMPORTTIME)."""
    import subprocess
    import sys

    from conftest import REPO, toolkit_env

    out = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=tiny_llama_dir, output_dir=out, data={"eval": None},
                          batch={"micro_batch_size": 4}, train={"max_steps": 1})
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"] if ranks == 2 else []
    done = subprocess.run([sys.executable, *launcher, "-m", "toolkit", "train", str(recipe),
                           "--set", f"strategy.name={strategy}"],
                          cwd=REPO, env={**toolkit_env(), "PYTHONPROFILEIMPORTTIME": "1"}, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    imported = [line for line in done.stderr.splitlines() if line.startswith("import time:")]
    assert any(line.endswith("| transformers") for line in imported)  # the ranks' imports are there to see
    assert not [line for line in imported if line.rsplit("|", 1)[-1].strip().startswith("deepspeed")]
    assert (out / "model" / "config.json").is_file()


def test_a_model_built_empty_exports_the_tensor_names_of_its_files(tmp_path):
    """GPT-NeoX's files name its head embed_out.weight, which transformers 5 loads as lm_head and save_pretrained
    writes back as embed_out for a model from from_pretrained. fsdp builds its model empty (meta device) and fills
    it: its export said lm_head.weight, so compare judged an fsdp arm "diverged in final weights" (other tensor
    names) against single on the same weights. A one-process fsdp run exports the files' names."""
    import subprocess
    import sys

    from safetensors import safe_open
    from transformers import AutoConfig

    from conftest import REPO, _minilm_tokenizer, forked_env

    model_dir = tmp_path / "neox"
    tokenizer = _minilm_tokenizer()
    config = AutoConfig.for_model("gpt_neox", vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=64, max_position_embeddings=64)
    AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)

    def names(folder):
        with safe_open(str(folder / "model.safetensors"), "pt") as f:
            return set(f.keys())

    assert "embed_out.weight" in names(model_dir)
    out = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.yaml", model_dir=model_dir, output_dir=out, data={"eval": None},
                          batch={"micro_batch_size": 4}, train={"max_steps": 1})
    done = subprocess.run([sys.executable, "-m", "toolkit", "train", str(recipe), "--set", "strategy.name=fsdp"],
                          cwd=REPO, env=forked_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert names(out / "model") == names(model_dir)
