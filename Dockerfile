# sluice: a reverse proxy with built-in rate limiting.
#
#   docker build -t sluice .
#   docker run --rm -p 8080:8080 sluice
#   curl -i http://127.0.0.1:8080/ping

# ---- build ----
FROM rust:1-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked \
 && install -D -m 0755 target/release/sluice /out/sluice
# The shipped config listens on 127.0.0.1:8080, which nothing outside the
# container can reach: the image's config listens on every interface instead.
# The admin listener stays on 127.0.0.1:9090, inside the container, where the
# HEALTHCHECK below reaches it. The greps fail the build if config.toml stops
# matching; `check` validates the result.
RUN sed 's/^listen = "127\.0\.0\.1:8080"/listen = "0.0.0.0:8080"/' config.toml > /out/config.toml \
 && grep -q '^listen = "0\.0\.0\.0:8080"' /out/config.toml \
 && grep -q '^admin_listen = "127\.0\.0\.1:9090"' /out/config.toml \
 && /out/sluice check --config /out/config.toml

# ---- runtime ----
FROM debian:bookworm-slim
# curl is for the HEALTHCHECK.
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates curl \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --user-group --no-create-home \
      --home-dir /nonexistent --shell /usr/sbin/nologin sluice
COPY --from=build /out/sluice /usr/local/bin/sluice
COPY --from=build /out/config.toml /etc/sluice/config.toml
ENV SLUICE_CONFIG=/etc/sluice/config.toml
USER sluice
# Only the proxy port: the admin listener (127.0.0.1:9090) stays inside.
EXPOSE 8080
# /healthz of the admin listener. A config mounted over /etc/sluice/config.toml
# must keep admin_listen = "127.0.0.1:9090" (or override this check).
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 \
  CMD curl -fsS http://127.0.0.1:9090/healthz || exit 1
ENTRYPOINT ["sluice"]
CMD ["--config", "/etc/sluice/config.toml"]
