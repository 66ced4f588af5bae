# syntax=docker/dockerfile:1
# spool's container image: `docker build -t spool:0.1.0 .` at the repo root.
# The builder compiles the release binary from the locked dependency graph; the runtime
# image holds only that binary, the CA roots (https servers and S3) and a non-root user.

FROM rust:1.95-slim-bookworm AS builder
WORKDIR /build
# Only what the release build reads: the manifest, the lock file and the sources.
COPY Cargo.toml Cargo.lock ./
COPY src ./src
COPY schemas ./schemas
# Cache mounts keep the registry and target dir between builds; the binary is copied out of
# the cache because cache mounts are not part of the image.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/build/target \
    cargo build --release --locked --bin spool \
    && install -m 0755 target/release/spool /usr/local/bin/spool

FROM debian:bookworm-slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 spool \
    && useradd --system --uid 10001 --gid spool --home-dir /data --shell /usr/sbin/nologin spool \
    && mkdir -p /data /etc/spool \
    && chown spool:spool /data
COPY --from=builder /usr/local/bin/spool /usr/local/bin/spool
# Numeric so that Kubernetes' runAsNonRoot can check it without reading /etc/passwd.
USER 10001:10001
WORKDIR /data
# The metrics endpoint when `[run] metrics_addr = "0.0.0.0:9100"`.
EXPOSE 9100
ENTRYPOINT ["spool"]
CMD ["run", "-c", "/etc/spool/spool.toml"]
