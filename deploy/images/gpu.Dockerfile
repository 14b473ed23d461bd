# Adds rfork to an official GPU serving image, vLLM's or SGLang's (build from the repository root,
# after the wheel: docker build -f deploy/images/Dockerfile --target wheel -t rfork-wheel:0.1.0 .):
#   docker build -f deploy/images/gpu.Dockerfile --build-arg BASE=vllm/vllm-openai:v0.32.0 \
#     --build-arg PORT=8000 -t rfork-vllm:0.1.0 .
#   docker build -f deploy/images/gpu.Dockerfile --build-arg BASE=lmsysorg/sglang:v0.5.23 \
#     --build-arg PORT=30000 -t rfork-sglang:0.1.0 .
# The image's own Python, torch and framework stay as they are (their versions are constraints of the
# install). libfabric: the `libfabric2` extra's 2.5.1 (PyPI's mpich wheel, with the efa and verbs
# providers; RFORK_LIBFABRIC_LIB=mpich), on rdma-core's user-space drivers (libibverbs, libefa, mlx5).
# On AWS you may prefer the EFA installer's libfabric: install it in this image and set
# RFORK_LIBFABRIC_LIB=system RFORK_LIBFABRIC_PREFIX=/opt/amazon/efa instead.
ARG BASE=vllm/vllm-openai:v0.32.0
ARG RFORK_WHEEL=rfork-wheel:0.1.0
FROM ${RFORK_WHEEL} AS rfork

FROM ${BASE}
ARG PORT=8000
USER 0
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      libibverbs1 ibverbs-providers librdmacm1 libxxhash0 \
 && rm -rf /var/lib/apt/lists/*
COPY --from=rfork /wheels /tmp/rfork-wheels
# PIP_BREAK_SYSTEM_PACKAGES: these images install into the system Python on purpose
RUN python3 -m pip list --format=freeze > /tmp/installed.txt \
 && PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --no-cache-dir --constraint /tmp/installed.txt \
      "$(ls /tmp/rfork-wheels/rfork-*.whl)[libfabric2]" \
 && rm -rf /tmp/rfork-wheels /tmp/installed.txt \
 && useradd --uid 10001 --user-group --create-home --home-dir /home/rfork rfork
ENV RFORK_LIBFABRIC_LIB=mpich RFORK_HEALTH_PORT=${PORT}
RUN python3 -c "from backends.providers import _native as n; assert n.VERSION >= (2, 0), n.VERSION" \
 && rfork --version
USER 10001
WORKDIR /home/rfork
EXPOSE ${PORT}
# the server's own health endpoint (vLLM and SGLang both answer /health)
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
  CMD ["sh", "-c", "python3 -c \"import urllib.request; urllib.request.urlopen('http://127.0.0.1:${RFORK_HEALTH_PORT}/health', timeout=4)\""]
ENTRYPOINT ["rfork"]
CMD ["--help"]
