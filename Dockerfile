# graphtrim images. Two targets:
#   runtime (default): the graphtrim CLI as entry point; what the MLflow server of
#            helm/graphtrim and the Kubeflow components run.
#   airflow: apache/airflow with graphtrim installed (Airflow's own entry point), for the
#            official Airflow chart with helm/airflow-values.yaml; with GPU=true the image of
#            graphtrim's GPU task pods.
# GPU=true switches onnxruntime to onnxruntime-gpu and torch to a CUDA build.
#
#   docker build -t graphtrim:0.1.0 .
#   docker build --build-arg GPU=true -t graphtrim:0.1.0-gpu .
#   docker build --target airflow -t graphtrim:0.1.0-airflow .
#   docker build --target airflow --build-arg GPU=true -t graphtrim:0.1.0-airflow-gpu .

ARG PYTHON_VERSION=3.11
ARG AIRFLOW_VERSION=3.3.2

FROM python:${PYTHON_VERSION}-slim AS runtime
ARG GPU=false
ARG TORCH_VERSION=2.13.0
ARG CUDA_INDEX=https://download.pytorch.org/whl/cu128
ARG CPU_INDEX=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 MLFLOW_DISABLE_TELEMETRY=true
RUN groupadd --gid 10001 graphtrim \
 && useradd --uid 10001 --gid 10001 --create-home --shell /usr/sbin/nologin graphtrim
WORKDIR /opt/graphtrim
COPY pyproject.toml constraints.txt README.md ./
COPY optimizer_core ./optimizer_core
COPY operators ./operators
COPY dags ./dags
# torch first, pinned, from the index of the build's kind: later ranges resolve to it
# (onnxruntime-gpu has its own pin in the constraints: its releases trail the CPU build's)
RUN if [ "$GPU" = "true" ]; then INDEX="$CUDA_INDEX"; ORT=gpu; else INDEX="$CPU_INDEX"; ORT=cpu; fi \
 && pip install "torch==${TORCH_VERSION}" --index-url "$INDEX" --extra-index-url https://pypi.org/simple \
 && pip install -c constraints.txt ".[${ORT},pipeline]" \
 && graphtrim --version
USER 10001:10001
ENTRYPOINT ["graphtrim"]
CMD ["--help"]

FROM apache/airflow:${AIRFLOW_VERSION}-python${PYTHON_VERSION} AS airflow
ARG GPU=false
ARG TORCH_VERSION=2.13.0
ARG CUDA_INDEX=https://download.pytorch.org/whl/cu128
ARG CPU_INDEX=https://download.pytorch.org/whl/cpu
ENV MLFLOW_DISABLE_TELEMETRY=true AIRFLOW__CORE__DAGS_FOLDER=/opt/graphtrim/dags
USER root
COPY --chown=airflow:root pyproject.toml constraints.txt README.md /opt/graphtrim/
COPY --chown=airflow:root optimizer_core /opt/graphtrim/optimizer_core
COPY --chown=airflow:root operators /opt/graphtrim/operators
COPY --chown=airflow:root dags /opt/graphtrim/dags
USER airflow
# GPU=true: the image of GPU tasks (KubernetesExecutor pods, $GRAPHTRIM_GPU_IMAGE)
RUN if [ "$GPU" = "true" ]; then INDEX="$CUDA_INDEX"; ORT=gpu; else INDEX="$CPU_INDEX"; ORT=cpu; fi \
 && pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "$INDEX" --extra-index-url https://pypi.org/simple \
 && pip install --no-cache-dir -c /opt/graphtrim/constraints.txt "/opt/graphtrim[${ORT},pipeline,airflow]"
