# syntax=docker/dockerfile:1
# The sluice commands, worker and enqueue, in one small image.
#   docker build -t sluice .
#   docker run --rm -e SLUICE_REDIS_ADDR=redis.example:6379 sluice                 # a worker
#   docker run --rm -e SLUICE_REDIS_ADDR=redis.example:6379 sluice enqueue --help  # the CLI

FROM golang:1.26 AS build
WORKDIR /src
# Modules first: editing code then does not download them again.
COPY go.mod go.sum ./
RUN go mod download
COPY . .
RUN CGO_ENABLED=0 go build -trimpath -ldflags='-s -w' -o /out/ ./cmd/worker ./cmd/enqueue

# Static binaries need no libc: distroless static has CA certificates (for
# redis.tls), tzdata and a non-root user, and no shell.
FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /out/ /usr/local/bin/
# The commands read config.yaml from the working directory: mount your own
# over /etc/sluice/config.yaml, or override keys with SLUICE_* variables.
WORKDIR /etc/sluice
COPY config.yaml ./
# Prometheus metrics; set SLUICE_WORKER_METRICS_ADDR=0.0.0.0:2112 to reach them
# from outside the container.
EXPOSE 2112
CMD ["worker"]
