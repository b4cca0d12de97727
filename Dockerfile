# The cohort image: `docker build -t cohort .` (docker compose, deploy/kubernetes). With
# `--target torch` it also holds PyTorch for torchrun (the PyTorchJob example): the CPU
# build unless TORCH_INDEX names another (https://download.pytorch.org/whl/cu124, ...).
FROM python:3.11-slim AS cohort
WORKDIR /app
COPY pyproject.toml README.md ./
COPY events ./events
COPY coordinator ./coordinator
COPY worker ./worker
COPY cohort ./cohort
COPY examples ./examples
RUN pip install --no-cache-dir .
ENTRYPOINT ["cohort"]

FROM cohort AS torch
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
# torchrun loads `--rdzv-backend=cohort` from entry points, which needs torch >= 2.6.
RUN pip install --no-cache-dir --index-url "$TORCH_INDEX" "torch>=2.6"

# The default target (the last stage): the slim image, without torch.
FROM cohort
