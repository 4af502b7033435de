// Command mkimage builds gozt's container image without a container daemon: one layer
// holding the static ztunnel binary, run as Istio's ztunnel chart runs it (uid 0, gid 1337,
// working directory / so the default ./var/run/secrets/... paths are the chart's mounts).
// The same binary gives the same image digest: every timestamp is fixed and the layer's tar
// entries are written in a fixed order. It writes an OCI layout (for umoci, crane, skopeo)
// and a docker-archive tarball (for docker load, podman load).
//
// A FIPS 140-3 build (GOFIPS140 set when the binary was built, make image FIPS=1) gets the
// label gozt.fips140 naming its Go Cryptographic Module, and its tag must end in -fips; the
// tag of any other binary must not, so that the tag says which image it is.
//
//	mkimage -bin bin/image/ztunnel -tag gozt/ztunnel:dev -out .tmp/image
package main

import (
	"archive/tar"
	"bytes"
	"debug/buildinfo"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// epoch is every timestamp in the image: the layer's files and the config's created time.
var epoch = time.Unix(0, 0).UTC()

// entrypoint is where the binary sits in the image.
const entrypoint = "/ztunnel"

func main() {
	bin := flag.String("bin", "bin/image/ztunnel", "static ztunnel binary (CGO_ENABLED=0)")
	tag := flag.String("tag", "gozt/ztunnel:dev", "image reference written into both outputs")
	out := flag.String("out", ".tmp/image", "output directory: oci/ (OCI layout) and ztunnel.tar (docker-archive)")
	arch := flag.String("arch", "amd64", "image architecture (the binary's GOARCH)")
	flag.Parse()
	digest, err := build(*bin, *tag, *arch, *out)
	if err != nil {
		fmt.Fprintln(os.Stderr, "mkimage:", err)
		os.Exit(1)
	}
	fmt.Println(digest)
}

// build writes out/oci and out/ztunnel.tar and returns the image's manifest digest.
func build(bin, tag, arch, out string) (v1.Hash, error) {
	ref, err := name.NewTag(tag)
	if err != nil {
		return v1.Hash{}, err
	}
	fips, err := fipsModule(bin)
	if err != nil {
		return v1.Hash{}, err
	}
	switch suffixed := strings.HasSuffix(ref.TagStr(), fipsSuffix); {
	case fips != "" && !suffixed:
		return v1.Hash{}, fmt.Errorf("%s is a FIPS 140-3 build (GOFIPS140=%s): its tag must end in %s, not %q", bin, fips, fipsSuffix, ref.TagStr())
	case fips == "" && suffixed:
		return v1.Hash{}, fmt.Errorf("%s is not a FIPS 140-3 build (no GOFIPS140): its tag must not end in %s", bin, fipsSuffix)
	}
	img, err := image(bin, arch, fips)
	if err != nil {
		return v1.Hash{}, err
	}
	if err := os.RemoveAll(out); err != nil {
		return v1.Hash{}, err
	}
	p, err := layout.Write(filepath.Join(out, "oci"), empty.Index)
	if err != nil {
		return v1.Hash{}, err
	}
	if err := p.AppendImage(img, layout.WithAnnotations(map[string]string{
		"org.opencontainers.image.ref.name": ref.TagStr(), // what umoci unpack --image dir:TAG finds
	})); err != nil {
		return v1.Hash{}, err
	}
	if err := tarball.WriteToFile(filepath.Join(out, "ztunnel.tar"), ref, img); err != nil {
		return v1.Hash{}, err
	}
	return img.Digest()
}

// fipsSuffix ends the tag of a FIPS 140-3 image.
const fipsSuffix = "-fips"

// fipsLabel names, on a FIPS 140-3 image, the Go Cryptographic Module its binary links.
const fipsLabel = "gozt.fips140"

// fipsModule returns the GOFIPS140 setting bin was built with ("v1.0.0-c2097c7c"), or ""
// for a build without one.
func fipsModule(bin string) (string, error) {
	bi, err := buildinfo.ReadFile(bin)
	if err != nil {
		return "", fmt.Errorf("%s: %w", bin, err)
	}
	for _, s := range bi.Settings {
		if s.Key == "GOFIPS140" && s.Value != "off" {
			return s.Value, nil
		}
	}
	return "", nil
}

// image is the OCI image: one gzip layer, the chart's user, the binary as entrypoint, and
// for a FIPS 140-3 build (fips: its module) the label saying so.
func image(bin, arch, fips string) (v1.Image, error) {
	exe, err := os.ReadFile(bin)
	if err != nil {
		return nil, err
	}
	tarBytes, err := layerTar(exe)
	if err != nil {
		return nil, err
	}
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) {
		return io.NopCloser(bytes.NewReader(tarBytes)), nil
	}, tarball.WithMediaType(types.OCILayer))
	if err != nil {
		return nil, err
	}
	base := mutate.MediaType(empty.Image, types.OCIManifestSchema1)
	base = mutate.ConfigMediaType(base, types.OCIConfigJSON)
	img, err := mutate.Append(base, mutate.Addendum{
		Layer:   layer,
		History: v1.History{Created: v1.Time{Time: epoch}, CreatedBy: "mkimage: COPY ztunnel " + entrypoint},
	})
	if err != nil {
		return nil, err
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return nil, err
	}
	cf = cf.DeepCopy()
	cf.Architecture, cf.OS = arch, "linux"
	cf.Created = v1.Time{Time: epoch}
	cf.Config = v1.Config{
		Entrypoint: []string{entrypoint},
		User:       "0:1337", // the chart's runAsUser and runAsGroup
		WorkingDir: "/",
		Env:        []string{"PATH=/"},
	}
	if fips != "" {
		cf.Config.Labels = map[string]string{fipsLabel: fips}
	}
	return mutate.ConfigFile(img, cf)
}

// layerTar is the layer: the binary, and the directories the chart mounts over (so a
// runtime with a read-only root need not create them), in a fixed order with fixed times
// and owners.
func layerTar(exe []byte) ([]byte, error) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	hdr := func(h *tar.Header) error {
		h.ModTime, h.Uid, h.Gid, h.Format = epoch, 0, 0, tar.FormatPAX
		return tw.WriteHeader(h)
	}
	for _, d := range []string{"tmp/", "var/", "var/run/", "var/run/secrets/", "var/run/secrets/istio/", "var/run/secrets/tokens/", "var/run/ztunnel/"} {
		mode := int64(0o755)
		if d == "tmp/" {
			mode = 0o1777
		}
		if err := hdr(&tar.Header{Typeflag: tar.TypeDir, Name: d, Mode: mode}); err != nil {
			return nil, err
		}
	}
	if err := hdr(&tar.Header{Typeflag: tar.TypeReg, Name: entrypoint[1:], Mode: 0o755, Size: int64(len(exe))}); err != nil {
		return nil, err
	}
	if _, err := tw.Write(exe); err != nil {
		return nil, err
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}
