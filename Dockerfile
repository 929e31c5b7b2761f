# syntax=docker/dockerfile:1
#
# compactor container image: a release build on the official Rust image, copied into a slim
# Debian runtime that runs as an unprivileged user.
#
#   docker build -t compactor:local .
#   docker run --rm -p 8787:8787 -p 127.0.0.1:9787:9787 compactor:local
#   docker run --rm -p 8787:8787 -p 127.0.0.1:9787:9787 -v "$PWD/deploy/compactor:/etc/compactor:ro" compactor:local
#
# The image carries deploy/compactor/compactor.toml as /etc/compactor/compactor.toml
# (listeners on 0.0.0.0, an /anthropic route, everything else at its default). To use your own,
# mount a directory holding a compactor.toml over /etc/compactor (as docker-compose.yml does)
# rather than the single file: an editor that replaces the file gives it a new inode, which a
# single-file bind mount does not follow, so hot reload would keep reading the old one.
# Environment variables COMPACTOR_<SECTION>__<KEY> override it (e.g. COMPACTOR_ADMIN__TOKEN).
#
# Note: this file was written without a Docker engine at hand and has not been built in CI.

# ---- build ------------------------------------------------------------------------------
# Pinned to the toolchain Cargo.lock was last resolved with; any release >= rust-version in
# Cargo.toml (1.85) builds it.
FROM rust:1.95-bookworm AS build
WORKDIR /src
# The whole workspace: cargo needs every member's manifest (plugins/*) and the bench targets
# Cargo.toml names, even to build only the compactor package. .dockerignore drops target/.
COPY . .
# Cache mounts keep the crate registry and target/ between builds; the binary is copied out of
# the cached target/ because cache mounts are not part of the image layer.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p compactor \
    && install -D -m 0755 target/release/compactor /out/compactor

# ---- runtime ----------------------------------------------------------------------------
FROM debian:bookworm-slim
# ca-certificates: system roots for https upstreams (compactor trusts webpki and system roots).
# curl: the HEALTHCHECK below; the binary has no self-probe subcommand. tini: PID 1 (below).
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates curl tini \
    && rm -rf /var/lib/apt/lists/*
# A fixed numeric uid/gid, so Kubernetes' runAsNonRoot can verify it without a passwd lookup.
RUN groupadd --system --gid 10001 compactor \
    && useradd --system --uid 10001 --gid 10001 --no-create-home \
       --home-dir /nonexistent --shell /usr/sbin/nologin compactor
COPY --from=build /out/compactor /usr/local/bin/compactor
# Read-only for the service user: the configuration is never written by compactor.
COPY --chmod=0644 deploy/compactor/compactor.toml /etc/compactor/compactor.toml
USER 10001:10001
ENV RUST_LOG=info
# 8787: proxy (point agents here). 9787: admin (/livez, /readyz, /metrics, sessions); keep it
# off public networks and set admin.token (COMPACTOR_ADMIN__TOKEN) when it is reachable.
EXPOSE 8787 9787
# /livez never needs the admin token. This assumes server.admin_listen stays on port 9787;
# change the URL if your configuration moves it.
HEALTHCHECK --interval=15s --timeout=3s --start-period=5s --retries=3 \
    CMD ["curl", "-fsS", "-o", "/dev/null", "http://127.0.0.1:9787/livez"]
# compactor drains in-flight requests on SIGTERM for server.shutdown_grace_secs (30 s by
# default): give `docker stop` a longer timeout (-t 40) if long streams must finish.
STOPSIGNAL SIGTERM
# tini is PID 1: it forwards signals to compactor and reaps orphaned processes (what an `exec`
# summarizer's program leaves when it is killed on timeout would otherwise stay zombies).
ENTRYPOINT ["/usr/bin/tini", "--", "/usr/local/bin/compactor"]
CMD ["serve", "--config", "/etc/compactor/compactor.toml"]
