# Image of the example training job: CPU PyTorch, gradwatch, examples/train_ddp.py.
# Build context: the repository root (docker-compose.yml sets it; by hand:
#   docker build -f deploy/compose/trainer.Dockerfile -t gradwatch-example:0.1.0 .).
FROM python:3.12-slim

ARG TORCH_SPEC=torch==2.13.0
# The CPU wheel index first, so no multi-GB CUDA build is pulled in.
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu "${TORCH_SPEC}"

WORKDIR /opt/gradwatch
COPY pyproject.toml README.md ./
COPY src ./src
RUN pip install --no-cache-dir .
COPY examples ./examples

# Only global rank 0 listens, on GRADWATCH_PORT.
EXPOSE 9977
ENV GRADWATCH_PORT=9977 \
    GRADWATCH_BIND_ADDRESS=0.0.0.0
CMD ["torchrun", "--standalone", "--nproc_per_node", "2", "examples/train_ddp.py"]
