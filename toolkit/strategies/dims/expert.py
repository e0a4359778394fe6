"""Expert parallel: each rank holds 1/ep of every mixture-of-experts layer's experts, and each token reaches the
experts its router chose by an all-to-all, then comes back by another.

Built on transformers' own expert parallelism (`transformers.distributed.expert_parallel`), driven by the model's
own `ep_plan` (Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE, GraniteMoE... declare one): `grouped_gemm` shards each
experts module's weights on dim 0 (whole experts per rank) and `ep_dispatch_experts` sends the tokens with its
`all_to_all` implementation (`all_to_all_single_autograd`: gradients come back through it). The toolkit lays out
the meshes and the data-parallel wrap around it, as transformers' DistributedConfig defines the degrees:

    dense view   dp_shard (the world)                  every rank its data shard; dense weights FSDP over it
    expert view  efsdp × ep (the same world)           ep: neighbouring ranks hold different experts;
                                                        efsdp = world / ep: the ranks holding the same experts
                                                        FSDP-shard them (1: each rank holds its experts whole)

An expert's gradient is the sum, over every rank's tokens routed to it, of the loss share's gradient (the
all-to-all's backward brings each rank's part home), then FSDP sums it over the efsdp copies: the whole world's
tokens, so it is divided by the world size where the dense weights' mean over dp_shard divides (FSDP2's gradient
divide factor, with the reduction forced to a sum: gloo has no PREMUL_SUM).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import fully_shard

from toolkit.config.recipe import Recipe
from toolkit.errors import RecipeError
from toolkit.observe.routing import DISPATCH, STACKED, num_experts, plan_of
from toolkit.process.dist import DistEnv
from toolkit.strategies.base import refuse_untested

IMPLEMENTATION = "all_to_all"  # transformers' EPImplementation: each (token, expert) pair to the expert's rank


def check_recipe(recipe: Recipe, *, ep: int, world_size: int, key: str = "parallel.ep") -> None:
    """What expert parallel cannot run, before any rank starts (ep > 1; `key`: the recipe key that set it)."""
    from toolkit.model.build import hf_config

    if world_size % ep:
        raise RecipeError(f"{key} {ep} does not divide the {world_size} ranks (expert parallel takes its ranks "
                          f"from dp_shard); use a world size that is a multiple of {ep}")
    config = hf_config(recipe.model)
    experts = num_experts(config)
    if not experts or not getattr(config, "base_model_ep_plan", None):
        raise RecipeError(f"{key} shards a mixture-of-experts model's experts; {config.model_type} is dense "
                          f"(no experts, no expert-parallel plan); drop {key}")
    if experts % ep:
        raise RecipeError(f"{key} {ep} does not divide the model's {experts} experts per layer; use an ep that "
                          f"divides {experts}")
    refuse_untested(recipe, layout="expert parallel", drop=key, lora_why="not tested together",
                    compile_why="its all-to-all reads split sizes back every layer")


def local_numel(model: nn.Module, *, ep: int, world_size: int, rank: int | None = None):
    """Per parameter, the elements a rank stores (toolkit plan): an experts weight's 1/ep of the experts on dim 0,
    FSDP2's dim-0 chunk of those over efsdp (padded); any other weight FSDP2's dim-0 chunk over the world.
    `rank` given: the rows that rank's shards hold unpadded, what its optimizer moments are made like."""
    import math

    from toolkit.memory.state_bytes import dim0_rows

    sharded = {name for name, style in plan_of(model).items() if style == STACKED}
    efsdp = world_size // ep

    def local(name: str, param: nn.Parameter) -> int:
        if param.dim() == 0:
            return 1
        rows, parts = (param.shape[0] // ep, efsdp) if name in sharded else (param.shape[0], world_size)
        if rank is None:
            return math.ceil(rows / parts) * math.prod(param.shape[1:])
        index = rank // ep if name in sharded else rank  # the expert mesh (efsdp, ep): ep the neighbours
        return dim0_rows(rows, parts, index) * math.prod(param.shape[1:])
    return local


def expert_units(model: nn.Module) -> tuple[set[int], list[int]]:
    """The ids of the experts weights the plan shards by expert, and each experts module's elements (its FSDP unit
    under expert parallel): toolkit plan's gathered bytes."""
    params = dict(model.named_parameters())
    stacked = [name for name, style in plan_of(model).items() if style == STACKED and name in params]
    per_module: dict[str, int] = {}
    for name in stacked:
        owner = name.rpartition(".")[0]
        per_module[owner] = per_module.get(owner, 0) + params[name].numel()
    return {id(params[name]) for name in stacked}, list(per_module.values())


def expert_mesh(env: DistEnv, ep: int):
    """The expert view of the world: (efsdp, ep, batch), ep the neighbouring ranks. `batch` (size 1) is the group
    of ranks holding the same batch, what transformers' dispatch slices a shared batch over (its tp); one rank here."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(env.device.type, (env.world_size // ep, ep, 1), mesh_dim_names=("efsdp", "ep", "batch"))


def apply_ep(model: nn.Module, mesh) -> list[nn.Module]:
    """Shard the experts over `mesh`'s ep dimension and route their tokens by all-to-all, in place (before FSDP:
    its expert units then shard what each rank keeps). Returns the experts modules, FSDP's first units."""
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    plan = plan_of(model)
    experts = [name for name, style in plan.items() if style == DISPATCH]
    if not experts:  # check_recipe refused dense configs; a model class without a plan lands here
        raise RecipeError(f"parallel.ep: {type(model).__name__} declares no expert-parallel plan; drop parallel.ep")
    apply_expert_parallelism(model, mesh["ep"], mesh["batch"], plan, ep_implementation=IMPLEMENTATION)
    modules = dict(model.named_modules())
    return [modules[name] for name in experts]


def shard_experts(experts: list[nn.Module], mesh, *, world_size: int, **shard) -> None:
    """fully_shard each experts module over efsdp (`shard`: the run's FSDP2 policy), its gradient divided by the
    world size: it holds the sum over every rank's tokens (see the module's docstring)."""
    efsdp = mesh["efsdp"]
    for module in experts:
        fully_shard(module, mesh=efsdp, **shard)
        module.set_gradient_divide_factor(float(world_size))  # type: ignore[operator]
        if efsdp.size() > 1:  # a factor other than the group's size would be a PREMUL_SUM: sum, divide locally
            module.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]

