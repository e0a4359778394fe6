# CUDA PyTorch base; the toolkit and its dependencies on top. Default command: the demo recipe.
FROM pytorch/pytorch:2.6.0-cuda12.4-cudnn9-devel
WORKDIR /toolkit
COPY . .
RUN pip install --no-cache-dir -e '.[test]'
CMD ["toolkit", "train", "recipes/minilm-sst.yaml"]
