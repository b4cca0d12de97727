FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY events ./events
COPY coordinator ./coordinator
COPY worker ./worker
COPY cohort ./cohort
COPY examples ./examples
RUN pip install --no-cache-dir .
ENTRYPOINT ["cohort"]
