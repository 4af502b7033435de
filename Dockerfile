# gozt's image for builders with a container daemon; `make image` builds the same image
# without one. Build the binary first:
#   CGO_ENABLED=0 go build -trimpath -tags grpcnotrace -o bin/image/ztunnel ./cmd/ztunnel
#   docker build -t gozt/ztunnel:dev .
# The FIPS 140-3 image (make image FIPS=1): the binary built with GOFIPS140, which links
# Go's validated cryptographic module and holds fips140=on as its default GODEBUG (no
# GODEBUG in the image's environment: a pod's own GODEBUG would replace it), and the tag
# and label that say so:
#   CGO_ENABLED=0 GOFIPS140=v1.0.0 go build -trimpath -tags grpcnotrace -o bin/image-fips/ztunnel ./cmd/ztunnel
#   docker build --build-arg BIN=bin/image-fips/ztunnel -t gozt/ztunnel:dev-fips \
#     --label gozt.fips140=$(go version -m bin/image-fips/ztunnel | sed -n "s/.*GOFIPS140=//p") .
# uid 0 gid 1337 is how Istio's ztunnel chart runs the container; / as working directory
# makes the default ./var/run/secrets/... paths the chart's mounts.
FROM scratch
ARG BIN=bin/image/ztunnel
COPY ${BIN} /ztunnel
USER 0:1337
WORKDIR /
ENTRYPOINT ["/ztunnel"]
