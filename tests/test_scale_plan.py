"""`toolkit plan --hardware NAME --nodes N`: step time and memory per layout on a cluster, ranked; hardware profiles
as data; bad input in one line. The collective bytes each layout's prediction stands on are held to the counter
in test_comm_prediction.py; how close the step time comes to published runs is benchmarks/scale_prediction.py's."""

import json
from pathlib import Path

import pytest
import yaml

from conftest import REPO, run_cli

from toolkit.config.parallel import Degrees
from toolkit.cost import hardware
from toolkit.cost.collectives import Collective, wire_time_s
from toolkit.cost.step_time import link_bandwidth, ranks_per_node

RECIPE = str(REPO / "recipes" / "llama3-8b.yaml")
NAMES = ("h100-sxm", "h100-pcie", "h200", "a100-40gb", "a100-80gb", "b200", "l40s", "mi300x")


@pytest.fixture(scope="module")
def two_nodes():
    done = run_cli("plan", RECIPE, "--hardware", "h100-sxm", "--nodes", "2", "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def llama3_8b_params() -> int:
    """Llama 3 8B's parameters from its shape, by hand: embedding, head, and per block q, k, v, o, the gated MLP
    and two norms, then the final norm."""
    hidden, inter, layers, vocab, kv = 4096, 14336, 32, 128256, 8 * 128
    block = hidden * hidden * 2 + hidden * kv * 2 + 3 * hidden * inter + 2 * hidden
    return 2 * vocab * hidden + layers * block + hidden


def test_every_layout_of_two_h100_nodes_has_its_step_time_and_memory(two_nodes):
    keys = {"layout", "world_size", "step_time_s", "tokens_per_s_per_gpu", "mfu", "peak_bytes_per_gpu", "fits"}
    planned = [p for p in two_nodes if "refused" not in p]
    names = {p["layout"] for p in planned}
    assert {"ddp", "fsdp", "hsdp-2x8", "zero1", "zero2", "zero3", "fsdp-tp2-lossp", "fsdp-tp8-sp-lossp", "pp2-fsdp",
            "fsdp-cp2", "hsdp-2x8-cp2", "pp2-fsdp-tp2-lossp", "pp2-fsdp-tp4-lossp", "pp2-tp8-lossp",
            "pp2-fsdp-tp2-sp-lossp", "pp2-tp8-sp-lossp"} <= names
    by_name = {p["layout"]: p for p in planned}
    # a stage per node, tensor-parallel inside it: tp splits the stage's blocks, so a GPU holds less than the
    # pipeline's fsdp replicas of whole blocks; tp pays its activations' all-reduces inside the node
    assert by_name["pp2-fsdp-tp2-lossp"]["peak_bytes_per_gpu"] < by_name["pp2-fsdp"]["peak_bytes_per_gpu"]
    assert "all-reduce activations over tp (in node)" in {c["what"] for c in by_name["pp2-fsdp-tp2-lossp"]["costs"]}
    # and on sequence shards inside the stages: less held (the checkpointed block inputs 1/tp), the activations
    # reduce-scattered and gathered instead of all-reduced
    for tp in ("fsdp-tp2", "fsdp-tp4", "tp8"):
        assert by_name[f"pp2-{tp}-sp-lossp"]["peak_bytes_per_gpu"] < by_name[f"pp2-{tp}-lossp"]["peak_bytes_per_gpu"]
    assert "all-gather activation shards over tp (in node)" in {c["what"] for c in by_name["pp2-tp8-sp-lossp"]["costs"]}
    # HSDP × cp: each rank traces half of every sequence, so it holds less than HSDP alone
    assert by_name["hsdp-2x8-cp2"]["peak_bytes_per_gpu"] < by_name["hsdp-2x8"]["peak_bytes_per_gpu"]
    assert "all-gather keys and values over cp (in node)" in {c["what"] for c in by_name["hsdp-2x8-cp2"]["costs"]}
    # FSDP shards over dp_shard × cp flattened: its parameters' gathers are named so (they said "over dp_shard",
    # which fsdp-cp2's 8 × 2 ranks of cp pairs do not have alone)
    fsdp_cp = {c["what"] for c in by_name["fsdp-cp2"]["costs"]}
    assert {"all-gather parameters over dp_shard × cp (network)",
            "reduce-scatter gradients over dp_shard × cp (network)"} <= fsdp_cp, fsdp_cp
    # sequence parallelism holds less than the same TP without it
    assert by_name["fsdp-tp8-sp-lossp"]["peak_bytes_per_gpu"] < by_name["fsdp-tp8-lossp"]["peak_bytes_per_gpu"]
    for p in planned:
        assert keys <= set(p) and p["world_size"] == 16, p
        # tokens per step = 64 sequences of 8,192: what the step time and the tokens/s per GPU must multiply to
        assert p["tokens_per_s_per_gpu"] * p["step_time_s"] * 16 == pytest.approx(64 * 8192, rel=1e-9)
        assert 0 < p["mfu"] < 1
    # ddp holds the whole model per GPU: fp32 weights, gradients and both moments alone are 16 bytes a parameter
    assert by_name["ddp"]["peak_bytes_per_gpu"] > 16 * llama3_8b_params() > 80e9 and not by_name["ddp"]["fits"]
    assert by_name["fsdp"]["fits"] and by_name["fsdp"]["peak_bytes_per_gpu"] < 16 * llama3_8b_params() / 16 + 20e9


@pytest.mark.parametrize("recipe, overrides, degree, suffixes", [
    (RECIPE, (), 8, ["-lossp", "-sp-lossp"]),  # Llama 3 8B: Llama blocks, a causal LM, 128,256 tokens of vocabulary
    (RECIPE, ("train.tiled_loss=true",), 8, ["", "-sp"]),  # the tiles are the other answer to the logits' memory
    (RECIPE, ('model.config={"model_type": "llama", "vocab_size": 1001, "hidden_size": 64, "num_hidden_layers": 2, '
              '"num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 128}',), 2, ["", "-sp"]),
    (str(REPO / "recipes" / "minilm-sst.yaml"), (), 2, [""]),  # an encoder classifier: neither
])
def test_auto_tp_layouts_take_what_the_model_takes(recipe, overrides, degree, suffixes):
    """The loss over the split vocabulary where the model takes it; sequence parallelism beside plain TP where it
    takes that: each layout planned is one the run accepts."""
    from toolkit.config.files import load_recipe
    from toolkit.plan.predict import planned_model
    from toolkit.plan.scale import tp_options
    from toolkit.strategies import validate_strategy

    loaded = load_recipe(recipe, list(overrides))
    variants = tp_options(loaded, planned_model(loaded), tp=degree)
    assert [suffix for suffix, _ in variants] == suffixes
    for suffix, options in variants:
        assert ("strategy.sequence_parallel=true" in options) == ("-sp" in suffix)
        assert ("strategy.sequence_parallel=false" in options) == ("-sp" not in suffix)
        assert ("strategy.loss_parallel=false" in options) == ("lossp" not in suffix)
        assert ("strategy.loss_parallel=true" in options) == ("lossp" in suffix)
        layout = load_recipe(recipe, [*overrides, "strategy.name=fsdp", f"strategy.tp_degree={degree}", *options])
        validate_strategy(layout, world_size=2 * degree)


@pytest.mark.parametrize("recipe, per_node, degrees", [
    (RECIPE, 6, [2]),  # Llama 3 8B's 32 heads: 3 and 6 do not split them, 4 does not tile a node of 6
    (RECIPE, 8, [2, 4, 8]),
    (str(REPO / "recipes" / "minilm-sst.yaml"), 6, [2, 3, 6]),  # 12 heads, 384 wide, MLP 1536
])
def test_auto_tries_tp_inside_a_node_at_each_degree_that_tiles_it_and_the_model_takes(recipe, per_node, degrees):
    """TP inside a node: the degrees that divide its GPUs (tp 2 on nodes of 3 planned a layout that could not
    run, 3 was never tried), and only those the model's heads and widths split by."""
    import re

    from toolkit.config.files import load_recipe
    from toolkit.cost.step_time import Cluster
    from toolkit.plan.predict import planned_model
    from toolkit.plan.scale import auto_layouts

    loaded = load_recipe(recipe, [])
    cluster = Cluster(hardware=hardware.load("h100-sxm"), num_nodes=2, gpus_per_node=per_node)
    names = auto_layouts(loaded, planned_model(loaded), cluster)
    assert sorted({int(m.group(1)) for name in names if (m := re.search(r"-tp(\d+)", name))}) == degrees


def test_the_layouts_that_fit_come_first_fastest_first(two_nodes):
    fits = [p["fits"] for p in two_nodes]
    assert fits == sorted(fits, reverse=True)  # every layout that fits before any that does not
    speeds = [p["tokens_per_s_per_gpu"] for p in two_nodes if p["fits"]]
    assert speeds == sorted(speeds, reverse=True)


def test_the_table_ranks_and_says_why_the_first_wins():
    done = run_cli("plan", RECIPE, "--hardware", "a100-80gb", "--nodes", "1", "--layouts", "fsdp,zero3,fsdp-tp2")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0].split()[:3] == ["layout", "GPUs", "step"]
    winner = lines[1].split()[0]
    # the first over the second: by how much and the cost that differs most, or a tie within what the model tells
    assert any(line.startswith(f"{winner} over ") and "x the tokens/s; " in line or
               line.startswith(f"{winner} and ") and " tie (within 2 %" in line for line in lines), done.stdout
    assert "ms a step on" in done.stdout


def test_a_tie_names_what_each_side_pays_that_the_other_does_not(two_nodes):
    """zero2 beside pp2-fsdp: the line named pp2-fsdp's bubble only ("zero2 0 ms"), as if zero2 paid nothing;
    zero2's exposed all-reduce of the gradients is in the line too, and a second is written as seconds."""
    from toolkit.cost.step_time import Cost, StepTime
    from toolkit.plan.scale import Planned, reasons

    def planned(row):
        costs = [Cost(what=c["what"], seconds=c["seconds"], exposed_s=c["exposed_s"]) for c in row["costs"]]
        step = StepTime(step_time_s=row["step_time_s"], tokens_per_step=1, costs=costs, mfu=row["mfu"],
                        tokens_per_s_per_gpu=row["tokens_per_s_per_gpu"])
        return Planned(layout=row["layout"], world_size=16, step=step, peak_bytes_per_gpu=1, fits=True)

    rows = {row["layout"]: row for row in two_nodes}
    exposed = {name: {c["what"]: c["exposed_s"] for c in rows[name]["costs"]} for name in ("zero2", "pp2-fsdp")}
    gradients = "all-reduce gradients over dp_shard (network)"
    assert exposed["zero2"][gradients] > 0.1 and exposed["pp2-fsdp"]["pipeline bubble"] > 0.1  # each pays its own
    first, second = sorted(("zero2", "pp2-fsdp"), key=lambda n: -rows[n]["tokens_per_s_per_gpu"])
    [line] = reasons([planned(rows[first]), planned(rows[second])])
    assert "pipeline bubble" in line and gradients in line, line
    assert [ms for ms in line.split() if ms == "ms"] and " 0 ms" in line
    slow = planned({**rows["zero2"], "costs": [{"what": "x", "seconds": 1.5, "exposed_s": 1.5}]})
    assert "spends 1.5 s a step on x" in reasons([planned(rows["zero3"]), slow])[0]


def sequence_parallel_recipe(tmp_path: Path) -> str:
    """The 8B recipe with strategy.sequence_parallel: true in its file (not a --set, which a layout that sets it
    itself refuses: test_a_set_that_a_named_layout_or_arm_would_replace_is_refused)."""
    raw = yaml.safe_load(Path(RECIPE).read_text())
    raw["strategy"]["sequence_parallel"] = True
    raw["data"]["train"] = str(REPO / raw["data"]["train"])
    path = tmp_path / "llama3-8b-sp.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def test_layouts_names_what_auto_plans_and_each_tp_row_sets_sequence_parallelism_itself(tmp_path):
    """--layouts takes auto's names (fsdp-tp8-lossp, fsdp-tp8-sp-lossp), not only the compare arms'; a recipe that
    turns sequence parallelism on leaves the plain row plain: it holds more than the -sp row (a rank keeps every
    token of its norms' activations), where before it was planned as a second SP row."""
    recipe = sequence_parallel_recipe(tmp_path)
    done = run_cli("plan", recipe, "--hardware", "h100-sxm", "--nodes", "1", "--json", "--layouts",
                   "fsdp-tp8-lossp,fsdp-tp8-sp-lossp")
    assert done.returncode == 0, done.stderr[-3000:]
    by_name = {p["layout"]: p for p in json.loads(done.stdout)}
    assert set(by_name) == {"fsdp-tp8-lossp", "fsdp-tp8-sp-lossp"}
    plain, sequence = by_name["fsdp-tp8-lossp"], by_name["fsdp-tp8-sp-lossp"]
    assert sequence["peak_bytes_per_gpu"] < plain["peak_bytes_per_gpu"], (sequence, plain)
    def gathers(p):  # seconds on SP's gathers and scatters of the sequence's shards
        return sum(c["seconds"] for c in p["costs"] if "activation shards" in c["what"])
    assert gathers(plain) == 0 < gathers(sequence)
    # fsdp-tp2, also a compare arm's name, is auto's row here: plain, where the arm would keep the recipe's SP
    tiled = ("--set", "train.tiled_loss=true")  # no -lossp rows: auto's plain row is named fsdp-tp2
    done = run_cli("plan", recipe, "--hardware", "h100-sxm", "--nodes", "1", "--json", "--layouts",
                   "fsdp-tp2,fsdp-tp2-sp", *tiled)
    assert done.returncode == 0, done.stderr[-3000:]
    by_name = {p["layout"]: p for p in json.loads(done.stdout)}
    assert gathers(by_name["fsdp-tp2"]) == 0 < gathers(by_name["fsdp-tp2-sp"])


def test_a_set_that_a_named_layout_or_arm_would_replace_is_refused():
    """`--layouts pp-tp2-lossp --set strategy.tp_degree=8` planned pp 8 × tp 2 at 16 GPUs under that name (the
    arm's tp_degree=2 was applied after the --set), so a README line compared the wrong layouts. Now refused in one
    line naming NAME@KEY=VALUE, which plans the layout asked for: the arm at tp 8 is auto's pp2-tp8-lossp, row for
    row. A --set equal to the layout's own value is no clash."""
    done = run_cli("plan", RECIPE, "--hardware", "h100-sxm", "--nodes", "2", "--layouts", "pp-tp2-lossp",
                   "--set", "strategy.tp_degree=8")
    assert done.returncode == 2 and done.stdout == "", done
    [line] = done.stderr.strip().splitlines()
    assert "sets strategy.tp_degree=2 itself, which would replace --set strategy.tp_degree=8" in line, line
    assert "pp-tp2-lossp@strategy.tp_degree=8" in line, line
    done = run_cli("plan", RECIPE, "--hardware", "h100-sxm", "--nodes", "2", "--json", "--layouts",
                   "pp-tp2-lossp@strategy.tp_degree=8,pp2-tp8-lossp,pp-tp2-lossp")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {p["layout"]: p for p in json.loads(done.stdout)}
    arm, auto, pp8 = rows["pp-tp2-lossp@strategy.tp_degree=8"], rows["pp2-tp8-lossp"], rows["pp-tp2-lossp"]
    assert {**arm, "layout": None} == {**auto, "layout": None}
    assert pp8["step_time_s"] != arm["step_time_s"]  # tp 2: eight stages, not two
    done = run_cli("plan", RECIPE, "--hardware", "h100-sxm", "--nodes", "2", "--layouts", "fsdp-tp8-lossp",
                   "--set", "strategy.sequence_parallel=true")
    assert done.returncode == 2 and "fsdp-tp8-lossp@strategy.sequence_parallel=true" in done.stderr, done.stderr
    # a row whose strategy does not read the key (zero3's loss_parallel=false only lets a recipe's tp option pass
    # its check) is no clash: it plans without the option, and the tp row with it
    done = run_cli("plan", RECIPE, "--hardware", "h100-sxm", "--nodes", "1", "--json", "--layouts",
                   "zero3,fsdp-tp8-sp-lossp", "--set", "strategy.loss_parallel=true")
    assert done.returncode == 0 and {p["layout"] for p in json.loads(done.stdout)} == {"zero3", "fsdp-tp8-sp-lossp"}
    # auto plans the --set on the recipe's own row and says which keys its other rows set themselves
    done = run_cli("plan", RECIPE, "--hardware", "h100-sxm", "--nodes", "1", "--json", "--set",
                   "strategy.sequence_parallel=true")
    assert done.returncode == 0 and "--set strategy.sequence_parallel=true: planned on the recipe's own row" \
        in done.stderr, done.stderr


def test_compare_and_plan_refuse_a_set_an_arm_would_replace(tmp_path):
    """compare and plan (this machine) take arms the same way: `--strategies pp-tp2 --set strategy.tp_degree=4`
    would run tp 2 without a word; refused in one line, nothing written; the arm's own override wins over both."""
    out = tmp_path / "exp"
    done = run_cli("compare", RECIPE, "--strategies", "single,pp-tp2", "--set", "strategy.tp_degree=4",
                   "--output", str(out))
    assert done.returncode == 2 and not out.exists(), done
    [line] = done.stderr.strip().splitlines()
    assert "arm 'pp-tp2' sets strategy.tp_degree=2 itself, which would replace strategy.tp_degree=4" in line, line
    done = run_cli("plan", RECIPE, "--strategies", "ddp,pp-tp2", "--nproc", "4", "--set", "strategy.tp_degree=4")
    assert done.returncode == 2 and "pp-tp2@strategy.tp_degree=4" in done.stderr, done.stderr
    from toolkit.compare.experiment import arm_overrides
    assert arm_overrides("pp-tp2@strategy.tp_degree=4", common=["strategy.tp_degree=8"])[-1] == \
        "strategy.tp_degree=4"
    assert arm_overrides("pp-tp2", common=["strategy.tp_degree=2", "strategy.schedule=gpipe"]) == \
        ("strategy.name=pipeline", "strategy.tp_degree=2")


def test_options_set_for_one_strategy_leave_auto_s_other_layouts_planned_as_without_them(two_nodes):
    """A recipe set up for zero with offload, or for fsdp x tp with sequence parallelism, still gets every layout
    of auto planned: the rows of another strategy plan without the recipe's options for it (and say so), and
    equal the rows a recipe without them gets; the recipe's own layout (its parallel: degrees) is refused with
    them, as its run is."""
    plain = {p["layout"]: p for p in two_nodes}
    done = run_cli("plan", RECIPE, "--hardware", "h100-sxm", "--nodes", "2", "--json", "--set", "strategy.name=zero",
                   "--set", "strategy.offload_optimizer=true")
    assert done.returncode == 0, done.stderr[-3000:]
    zero = {p["layout"]: p for p in json.loads(done.stdout)}
    assert set(zero) == set(plain) and not [p for p in zero.values() if "refused" in p]
    for name, row in zero.items():
        if name.startswith("zero"):  # offloaded: the host's AdamW and the PCIe traffic cost time
            assert "without" not in row and row["step_time_s"] > plain[name]["step_time_s"], (row, plain[name])
        else:
            assert row["without"] == ["strategy.offload_optimizer=true"], row
            assert {k: v for k, v in row.items() if k != "without"} == plain[name]
    done = run_cli("plan", RECIPE, "--hardware", "h100-sxm", "--nodes", "2", "--set", "strategy.name=zero",
                   "--set", "strategy.offload_optimizer=true")
    assert "every layout but zero" in done.stdout and "without the recipe's strategy.offload_optimizer=true" \
        in done.stdout, done.stdout
    done = run_cli("plan", RECIPE, "--hardware", "h100-sxm", "--nodes", "2", "--json", "--set",
                   "strategy.sequence_parallel=true")
    assert done.returncode == 0, done.stderr[-3000:]
    sequence = {p["layout"]: p for p in json.loads(done.stdout)}
    for name in ("ddp", "fsdp", "hsdp-2x8", "zero1", "zero2", "zero3", "pp2-fsdp", "fsdp-cp2"):
        assert sequence[name] == plain[name], name  # the rows without TP set it off themselves: nothing dropped
    done = run_cli("plan", RECIPE, "--hardware", "h100-sxm", "--nodes", "2", "--json", "--set", "parallel.dp_shard=16",
                   "--set", "strategy.offload_optimizer=true")
    [own] = json.loads(done.stdout)
    assert done.returncode == 1 and "strategy.offload_optimizer applies to zero only" in own["refused"], own


def test_under_the_table_the_first_layout_under_each_activation_checkpointing_and_the_fastest_that_fits():
    """Each setting planned as its own --set plans it: none the fastest and the largest, full the slowest and the
    smallest; on 8 40 GB A100s only full fits, on 16 80 GB H100s none does, within the allocator's reserve, and
    selective with 10 % free."""
    import re

    lines = {}
    for hw, nodes in (("a100-40gb", "1"), ("h100-sxm", "2")):  # 8 and 16 GPUs
        done = run_cli("plan", RECIPE, "--hardware", hw, "--nodes", nodes, "--layouts", "zero3")
        assert done.returncode == 0, done.stderr[-3000:]
        lines[hw] = next(line for line in done.stdout.splitlines() if line.startswith("activation checkpointing for"))
    found = {mode: (int(speed.replace(",", "")), float(gb)) for mode, speed, gb in
             re.findall(r"(none|selective|full) ([\d,]+) tokens/s/GPU at ([\d.]+) GB", lines["a100-40gb"])}
    assert list(found) == ["none", "selective", "full"], lines["a100-40gb"]
    assert found["none"][0] > found["selective"][0] > found["full"][0]
    assert found["none"][1] > found["selective"][1] > found["full"][1]
    alone = run_cli("plan", RECIPE, "--hardware", "a100-40gb", "--nodes", "1", "--layouts", "zero3", "--json",
                    "--set", "train.activation_checkpointing=selective")
    [selective] = json.loads(alone.stdout)
    assert found["selective"] == (round(selective["tokens_per_s_per_gpu"]),
                                  round(selective["peak_bytes_per_gpu"] / 1e9, 1))
    assert "full 2," in lines["a100-40gb"] and "(the recipe's)" in lines["a100-40gb"]  # llama3-8b.yaml: true
    assert lines["a100-40gb"].endswith("the fastest that fits: full")
    assert "the fastest that fits: none (--set train.activation_checkpointing=false), within 10 %" in lines["h100-sxm"]
    assert lines["h100-sxm"].endswith("10 % free: selective (--set train.activation_checkpointing=selective)")


def test_a_ring_moves_what_the_algorithm_says():
    # 4 ranks all-reduce 1 GB: each rank's link carries 2 (n-1)/n of it, in 2 (n-1) latency steps
    reduce = Collective(op="allreduce_", payload_bytes=10 ** 9, calls=1, group="dp_shard", group_size=4,
                        phase="backward")
    assert wire_time_s(reduce, bandwidth_bytes_per_s=1e11, latency_s=1e-5) == pytest.approx(1.5e9 / 1e11 + 6e-5)
    gather = Collective(op="_allgather_base_", payload_bytes=10 ** 8, calls=2, group="dp_shard", group_size=4,
                        phase="forward")
    assert wire_time_s(gather, bandwidth_bytes_per_s=1e11, latency_s=0.0) == pytest.approx(3e8 / 1e11)


def test_a_replica_group_across_nodes_moves_through_one_nic_a_full_node_through_all():
    h100 = hardware.load("h100-sxm")
    hsdp = Degrees(dp_replicate=4, dp_shard=8)  # 4 nodes of 8: a shard group per node, replicas across
    assert ranks_per_node("dp_shard", 8, hsdp, 8) == 8 and ranks_per_node("dp_replicate", 4, hsdp, 8) == 1
    inside, _, where = link_bandwidth(h100, size=8, per_node=8, bus_efficiency=1.0)
    one_nic, _, across = link_bandwidth(h100, size=4, per_node=1, bus_efficiency=1.0)
    every_nic, _, _ = link_bandwidth(h100, size=32, per_node=8, bus_efficiency=1.0)
    assert (where, across) == ("in node", "network")
    assert inside == 450e9 and one_nic == 50e9 and every_nic == min(450e9, 8 * 50e9)


def test_the_shipped_profiles_are_the_datasheets_named():
    assert set(NAMES) <= set(hardware.known())
    for name in NAMES:
        profile = hardware.load(name)
        assert profile.peak("bf16") >= profile.peak("fp32") > 0 and profile.memory_bytes >= 40e9


def write_profile(path: Path, **changes) -> Path:
    raw = yaml.safe_load((REPO / "toolkit" / "cost" / "profiles" / "h100-sxm.yaml").read_text())
    for key, value in changes.items():
        section, _, field = key.partition(".")
        if value is None:
            (raw[section].pop(field) if field else raw.pop(section))
        elif field:
            raw[section][field] = value
        else:
            raw[section] = value
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.parametrize("args, words", [
    (("--hardware", "h900"), "no such profile; known: a100-40gb, a100-80gb"),
    (("--hardware", "h100-sxm", "--nodes", "0"), "--nodes 0: give 1 or more"),
    (("--hardware", "h100-sxm", "--layouts", "fsdp,warp"), "--layouts: unknown layout 'warp'; choose from auto, "
     "the layouts auto plans here (fsdp-tp2-lossp, fsdp-tp2-sp-lossp,"),
    (("--json",), "--json goes with --hardware"),
    (("--layouts", "auto"), "--layouts goes with --hardware"),  # its default's name too (before: ignored)
    (("--hardware", "h100-sxm", "--set", "parallel.dp_shard=4", "--set", "parallel.tp=2"),
     "parallel: dp_shard 4 × tp 2 = 8 ranks, but --nodes 2 × --gpus-per-node 8 = 16"),
])
def test_a_plan_mistake_is_one_line_exit_2(args, words):
    more = ("--nodes", "2") if "parallel.tp=2" in args else ()
    done = run_cli("plan", RECIPE, *args, *more)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert words in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


@pytest.mark.parametrize("changes, words", [
    ({"memory_bandwidth_bytes_per_s": None}, "key 'memory_bandwidth_bytes_per_s' is required"),
    ({"intra_node.bandwidth_bytes_per_s": 0}, "intra_node.bandwidth_bytes_per_s is 0.0; give a positive number"),
    ({"peak_flops_per_s.bf16": -1.0}, "peak_flops_per_s.bf16 is -1.0; give a positive number"),
    # read only where a layout runs (before: a traceback from the step-time model, or after a compare's arms ran)
    ({"measured": {"attention_flops_per_s": {"abc": 1e12}}},
     "measured.attention_flops_per_s has the key 'abc'; its keys are sizes, positive numbers"),
    ({"measured": {"bus_bandwidth_by_kind": {"all_reduce": {"-8": 1e9}}}},
     "measured.bus_bandwidth_by_kind.all_reduce has the key '-8'; its keys are sizes, positive numbers"),
    ({"measured": {"bus_bandwidth_by_kind": {"bogus": {"1024": 1e9}}}},
     "measured.bus_bandwidth_by_kind has 'bogus'; its kinds are all_gather, all_reduce, all_to_all,"),
    ({"measured": {"matmul_dtype": "int3"}}, "measured.matmul_dtype is 'int3'; give one of bf16, fp16, fp32, fp8"),
])
def test_a_bad_profile_file_is_one_line_exit_2(tmp_path, changes, words):
    profile = write_profile(tmp_path / "mine.yaml", **changes)
    done = run_cli("plan", RECIPE, "--hardware", str(profile))
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert words in done.stderr and str(profile) in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_calibrate_measures_this_cpu_into_a_profile_the_plan_reads(tmp_path):
    out = tmp_path / "cpu.yaml"
    done = run_cli("calibrate", str(REPO / "recipes" / "llama-tiny.yaml"), "--hardware", "cpu", "--nproc", "2",
                   "--output", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    profile = hardware.load(str(out))
    measured = profile.measured
    assert measured.num_ranks == 2 and measured.threads >= 1 and not profile.overlaps_communication
    # measured in a process of its own with the allocator a rank runs with (no page faults on each large tensor)
    assert profile.description.endswith("measured with host memory fast"), profile.description
    assert measured.matmul_flops_per_s > 1e8 and measured.memory_bandwidth_bytes_per_s > 1e8
    assert measured.bus_bandwidth_bytes_per_s > 1e6 and set(measured.attention_flops_per_s) == {"64", "256", "1024"}
    # the loss over llama-tiny's 30,522 logits a token: at least one fp32 read and write of each, at most 1 µs
    assert 8 / measured.memory_bandwidth_bytes_per_s < measured.loss_seconds_per_logit < 1e-6
    # an op's host time beside its arithmetic: microseconds (a llama-tiny block's: 15-19 µs here)
    assert 1e-6 < measured.seconds_per_op < 1e-3
    planned = run_cli("plan", str(REPO / "recipes" / "llama-tiny.yaml"), "--hardware", str(out), "--gpus-per-node", "2",
                      "--layouts", "ddp,fsdp", "--json")
    assert planned.returncode in (0, 1), planned.stderr[-2000:]
    assert {p["layout"] for p in json.loads(planned.stdout)} == {"ddp", "fsdp"}
    # a CPU rank's memory holds its process (torch, transformers, datasets: ~0.5 GiB), as the plan of this machine
    # counts it: the profile's plan left it out (ddp 0.49 GB against 0.96 GiB planned and 1.0 GiB measured)
    here = run_cli("plan", str(REPO / "recipes" / "llama-tiny.yaml"), "--strategies", "ddp,fsdp")
    assert here.returncode == 0, here.stderr[-2000:]
    peaks = {line.split()[0]: int(line.split()[-2]) * 2 ** 20 for line in here.stdout.splitlines()[1:3]}
    for layout in json.loads(planned.stdout):
        assert layout["peak_bytes_per_gpu"] == pytest.approx(peaks[layout["layout"]], rel=0.03), (layout, peaks)


def test_a_measuring_process_killed_is_one_line_exit_1_and_writes_no_profile(tmp_path):
    """The process measuring the compute rates killed, as the kernel's OOM killer would: one line naming what
    failed, no traceback, no profile file. A plain `python -m toolkit` (not the tests' forked ones), so that the
    measuring process is a child of the command's."""
    import os
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "cpu.yaml"
    command = subprocess.Popen([sys.executable, "-m", "toolkit", "calibrate", "--hardware", "cpu", "--nproc", "2",
                                "--output", str(out)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    killed, deadline = None, time.monotonic() + 120
    while killed is None and command.poll() is None and time.monotonic() < deadline:
        children = Path(f"/proc/{command.pid}/task/{command.pid}/children").read_text().split()
        for pid in children:
            try:
                if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(int(pid), signal.SIGKILL)
                    killed = pid
            except (FileNotFoundError, ProcessLookupError):
                pass
        time.sleep(0.05)
    _, stderr = command.communicate(timeout=300)
    assert killed is not None, f"no measuring process was seen: {stderr[-2000:]}"
    assert command.returncode == 1, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == (
        "toolkit: calibrate: measuring the CPU's compute rates failed: the process measuring them ended without a "
        "result (killed: out of memory?); nothing written"), stderr[-3000:]
    assert not out.exists()


def test_calibrating_a_gpu_profile_without_a_gpu_is_one_line_exit_2():
    done = run_cli("calibrate", "--hardware", "h100-sxm")
    assert done.returncode == 2 and "no GPU here to measure; use --hardware cpu" in done.stderr, done.stderr


def test_a_calibrate_output_it_cannot_write_is_one_line_before_measuring(tmp_path):
    """Checked before the measuring (before: a traceback from the rename, after it had measured for ~20 s)."""
    folder, file = tmp_path / "profiles", tmp_path / "notes.txt"
    folder.mkdir()
    file.write_text("x")
    for output, words in ((folder, f"--output {folder} is a folder; name the profile file to write"),
                          (file / "cpu.yaml", f"--output {file / 'cpu.yaml'}: {file} is a file, not a folder"),
                          # a name the file system refuses: an OSError from is_dir before
                          (tmp_path / ("a" * 300 + ".yaml"), "its file name is longer than the file system allows"),
                          (tmp_path / ("a" * 300) / "cpu.yaml", "File name too long; choose another --output")):
        done = run_cli("calibrate", "--hardware", "cpu", "--output", str(output))
        assert done.returncode == 2 and words in done.stderr, done.stderr
        # its one line: not after "[toolkit] calibrating the CPU ..." and the measuring
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "profiles"] and not any(folder.iterdir())


def test_context_parallel_holds_a_long_sequence_fsdp_alone_cannot():
    done = run_cli("plan", RECIPE, "--hardware", "h100-sxm", "--layouts", "fsdp,fsdp-cp2", "--json",
                   "--set", "data.max_length=32768", "--set", "model.config.max_position_embeddings=32768")
    assert done.returncode == 0, done.stderr[-3000:]
    planned = {p["layout"]: p for p in json.loads(done.stdout)}
    # each cp rank traces its half of every 32k sequence, beside the gathered keys and values it keeps
    assert planned["fsdp-cp2"]["fits"] and not planned["fsdp"]["fits"]
    assert planned["fsdp-cp2"]["peak_bytes_per_gpu"] < 0.75 * planned["fsdp"]["peak_bytes_per_gpu"]
    costs = {c["what"] for c in planned["fsdp-cp2"]["costs"]}
    assert "all-gather keys and values over cp (in node)" in costs


def test_a_model_that_names_no_blocks_is_counted_by_its_layer_stack():
    """DistilBERT declares no _no_split_modules, and a single arm takes no strategy.blocks: the FLOP count (and so
    compare's predicted step time) takes the class of its largest list of one class (before: the report of every
    compare of such a model stopped with "set strategy.blocks", which a single arm cannot set)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from toolkit.cost.flops import model_flops

    for layers in (1, 2):  # a list of one block is a stack too
        config = AutoConfig.for_model("distilbert", vocab_size=100, dim=32, hidden_dim=64, n_layers=layers, n_heads=2)
        model = AutoModelForSequenceClassification.from_config(config)
        assert not getattr(model, "_no_split_modules", None)
        # by hand, per block: q, k, v and the output projection (32 x 32 each), the MLP's two 32 x 64 matrices
        block = 4 * 32 * 32 + 2 * 32 * 64
        flops = model_flops(model, seq_len=16, checkpointing="none")
        assert flops.block_matmul == 6.0 * layers * block
        assert flops.attention == 12.0 * layers * 32 * 16


@pytest.mark.parametrize("layout, sets, data_shards, vocab_share", [
    ("ddp", ("strategy.name=ddp",), 16, 1),
    # each TP rank computes every logit of its data shard's tokens (the head is not split)
    ("fsdp-tp2", ("strategy.name=fsdp", "strategy.tp_degree=2"), 8, 1),
    # ... or its half of the vocabulary's, where loss_parallel splits the head
    ("fsdp-tp2-lossp", ("strategy.name=fsdp", "strategy.tp_degree=2", "strategy.loss_parallel=true"), 8, 2)])
def test_a_measured_loss_rate_costs_every_logit_a_rank_computes(layout, sets, data_shards, vocab_share):
    """A causal LM's loss passes over its logits (the fp32 copy, log-softmax and their gradients), memory-bound
    work a GEMM rate does not count: where calibrate measured seconds per logit (the CPU profile), each rank pays
    its tokens × the vocabulary of them; a datasheet profile (its fitted efficiency covers such work) and a
    classifier (no vocabulary of logits) pay none."""
    import dataclasses

    from toolkit.config.files import load_recipe
    from toolkit.config.parallel import resolve
    from toolkit.cost import step_time
    from toolkit.plan.predict import planned_model
    from toolkit.plan.scale import work_for_shapes

    recipe = resolve(load_recipe(RECIPE, list(sets)), world_size=16)
    model = planned_model(recipe)
    work = work_for_shapes(recipe, model, world_size=16, rank=15, shapes=None)
    h100 = hardware.load("h100-sxm")
    measured = dataclasses.replace(h100, measured=dataclasses.replace(h100.measured, loss_seconds_per_logit=2e-12))
    costs = {c.what: c for c in step_time.predict(model, work, step_time.Cluster(hardware=measured, num_nodes=2,
                                                                                  gpus_per_node=8)).costs}
    tokens = 64 * 8192 // data_shards  # the recipe's global batch of 64 sequences of 8,192 tokens, one shard's
    assert costs["loss over the logits"].exposed_s == pytest.approx(tokens * 128256 / vocab_share * 2e-12, rel=1e-12)
    plain = step_time.predict(model, work, step_time.Cluster(hardware=h100, num_nodes=2, gpus_per_node=8))
    assert "loss over the logits" not in {c.what for c in plain.costs}
    minilm = resolve(load_recipe(str(REPO / "recipes" / "minilm-sst.yaml"), []), world_size=2)
    classifier = planned_model(minilm)
    cpu = step_time.Cluster(hardware=measured, num_nodes=1, gpus_per_node=2)
    work = work_for_shapes(minilm, classifier, world_size=2, rank=1, shapes=None)
    assert "loss over the logits" not in {c.what for c in step_time.predict(classifier, work, cpu).costs}


def test_zero3s_host_time_per_call_is_charged_where_the_host_computes():
    """ZeRO-3's hooks spend host time around each gather and reduce-scatter (fetch, release, re-partition in
    Python): on a profile whose host also computes (a CPU: overlaps_communication false), each tensor its
    calls carry costs HOST_S_PER_TENSOR; ZeRO-2 and a GPU profile (the host runs ahead of the device) pay none."""
    import dataclasses

    from toolkit.config.files import load_recipe
    from toolkit.config.parallel import resolve
    from toolkit.cost import step_time
    from toolkit.plan.predict import planned_model
    from toolkit.plan.scale import work_for_shapes
    from toolkit.strategies.zero.collectives import HOST_S_PER_TENSOR

    h100 = hardware.load("h100-sxm")
    host_computes = dataclasses.replace(h100, overlaps_communication=False)

    def host_cost(stage: int, profile) -> float | None:
        recipe = resolve(load_recipe(str(REPO / "recipes" / "minilm-sst.yaml"),
                                     ["strategy.name=zero", f"strategy.stage={stage}"]), world_size=2)
        model = planned_model(recipe)
        work = work_for_shapes(recipe, model, world_size=2, rank=0, shapes=None)
        costs = step_time.predict(model, work, step_time.Cluster(hardware=profile, num_nodes=1,
                                                                  gpus_per_node=2)).costs
        return next((c.exposed_s for c in costs if c.what == "host time around the collectives"), None)

    recipe = load_recipe(str(REPO / "recipes" / "minilm-sst.yaml"), [])
    params = len(list(planned_model(recipe).parameters()))
    # one micro-batch of 16 a rank: each parameter gathered (before its forward, or once a step where it stays
    # whole) and each gradient reduce-scattered, whatever calls DeepSpeed's prefetch and buckets group them in
    assert host_cost(3, host_computes) == pytest.approx(2 * params * HOST_S_PER_TENSOR, rel=1e-12)
    assert host_cost(3, h100) is None
    assert host_cost(2, host_computes) is None


@pytest.mark.parametrize("gpus_per_node", [8, 1])  # the cp pair on NVLink, and on one NIC each
def test_a_ring_s_passes_hide_behind_the_attention_it_computes_but_each_layer_s_last_gradient_pass(gpus_per_node):
    """torch's ring (_templated_ring_attention and its backward) starts each pass of keys and values, and of their
    gradients, before it attends to the block the rank holds, and waits for it after; only the gradient pass after a
    layer's last block is waited for at once. Before, every pass was charged as exposed, as allgather's are."""
    import dataclasses

    from toolkit.config.files import load_recipe
    from toolkit.config.parallel import resolve
    from toolkit.cost import step_time
    from toolkit.plan.predict import planned_model
    from toolkit.plan.scale import work_for_shapes

    length = 32768
    recipe = resolve(load_recipe(RECIPE, ["strategy.name=fsdp", "strategy.cp_degree=2", "parallel.cp_method=ring",
                                          f"data.max_length={length}",
                                          f"model.config.max_position_embeddings={length}"]), world_size=8)
    model = planned_model(recipe)
    work = work_for_shapes(recipe, model, world_size=8, rank=0, shapes=None)
    h100 = hardware.load("h100-sxm")
    cluster = step_time.Cluster(hardware=h100, num_nodes=8 // gpus_per_node, gpus_per_node=gpus_per_node)
    costs = {c.what.split(" over ")[0]: c for c in step_time.predict(model, work, cluster).costs}
    ring = {c.what: c for c in work.collectives if c.what.endswith("to the next rank")}
    assert len(ring) == 3 and {c.overlap for c in ring.values()} == {"attention", "nothing"}
    # by hand: the rank's attention, fwd + bwd (12 · layers · hidden · length a token) and the recompute's forward
    # (activation checkpointing: 4/3), over its half of a data shard's tokens (64 sequences over 4 shards), at the
    # profile's fitted share of the bf16 peak
    attention_s = 64 * length / 4 / 2 * 12 * 32 * 4096 * length * 4 / 3 / (h100.peak("bf16") * h100.compute_efficiency)
    hidden = [costs[f"all-to-all {what}"] for what, c in ring.items() if c.overlap == "attention"]
    total = sum(c.seconds for c in hidden)
    first = sum(costs[f"all-to-all {what}"].seconds / c.calls for what, c in ring.items() if c.overlap == "attention")
    assert sum(c.exposed_s for c in hidden) == pytest.approx(min(total, max(total - attention_s, first)), rel=1e-9)
    last = costs["all-to-all each layer's last key and value gradients to the next rank"]
    assert last.exposed_s == last.seconds > 0
    if gpus_per_node == 8:  # NVLink: every pass but the first of each kind hides
        assert sum(c.exposed_s for c in hidden) == pytest.approx(first, rel=1e-9) and first < total
    # where the host's cores also compute (a CPU profile) nothing hides, as before
    cpu_like = step_time.Cluster(hardware=dataclasses.replace(h100, overlaps_communication=False),
                                 num_nodes=cluster.num_nodes, gpus_per_node=gpus_per_node)
    for cost in step_time.predict(model, work, cpu_like).costs:
        if cost.what.split(" over ")[0].endswith("to the next rank"):
            assert cost.exposed_s == cost.seconds


def test_a_precision_this_machines_accelerator_lacks_is_planned_for_the_cluster_s():
    """fp16 ZeRO-3 on H100s is a plan, although DeepSpeed's CPU accelerator here has no fp16: the accelerator check
    belongs to a run on this machine (train.checks.check_accelerator; test_cli_errors holds `validate` to it), not to
    the strategy's rules the cluster's plan applies (before: "--layouts zero3 at 16 GPUs: precision fp16 is not
    supported by DeepSpeed's cpu accelerator")."""
    done = run_cli("plan", RECIPE, "--hardware", "h100-sxm", "--nodes", "2", "--layouts", "zero3", "--json",
                   "--set", "precision=fp16")
    assert done.returncode == 0, done.stderr[-3000:]
    (zero3,) = json.loads(done.stdout)
    assert "refused" not in zero3 and zero3["layout"] == "zero3" and zero3["step_time_s"] > 0, zero3


def test_a_pipelines_planned_compute_is_its_busiest_rank_by_the_split():
    """The step time charges a pipeline's busiest rank as its split cuts it: the default split balances a tp rank's
    FLOPs, so the head's stage holds fewer blocks; the plan charged an even 1/pp of the blocks beside the whole head
    (Llama 3 8B at pp 2 × tp 8 without loss parallel: about 23 % too much compute). With the split given, each
    row's compute is the costlier of its two stages, by the FLOPs of a block and of the head (cost/flops.py): the
    first stage's blocks where it holds most (28 of 32), else the last stage's with the head."""
    from toolkit.config.files import load_recipe
    from toolkit.cost.flops import model_flops
    from toolkit.plan.predict import planned_model

    splits = (8, 16, 28)
    layouts = ",".join(f"pp-tp2@strategy.tp_degree=8@strategy.split=[{k}]" for k in splits)
    done = run_cli("plan", RECIPE, "--hardware", "h100-sxm", "--nodes", "2", "--json", "--layouts",
                   f"{layouts},pp-tp2@strategy.tp_degree=8")
    assert done.returncode == 0, done.stderr[-3000:]
    compute = {p["layout"]: next(c["seconds"] for c in p["costs"] if c["what"] == "compute")
               for p in json.loads(done.stdout)}
    flops = model_flops(planned_model(load_recipe(RECIPE)), seq_len=8192, checkpointing="full")
    block = (flops.block_matmul + flops.attention + flops.recompute) / 32 / 8  # a tp rank's share of one block

    def busiest(first: int) -> float:
        return max(first * block, (32 - first) * block + flops.head_matmul)
    seconds = {k: compute[f"pp-tp2@strategy.tp_degree=8@strategy.split=[{k}]"] for k in splits}
    assert busiest(28) == 28 * block and busiest(8) > busiest(16)  # both stages' sides are checked
    for k in splits:
        assert seconds[k] / seconds[16] == pytest.approx(busiest(k) / busiest(16), rel=1e-9), k
    # the default split is the one of these blocks that minimises the busiest rank
    default = compute["pp-tp2@strategy.tp_degree=8"]
    best = min(busiest(k) for k in range(1, 32))
    assert default / seconds[16] == pytest.approx(best / busiest(16), rel=1e-9)
    assert default < seconds[16]


@pytest.mark.parametrize("num_ranks, threads, cores, world, share", [
    (2, 1, None, 1, 2.0),   # measured at 2 ranks of a thread on 2 cores: one process computes on both
    (2, 1, None, 2, 1.0),   # as measured
    (1, 2, None, 2, 0.5),   # measured alone on 2 cores: each of 2 ranks gets one
    (4, 1, 0.5, 1, 4.0),    # 4 ranks time-shared 2 cores (half a core each): one process gets both
    (4, 1, 0.5, 4, 1.0)])
def test_a_cpu_profile_plans_each_rank_on_its_share_of_the_cores_it_was_measured_on(num_ranks, threads, cores,
                                                                                      world, share):
    """plan --hardware with a CPU profile planned every layout at the profile's own per-rank rate: single, which
    computes on all the cores, at one thread's (0.87 s a step against 0.39-0.44 s measured, from a 2-rank profile).
    `share`: the rank's compute rate over the measured one, counted here from the machine's cores."""
    import dataclasses

    from toolkit.plan.scale import at_ranks

    h100 = hardware.load("h100-sxm")
    measured = hardware.Measured(matmul_flops_per_s=1e10, num_ranks=num_ranks, threads=threads, cores=cores,
                                 loss_seconds_per_logit=1e-9, attention_flops_per_s={"64": 2e9})
    profile = dataclasses.replace(h100, measured=measured)
    planned = at_ranks(profile, world)
    assert planned.measured.matmul_flops_per_s == pytest.approx(1e10 * share)
    assert planned.measured.attention_flops_per_s["64"] == pytest.approx(2e9 * share)
    assert planned.measured.loss_seconds_per_logit == pytest.approx(1e-9 / share)
