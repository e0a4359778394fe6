"""Training checkpoints: one format that every strategy writes and every other strategy reads.

A checkpoint is a folder `output_dir/checkpoints/step-NNNNNNNN/` holding
  - a `torch.distributed.checkpoint` (DCP) save: `model.<name>` (fp32 master weights under the model's own
    parameter names, a tied weight once), `optim.state.<name>.<exp_avg|exp_avg_sq|step>` (AdamW's state, torch's flattened
    layout), `rng.<rank>` (each rank's CPU generator) and on a GPU `device_rng.<rank>` (its CUDA generator);
  - `manifest.json`: step, strategy, world size, precision, recipe hash, tokens seen, versions, the LR
    schedule's and the loss scaler's state (small numbers, JSON; DCP's own pickled `.metadata` is read by
    verify.MetadataUnpickler, which builds DCP's metadata classes only: nothing a checkpoint names runs on load);
  - `recipe.yaml` and `hf/` (the model's config and tokenizer): enough for `toolkit convert` alone;
  - `digests.json`: every other file's size and SHA-256, compared before a resume or convert reads a tensor
    (toolkit/checkpoint/digest.py).

DCP reshards on load, so a save from N ranks loads at M. The strategies meet in that one layout:
single/dp/ddp/fsdp read and write it with torch's `get_state_dict`/`set_state_dict` helpers. Weights are
loaded into the plain model before the strategy wraps it, so every strategy shards them its own way. ZeRO's
masters and Adam moments live in DeepSpeed's flat partitions: each rank writes its pieces of them as chunks of
the full tensors (in the background with `checkpoint.async`) and reads them back the same way
(toolkit/checkpoint/fragments.py).

A save is atomic: written under `.step-NNNNNNNN.partial`, renamed into place by rank 0 once every rank's
files and the manifest are on disk and their digests recorded; older checkpoints beyond `keep_last` are deleted
only after that.
"""
