# gozt's image for builders with a container daemon; `make image` builds the same image
# without one. Build the binary first:
#   CGO_ENABLED=0 go build -trimpath -tags grpcnotrace -o bin/image/ztunnel ./cmd/ztunnel
#   docker build -t gozt/ztunnel:dev .
# uid 0 gid 1337 is how Istio's ztunnel chart runs the container; / as working directory
# makes the default ./var/run/secrets/... paths the chart's mounts.
FROM scratch
COPY bin/image/ztunnel /ztunnel
USER 0:1337
WORKDIR /
ENTRYPOINT ["/ztunnel"]
