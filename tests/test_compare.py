"""`toolkit compare`: a real 2-process experiment, its verdicts, memory ratios, failure/resume and report."""

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from conftest import run_cli, write_recipe


@pytest.fixture(scope="module")
def experiment(tmp_path_factory, tiny_tied_llama_dir):
    # tied input/output embeddings: each strategy gathers the shared weight its own way, the exports must agree;
    # pp-1f1b holds the tied weight on both stages (embedding on the first, head on the last). Tensor parallel is
    # left out here for the suite's time: tests/test_tensor_parallel.py checks tp and fsdp's tp_degree against
    # single (2-D at 4 ranks, and its activation all-reduces per step), tests/test_compare_inputs.py a tp arm's
    # batch split in compare
    root = tmp_path_factory.mktemp("compare")
    recipe = write_recipe(root / "recipe.yaml", model_dir=tiny_tied_llama_dir, output_dir=root / "unused",
                          batch={"micro_batch_size": 4, "grad_accum_steps": 1})
    out = root / "exp"
    # each arm also writes its TensorBoard run (tests/test_tracking.py checks a run's values; here, the overlay)
    result = run_cli("compare", str(recipe), "--strategies", "single,ddp,fsdp,zero3,pp-1f1b",
                     "--nproc", "2", "--steps", "5", "--output", str(out),  # (--set output_dir=... works as well: below)
                     "--set", "train.report_to=tensorboard")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out, json.loads((out / "results.json").read_text()), result.stdout


def _arms(results):
    return {a["arm"]: a for a in results["arms"]}


def test_fp32_strategies_are_all_equivalent(experiment):
    _, results, stdout = experiment
    arms = _arms(results)
    assert arms["single"]["verdict"] == "reference"
    for name in ("ddp", "fsdp", "zero3", "pp-1f1b"):
        assert arms[name]["verdict"] == "equivalent", (name, arms[name])
    # the terminal ends with the verdict table and the recommendation, every line of it within 120 characters
    end = stdout[stdout.index("\narm "):stdout.index("[compare] report:")].strip().splitlines()
    assert end[0].split()[:4] == ["arm", "world", "precision", "verdict"] and "tokens/s" in end[0]
    assert [line.split()[0] for line in end[2:7]] == ["single", "ddp", "fsdp", "zero3", "pp-1f1b"]
    assert all(" equivalent " in line for line in end[3:7]), end
    assert end[end.index("recommendation:") + 1].startswith("- fastest equivalent arm:")
    assert max(len(line) for line in end) <= 120, end


def test_sharded_arms_hold_half_the_model_states_of_ddp(experiment):
    arms = _arms(experiment[1])
    ddp = arms["ddp"]["model_state_bytes_per_rank"]
    assert len(ddp) == 2
    for rank_bytes in arms["fsdp"]["model_state_bytes_per_rank"]:
        assert rank_bytes / ddp[0] == pytest.approx(0.5, rel=0.10), ("fsdp", rank_bytes, ddp[0])
    # ZeRO-3 partitions params, grads and Adam moments 1/N like FSDP, but DeepSpeed also keeps an fp32
    # master copy of its partition even when the model itself is fp32 (FSDP updates the params in place):
    # per rank 4N/2 params + 4N/2 grads + 8N/2 moments + 4N/2 masters = 10N vs DDP's 16N, i.e. 0.625.
    # So: each partitioned state is half of DDP's, and the optimizer holds moments/2 + one master partition.
    ddp_detail = arms["ddp"]["model_state_detail_per_rank"][0]
    for detail in arms["zero3"]["model_state_detail_per_rank"]:
        assert detail["params_bytes"] / ddp_detail["params_bytes"] == pytest.approx(0.5, rel=0.10)
        assert detail["grads_bytes"] / ddp_detail["grads_bytes"] == pytest.approx(0.5, rel=0.10)
        expected_optim = ddp_detail["optim_bytes"] / 2 + ddp_detail["params_bytes"] / 2
        assert detail["optim_bytes"] == pytest.approx(expected_optim, rel=0.10)
    for rank_bytes in arms["zero3"]["model_state_bytes_per_rank"]:
        assert rank_bytes / ddp[0] == pytest.approx(10 / 16, rel=0.10)


def test_measurements_are_present(experiment):
    for arm in experiment[1]["arms"]:
        assert arm["tokens_per_s"] > 0 and arm["samples_per_s"] > 0
        assert arm["step_time_p10_s"] <= arm["step_time_s"] <= arm["step_time_p90_s"]
        assert arm["num_timed_steps"] == 3  # of 5: step 1 warms up, step 3 counts collectives
        assert 0 < arm["mfu"] < 1 and "measured" in arm["peak_source"]
        assert all(b > 0 for b in arm["peak_mem_bytes_per_rank"])
        assert arm["final_eval_loss"] is not None and len(arm["losses"]) == 5
        # toolkit plan's prediction, made by the run before setup, beside what it measured
        assert arm["predicted_model_state_bytes_per_rank"] == arm["model_state_bytes_per_rank"], arm["arm"]
        assert arm["model_state_prediction_error"] == 0 and arm["peak_prediction_error"] is not None
    # a pipeline's stages differ: each rank's peak against its own prediction, the worse one reported
    pipeline = next(arm for arm in experiment[1]["arms"] if arm["arm"] == "pp-1f1b")
    measured, predicted = pipeline["peak_mem_bytes_per_rank"], pipeline["predicted_peak_bytes_per_rank"]
    assert len(set(predicted)) == 2
    assert pipeline["peak_prediction_error"] == max(((m - p) / p for m, p in zip(measured, predicted)), key=abs)
    memory = (experiment[0] / "report.md").read_text().split("## Memory: predicted and measured", 1)[1]
    assert "- zero3: model states measured" in memory and "(error 0.00 %)" in memory
    assert f"peak measured {measured[0] / 2 ** 20:.0f}/{measured[1] / 2 ** 20:.0f} vs predicted " \
           f"{predicted[0] / 2 ** 20:.0f}/{predicted[1] / 2 ** 20:.0f} MiB/rank" in memory


def test_the_peak_is_also_predicted_at_the_longest_micro_batch_a_run_trained_on(experiment):
    """Each micro-batch is padded to its longest sample, so a run of short samples never reaches the plan's peak at
    data.max_length: each rank records the longest padded length it trained on (at least its counted step's, at
    most max_length), and compare predicts each rank's peak again at it (a pipeline's: rounded up to the multiple
    of 8 its step is padded to), below the plan's, beside what the run measured."""
    out, results, _ = experiment
    shorter = 0
    for arm in results["arms"]:
        run = json.loads((out / arm["arm"] / "run.json").read_text())
        max_length = yaml.safe_load((out / arm["arm"] / "recipe.yaml").read_text())["data"]["max_length"]
        counted = run["comm_per_step"]["micro_batch_shapes_per_rank"]
        tokens = [peak["longest_micro_batch_tokens"] for peak in run["peak_memory"]]
        for rank, longest in enumerate(tokens):
            assert max(length for _, length in counted[rank]) <= longest <= max_length
        if arm["arm"] == "pp-1f1b":
            tokens = [min(max_length, -(-t // 8) * 8) for t in tokens]
        if min(tokens) == max_length:
            assert "predicted_peak_bytes_per_rank_at_longest" not in arm
            continue
        shorter += 1
        assert arm["longest_micro_batch_tokens_per_rank"] == tokens
        at_longest = arm["predicted_peak_bytes_per_rank_at_longest"]
        for rank, (at, plan) in enumerate(zip(at_longest, arm["predicted_peak_bytes_per_rank"], strict=True)):
            assert at < plan if tokens[rank] < max_length else at == plan, (arm["arm"], rank)
        memory = (out / "report.md").read_text().split("## Memory: predicted and measured", 1)[1]
        assert (f"at each rank's longest micro-batch, {'/'.join(map(str, tokens))} tokens padded, "
                f"{'/'.join(f'{b / 2 ** 20:.0f}' for b in at_longest)} MiB/rank") in memory
    assert shorter  # the review texts are shorter than the recipe's max_length


def test_communication_per_step_is_counted_from_the_collectives(experiment):
    out, results, _ = experiment
    arms = _arms(results)
    num_params = json.loads((out / "ddp" / "run.json").read_text())["num_params"]
    grad_bytes = 4 * num_params  # fp32: one gradient of every parameter (the tied embedding once)
    loop_bytes = 4 * 8  # the loop's own all-reduces per step: 3 float64 counts + the float64 loss sum
    assert arms["single"]["comm"]["total_bytes"] == 0  # one process: nothing to communicate
    ddp = arms["ddp"]["comm"]
    assert ddp["step"] == 3
    # DDP all-reduces every gradient once, in buckets; rotary inv_freq is a buffer DDP broadcasts each forward
    assert ddp["bytes_by_op"]["allreduce_"] == grad_bytes + loop_bytes
    assert set(ddp["bytes_by_op"]) <= {"allreduce_", "broadcast_"} and ddp["bytes_by_op"].get("broadcast_", 0) < 1024
    for name in ("fsdp", "zero3"):
        ops = arms[name]["comm"]["bytes_by_op"]
        # each rank reduce-scatters every full gradient (FSDP2 pads shards to equal size, hence <=1% slack)
        assert grad_bytes <= ops["_reduce_scatter_base_"] <= grad_bytes * 1.01, (name, ops)
        # and all-gathers from its own half of the parameters (at least once per step)
        assert ops["_allgather_base_"] >= grad_bytes / 2 * 0.99, (name, ops)
    section = (out / "report.md").read_text().split("## Communication per step", 1)[1].split("##", 1)[0]
    mib, calls = ddp["bytes_by_op"]["allreduce_"] / 2 ** 20, ddp["calls_by_op"]["allreduce_"]
    assert re.search(rf"- ddp \(step 3, rank 0\): .*allreduce_ {mib:.2f} MiB in {calls} call\(s\)", section), section
    # the counted step is left out of the throughput medians (its per-op hook costs time)
    metrics = [json.loads(l) for l in (out / "ddp" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "comm_bytes" in m] == [3]
    assert "Communication per step" in (out / "report.md").read_text()


def test_pipeline_arm_shows_its_bubble_and_stage_traffic(experiment):
    out, results, stdout = experiment
    pipeline = _arms(results)["pp-1f1b"]["pipeline"]
    # global batch 8 on one data-parallel replica of micro 4: m = 2 micro-batches through p = 2 stages
    assert pipeline["stages_per_rank"] == [[0], [1]]
    assert pipeline["bubble_theory"] == pytest.approx((2 - 1) / (2 + 2 - 1))
    assert all(0.0 <= b < 1.0 for b in pipeline["bubble_measured_per_rank"])
    assert len(pipeline["peak_mem_bytes_per_rank"]) == 2 and all(b > 0 for b in pipeline["peak_mem_bytes_per_rank"])
    # one stage boundary: each micro-batch's hidden states (4 × length × 32 fp32) go forward, their gradient
    # comes back; nothing else crosses it. length: the counted step's longest sample rounded up to 8
    shapes = json.loads((out / "pp-1f1b" / "run.json").read_text())["comm_per_step"]["micro_batch_shapes_per_rank"][0]
    length = -(-max(n for _, n in shapes) // 8) * 8
    assert pipeline["p2p_send_bytes_per_step"] == 2 * 2 * (4 * length * 32 * 4)
    report = (out / "report.md").read_text()
    section = report.split("## Pipeline stages", 1)[1].split("##", 1)[0]
    assert "pp-1f1b: rank 0 stage 0: idle " in section and "theoretical bubble 0.33" in section
    assert f"{2 * 2 * 4 * length * 32 * 4 / 2 ** 20:.2f} MiB sent between stages per step" in section
    measurements = report.split("## All measurements", 1)[1].split("\n## ", 1)[0]  # the full table: not the console's
    assert re.search(r"\| pp-1f1b \|.*\| \d\.\d\d \(theory 0\.33\) \|", measurements), measurements
    assert "(theory 0.33)" not in stdout and "id='pipeline'" in (out / "report.html").read_text()


def test_report_files_exist_and_html_renders(experiment, tmp_path):
    out, _, _ = experiment
    for name in ("report.md", "report.html", "results.json", "curves.png", "memory.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0
    html = (out / "report.html").read_text()
    assert "id='summary'" in html and "data:image/png;base64," in html and "id='audit'" in html
    chromium = shutil.which("chromium")
    assert chromium, "Debian package chromium is required for this test (make test installs it)"
    shot = tmp_path / "shot.png"
    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                    "--disable-background-networking", "--disable-component-update", "--disable-sync",
                    f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={shot}", "--window-size=1200,1600",
                    f"file://{out / 'report.html'}"], check=True, capture_output=True, timeout=120)
    from PIL import Image

    image = Image.open(shot).convert("L")
    lo, hi = image.getextrema()
    assert hi - lo > 100  # not blank: dark text and plots on a light page
    grey_levels = sum(1 for count in image.histogram() if count)
    assert grey_levels > 20


def test_planted_divergence_and_failed_arm_then_resume(tmp_path, tiny_llama_dir):
    recipe = write_recipe(tmp_path / "recipe.yaml", model_dir=tiny_llama_dir, output_dir=tmp_path / "unused",
                          train={"eval_every": None})
    out = tmp_path / "exp"
    args = ("compare", str(recipe), "--strategies",
            "single,single@optim.lr=0.002,single@data.max_length=1", "--nproc", "2", "--steps", "5",
            "--set", f"output_dir={out}")
    first = run_cli(*args)
    assert first.returncode == 1  # an arm failed: the command says so, the report is still written
    arms = _arms(json.loads((out / "results.json").read_text()))
    diverged = arms["single@optim.lr=0.002"]
    # step 1's loss and grad norm come before the first update; the first update uses the other lr
    assert diverged["verdict"] == "diverged at step 2"
    assert any(d.startswith("optim.lr: 0.002 vs 0.001") for d in diverged["differences"])
    # an arm whose own override its launch refuses (compare checks the data the arms share, and each arm's
    # strategy and batch, before any arm runs; a run that fails while it runs is recorded alike)
    failed = arms["single@data.max_length=1"]
    assert failed["status"] == "failed" and "data.max_length 1 leaves no room for text" in failed["error"], failed
    why = (out / "report.md").read_text().split("## Why arms differ", 1)[1].split("##", 1)[0]
    assert "**single@data.max_length=1** failed: " in why  # the table and this section agree
    assert "- **single@optim.lr=0.002**\n  - `optim.lr: 0.001 → 0.002`\n" in (out / "report.md").read_text()

    # a re-run runs the failed arm again, and only it (an arm damaged or never run is run again too:
    # tests/test_compare_inputs.py)
    second = run_cli(*args)
    assert "single: already completed, skipped" in second.stdout
    assert "single@optim.lr=0.002: already completed, skipped" in second.stdout
    assert "single@data.max_length=1: failed" in second.stdout


def test_tensorboard_overlays_one_run_per_arm(experiment):
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    out, results, stdout = experiment
    arms = [a["arm"] for a in results["arms"]]
    boards = EventMultiplexer().AddRunsFromDirectory(str(out / "tensorboard"))  # as `tensorboard --logdir` does
    boards.Reload()
    assert sorted(boards.Runs()) == sorted(arms)
    for arm in arms:
        assert len(list((out / "tensorboard" / arm).glob("events.out.tfevents.*"))) == 1, arm  # rank 0 only
        want = [json.loads(line)["loss"] for line in (out / arm / "metrics.jsonl").read_text().splitlines()]
        got = [e.value for e in boards.Scalars(arm, "loss")]
        assert got == pytest.approx(want, rel=2**-23), arm  # float32 in the event files
        assert not (out / arm / "tensorboard").exists()  # the arm's run is in the experiment folder only
    assert f"tensorboard --logdir {out / 'tensorboard'}" in stdout


def test_report_rerenders_from_saved_runs(experiment):
    out, results, _ = experiment
    (out / "report.html").unlink()
    result = run_cli("report", str(out))
    assert result.returncode == 0 and (out / "report.html").is_file()
    assert json.loads((out / "results.json").read_text())["arms"][1]["verdict"] == results["arms"][1]["verdict"]


@pytest.fixture(scope="module")
def bert_experiment(tmp_path_factory, tiny_bert_dir):
    """A BERT classifier (attention key biases: an exact gradient of zero) under fsdp (ddp on the same classifier
    is checked against single in tests/test_equivalence.py; here it would add a launch and no new path through
    the verdict), plus an arm that really differs: weight decay 0.5 instead of 0.01. AdamW's decay moves a weight
    w by lr·Δwd·|w| a step; over the 5 steps' lrs (warm-up 2, then cosine from 1e-3: they sum to ~2.8e-3) that is
    ~1.4e-3·|w| more, outside the 1e-5 + 1e-5·|w| tolerance (and the rounding reference's widened bounds, a few
    1e-5 at most) wherever |w| > ~0.05: thousands of the word embedding's 1M elements (std 0.02), so the verdict
    must see it in the final weights. (Decay 0.05 moved them ~1.1e-4·|w|: at |w| ≤ 0.1 a hair from the bound, and
    the rounding reference's bounds took it in.)"""
    root = tmp_path_factory.mktemp("compare-bert")
    recipe = write_recipe(root / "recipe.yaml", model_dir=tiny_bert_dir, task="sequence-classification",
                          output_dir=root / "unused", batch={"micro_batch_size": 4, "grad_accum_steps": 1},
                          train={"eval_every": None})
    out = root / "exp"
    result = run_cli("compare", str(recipe), "--strategies", "single,fsdp,single@optim.weight_decay=0.5",
                     "--nproc", "2", "--steps", "5", "--set", f"output_dir={out}")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out, json.loads((out / "results.json").read_text())


def test_noise_driven_weights_are_exactly_the_attention_key_biases(bert_experiment):
    # judged from the reference's own gradients, not from names: what it finds must be what the maths says
    out, results = bert_experiment
    scale = json.loads((out / "single" / "run.json").read_text())["gradient_scale"]
    from toolkit.compare.verdict import noise_driven_tensors

    found = noise_driven_tensors({"gradient_scale": scale})
    keys = {name for name in scale["max_abs_over_norm"] if name.endswith("attention.self.key.bias")}
    assert len(keys) == 2 and found == keys
    arms = _arms(results)
    assert arms["fsdp"]["verdict"] == "equivalent", arms["fsdp"].get("differences")
    assert arms["fsdp"]["noise_note"].startswith("noise-driven (gradient ≈ 0 by construction")
    # the report names each once, under its own heading, with the arms that moved it and how far; not as a reason
    # why arms differ
    report = (out / "report.md").read_text()
    section = report.split("## Not judged: weights moved by rounding alone\n", 1)[1].split("\n## ", 1)[0]
    for key in keys:
        assert report.count(key) == 1 and re.search(rf"- {re.escape(key)}: fsdp (unchanged|\|Δ\| \S+), "
                                                    rf"single@optim.weight_decay=0.5 (unchanged|\|Δ\| \S+)", section)
    assert "key.bias" not in report.split("## Why arms differ", 1)[1].split("\n## ", 1)[0] and "up to 0" not in report


def test_a_real_setting_difference_diverges_and_is_named(bert_experiment):
    arms = _arms(bert_experiment[1])
    decayed = arms["single@optim.weight_decay=0.5"]
    assert decayed["verdict"].startswith("diverged"), decayed
    assert "optim.weight_decay: 0.5 vs 0.01" in decayed["differences"]
    report = (bert_experiment[0] / "report.md").read_text()
    assert "single@optim.weight_decay=0.5** (diverged" in report and "every arm matches" not in report
    assert "not recommended: diverged" in report


def test_weights_moved_outside_tolerance_diverge_naming_the_tensor(bert_experiment, tmp_path):
    from safetensors.torch import load_file, save_file

    out, results = bert_experiment
    copy = tmp_path / "exp"
    shutil.copytree(out, copy)
    path = copy / "fsdp" / "model" / "model.safetensors"
    weights = load_file(str(path))
    name = "bert.encoder.layer.0.attention.self.query.weight"  # a gradient-carrying tensor
    element = weights[name].view(-1)
    element[7] += 10 * (1e-5 + 1e-5 * abs(float(element[7])))  # 10× the tolerance, losses untouched
    save_file(weights, str(path))
    result = run_cli("report", str(copy))
    assert result.returncode == 0, result.stderr[-3000:]
    arm = _arms(json.loads((copy / "results.json").read_text()))["fsdp"]
    assert arm["verdict"] == "diverged in final weights"
    assert arm["differences"][0].startswith(f"final weights: {name}: 1 of 1024 elements outside |Δ| ≤ 1e-05")
    assert f"fsdp** (diverged in final weights) vs single: final weights: {name}" in (copy / "report.md").read_text()


def test_report_opens_with_the_verdicts_and_a_recommendation(experiment):
    out, results, stdout = experiment
    report = (out / "report.md").read_text()
    top, advice = report.split("\n## Recommendation\n", 1)
    # the narrow verdict table before it: one row per arm
    assert "| arm | world | precision | verdict | tokens/s | × ref | peak MiB/rank | final loss |" in top
    assert all(f"| {a['arm']} | {a['world_size']} | fp32 | {a['verdict']} | " in top for a in results["arms"])
    advice = advice.split("\n## ", 1)[0]
    # 5 steps time 3 (step 1 warms up, step 3 counts collectives): too few to name a fastest arm
    assert re.search(r"fastest equivalent arm: not told apart: \S+ has the highest median \(\d+ tokens/s, "
                     r"\d\.\d\d× the reference\), but its difference to \S+ is not measured enough \(\S+ timed "
                     r"over 3 steady step\(s\), \S+ over 3; fewer than 5 each: run --steps 7 or more\)", advice), advice
    assert "least memory per rank: **" in advice
    # FSDP holds 1/2 of the model states at 2 ranks (a few buffers are not sharded)
    assert re.search(r"fsdp: -(4[5-9]|5[0-5]) % model-state memory per rank vs ddp, \d\.\d\d× its tokens/s", advice)
    assert "least memory per rank: " in stdout and "fsdp: -" in stdout  # the console prints it too
    # the details after; each arm's recipe as its changes, the reference's whole recipe at the end
    assert report.index("\n## Recommendation") < report.index("\n## All measurements") < report.index(
        "\n## Why arms differ") < report.index("\n## Recipes: what each arm changes from the reference")
    assert report.rindex("\n## ") == report.index("\n## Appendix: the reference arm's resolved recipe (single)")
    changes = report.split("## Recipes: what each arm changes from the reference", 1)[1].split("\n## ", 1)[0]
    assert "- **fsdp**\n  - `strategy.name: single → fsdp`\n" in changes and "model.config" not in changes
    assert report.count("```yaml\nmodel:\n") == 1  # one whole recipe, the reference's, in the appendix
    assert report.index("```yaml\nmodel:\n") > report.index("\n## Appendix")


def test_each_arm_shows_its_predicted_step_time_from_this_machines_profile(experiment, tmp_path):
    out, results, stdout = experiment
    profile = yaml.safe_load((out / "hardware.yaml").read_text())  # measured once the arms were done
    assert profile["measured"]["num_ranks"] == 2 and profile["overlaps_communication"] is False
    for arm in results["arms"]:
        assert arm["predicted_step_time_s"] > 0, arm["arm"]
        assert arm["prediction_error"] == pytest.approx(arm["predicted_step_time_s"] / arm["step_time_s"] - 1)
    section = (out / "report.md").read_text().split("## Step time: predicted and measured", 1)[1].split("##", 1)[0]
    assert re.search(r"- fsdp: measured [\d,]+ ms \(p10-p90 [\d,]+-[\d,]+\), predicted [\d,]+ ms \([+-]\d+ %, "
                     r"(below its p10|above its p90|within its p10-p90)\); predicted: ", section), section
    # each arm lists its prediction's three largest parts, largest first; which they are depends on this machine's
    # measured matmul and gloo speeds (fsdp's all-gather and the loss can outweigh its compute), so the order is
    # checked, and compute's place is checked below on profiles made slower and faster
    for arm in results["arms"]:
        parts = arm["predicted_largest"]
        assert 1 <= len(parts) <= 3 and f"- {arm['arm']}: measured " in section, arm
        assert f"; predicted: {', '.join(parts)}\n" in section + "\n", (arm, section)
        shares = [int(re.fullmatch(r".+ (\d+) %", part).group(1)) for part in parts]
        assert shares == sorted(shares, reverse=True) and sum(shares) <= 101, parts  # each share rounded
    # where each prediction falls against its arm's own spread of timed steps, as the numbers say
    for arm in results["arms"]:
        low, high, predicted = arm["step_time_p10_s"], arm["step_time_p90_s"], arm["predicted_step_time_s"]
        where = "below its p10" if predicted < low else "above its p90" if predicted > high else "within its p10-p90"
        assert re.search(rf"- {re.escape(arm['arm'])}: measured .*%, {where}\); predicted", section), (arm, section)
    assert "step time, measured and as toolkit plan predicts it on cpu: this machine's CPU" in stdout
    # the prediction reads the profile: a machine whose matmuls and attention run 4x faster predicts less time;
    # one where they run 100x slower predicts compute as every arm's largest part
    faster, slower = _reported_with_compute_rate(out, tmp_path / "faster", 4), \
        _reported_with_compute_rate(out, tmp_path / "slower", 1 / 100)
    for arm in results["arms"]:
        assert faster[arm["arm"]]["predicted_step_time_s"] < arm["predicted_step_time_s"], arm["arm"]
        assert slower[arm["arm"]]["predicted_largest"][0].startswith("compute "), slower[arm["arm"]]


def _reported_with_compute_rate(out: Path, copy: Path, factor: float) -> dict[str, dict]:
    """Each arm's results after `toolkit report` of a copy of the experiment whose profile's matmul and attention
    rates are scaled by `factor`."""
    shutil.copytree(out, copy)
    profile = yaml.safe_load((copy / "hardware.yaml").read_text())
    profile["measured"]["matmul_flops_per_s"] *= factor
    profile["measured"]["attention_flops_per_s"] = {k: v * factor for k, v in
                                                    profile["measured"]["attention_flops_per_s"].items()}
    (copy / "hardware.yaml").write_text(yaml.safe_dump(profile))
    assert run_cli("report", str(copy)).returncode == 0
    return {a["arm"]: a for a in json.loads((copy / "results.json").read_text())["arms"]}
