"""`toolkit calibrate --hardware GPU` measures a model's GEMMs as a step spends them (toolkit/cost/calibrate.py:
gemm_counts, matmul_flops_per_s, gpu_profile). Run on an H200, it wrote 271 TFLOP/s for a 1B Llama whose GEMMs ran
at ~700 in the same run's profile: each distinct shape weighed alike, so the one head (its 30,522-token vocabulary
on a slow kernel) outweighed the 154 block GEMMs. These run on the CPU, the device standing in for the GPU."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from toolkit.cost import calibrate, hardware

CONFIG = dict(vocab_size=301, hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, tie_word_embeddings=False)


def test_gemm_counts_are_the_models_linear_layers_by_shape():
    model = LlamaForCausalLM(LlamaConfig(**CONFIG))
    layers, hidden, mlp, vocab = 3, 48, 80, 301
    kv = 2 * hidden // 4  # 2 KV heads of 12
    want = {(64, hidden, hidden): 2 * layers, (64, hidden, kv): 2 * layers, (64, hidden, mlp): 2 * layers,
            (64, mlp, hidden): layers, (64, hidden, vocab): 1}
    assert calibrate.gemm_counts(model, 64) == want


def test_matmul_rate_weighs_each_shape_by_its_count(monkeypatch):
    """Two shapes, one 4 times in the model at 1 s a pass, one once at 3 s: the step's rate is all FLOPs over
    4 × 1 + 3 seconds, not the shapes' FLOPs over 1 + 3."""
    small, large = (8, 4, 4), (8, 4, 16)
    times = iter([1.0, 3.0])
    monkeypatch.setattr(calibrate, "median_seconds", lambda run: (run(), next(times))[1])
    rate = calibrate.matmul_flops_per_s({small: 4, large: 1}, torch.float32, torch.device("cpu"))
    flops = 6 * 8 * 4 * (4 * 4 + 16)
    assert rate == flops / (4 * 1.0 + 3.0)


def test_gpu_profile_measures_attention_at_the_micro_batch_tokens(monkeypatch):
    """Each length up to the micro-batch's tokens, as many sequences as fill them, GPU_BURST calls timed at once."""
    real_device = torch.device
    monkeypatch.setattr(calibrate.torch, "device", lambda *_: real_device("cpu"))
    monkeypatch.setattr(calibrate, "GPU_BURST", 2)
    monkeypatch.setattr(calibrate, "GPU_ATTENTION_LENGTHS", (16, 32, 64, 128))
    runs = []

    def sdpa(q, k, v, is_causal):
        runs.append(tuple(q.shape))
        return (q @ k.transpose(-1, -2)).softmax(-1) @ v
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG))
    profile = calibrate.gpu_profile(hardware.load("h200"), nproc=1, model=model, tokens=64, dtype=torch.float32)
    assert sorted(profile.measured.attention_flops_per_s, key=int) == ["16", "32", "64"]
    assert {shape for shape in runs} == {(4, 4, 16, 12), (2, 4, 32, 12), (1, 4, 64, 12)}
    assert all(rate > 0 for rate in profile.measured.attention_flops_per_s.values())
    assert profile.measured.matmul_dtype == "fp32" and profile.name == "h200"
