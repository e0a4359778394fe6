"""Run under torchrun by tests/test_loading.py: for each case, the toolkit builds and sets up the recipe's strategy
(low-memory loading where it applies), gathers the full weights it starts from, and rank 0 compares them with a
plain transformers build in this process (torch.manual_seed, then from_pretrained or from_config), element by
element; each case's export is written too, and its tensor names read beside those of the plain model's own
save_pretrained. Writes {case: {"weights": ..., "layout": ..., "export_names": ...}} as JSON."""

import json
import sys
from pathlib import Path

import torch


def reference(recipe):
    """The recipe's model built by transformers alone, as one process would build it."""
    import transformers

    auto = (transformers.AutoModelForCausalLM if recipe.model.task == "causal-lm"
            else transformers.AutoModelForSequenceClassification)
    extra = {"num_labels": recipe.model.num_labels} if recipe.model.task == "sequence-classification" else {}
    extra["dtype"] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[recipe.model.load_dtype]
    torch.manual_seed(recipe.seed)
    if recipe.model.path is not None:
        from toolkit.model.build import resolve_path

        model = auto.from_pretrained(str(resolve_path(recipe.model.path)), **extra)
    else:
        fields = dict(recipe.model.config)
        labels = {k: v for k, v in extra.items() if k == "num_labels"}
        config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields, **labels)
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(resolve_tokenizer(recipe)))
        config.pad_token_id = tokenizer.pad_token_id
        model = auto.from_config(config, dtype=extra["dtype"])
    return model


def resolve_tokenizer(recipe):
    from toolkit.model.build import resolve_path

    return resolve_path(recipe.model.tokenizer)


def compare(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict:
    shared = sorted(set(got) & set(want))
    differing = [k for k in shared if got[k].shape != want[k].shape or not torch.equal(got[k].float(), want[k].float())]
    return {"missing": sorted(set(want) - set(got) - aliases(want)), "extra": sorted(set(got) - set(want)),
            "compared": len(shared), "differing": differing[:5], "num_differing": len(differing)}


def aliases(state: dict[str, torch.Tensor]) -> set[str]:
    """Tied names the toolkit exports once (lm_head.weight beside the input embedding)."""
    seen, out = {}, set()
    for key, value in state.items():
        if value.untyped_storage().data_ptr() in seen:
            out.add(key)
        seen.setdefault(value.untyped_storage().data_ptr(), key)
    return out


def names(folder: Path) -> list[str]:
    from safetensors import safe_open

    return sorted(name for file in folder.glob("*.safetensors") for name in safe_open(str(file), "pt").keys())


def main() -> None:
    from toolkit.process.dist import exit_process, init_distributed, shutdown
    from toolkit.model.export import export_model
    from toolkit.launch.launcher import prepare_environment
    from toolkit.checkpoint.loading import ModelSource
    from toolkit.train.loop import setup_strategy
    from toolkit.model.build import load_tokenizer
    from toolkit.strategies.optim.adamw import param_groups
    from toolkit.config.recipe import plan_batch
    from toolkit.config.files import load_recipe
    from toolkit.strategies import make_strategy

    out, cases = sys.argv[1], json.loads(sys.argv[2])  # {name: [recipe path, override, ...]}
    prepare_environment()
    env = init_distributed()
    results = {}
    for name, (path, *overrides) in cases.items():
        recipe = load_recipe(path, overrides)
        strategy = make_strategy(recipe)
        source = ModelSource(recipe=recipe, tokenizer=load_tokenizer(recipe.model))
        model = strategy.build_model(source, env=env)
        groups = [len(g["params"]) for g in param_groups(model, recipe.optim)]  # decayed, not decayed
        setup_strategy(strategy, model, source=source, env=env, total_steps=1,
                       plan=plan_batch(recipe.batch, world_size=env.world_size))
        got = strategy.state.full_state_dict()
        exported = export_model(strategy, tokenizer=source.tokenizer, out_dir=Path(out).parent / f"export-{name}",
                                env=env, task=recipe.model.task)
        if env.is_main:
            plain = reference(recipe)
            plain.save_pretrained(Path(out).parent / f"plain-{name}")
            # the reference's matrices are decayed, its vectors not (counted here, not by param_groups)
            dims = [p.dim() for p in plain.parameters()]
            want_groups = [sum(d >= 2 for d in dims), sum(d < 2 for d in dims)]
            results[name] = {"weights": compare(got, plain.state_dict()), "layout": strategy.report().layout,
                             "param_groups": groups, "want_groups": want_groups,
                             # the exported file's tensor names, beside those transformers' own save writes
                             "export_names": names(exported), "want_export_names": names(Path(out).parent / f"plain-{name}")}
        strategy.close()
    if env.is_main:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
    shutdown(completed=True)
    exit_process(0)


if __name__ == "__main__":
    main()
