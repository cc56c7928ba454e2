# A p2ptrain peer on CPU. Every option is an environment variable (P2PTRAIN_*), so a peer needs no command
# line of its own:
#
#   docker build -t p2ptrain .
#   docker run --rm -p 31337:31337 --stop-timeout 120 \
#       -e P2PTRAIN_INITIAL_PEERS=/ip4/203.0.113.10/tcp/31337/p2p/12D3KooW... -e P2PTRAIN_RUN_ID=demo \
#       -e P2PTRAIN_ANNOUNCE_MADDRS=/ip4/<this machine's public IP>/tcp/31337 p2ptrain join
#
# Dockerfile.cuda is the same on a CUDA base image with the CUDA build of torch.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1

# torch first, from the CPU index: the CPU build, without CUDA's libraries (a much smaller image).
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

WORKDIR /src
COPY pyproject.toml README.md ./
COPY p2ptrain ./p2ptrain
RUN pip install . && rm -rf /src

# A user of its own; /data holds checkpoints, event files and the token cache (mount a volume there).
RUN useradd --create-home --home-dir /data p2ptrain
USER p2ptrain
WORKDIR /data
VOLUME /data

# Inside a container the peer listens on every interface (the default, 127.0.0.1, cannot be reached from
# outside it), and so does its metrics endpoint; both are the P2PTRAIN_* defaults of this image, which
# `docker run -e` overrides.
ENV P2PTRAIN_HOST_MADDRS=/ip4/0.0.0.0/tcp/31337 \
    P2PTRAIN_METRICS_HOST=0.0.0.0 \
    P2PTRAIN_METRICS_PORT=9464
EXPOSE 31337 9464

# SIGTERM (docker stop) makes a peer finish its step, its rounds and a checkpoint: give it time to
# (--stop-timeout 120 on docker run; the default is 10 s).
STOPSIGNAL SIGTERM
ENTRYPOINT ["p2ptrain"]
CMD ["--help"]
