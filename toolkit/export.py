"""Export the trained model as one Hugging Face folder (save_pretrained, safetensors), atomically."""

from __future__ import annotations

import shutil
from pathlib import Path

from toolkit.dist import DistEnv, barrier


def export_model(strategy, *, tokenizer, out_dir: Path, env: DistEnv) -> Path:
    """Collective: gather full weights, then rank 0 writes a temp dir and renames it to out_dir/model."""
    state_dict = strategy.full_state_dict()
    final = out_dir / "model"
    if env.is_main:
        tmp = out_dir / ".model.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        module = strategy.export_module()
        module.save_pretrained(str(tmp), state_dict=state_dict)
        tokenizer.save_pretrained(str(tmp))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    barrier(env)
    return final
